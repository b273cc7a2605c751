"""A vLLM-shaped upstream with faults, for the soak (``python -m bench.soak.upstream``).

It serves ``GET /metrics`` from a real vLLM capture, so that kvtax learns the model names as it
would from vLLM (``--also-model`` serves the capture's series under more names). It answers
``POST /v1/completions`` and ``/v1/chat/completions`` the way vLLM 0.32 does, through the one
builder (:mod:`kvtax_dev.fakevllm.events`): streams of ``data: <json>\\n\\n`` events with
cumulative usage on every chunk when ``continuous_usage_stats`` is asked, a usage-only chunk
when ``include_usage`` is, then ``[DONE]``; non-streamed JSON otherwise. Each request says how
it should be answered through ``soak_*`` fields in its body (see :class:`Plan`), so the load
generator alone decides the mix and knows what each client should see.

Unlike :mod:`kvtax_dev.fakevllm.fast`, which is kept minimal so that the relay benchmark
measures the relay, this server misbehaves on purpose: non-streamed bodies arrive in several
writes with pauses, it answers 500 with a JSON body, drops the connection mid-stream or
mid-body, and holds a stream open until the client leaves.

Each completion token is the word ``lorem`` (:data:`WORD`), so a client that did not ask for
usage can still count the tokens it received.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from kvtax_dev.fakevllm.events import (
    DONE,
    Ask,
    Style,
    dump,
    encode,
    role_chunk,
    token_chunk,
    usage_chunk,
    whole,
)

__all__ = ["HOLD_MAX", "KEEPALIVE", "STYLE", "WORD", "Plan", "app", "main", "serve_models"]

WORD = "lorem"
# A held stream resumes after this long even if its client never leaves: every loop is bounded.
HOLD_MAX = 60.0
_PROMPT_TOKENS = 7
_MODEL = re.compile(r'model_name="[^"]*"')
# vLLM's uvicorn closes idle keep-alive connections after 5 s; so does this server. The proxy's
# pooled connections therefore end a few seconds after the load stops, and a descriptor still
# open once the soak has been idle longer than that is a leak, not the pool.
KEEPALIVE = 5.0

# The wall clock in ``created``, no token ids and no fingerprint: what the soak has always sent.
STYLE = Style(
    id="cmpl-soak",
    clock=lambda: int(time.time()),
    piece=WORD + " ",
    logprobs=True,
    ids=False,
    fingerprint=None,
)


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

    def ask(self, *, include: bool = False, continuous: bool = False) -> Ask:
        return Ask(
            chat=self.chat,
            model=self.model,
            tokens=self.tokens,
            prompt=_PROMPT_TOKENS,
            per_chunk=self.per_chunk,
            filler=self.filler,
            include=include,
            continuous=continuous,
        )


def _whole(plan: Plan) -> bytes:
    """A non-streamed answer of exactly ``plan.body_bytes`` bytes (or its natural size)."""
    text = " ".join([WORD] * plan.tokens)
    bare = dump(whole(STYLE, plan.ask(), text))
    return dump(whole(STYLE, plan.ask(), text + "." * max(0, plan.body_bytes - len(bare))))


def _drop(request: web.Request) -> None:
    # Abort, not close: the peer sees the connection break without a clean end of body.
    transport = request.transport
    if transport is not None:
        transport.abort()


async def _stream(request: web.Request, plan: Plan, body: dict[str, Any]) -> web.StreamResponse:
    options = body.get("stream_options") or {}
    include = options.get("include_usage") is True
    ask = plan.ask(
        include=include, continuous=include and options.get("continuous_usage_stats") is True
    )
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await response.prepare(request)
    if plan.chat:
        await response.write(encode(role_chunk(STYLE, ask, 0)))
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
        await response.write(encode(token_chunk(STYLE, ask, 0, sent, step)))
        sent += step
    if include:
        await response.write(encode(usage_chunk(STYLE, ask, sent)))
    await response.write(DONE)
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
        return await _in_writes(request, plan, 500, dump(error))
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


def app(page: str) -> web.Application:
    """The soak's upstream, serving ``page`` as its ``/metrics``."""

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=page, content_type="text/plain")

    served = web.Application()
    served.router.add_post("/v1/completions", completions)
    served.router.add_post("/v1/chat/completions", completions)
    served.router.add_get("/metrics", metrics)
    return served


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--metrics", type=Path, required=True, help="a captured vLLM page")
    parser.add_argument("--also-model", action="append", default=[], help="serve this model too")
    args = parser.parse_args()
    web.run_app(
        app(serve_models(args.metrics.read_text(), args.also_model)),
        host="127.0.0.1",
        port=args.port,
        access_log=None,
        print=None,
        backlog=4096,
        keepalive_timeout=KEEPALIVE,
        handler_cancellation=True,
    )
