"""The testbed's load driver (kvtax_dev.testbed.load.drive) against the benchmark's SSE server."""

from __future__ import annotations

import asyncio

from aiohttp import web

from kvtax_dev.fakevllm.fast import completions
from kvtax_dev.testbed.load import RequestResult, drive


async def _drive_stand_in(**kwargs: object) -> list[RequestResult]:
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        return await drive(f"http://127.0.0.1:{port}", "bench", **kwargs)  # type: ignore[arg-type]
    finally:
        await runner.cleanup()


def test_streamed_requests_are_read_to_the_end_with_usage() -> None:
    results = asyncio.run(
        _drive_stand_in(concurrency=3, max_tokens=5, stream=True, include_usage=True)
    )
    assert [r.index for r in results] == [0, 1, 2]
    assert all(r.ok for r in results), results
    assert {(r.chunks, r.completion_tokens, r.finish_reason) for r in results} == {(5, 5, "length")}
    assert {r.text for r in results} == {"lorem " * 5}
    assert all(r.ttft_s is not None for r in results)


def test_a_client_that_hangs_up_after_n_chunks_says_so() -> None:
    [result] = asyncio.run(
        _drive_stand_in(concurrency=1, max_tokens=50, stream=True, disconnect_after_chunks=3)
    )
    assert (result.disconnected, result.chunks, result.ok) == (True, 3, False)
    assert result.completion_tokens is None  # the usage chunk never came


def test_a_load_for_a_time_keeps_its_clients_busy_until_then_and_sends_no_more() -> None:
    # Protection: for_seconds. A count of requests lasts as long as the engine takes; a load
    # for a time keeps sending (more than one wave here) and stops starting requests after it.
    results = asyncio.run(
        _drive_stand_in(concurrency=2, max_tokens=2, stream=True, requests=1, for_seconds=0.3)
    )
    assert len(results) > 2  # each client sent again as its request ended: not a count of 1
    assert [r.index for r in results] == list(range(len(results)))
    assert all(r.ok for r in results), results
