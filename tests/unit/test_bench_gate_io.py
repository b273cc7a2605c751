"""bench/gate/gate.py's clients and its GIE proxy against in-process stand-ins (no engine, no
timing)."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from bench.gate import client, gate
from bench.gate.arrivals import WORKLOADS, Spec
from bench.gate.gie import GieProxy
from bench.gate.stats import summarize

from kvtax_dev.fakevllm.fast import completions


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    # Cancel a handler when its client hangs up, as the stand-in that never answers needs.
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def _spec(index: int, max_tokens: int, prompt_tokens: int = 40) -> Spec:
    return Spec(index, 0.0, prompt_tokens, max_tokens, long=prompt_tokens > 100)


async def _refuse_or_stream(request: web.Request) -> web.StreamResponse:
    """429 with Retry-After for max_tokens 3, 503 without for 4, 500 for 5; else a stream."""
    body = await request.json()
    if body["max_tokens"] == 3:
        return web.json_response({"error": {}}, status=429, headers={"Retry-After": "2"})
    if body["max_tokens"] == 4:
        return web.json_response({"error": {}}, status=503)
    if body["max_tokens"] == 5:
        return web.json_response({"error": {}}, status=500)
    return await completions(request)


@pytest.fixture
async def upstream() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/v1/completions", _refuse_or_stream)
    runner, url = await _serve(app)
    yield url
    await runner.cleanup()


async def test_open_loop_records_streams_and_refusals(upstream: str) -> None:
    specs = [_spec(0, 6), _spec(1, 3), _spec(2, 4), _spec(3, 5), _spec(4, 9, prompt_tokens=900)]
    records, cutoff = await client.open_loop(
        upstream, specs, "test", "bench", duration=0.0, drain=60.0
    )
    assert cutoff >= 0.0
    by = {r.index: r for r in records}
    assert by[0].completed
    assert by[4].completed
    assert [n for _, n in by[0].events] == [1, 2, 3, 4, 5, 6]
    assert by[4].events[-1][1] == 9
    assert by[4].long
    assert not by[0].long
    assert by[0].first == by[0].events[0][0]
    assert [(f.status, f.retry_after) for f in by[1].refusals] == [(429, "2")]
    assert [(f.status, f.retry_after) for f in by[2].refusals] == [(503, None)]
    assert by[1].refused
    assert by[2].refused
    assert not by[1].events
    assert (by[3].error or "").startswith("HTTP 500")
    assert not by[3].admitted
    summary = summarize(records, window=60.0, cutoff=cutoff, slo_ttft=60.0, slo_gap=60.0)
    assert (summary.admitted, summary.completed, summary.refused_429, summary.refused_503) == (
        2,
        2,
        1,
        1,
    )
    assert summary.tokens == 15
    row = by[1].row()
    assert row["refusals"][0][0] == 429
    assert row["refusals"][0][2] == "2"
    assert (row["status"], row["tokens"], row["first"]) == (429, 0, None)
    assert by[4].row()["tokens"] == 9


async def test_open_loop_cancels_what_is_still_open_at_the_cutoff() -> None:
    async def hang(request: web.Request) -> web.StreamResponse:
        answer = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await answer.prepare(request)
        await asyncio.Event().wait()
        return answer

    app = web.Application()
    app.router.add_post("/v1/completions", hang)
    runner, url = await _serve(app)
    try:
        records, _ = await client.open_loop(
            url, [_spec(0, 8)], "test", "bench", duration=0.0, drain=0.05
        )
    finally:
        await runner.cleanup()
    [rec] = records
    assert rec.status == 200
    assert rec.admitted
    assert not rec.completed
    assert rec.first is None


async def test_closed_loop_retries_a_refusal_after_retry_after() -> None:
    seen: dict[str, int] = {}

    async def refuse_first(request: web.Request) -> web.StreamResponse:
        key = hashlib.sha1(await request.read()).hexdigest()
        seen[key] = seen.get(key, 0) + 1
        if seen[key] == 1:
            return web.json_response({}, status=429, headers={"Retry-After": "0"})
        return await completions(request)

    app = web.Application()
    app.router.add_post("/v1/completions", refuse_first)
    runner, url = await _serve(app)
    sizes = (_spec(i, 4) for i in itertools.count())
    try:
        records, _ = await client.closed_loop(
            url, 2, sizes, "test", "bench", duration=0.3, drain=60.0
        )
    finally:
        await runner.cleanup()
    assert len(records) >= 2
    done = [r for r in records if r.completed]
    assert done
    for rec in done:
        assert rec.status == 200
        assert [(f.status, f.retry_after) for f in rec.refusals] == [(429, "0")]
        assert rec.attempts == 2


class _Metrics:
    def __init__(self) -> None:
        self.kv = 0.1
        self.waiting = 0

    async def page(self, request: web.Request) -> web.Response:
        return web.Response(
            text=(
                "# TYPE vllm:kv_cache_usage_perc gauge\n"
                f'vllm:kv_cache_usage_perc{{engine="0"}} {self.kv}\n'
                "# TYPE vllm:num_requests_waiting gauge\n"
                f'vllm:num_requests_waiting{{engine="0"}} {self.waiting}\n'
            )
        )


async def test_gie_proxy_relays_until_saturated_then_sheds_without_retry_after() -> None:
    metrics = _Metrics()
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/metrics", metrics.page)
    upstream_runner, upstream = await _serve(app)
    # A poll interval far longer than the test: readings change only when it says poll_once.
    proxy = GieProxy(upstream, f"{upstream}/metrics", poll=3600.0)
    await proxy.start()
    proxy_runner, url = await _serve(proxy.app())
    body = client.request_body(_spec(0, 5), "gie", "bench")
    headers = {"Content-Type": "application/json"}
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{url}/healthz") as resp:
                assert resp.status == 200
            async with session.post(f"{url}/v1/completions", data=body, headers=headers) as resp:
                assert resp.status == 200
                text = await resp.text()
            assert text.count("data: ") == 7  # five tokens, the usage chunk, [DONE]

            metrics.kv = 0.85
            await proxy.poll_once()
            async with session.post(f"{url}/v1/completions", data=body, headers=headers) as resp:
                assert resp.status == 429
                assert "Retry-After" not in resp.headers
                assert (await resp.json())["error"]["type"] == "rate_limit_exceeded"

            metrics.kv, metrics.waiting = 0.2, 5
            await proxy.poll_once()
            async with session.post(f"{url}/v1/completions", data=body, headers=headers) as resp:
                assert resp.status == 429

            metrics.waiting = 4
            await proxy.poll_once()
            async with session.post(f"{url}/v1/completions", data=body, headers=headers) as resp:
                assert resp.status == 200
                await resp.read()
            async with session.get(f"{url}/gie/stats") as resp:
                stats = await resp.json()
    finally:
        await proxy_runner.cleanup()
        await proxy.stop()
        await upstream_runner.cleanup()
    assert (stats["relayed"], stats["shed"]) == (2, 2)
    assert stats["polls"] == 4
    assert stats["saturated_polls"] == 2


async def test_warm_up_sends_its_requests_one_at_a_time_in_the_workloads_sizes() -> None:
    # Protection: one at a time. The gate learns a service time from requests that left it;
    # sent together through a cap of one, the later ones would queue and could be shed.
    open_now, most, sizes = 0, 0, []

    async def count(request: web.Request) -> web.StreamResponse:
        nonlocal open_now, most
        open_now += 1
        most = max(most, open_now)
        try:
            body = await request.json()
            sizes.append((len(body["prompt"]), body["max_tokens"]))
            await asyncio.sleep(0.01)  # overlap any request sent alongside
            return await completions(request)
        finally:
            open_now -= 1

    app = web.Application()
    app.router.add_post("/v1/completions", count)
    runner, url = await _serve(app)
    workload = WORKLOADS["long"]
    try:
        records = await gate.warm_up(url, workload, "test", 3)
    finally:
        await runner.cleanup()
    assert len(records) == len(sizes) == 3
    assert all(r.completed for r in records)
    assert most == 1
    for prompt, max_tokens in sizes:
        assert workload.long_prompt[0] <= prompt <= workload.long_prompt[1]
        assert workload.output[0] <= max_tokens <= workload.output[1]


def test_a_killed_run_leaves_through_its_with_blocks() -> None:
    # Protection: _exit_on_sigterm. Without it SIGTERM ends Python at once, no `finally` or
    # `with` runs, and the engine (in a process group of its own) keeps serving.
    code = (
        "from bench.gate import gate\n"
        "import time\n"
        "gate._exit_on_sigterm()\n"
        "try:\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(120)\n"
        "finally:\n"
        "    print('stopped what it started', flush=True)\n"
    )
    root = Path(__file__).resolve().parents[2]
    child = subprocess.Popen(
        [sys.executable, "-c", code], cwd=root, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "ready"
    child.send_signal(signal.SIGTERM)
    out, _ = child.communicate(timeout=60)
    assert "stopped what it started" in out
    assert child.returncode == 128 + signal.SIGTERM
