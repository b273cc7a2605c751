"""A fast synthetic vLLM stream server for the relay benchmark
(``python -m bench.relay.sse_upstream``; the unit tests serve its handlers in process).

It answers ``POST /v1/completions`` with a vLLM-0.32-shaped stream: ``max_tokens`` chunks of one
token each, ``bench_interval`` seconds apart (0 = as fast as the socket takes them), with 0.32's
``prompt_token_ids`` and ``token_ids`` on each choice (null unless ``return_token_ids`` is asked;
the prompt's ids on the first chunk only), cumulative usage on each chunk only when
``continuous_usage_stats`` is asked, a usage chunk when ``include_usage`` is, and ``[DONE]``.
``POST /v1/messages`` and ``POST /v1/responses`` answer the same stream as vLLM 0.32 writes
those APIs' named events (one token per content event, usage at the end only), ``max_tokens``
or ``max_output_tokens`` deltas long.
``GET /metrics`` answers a minimal vLLM page and ``GET /version`` 0.32's version, so a kvtax
sidecar in front of it scrapes without errors and counts as it would in front of vLLM 0.32
(``--version`` names another: a version before the token ids has kvtax count by continuous
usage, as it does in front of such a vLLM).
The events come from the one builder (:mod:`kvtax_dev.fakevllm.events`), each distinct chunk
encoded once and kept: the server should cost as little CPU as possible, so the benchmark
measures the relay.
"""

from __future__ import annotations

import argparse
import asyncio
import functools

from aiohttp import web

from kvtax_dev.fakevllm.apis import Named
from kvtax_dev.fakevllm.events import DONE, Ask, Style, encode, token_chunk, usage_chunk

__all__ = ["STYLE", "VERSION", "app", "completions", "main", "metrics", "named", "version"]

_METRICS = (
    "# TYPE vllm:generation_tokens counter\n"
    'vllm:generation_tokens_total{engine="0",model_name="bench"} 0.0\n'
)
_PROMPT = 16
VERSION = "0.32.0"
_CREATED = 1764400000

# vLLM's every null field, ids counted as an engine would hand them out; the fingerprint on the
# usage chunk only.
STYLE = Style(
    id="cmpl-bench0000000000000000",
    usage_id="cmpl-bench",
    created=_CREATED,
    piece="lorem ",
    logprobs=True,
    stop_reason=True,
    prompt_id=None,
    first_token_id=1001,
    count_ids=True,
    fingerprint="vllm-0.32.0-bench",
    terminal_fingerprint=False,
)


@functools.cache
def _chunk(i: int, final: bool, usage: bool, ids: bool) -> bytes:
    """The ``i``-th token's event (from 1). The stream's length only decides whether it is the
    last, so one more than ``i`` stands for any longer stream: the cache keeps one per kind."""
    ask = Ask(
        model="bench", tokens=i if final else i + 1, prompt=_PROMPT, continuous=usage, ids=ids
    )
    return encode(token_chunk(STYLE, ask, 0, i - 1, 1))


@functools.cache
def _usage(n: int) -> bytes:
    return encode(usage_chunk(STYLE, Ask(model="bench", prompt=_PROMPT), n))


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
        await response.write(_usage(n))
    await response.write(DONE)
    await response.write_eof()
    return response


@functools.cache
def _named(messages: bool) -> Named:
    return Named(
        messages,
        "bench",
        _PROMPT,
        full=True,
        message_id="chatcmpl-bench",
        response_id="resp_bench",
        item_id="msg_bench",
        created=_CREATED,
    )


@functools.cache
def _opening(messages: bool) -> bytes:
    return b"".join(_named(messages).opening())


@functools.cache
def _delta(messages: bool, sequence: int) -> bytes:
    """A content event; a Messages stream's are all alike (``sequence`` 0 keeps one)."""
    return _named(messages).delta(sequence, STYLE.piece)


@functools.cache
def _closing(messages: bool, sequence: int, n: int) -> bytes:
    return b"".join(_named(messages).closing(sequence, n))


async def named(request: web.Request) -> web.StreamResponse:
    """/v1/messages or /v1/responses: named events, one token per delta."""
    spec = await request.json()
    messages = request.path == "/v1/messages"
    n = int(spec.get("max_tokens" if messages else "max_output_tokens", 16))
    interval = float(spec.get("bench_interval", 0.0))
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await response.prepare(request)
    await response.write(_opening(messages))
    sequence = _named(messages).opened
    for _ in range(n):
        if interval:
            await asyncio.sleep(interval)
        await response.write(_delta(messages, 0 if messages else sequence))
        if not messages:  # only a Responses stream numbers its events
            sequence += 1
    await response.write(_closing(messages, sequence, n))
    await response.write_eof()
    return response


_VERSION = web.AppKey("version", str)


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": request.app.get(_VERSION, VERSION)})


async def metrics(request: web.Request) -> web.Response:
    return web.Response(text=_METRICS, content_type="text/plain")


def app(vllm_version: str = VERSION) -> web.Application:
    served = web.Application()
    served[_VERSION] = vllm_version
    served.router.add_post("/v1/completions", completions)
    served.router.add_post("/v1/messages", named)
    served.router.add_post("/v1/responses", named)
    served.router.add_get("/metrics", metrics)
    served.router.add_get("/version", version)
    return served


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument(
        "--version",
        default=VERSION,
        help=f"the vLLM version GET /version answers (default {VERSION})",
    )
    args = parser.parse_args()
    served = app(args.version)
    web.run_app(served, host="127.0.0.1", port=args.port, access_log=None, print=None, backlog=4096)
