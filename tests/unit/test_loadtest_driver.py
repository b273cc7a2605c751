"""The sweep against a small in-process server: steps, counters, knees, errors, Ctrl-C."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from aiohttp.test_utils import TestServer

from kvtax import cli
from kvtax.errors import InputError
from kvtax.tools.loadtest import driver
from kvtax.tools.loadtest.distributions import parse_distribution
from kvtax.tools.loadtest.knees import preemption_knee
from kvtax.tools.loadtest.measure import StepResult
from kvtax.tools.loadtest.plan import LoadPlan
from tests.unit.loadtest_fake import PreemptingServer


def _plan(levels: tuple[float, ...], mode: str = "concurrency") -> LoadPlan:
    return LoadPlan(
        mode=mode,
        levels=levels,
        step_seconds=0.6,
        prompt_tokens=parse_distribution("const:8", field="p"),
        output_tokens=parse_distribution("const:20", field="o"),
        scrape_interval=0.1,
        # A bound against hangs, not a time the requests need: a step's requests take tens of
        # milliseconds, but beside the suite's engine lanes on 2 cores one was still running
        # after 5 s and was cancelled (not ok). The drain waits only as long as they run.
        drain_seconds=60.0,
    )


async def _serve(fake: PreemptingServer) -> TestServer:
    server = TestServer(fake.app())
    await server.start_server()
    return server


async def test_sweep_counts_each_steps_preemptions_and_finds_the_knee() -> None:
    fake = PreemptingServer(fits=2)
    server = await _serve(fake)
    try:
        url = str(server.make_url("")).rstrip("/")
        target = await driver.check_target(url, None, None)
        steps: list[StepResult] = []
        lines: list[str] = []
        await driver.run_sweep(_plan((1, 2, 3, 4)), target, steps, lines.append)
    finally:
        await server.close()
    assert [s.level for s in steps] == [1, 2, 3, 4]
    counts = [s.engine.preemptions for s in steps]
    assert counts[0] == 0
    assert counts[1] == 0
    assert counts[2]
    assert counts[3]
    # Every preemption the server counted falls in one step: none between steps.
    assert sum(c or 0 for c in counts) == fake.preemptions
    assert preemption_knee(counts) is not None
    assert preemption_knee(counts).index == 2  # type: ignore[union-attr]
    for s in steps:
        assert (s.ok, s.delivered_tokens) == (s.requests, 20 * s.requests), s
    assert sum(s.engine.generation_tokens or 0 for s in steps) == fake.generated
    assert steps[2].engine.tax_method == "estimated"  # no recompute counter: estimated
    assert any("step 3/4" in line for line in lines)


async def test_rate_mode_sends_requests_at_about_the_rate() -> None:
    fake = PreemptingServer(fits=100)
    server = await _serve(fake)
    try:
        target = await driver.check_target(str(server.make_url("")), None, None)
        steps: list[StepResult] = []
        await driver.run_sweep(_plan((5.0, 40.0), mode="rate"), target, steps, lambda _: None)
    finally:
        await server.close()
    assert steps[0].requests < steps[1].requests


async def test_a_cancelled_sweep_keeps_the_steps_it_measured() -> None:
    fake = PreemptingServer(fits=2)
    server = await _serve(fake)
    steps: list[StepResult] = []
    try:
        target = await driver.check_target(str(server.make_url("")), None, None)
        task = asyncio.create_task(
            driver.run_sweep(_plan((1, 2, 3, 4, 5, 6)), target, steps, lambda _: None)
        )
        while not steps:
            await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        await server.close()
    assert 1 <= len(steps) < 6
    assert steps[0].ok > 0


async def test_an_unreachable_url_is_named() -> None:
    with pytest.raises(InputError) as err:
        await driver.check_target("http://127.0.0.1:9", None, "m")
    assert str(err.value).startswith("URL: cannot reach http://127.0.0.1:9")


async def test_a_metrics_page_without_the_model_is_named() -> None:
    fake = PreemptingServer()
    server = await _serve(fake)
    try:
        with pytest.raises(InputError) as err:
            await driver.check_target(str(server.make_url("")), None, "other")
    finally:
        await server.close()
    assert str(err.value).startswith("--metrics-url:")
    assert "'other'" in str(err.value)


def test_cli_names_an_unreachable_url(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code = cli.main(["loadtest", "http://127.0.0.1:9", "--model", "m", "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("kvtax loadtest: URL: cannot reach")
    assert "\n" not in err


def test_cli_refuses_a_step_too_short_to_measure(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["loadtest", "http://127.0.0.1:9", "--step-duration", "0.1"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("kvtax loadtest: --step-duration: 0.1 s is too short to measure")


def test_ctrl_c_still_writes_the_measured_steps(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake = PreemptingServer(fits=1)

    async def check(url: str, metrics: str | None, model: str | None) -> driver.Target:
        return driver.Target(url, f"{url}/metrics", "m")

    async def sweep_then_interrupt(plan, target, steps, progress, settings=None):  # type: ignore[no-untyped-def]
        server = await _serve(fake)
        try:
            real = driver.Target(str(server.make_url("")).rstrip("/"), "", "m")
            real = driver.Target(real.url, f"{real.url}/metrics", "m")
            await real_sweep(plan, real, steps, progress, settings)
        finally:
            await server.close()
        raise KeyboardInterrupt

    real_sweep = driver.run_sweep
    monkeypatch.setattr(driver, "check_target", check)
    monkeypatch.setattr(driver, "run_sweep", sweep_then_interrupt)
    code = cli.main(
        [
            "loadtest",
            "http://unused",
            "--levels",
            "1,2",
            "--step-duration",
            "0.5",
            "--scrape-interval",
            "0.1",
            "--prompt-tokens",
            "const:4",
            "--output-tokens",
            "const:10",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 130
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["interrupted"] is True
    assert [s["level"] for s in report["steps"]] == [1, 2]
    assert "Stopped by Ctrl-C" in (tmp_path / "report.md").read_text()


async def test_no_request_goes_out_on_a_connection_vllm_may_be_closing() -> None:
    # The race: vLLM arms its keep-alive close as an answer ends, and when its loop runs
    # late the close comes before it reads the next request on that connection. This server
    # does that every time: it answers a connection's first request, and closes it unanswered
    # on any later one. A sweep that reused a connection would fail the second request with
    # "Server disconnected"; the sweep's requests must all be answered.
    peers: list[object] = []

    async def first_only(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peers.append(writer.get_extra_info("peername"))
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
            await reader.read(1)  # a second request, or the client's close: either way, close
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(first_only, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with driver.load_session(4) as session:
            for _ in range(3):
                # A POST, as the sweep's requests are: aiohttp sends a GET again by itself.
                async with session.post(f"http://127.0.0.1:{port}/v1/completions", json={}) as resp:
                    assert await resp.text() == "ok"
    finally:
        server.close()
        await server.wait_closed()
    assert len(set(peers)) == 3, peers
