"""The Gateway API Inference Extension's saturation rule, as a small reverse proxy for the bench.

llm-d's router (the GIE endpoint picker) calls a model server saturated when its KV cache usage
reaches 80 % of the pool or its waiting queue reaches 5 requests (``usage / 0.8 >= 1`` or
``waiting / 5 >= 1``), from the server's own metrics; while it is saturated, new requests are
answered 429 instead of being sent on. This module applies that rule in front of one vLLM so
bench/gate/gate.py can run it beside kvtax's gate: it polls vLLM's ``/metrics`` every ``--poll``
seconds (0.1 s by default; GIE refreshes its metrics every 50 ms, a cost this 2-core host
would charge to the engine's API server), reads ``vllm:kv_cache_usage_perc`` (older vLLMs:
``vllm:gpu_cache_usage_perc``) and ``vllm:num_requests_waiting``, and relays every request
unchanged while the last reading is not saturated. Its 429 carries no Retry-After: the rule
has none to give. Every request is treated as sheddable (GIE sheds only requests of negative
priority; the bench's are all alike). With ``--stale S``, a reading older than S seconds counts
as saturated, as GIE treats a pod whose metrics are stale; off by default.

It is bench code, not part of kvtax. Run it as ``python -m bench.gate.gie --upstream URL
--metrics URL --port N``; ``GET /gie/stats`` answers its counters as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from dataclasses import asdict, dataclass

import aiohttp
from aiohttp import web

from kvtax_dev.exposition import read_samples, total

KV_USAGE_NAMES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
WAITING_NAME = "vllm:num_requests_waiting"
KV_THRESHOLD = 0.8
QUEUE_THRESHOLD = 5
DEFAULT_POLL_S = 0.1
# Headers relayed each way; the rest (hop-by-hop, lengths, codings) are the proxy's own.
_FORWARD = ("Content-Type", "Authorization", "Accept")
_BACK = ("Content-Type", "Retry-After")
_SHED_BODY = {
    "error": {
        "message": "the model server is saturated (GIE rule: KV usage >= 0.8 or waiting >= 5)",
        "type": "rate_limit_exceeded",
        "code": 429,
    }
}


def read_saturation(text: str) -> tuple[float, float] | None:
    """(KV usage as a fraction, requests waiting) from a vLLM ``/metrics`` page; None when the
    page has either series missing."""
    samples = read_samples(text)
    usage = next((samples[n] for n in KV_USAGE_NAMES if n in samples), None)
    if not usage or WAITING_NAME not in samples:
        return None
    return max(usage.values()), total(samples, WAITING_NAME)


def saturated(
    kv_usage: float,
    waiting: float,
    *,
    kv_threshold: float = KV_THRESHOLD,
    queue_threshold: float = QUEUE_THRESHOLD,
    age: float | None = None,
    stale_after: float | None = None,
) -> bool:
    """GIE's saturation rule for one server: either headroom used up. ``age`` (seconds since
    the reading) past ``stale_after`` counts as saturated too."""
    if stale_after is not None and (age is None or age > stale_after):
        return True
    return kv_usage / kv_threshold >= 1.0 or waiting / queue_threshold >= 1.0


@dataclass
class Stats:
    relayed: int = 0
    shed: int = 0
    polls: int = 0
    poll_errors: int = 0
    saturated_polls: int = 0
    last_kv_usage: float = 0.0
    last_waiting: float = 0.0


class GieProxy:
    """The rule in front of ``upstream``, reading ``metrics_url``."""

    def __init__(
        self,
        upstream: str,
        metrics_url: str,
        *,
        poll: float = DEFAULT_POLL_S,
        stale_after: float | None = None,
    ) -> None:
        self.upstream = upstream.rstrip("/")
        self.metrics_url = metrics_url
        self.poll = poll
        self.stale_after = stale_after
        self.stats = Stats()
        self._reading: tuple[float, float] | None = None
        self._read_at: float | None = None
        self._session: aiohttp.ClientSession | None = None
        self._poller: asyncio.Task[None] | None = None

    def saturated_now(self) -> bool:
        if self._reading is None:
            # No reading yet: only the staleness rule can say anything.
            return self.stale_after is not None
        age = time.monotonic() - self._read_at if self._read_at is not None else None
        return saturated(*self._reading, age=age, stale_after=self.stale_after)

    async def poll_once(self) -> None:
        assert self._session is not None
        try:
            async with self._session.get(self.metrics_url) as resp:
                text = await resp.text()
            reading = read_saturation(text) if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError):
            reading = None
        self.stats.polls += 1
        if reading is None:
            self.stats.poll_errors += 1
            return
        self._reading, self._read_at = reading, time.monotonic()
        self.stats.last_kv_usage, self.stats.last_waiting = reading
        if saturated(*reading):
            self.stats.saturated_polls += 1

    async def _poll_forever(self) -> None:
        # start() took the first reading; each later one comes ``poll`` after the one before.
        began = time.monotonic()
        while True:
            await asyncio.sleep(max(0.0, self.poll - (time.monotonic() - began)))
            began = time.monotonic()
            await self.poll_once()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/gie/stats":
            return web.json_response(asdict(self.stats))
        if request.path == "/healthz":
            if self._reading is None:
                return web.Response(status=503, text="no reading of vLLM's metrics yet")
            return web.Response(text="ok")
        if request.method == "POST" and self.saturated_now():
            self.stats.shed += 1
            await request.read()
            return web.json_response(_SHED_BODY, status=429)
        self.stats.relayed += 1
        assert self._session is not None
        body = await request.read()
        headers = {k: request.headers[k] for k in _FORWARD if k in request.headers}
        async with self._session.request(
            request.method, self.upstream + request.path_qs, data=body, headers=headers
        ) as upstream:
            answer = web.StreamResponse(
                status=upstream.status,
                headers={k: upstream.headers[k] for k in _BACK if k in upstream.headers},
            )
            await answer.prepare(request)
            async for chunk in upstream.content.iter_any():
                await answer.write(chunk)
            await answer.write_eof()
            return answer

    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        self._session = aiohttp.ClientSession(
            timeout=timeout, connector=aiohttp.TCPConnector(limit=0), auto_decompress=False
        )
        await self.poll_once()
        self._poller = asyncio.create_task(self._poll_forever())

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        if self._session is not None:
            await self._session.close()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        return app


async def serve(proxy: GieProxy, host: str, port: int) -> None:
    await proxy.start()
    # Cancel a request's handler when its client hangs up, so the upstream request closes and
    # vLLM aborts it, as it would behind a gateway.
    runner = web.AppRunner(proxy.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    print(f"bench.gate.gie: listening on http://{host}:{port}", file=sys.stderr, flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
        await proxy.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench.gate.gie", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--upstream", required=True, help="Where admitted requests go (URL).")
    parser.add_argument("--metrics", required=True, help="vLLM's /metrics URL, polled.")
    parser.add_argument("--host", default="127.0.0.1", help="Listen address.")
    parser.add_argument("--port", type=int, required=True, help="Listen port.")
    parser.add_argument(
        "--poll",
        type=float,
        default=DEFAULT_POLL_S,
        help=f"Seconds between polls of vLLM's /metrics (default {DEFAULT_POLL_S}).",
    )
    parser.add_argument(
        "--stale",
        type=float,
        default=None,
        help="Count a reading older than this many seconds as saturated (default: off).",
    )
    args = parser.parse_args(argv)
    proxy = GieProxy(args.upstream, args.metrics, poll=args.poll, stale_after=args.stale)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(proxy, args.host, args.port))
    json.dump(asdict(proxy.stats), sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
