"""A fast synthetic vLLM stream server for the relay benchmark
(``python -m bench.relay.sse_upstream``).

It answers ``POST /v1/completions`` with a vLLM-0.32-shaped stream: ``max_tokens`` chunks of one
token each, ``bench_interval`` seconds apart (0 = as fast as the socket takes them), with 0.32's
``prompt_token_ids`` and ``token_ids`` on each choice (null unless ``return_token_ids`` is asked;
the prompt's ids on the first chunk only), cumulative usage on each chunk only when
``continuous_usage_stats`` is asked, a usage chunk when ``include_usage`` is, and ``[DONE]``.
``POST /v1/messages`` and ``POST /v1/responses`` answer the same stream as vLLM 0.32 writes
those APIs' named events (one token per content event, usage at the end only), ``max_tokens``
or ``max_output_tokens`` deltas long.
``GET /metrics`` answers a minimal vLLM page and ``GET /version`` 0.32's version, so a kvtax
sidecar in front of it scrapes without errors and counts as it would in front of vLLM 0.32.
The chunks are encoded once: the server should cost as little CPU as possible, so the benchmark
measures the relay.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json

from aiohttp import web

_METRICS = (
    "# TYPE vllm:generation_tokens counter\n"
    'vllm:generation_tokens_total{engine="0",model_name="bench"} 0.0\n'
)
_TEXT = "lorem "
_PROMPT = 16
VERSION = "0.32.0"


@functools.cache
def _chunk(i: int, final: bool, usage: bool, ids: bool) -> bytes:
    finish = '"length"' if final else "null"
    prompt_ids = (
        json.dumps(list(range(1, _PROMPT + 1))).replace(" ", "") if ids and i == 1 else "null"
    )
    token_ids = f"[{1000 + i}]" if ids else "null"
    body = (
        '{"id":"cmpl-bench0000000000000000","object":"text_completion","created":1764400000,'
        f'"model":"bench","choices":[{{"index":0,"text":"{_TEXT}","logprobs":null,'
        f'"finish_reason":{finish},"stop_reason":null,"prompt_token_ids":{prompt_ids},'
        f'"token_ids":{token_ids}}}]'
    )
    if usage:
        body += (
            f',"usage":{{"prompt_tokens":{_PROMPT},"total_tokens":{_PROMPT + i},'
            f'"completion_tokens":{i}}}'
        )
    return b"data: " + body.encode() + b"}\n\n"


async def completions(request: web.Request) -> web.StreamResponse:
    spec = await request.json()
    n = int(spec.get("max_tokens", 16))
    interval = float(spec.get("bench_interval", 0.0))
    options = spec.get("stream_options") or {}
    include = bool(options.get("include_usage"))
    continuous = include and bool(options.get("continuous_usage_stats"))
    ids = bool(spec.get("return_token_ids"))
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await response.prepare(request)
    for i in range(1, n + 1):
        if interval:
            await asyncio.sleep(interval)
        await response.write(_chunk(i, i == n, continuous, ids))
    if include:
        usage = {"prompt_tokens": _PROMPT, "total_tokens": _PROMPT + n, "completion_tokens": n}
        final = {"id": "cmpl-bench", "object": "text_completion", "created": 1764400000}
        final |= {"model": "bench", "choices": [], "usage": usage}
        final |= {"system_fingerprint": "vllm-0.32.0-bench"}
        await response.write(
            b"data: " + json.dumps(final, separators=(",", ":")).encode() + b"\n\n"
        )
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def _named(name: str, data: str) -> bytes:
    return f"event: {name}\ndata: {data}\n\n".encode()


# The events of vLLM 0.32's Messages and Responses streams, as it writes them (compact JSON).
_MESSAGE_START = _named(
    "message_start",
    '{"type":"message_start","message":{"id":"chatcmpl-bench","type":"message",'
    '"role":"assistant","content":[],"model":"bench","stop_reason":null,"stop_sequence":null,'
    f'"usage":{{"input_tokens":{_PROMPT},"output_tokens":0}}}}}}',
)
_BLOCK_START = _named(
    "content_block_start",
    '{"type":"content_block_start","content_block":{"type":"text","text":""},"index":0}',
)
_BLOCK_DELTA = _named(
    "content_block_delta",
    f'{{"type":"content_block_delta","delta":{{"type":"text_delta","text":"{_TEXT}"}},"index":0}}',
)
_BLOCK_STOP = _named("content_block_stop", '{"type":"content_block_stop","index":0}')


@functools.cache
def _messages_end(n: int) -> bytes:
    usage = f'"usage":{{"input_tokens":{_PROMPT},"output_tokens":{n}}}'
    delta = '"delta":{"stop_reason":"max_tokens","stop_sequence":null}'
    return _named("message_delta", f'{{"type":"message_delta",{delta},{usage}}}') + _named(
        "message_stop", '{"type":"message_stop"}'
    )


@functools.cache
def _response_event(kind: str, sequence: int, n: int = 0) -> bytes:
    """One event of a Responses stream; ``kind`` names it, ``n`` is the output so far."""
    response = (
        '{"id":"resp_bench","created_at":1764400000,"model":"bench","object":"response",'
        f'"output":[],"status":"{"completed" if kind == "response.completed" else "in_progress"}",'
        '"usage":'
        + (
            f'{{"input_tokens":{_PROMPT},"output_tokens":{n},"total_tokens":{_PROMPT + n}}}'
            if kind == "response.completed"
            else "null"
        )
        + "}"
    )
    if kind == "response.output_text.delta":
        data = (
            f'{{"content_index":0,"delta":"{_TEXT}","item_id":"msg_bench","logprobs":[],'
            f'"output_index":0,"sequence_number":{sequence},"type":"{kind}"}}'
        )
    elif kind in ("response.created", "response.in_progress", "response.completed"):
        data = f'{{"response":{response},"sequence_number":{sequence},"type":"{kind}"}}'
    else:
        data = f'{{"output_index":0,"sequence_number":{sequence},"type":"{kind}"}}'
    return _named(kind, data)


_RESPONSE_OPEN = ("response.created", "response.in_progress", "response.output_item.added")
_RESPONSE_CLOSE = ("response.output_text.done", "response.output_item.done")


async def named(request: web.Request) -> web.StreamResponse:
    """/v1/messages or /v1/responses: named events, one token per delta."""
    spec = await request.json()
    messages = request.path == "/v1/messages"
    n = int(spec.get("max_tokens" if messages else "max_output_tokens", 16))
    interval = float(spec.get("bench_interval", 0.0))
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await response.prepare(request)
    if messages:
        await response.write(_MESSAGE_START + _BLOCK_START)
    else:
        await response.write(b"".join(_response_event(k, i) for i, k in enumerate(_RESPONSE_OPEN)))
    sequence = len(_RESPONSE_OPEN)
    for _ in range(n):
        if interval:
            await asyncio.sleep(interval)
        if messages:
            await response.write(_BLOCK_DELTA)
        else:
            await response.write(_response_event("response.output_text.delta", sequence))
            sequence += 1
    if messages:
        await response.write(_BLOCK_STOP + _messages_end(n))
    else:
        closing = [(k, sequence + i) for i, k in enumerate(_RESPONSE_CLOSE)]
        closing.append(("response.completed", sequence + len(closing)))
        await response.write(b"".join(_response_event(k, i, n) for k, i in closing))
    await response.write_eof()
    return response


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": VERSION})


async def metrics(request: web.Request) -> web.Response:
    return web.Response(text=_METRICS, content_type="text/plain")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/messages", named)
    app.router.add_post("/v1/responses", named)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/version", version)
    web.run_app(app, host="127.0.0.1", port=args.port, access_log=None, print=None, backlog=4096)


if __name__ == "__main__":
    main()
