"""A fast synthetic vLLM stream server for the relay benchmark (``python -m bench.sse_upstream``).

It answers ``POST /v1/completions`` with a vLLM-0.32-shaped stream: ``max_tokens`` chunks of one
token each, ``bench_interval`` seconds apart (0 = as fast as the socket takes them), with 0.32's
``prompt_token_ids`` and ``token_ids`` on each choice (null unless ``return_token_ids`` is asked;
the prompt's ids on the first chunk only), cumulative usage on each chunk only when
``continuous_usage_stats`` is asked, a usage chunk when ``include_usage`` is, and ``[DONE]``.
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
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/version", version)
    web.run_app(app, host="127.0.0.1", port=args.port, access_log=None, print=None, backlog=4096)


if __name__ == "__main__":
    main()
