"""Periodic work in ``kvtax serve`` has one mechanism: the APScheduler scheduler build() makes.

Its jobs after start are the scrape, the gateway poll (when configured), the ``/v1/models``
refresh and the loop watch, all on the one scheduler; nothing in ``serve/`` sleeps in a loop
or builds a scheduler of its own but :mod:`kvtax.serve.schedule`. The scrape pushes its
figures to subscribers (the gate) instead of being polled for them, and one subscriber that
raises stops neither the scrape nor the others.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer, unused_port

from kvtax.figures.derive import ModelFigures
from kvtax.gate.order import SERVICE_ENOUGH
from kvtax.serve.config import load_config
from kvtax.serve.schedule import Periodic
from kvtax.serve.scrape.job import ScrapeJob
from kvtax.serve.scrape.parsepool import ParsePool
from kvtax.serve.wiring import build
from tests.unit.conftest import read_fixture

SERVE = Path(__file__).resolve().parents[2] / "exporter" / "kvtax" / "serve"
PAGE = read_fixture("0.32-preempting.prom")


def _sources() -> dict[str, str]:
    return {p.relative_to(SERVE).as_posix(): p.read_text() for p in sorted(SERVE.rglob("*.py"))}


def test_nothing_in_serve_sleeps_in_a_loop_or_builds_a_scheduler_of_its_own() -> None:
    # The one pause: a request of a large body gives way between its steps (each a scan of tens
    # of MiB) for a millisecond, once per step, so that every other connection has its turn.
    sleeps = {path for path, text in _sources().items() if "asyncio.sleep(" in text}
    assert sleeps <= {"proxy/request.py"}
    sleeps -= {
        path
        for path in sleeps
        if _sources()[path].count("asyncio.sleep(") == 1
        and "asyncio.sleep(_GIVE_WAY)" in _sources()[path]
    }
    loops = {path for path, text in _sources().items() if re.search(r"while True\s*:", text)}
    schedulers = {
        path
        for path, text in _sources().items()
        if re.search(r"\b(AsyncIOScheduler|BackgroundScheduler|AsyncScheduler)\(", text)
    }
    assert sleeps == set()
    assert loops == set()
    assert schedulers == {"schedule.py"}


def _config(vllm_url: str, **flags: str) -> Any:
    return load_config(
        {
            "vllm.url": vllm_url,
            "web.listen_address": f"127.0.0.1:{unused_port()}",
            "proxy.listen_address": "off",
            "scrape.interval": "1m",
            "scrape.timeout": "2s",
            **flags,
        },
        env={},
        file=None,
    )


async def _vllm() -> TestServer:
    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=PAGE, content_type="text/plain")

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": []})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    server = TestServer(app)
    await server.start_server()
    return server


async def test_every_periodic_job_is_a_job_of_the_one_scheduler() -> None:
    vllm = await _vllm()
    url = str(vllm.make_url("")).rstrip("/")
    stack = build(_config(url, **{"gateway.url": f"{url}/metrics"}))
    try:
        await stack.start()
        jobs = {job.id: job for job in stack.scheduler.get_jobs()}
        assert set(jobs) == {"scrape", "gateway", "models", "loopwatch"}
        seconds = {name: job.trigger.interval.total_seconds() for name, job in jobs.items()}
        assert seconds == {"scrape": 60.0, "gateway": 60.0, "models": 300.0, "loopwatch": 0.25}
        # Draining stops the pollers; the scrape and the watch go on, /metrics stays up.
        await stack.drain()
        assert {job.id for job in stack.scheduler.get_jobs()} == {"scrape", "loopwatch"}
    finally:
        await stack.drain()
        await stack.stop()
        await vllm.close()
    assert stack.scheduler.get_jobs() == []


async def test_without_a_gateway_or_a_models_refresh_only_the_scrape_and_the_watch_run() -> None:
    stack = build(_config("http://127.0.0.1:9", **{"delivery.models_refresh": "0"}))
    try:
        await stack.start()
        assert {job.id for job in stack.scheduler.get_jobs()} == {"scrape", "loopwatch"}
    finally:
        await stack.drain()
        await stack.stop()
    await asyncio.sleep(0)  # AsyncIOScheduler.shutdown runs at the loop's next turn
    assert not stack.scheduler.running


def test_the_gate_is_handed_the_figures_of_each_fold() -> None:
    stack = build(_config("http://127.0.0.1:9", **{"gate.mode": "adaptive"}))
    before = stack.gate.capacity_tokens
    stack.scrape.ingest(PAGE, timestamp=1000.0)
    # The first fold already told the gate the KV pool's size: nothing polled for it.
    assert before is None
    assert stack.gate.capacity_tokens is not None
    # ... and vLLM's mean request latency, the gate's service time until its own is known.
    count = _value(PAGE, "vllm:e2e_request_latency_seconds_count")
    mean = _value(PAGE, "vllm:e2e_request_latency_seconds_sum") / count
    samples, service_time = stack.gate._service.reading()
    assert samples == SERVICE_ENOUGH
    assert service_time == pytest.approx(mean)


def _value(page: str, name: str) -> float:
    """The sum of ``name``'s samples on ``page``."""
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in page.splitlines() if line.startswith(name + "{")
    )


class _Recorder:
    def __init__(self) -> None:
        self.seen: list[Mapping[str, ModelFigures]] = []

    def __call__(self, figures: Mapping[str, ModelFigures]) -> None:
        self.seen.append(figures)


def _boom(figures: Mapping[str, ModelFigures]) -> None:
    raise RuntimeError("a subscriber's bug")


async def test_a_subscriber_that_raises_stops_neither_the_scrape_nor_the_others(
    caplog: pytest.LogCaptureFixture,
) -> None:
    vllm = await _vllm()
    first, last = _Recorder(), _Recorder()
    parser = ParsePool()
    job = ScrapeJob(
        _config(str(vllm.make_url("")).rstrip("/")),
        parser=parser,
        on_figures=[first, _boom, last],
    )
    try:
        with caplog.at_level(logging.ERROR, logger="kvtax.serve.scrape.job"):
            await job.scrape_once()
            await job.scrape_once()
    finally:
        parser.close()
        await job.close()
        await vllm.close()
    assert job.health.up
    assert job.health.scrapes == 2
    assert sum(job.health.errors.values()) == 0
    assert len(first.seen) == len(last.seen) == 2
    assert last.seen[-1] is job.figures
    failures = [r for r in caplog.records if "handing the scrape's figures" in r.getMessage()]
    assert len(failures) == 2
    assert "_boom" in failures[0].getMessage()


async def test_a_run_submitted_before_stop_that_begins_after_it_does_nothing() -> None:
    # Protection: Periodic._once returns when the job is stopped. The scheduler submits a run as
    # a task; stopped before that task's first step, stop() cannot see it to wait for it, and it
    # ran on what its owner had closed since (a poller's session: "Session is closed", logged as
    # a failed poll; tests/unit/test_poller.py failed 9 runs in 30 so).
    runs: list[int] = []

    async def run() -> None:
        runs.append(1)

    job = Periodic("probe", run, 3600.0)
    job.start()
    submitted = asyncio.ensure_future(job._once())  # as the scheduler's executor submits a run
    await job.stop()
    await submitted
    assert runs == []
    # Started, the same job runs.
    job.start()
    await job._once()
    await job.stop()
    assert runs == [1]
