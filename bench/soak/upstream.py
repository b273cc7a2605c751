"""A vLLM-shaped upstream with faults, for the soak (``python -m bench.soak.upstream``).

It serves ``GET /metrics`` from a real vLLM capture, so that kvtax learns the model names as it
would from vLLM (``--also-model`` serves the capture's series under more names). It answers
``POST /v1/completions`` and ``/v1/chat/completions`` the way vLLM 0.32 does: streams of
``data: <json>\n\n`` events with cumulative usage on every chunk when ``continuous_usage_stats``
is asked, a usage-only chunk when ``include_usage`` is, then ``[DONE]``; non-streamed JSON
otherwise. Each request says how it should be answered through ``soak_*`` fields in its body
(see :class:`Plan`), so the load generator alone decides the mix and knows what each client
should see.

Unlike :mod:`bench.relay.sse_upstream`, which is kept minimal so that the relay benchmark measures
the relay, this server misbehaves on purpose: non-streamed bodies arrive in several writes with
pauses, it answers 500 with a JSON body, drops the connection mid-stream or mid-body, and holds a
stream open until the client leaves.

Each completion token is the word ``lorem`` (:data:`WORD`), so a client that did not ask for
usage can still count the tokens it received.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

__all__ = ["HOLD_MAX", "WORD", "Plan", "main", "serve_models"]

WORD = "lorem"
# A held stream resumes after this long even if its client never leaves: every loop is bounded.
HOLD_MAX = 60.0
PROMPT_TOKENS = 7
_MODEL = re.compile(r'model_name="[^"]*"')
# vLLM's uvicorn closes idle keep-alive connections after 5 s; so does this server. The proxy's
# pooled connections therefore end a few seconds after the load stops, and a descriptor still
# open once the soak has been idle longer than that is a leak, not the pool.
KEEPALIVE = 5.0


def _dump(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


@dataclass(frozen=True, slots=True)
class Plan:
    """How to answer one request, read from its ``soak_*`` fields."""

    chat: bool
    stream: bool
    model: str
    tokens: int
    per_chunk: int = 1
    interval: float = 0.0
    filler: int = 0  # extra bytes of text per chunk, to make a stream heavy for slow readers
    fault: str = ""  # "", "error" (500 + JSON), "drop" (connection dropped after ``after``)
    after: int = 0  # tokens sent before a drop, or before a hold
    hold: bool = False  # hold the stream after ``after`` tokens until the client leaves
    body_bytes: int = 0  # size of a non-streamed body
    writes: int = 1  # the non-streamed body arrives in this many writes
    pause: float = 0.0  # between those writes
    length: bool = True  # send Content-Length (else chunked)

    @classmethod
    def of(cls, path: str, body: dict[str, Any]) -> Plan:
        return cls(
            chat=path.endswith("/chat/completions"),
            stream=body.get("stream") is True,
            model=str(body.get("model", "")),
            tokens=int(body.get("max_tokens", 16)),
            per_chunk=max(1, int(body.get("soak_per_chunk", 1))),
            interval=float(body.get("soak_interval", 0.0)),
            filler=int(body.get("soak_filler", 0)),
            fault=str(body.get("soak_fault", "")),
            after=int(body.get("soak_after", 0)),
            hold=bool(body.get("soak_hold", False)),
            body_bytes=int(body.get("soak_body_bytes", 0)),
            writes=max(1, int(body.get("soak_writes", 1))),
            pause=float(body.get("soak_pause", 0.0)),
            length=bool(body.get("soak_length", True)),
        )


def _usage(tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": PROMPT_TOKENS,
        "total_tokens": PROMPT_TOKENS + tokens,
        "completion_tokens": tokens,
    }


def _chunk(plan: Plan, text: str | None, sent: int, usage: bool) -> bytes:
    """One stream event; ``text=None`` is the chat role chunk vLLM sends first (no tokens)."""
    final = sent == plan.tokens and text is not None
    if plan.chat:
        delta = {"role": "assistant", "content": ""} if text is None else {"content": text}
        choice: dict[str, Any] = {"index": 0, "delta": delta}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or ""}
        kind = "text_completion"
    choice |= {"logprobs": None, "finish_reason": "length" if final else None}
    event: dict[str, Any] = {"id": "cmpl-soak", "object": kind, "created": int(time.time())}
    event |= {"model": plan.model, "choices": [choice]}
    if usage:
        event["usage"] = _usage(sent)
    return b"data: " + _dump(event) + b"\n\n"


def _whole(plan: Plan) -> bytes:
    """A non-streamed answer of exactly ``plan.body_bytes`` bytes (or its natural size)."""

    def body(text: str) -> bytes:
        if plan.chat:
            choice: dict[str, Any] = {"message": {"role": "assistant", "content": text}}
            kind = "chat.completion"
        else:
            choice, kind = {"text": text}, "text_completion"
        choice = {"index": 0, **choice, "finish_reason": "length"}
        answer = {"id": "cmpl-soak", "object": kind, "created": int(time.time())}
        answer |= {"model": plan.model, "choices": [choice], "usage": _usage(plan.tokens)}
        return _dump(answer)

    text = " ".join([WORD] * plan.tokens)
    bare = body(text)
    return body(text + "." * max(0, plan.body_bytes - len(bare)))


def _drop(request: web.Request) -> None:
    # Abort, not close: the peer sees the connection break without a clean end of body.
    transport = request.transport
    if transport is not None:
        transport.abort()


async def _stream(request: web.Request, plan: Plan, body: dict[str, Any]) -> web.StreamResponse:
    options = body.get("stream_options") or {}
    include = options.get("include_usage") is True
    continuous = include and options.get("continuous_usage_stats") is True
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await response.prepare(request)
    if plan.chat:
        await response.write(_chunk(plan, None, 0, continuous))
    sent, held = 0, False
    while sent < plan.tokens:
        if plan.fault == "drop" and sent >= plan.after:
            _drop(request)
            return response
        if plan.hold and not held and sent >= plan.after:
            # The server cancels this handler when the client's connection goes, as vLLM
            # aborts a request whose client left.
            held = True
            await asyncio.sleep(HOLD_MAX)
        if plan.interval:
            await asyncio.sleep(plan.interval)
        step = min(plan.per_chunk, plan.tokens - sent)
        sent += step
        text = " ".join([WORD] * step) + " " + "." * plan.filler
        await response.write(_chunk(plan, text, sent, continuous))
    if include:
        kind = "chat.completion.chunk" if plan.chat else "text_completion"
        final = {"id": "cmpl-soak", "object": kind, "created": int(time.time())}
        final |= {"model": plan.model, "choices": [], "usage": _usage(sent)}
        await response.write(b"data: " + _dump(final) + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def _in_writes(
    request: web.Request, plan: Plan, status: int, data: bytes
) -> web.StreamResponse:
    """Send ``data`` in ``plan.writes`` writes, ``plan.pause`` apart; a drop cuts it halfway."""
    response = web.StreamResponse(status=status, headers={"Content-Type": "application/json"})
    if plan.length:
        response.content_length = len(data)
    await response.prepare(request)
    step = -(-len(data) // plan.writes)
    for start in range(0, len(data), step):
        if start:
            await asyncio.sleep(plan.pause)
        if plan.fault == "drop" and start >= len(data) // 2:
            _drop(request)
            return response
        await response.write(data[start : start + step])
    await response.write_eof()
    return response


async def completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    plan = Plan.of(request.path, body)
    if plan.fault == "error":
        error = {"error": {"message": "boom", "type": "InternalServerError", "code": 500}}
        return await _in_writes(request, plan, 500, _dump(error))
    if plan.stream:
        return await _stream(request, plan, body)
    return await _in_writes(request, plan, 200, _whole(plan))


def serve_models(capture: str, extra: list[str]) -> str:
    """The captured page, with each series of its model repeated for every ``extra`` model, in
    place, so that each family's samples stay together as the text format requires."""
    lines = []
    for line in capture.splitlines():
        lines.append(line)
        found = _MODEL.search(line)
        if found and not line.startswith("#"):
            lines += [line.replace(found.group(0), f'model_name="{name}"') for name in extra]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--metrics", type=Path, required=True, help="a captured vLLM page")
    parser.add_argument("--also-model", action="append", default=[], help="serve this model too")
    args = parser.parse_args()
    page = serve_models(args.metrics.read_text(), args.also_model)

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=page, content_type="text/plain")

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_get("/metrics", metrics)
    web.run_app(
        app,
        host="127.0.0.1",
        port=args.port,
        access_log=None,
        print=None,
        backlog=4096,
        keepalive_timeout=KEEPALIVE,
        handler_cancellation=True,
    )


if __name__ == "__main__":
    main()
