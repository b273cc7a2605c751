"""The sidecar in-process (the scrape job and the web port in front of it), against an aiohttp
server standing in for vLLM.

The stand-in produces on demand what a real vLLM cannot: a refused connection, a stall past the
timeout, a 500, a garbage body, and a comeback whose counters restarted lower. Tests drive
``ScrapeJob.scrape_once()`` directly and move an injected clock; nothing sleeps on the scheduler.
"""

from __future__ import annotations

import asyncio
import gzip
import io
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer, unused_port
from prometheus_client.exposition import choose_encoder, generate_latest
from prometheus_client.openmetrics.parser import text_fd_to_metric_families

from kvtax.serve.config import load_config
from kvtax.serve.scrape.job import ScrapeJob
from kvtax.serve.scrape.parsepool import ParsePool
from kvtax.serve.scrape.readiness import FRESH_FOR
from kvtax.serve.web import port as port_module
from kvtax.serve.web.port import WebPort
from tests.unit.conftest import FakeClock, Labels, one, parse_exposition, read_fixture, web_port

ServerFactory = Callable[..., Awaitable[TestServer]]
ClientFactory = Callable[[web.Application], Awaitable[TestClient[web.Request, web.Application]]]


@dataclass
class FakeVllm:
    """What the stand-in answers. ``mode``: ok, slow, status500 or garbage."""

    body: str = field(default_factory=lambda: read_fixture("0.32-preempting.prom"))
    version: str | None = "0.32.0"
    mode: str = "ok"
    release: asyncio.Event = field(default_factory=asyncio.Event)
    healthy: bool = True

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/version", self._version)
        app.router.add_get("/health", self._health)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.mode == "slow":
            # Held until the test releases it, well past the scraper's timeout.
            await self.release.wait()
        if self.mode == "status500":
            return web.Response(status=500, text="Internal Server Error")
        if self.mode == "garbage":
            return web.Response(text="<html><body>upstream gone</body></html>\n")
        return web.Response(text=self.body, content_type="text/plain")

    async def _version(self, request: web.Request) -> web.Response:
        if self.version is None:
            return web.Response(status=404)
        return web.Response(text=json.dumps({"version": self.version}))


@pytest.fixture
def vllm() -> FakeVllm:
    return FakeVllm()


@pytest.fixture
async def server(vllm: FakeVllm, aiohttp_server: ServerFactory) -> TestServer:
    return await aiohttp_server(vllm.app())


@pytest.fixture(scope="module")
def parser() -> Iterator[ParsePool]:
    """One parse worker for the module: starting a process per test would cost a second each."""
    pool = ParsePool()
    yield pool
    pool.close()


def make_job(port: int, clock: FakeClock, parser: ParsePool, **settings: str) -> ScrapeJob:
    config = load_config(
        {
            "vllm.url": f"http://127.0.0.1:{port}",
            "scrape.interval": "1s",
            "scrape.timeout": "200ms",
            "window": "5m",
            **settings,
        },
        env={},
        file=None,
    )
    return ScrapeJob(config, clock=clock, parser=parser)


@pytest.fixture
async def job(server: TestServer, clock: FakeClock, parser: ParsePool) -> AsyncIterator[ScrapeJob]:
    assert server.port is not None
    made = make_job(server.port, clock, parser)
    yield made
    await made.close()


@pytest.fixture
def port(job: ScrapeJob) -> WebPort:
    """The web port in front of ``job``, as kvtax serve connects its own."""
    return web_port(job)


def metrics(port: WebPort) -> dict[str, dict[Labels, float]]:
    return parse_exposition(generate_latest(port.registry).decode())


def errors(port: WebPort, reason: str) -> float:
    return one(metrics(port), "kvtax_scrape_errors_total", reason=reason)


async def test_a_good_scrape_publishes_up_and_the_engine_figures(
    job: ScrapeJob, port: WebPort, clock: FakeClock
) -> None:
    await job.scrape_once()
    clock.advance(5)
    await job.scrape_once()
    m = metrics(port)
    assert one(m, "kvtax_vllm_up") == 1.0
    assert one(m, "kvtax_scrapes_total") == 2.0
    assert one(m, "kvtax_vllm_info", version="0.32.0", engine="v1", api_servers="1") == 1.0
    assert one(m, "kvtax_kv_capacity_tokens", model_name="tiny-llama") == 2048.0
    assert one(m, "kvtax_last_scrape_success_timestamp_seconds") == clock.now
    assert m["kvtax_scrape_duration_seconds"][frozenset()] >= 0
    for reason in ("timeout", "refused", "connect", "http_status", "parse", "no_models"):
        assert errors(port, reason) == 0.0  # created up front, so rate() works at once
        assert one(m, "kvtax_last_scrape_error", reason=reason) == 0.0


async def test_vllm_down_is_up_0_and_refused_errors_rise(
    server: TestServer, job: ScrapeJob, port: WebPort
) -> None:
    await server.close()
    await job.scrape_once()
    assert one(metrics(port), "kvtax_vllm_up") == 0.0
    assert errors(port, "refused") == 1.0
    await job.scrape_once()
    assert errors(port, "refused") == 2.0
    assert errors(port, "timeout") == 0.0
    assert errors(port, "connect") == 0.0


async def test_slow_vllm_is_a_timeout(vllm: FakeVllm, job: ScrapeJob, port: WebPort) -> None:
    vllm.mode = "slow"
    try:
        await job.scrape_once()
    finally:
        vllm.release.set()
    assert one(metrics(port), "kvtax_vllm_up") == 0.0
    assert errors(port, "timeout") == 1.0
    assert errors(port, "connect") == 0.0
    assert errors(port, "refused") == 0.0


async def test_http_500_is_http_status(vllm: FakeVllm, job: ScrapeJob, port: WebPort) -> None:
    vllm.mode = "status500"
    await job.scrape_once()
    assert one(metrics(port), "kvtax_vllm_up") == 0.0
    assert errors(port, "http_status") == 1.0


async def test_garbage_body_is_parse(vllm: FakeVllm, job: ScrapeJob, port: WebPort) -> None:
    vllm.mode = "garbage"
    await job.scrape_once()
    assert one(metrics(port), "kvtax_vllm_up") == 0.0
    assert errors(port, "parse") == 1.0
    assert job.health.last_error is not None
    assert job.health.last_error.startswith("parse")


async def test_a_page_without_models_is_no_models(
    vllm: FakeVllm, job: ScrapeJob, port: WebPort
) -> None:
    vllm.body = "# TYPE process_open_fds gauge\nprocess_open_fds 12\n"
    await job.scrape_once()
    assert one(metrics(port), "kvtax_vllm_up") == 0.0
    assert errors(port, "no_models") == 1.0


# vLLM with --disable-log-stats, or a release that renamed every metric kvtax reads: the page
# answers 200 with process series and nothing else.
STATS_OFF_PAGE = "# TYPE process_open_fds gauge\nprocess_open_fds 12\n"


@pytest.mark.parametrize("proxy", [":8001", "off"], ids=["proxy", "observe-only"])
async def test_a_page_without_vllm_series_keeps_the_pod_ready_and_raises_a_metric(  # noqa: PLR0917 - pytest fixtures
    proxy: str,
    vllm: FakeVllm,
    server: TestServer,
    clock: FakeClock,
    parser: ParsePool,
    aiohttp_client: ClientFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert server.port is not None
    job = make_job(server.port, clock, parser, **{"proxy.listen_address": proxy})
    port = web_port(job)
    try:
        client = await aiohttp_client(port.app())
        await job.scrape_once()  # a good page first: then the series vanish
        assert one(metrics(port), "kvtax_vllm_metrics_missing") == 0.0
        vllm.body = STATS_OFF_PAGE
        for _ in range(5):  # long past the three intervals the old readiness allowed
            clock.advance(1)
            await job.scrape_once()
            resp = await client.get("/readyz")
            assert resp.status == 200, await resp.text()
        assert one(metrics(port), "kvtax_vllm_metrics_missing") == 1.0
        warnings = [
            r.getMessage() for r in caplog.records if "--disable-log-stats" in r.getMessage()
        ]
        assert len(warnings) == 1  # one line when it starts, not one per scrape
        vllm.body = read_fixture("0.32-preempting.prom")
        await job.scrape_once()
        assert one(metrics(port), "kvtax_vllm_metrics_missing") == 0.0
    finally:
        await job.close()


async def test_observe_only_is_ready_even_with_vllm_down(
    clock: FakeClock, parser: ParsePool, aiohttp_client: ClientFactory
) -> None:
    job = make_job(unused_port(), clock, parser, **{"proxy.listen_address": "off"})
    port = web_port(job)
    try:
        client = await aiohttp_client(port.app())
        await job.scrape_once()
        assert one(metrics(port), "kvtax_vllm_up") == 0.0
        resp = await client.get("/readyz")
        assert resp.status == 200
        assert "observe-only" in await resp.text()
    finally:
        await job.close()


async def test_the_telemetry_path_moves_the_metrics_page(
    server: TestServer, clock: FakeClock, parser: ParsePool, aiohttp_client: ClientFactory
) -> None:
    assert server.port is not None
    job = make_job(server.port, clock, parser, **{"web.telemetry_path": "/kvtax/metrics"})
    port = web_port(job)
    try:
        client = await aiohttp_client(port.app())
        moved = await client.get("/kvtax/metrics")
        assert moved.status == 200
        assert "kvtax_vllm_up" in await moved.text()
        assert (await client.get("/metrics")).status == 404
    finally:
        await job.close()


async def test_vllm_back_after_a_restart_is_up_within_one_scrape_with_no_negative_rate(  # noqa: PLR0917 - pytest fixtures
    vllm: FakeVllm,
    server: TestServer,
    job: ScrapeJob,
    port: WebPort,
    clock: FakeClock,
    aiohttp_server: ServerFactory,
) -> None:
    vllm.body = read_fixture("0.32-after-overload.prom")
    await job.scrape_once()
    clock.advance(5)
    await job.scrape_once()
    before = metrics(port)
    assert one(before, "kvtax_vllm_up") == 1.0

    vllm_port = server.port
    await server.close()
    clock.advance(5)
    await job.scrape_once()
    assert one(metrics(port), "kvtax_vllm_up") == 0.0

    # vLLM comes back on the same port, restarted: its counters start again from zero.
    vllm.body = read_fixture("0.32-idle.prom")
    await aiohttp_server(vllm.app(), port=vllm_port)
    clock.advance(5)
    await job.scrape_once()
    after = metrics(port)
    assert one(after, "kvtax_vllm_up") == 1.0
    assert one(after, "kvtax_vllm_restarts_total") == 1.0
    for name, series in after.items():
        if name.endswith(("_per_second", "_total")):
            for labels, value in series.items():
                assert value >= 0, (name, labels)
    # Totals never fall, and the restart adds no spike: the idle engine's raw values are small.
    for name in (
        "kvtax_engine_generation_tokens_total",
        "kvtax_engine_preemptions_total",
        "kvtax_engine_prompt_computed_tokens_total",
    ):
        old = one(before, name, model_name="tiny-llama")
        new = one(after, name, model_name="tiny-llama")
        assert old <= new <= old + 1_000, name
    tax = one(after, "kvtax_preemption_tax_ratio", model_name="tiny-llama", method="estimated")
    assert 0.0 <= tax <= 1.0


async def test_healthz_is_always_200_and_readyz_follows_vllm_health_with_the_proxy_on(
    vllm: FakeVllm,
    job: ScrapeJob,
    port: WebPort,
    clock: FakeClock,
    aiohttp_client: ClientFactory,
) -> None:
    assert job.config.proxy_listen_address is not None  # the proxy is on by default
    job.vllm_health.clock = clock  # vLLM's answer is reused until the clock moves on
    client = await aiohttp_client(port.app())

    async def status(path: str) -> int:
        resp = await client.get(path)
        await resp.read()
        return resp.status

    assert await status("/healthz") == 200
    # Ready before any scrape: readiness asks vLLM's /health, not kvtax's scrapes.
    assert await status("/readyz") == 200
    vllm.mode = "status500"
    await job.scrape_once()
    assert await status("/readyz") == 200  # a failing /metrics page does not gate traffic
    vllm.healthy = False
    assert await status("/readyz") == 200  # the answer of a moment ago
    clock.advance(FRESH_FOR)
    resp = await client.get("/readyz")
    assert resp.status == 503
    assert "cannot reach vLLM: http_status" in await resp.text()
    assert await status("/healthz") == 200
    vllm.healthy = True
    clock.advance(FRESH_FOR)
    assert await status("/readyz") == 200
    job.draining = True  # at once, not a second later
    assert await status("/readyz") == 503

    resp = await client.get("/metrics")
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/plain")
    assert "kvtax_vllm_up 0.0" in await resp.text()


async def test_version_and_engine_kind_are_published(
    vllm: FakeVllm, job: ScrapeJob, port: WebPort
) -> None:
    vllm.body = read_fixture("0.6.6.prom")
    vllm.version = None  # V0 servers without /version still work
    await job.scrape_once()
    m = metrics(port)
    assert one(m, "kvtax_vllm_up") == 1.0
    assert one(m, "kvtax_vllm_info", version="unknown", engine="v0", api_servers="1") == 1.0


async def test_a_page_served_by_several_api_servers_is_named_on_the_info_series(
    vllm: FakeVllm,
    job: ScrapeJob,
    port: WebPort,
    clock: FakeClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # With --api-server-count > 1 vLLM serves /metrics from prometheus-client's multiprocess
    # collector: the default registry's python_*/process_* series are gone (the real 2- and
    # 3-server pages of docs/multi-api-server.md); the figures are the processes' sums.
    default_registry = ("python_", "process_")

    def family(line: str) -> str:  # "# TYPE name counter" or "name{...} value"
        return line.split()[2] if line.startswith("#") else line

    vllm.body = "".join(
        line + "\n"
        for line in read_fixture("0.32-preempting.prom").splitlines()
        if not family(line).startswith(default_registry)
    )
    caplog.set_level(logging.INFO, logger="kvtax.serve.scrape.job")
    await job.scrape_once()
    clock.advance(5)
    await job.scrape_once()
    m = metrics(port)
    assert one(m, "kvtax_vllm_info", version="0.32.0", engine="v1", api_servers="several") == 1.0
    assert one(m, "kvtax_kv_capacity_tokens", model_name="tiny-llama") == 2048.0
    said = [r.getMessage() for r in caplog.records if "API-server" in r.getMessage()]
    assert len(said) == 1  # once, not per scrape


async def test_the_server_version_decides_prefix_cache_units(
    vllm: FakeVllm, job: ScrapeJob, port: WebPort
) -> None:
    vllm.body = read_fixture("0.8.2.prom")
    vllm.version = "0.8.2"
    await job.scrape_once()
    assert job.health.version == "0.8.2"
    # 0.8.2 counts prefix-cache hits in blocks of 16 tokens: computed = prompt - hits x 16.
    computed = one(
        metrics(port),
        "kvtax_engine_prompt_computed_tokens_total",
        model_name="meta-llama/Llama-3.1-8B-Instruct",
    )
    assert computed == 96_648 - 1_510 * 16


async def test_a_page_larger_than_one_read_is_read_whole(
    vllm: FakeVllm, job: ScrapeJob, port: WebPort
) -> None:
    # Regression: the scraper took the first chunk of a large body for the whole page, so a
    # 1 MB page from a 30-model server failed as "parse" on every scrape.
    lines = ["# TYPE unrelated_filler gauge"]
    lines += [f'unrelated_filler{{index="{i:06d}",pad="{"x" * 16}"}} 1' for i in range(25_000)]
    lines += ["# TYPE vllm:num_requests_running gauge"]
    lines += ['vllm:num_requests_running{model_name="last-line"} 7']
    vllm.body = "\n".join(lines) + "\n"
    assert len(vllm.body) > 1_000_000
    await job.scrape_once()
    assert job.health.last_error is None
    assert job.health.up
    assert one(metrics(port), "kvtax_requests_running", model_name="last-line") == 7


async def test_stop_waits_for_the_first_scrape_it_started(
    vllm: FakeVllm, server: TestServer, clock: FakeClock, parser: ParsePool
) -> None:
    # start() runs the first scrape at once, as a task of its own; a stop() right after must
    # not leave it pending on the loop, to run against a closed scraper or be torn down later.
    assert server.port is not None
    config = load_config(
        {
            "vllm.url": f"http://127.0.0.1:{server.port}",
            "web.listen_address": f"127.0.0.1:{unused_port()}",
            "scrape.interval": "1m",
            "scrape.timeout": "200ms",
        },
        env={},
        file=None,
    )
    job = ScrapeJob(config, clock=clock, parser=parser)
    port = web_port(job)
    vllm.mode = "slow"
    await port.start()
    job.start()
    await job.stop()
    await port.stop()
    await job.close()
    vllm.release.set()
    scrapes = [
        task
        for task in asyncio.all_tasks()
        if getattr(task.get_coro(), "__qualname__", "") == "ScrapeJob.scrape_once"
    ]
    assert scrapes == []
    assert job.health.scrapes == 1
    assert job.health.errors["timeout"] == 1


def count_renders(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every /metrics page the web port renders, in order."""
    pages: list[bytes] = []

    def choose(accept: str) -> tuple[Callable[[Any], bytes], str]:
        encoder, content_type = choose_encoder(accept)

        def render(registry: Any) -> bytes:
            pages.append(encoder(registry))
            return pages[-1]

        return render, content_type

    monkeypatch.setattr(port_module, "choose_encoder", choose)
    return pages


async def test_concurrent_scrapes_of_kvtax_share_one_render(
    job: ScrapeJob, port: WebPort, aiohttp_client: ClientFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Protection: a render costs 3.5-4.6 ms of the loop that relays the proxy's streams; 200
    # scrapers at once held a relayed stream 0.67 s when each rendered its own page.
    await job.scrape_once()
    pages = count_renders(monkeypatch)
    client = await aiohttp_client(port.app())
    responses = await asyncio.gather(*(client.get("/metrics") for _ in range(200)))
    bodies = {await r.read() for r in responses}
    assert {r.status for r in responses} == {200}
    # They land in a few turns of the loop (2 here); one render each, not one per scraper.
    assert len(pages) <= 20, len(pages)
    assert bodies <= set(pages)


async def test_the_page_changes_as_soon_as_a_scrape_changes_the_figures(  # noqa: PLR0917 - pytest fixtures
    vllm: FakeVllm,
    job: ScrapeJob,
    port: WebPort,
    aiohttp_client: ClientFactory,
    monkeypatch: pytest.MonkeyPatch,
    clock: FakeClock,
) -> None:
    count_renders(monkeypatch)
    client = await aiohttp_client(port.app())

    async def page() -> dict[str, dict[Labels, float]]:
        return parse_exposition(await (await client.get("/metrics")).text())

    await job.scrape_once()
    assert one(await page(), "kvtax_vllm_up") == 1.0
    assert one(await page(), "kvtax_scrapes_total") == 1.0
    vllm.mode = "status500"
    await job.scrape_once()  # a failed scrape changes the page too
    first = await page()
    assert (one(first, "kvtax_vllm_up"), one(first, "kvtax_scrapes_total")) == (0.0, 2.0)
    vllm.mode = "ok"
    await job.scrape_once()
    assert one(await page(), "kvtax_kv_capacity_tokens", model_name="tiny-llama") == 2048.0


async def test_a_page_is_shared_within_one_turn_of_the_loop_and_never_after(
    port: WebPort, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Between scrapes of vLLM the proxy's counters still move: a page asked for in a later turn
    # of the loop is rendered anew, so no reader ever gets counters older than its own ask.
    pages = count_renders(monkeypatch)
    first = [port.page()[0] for _ in range(50)]
    assert len(pages) == 1
    assert set(first) == {pages[0]}
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    port.page()
    assert len(pages) == 2


# What Prometheus 2.x sends by default (scrape/scrape.go's acceptHeader).
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
    "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)


@pytest.mark.parametrize(
    "case",
    [
        (PROMETHEUS_ACCEPT, "gzip", "application/openmetrics-text", True),
        (PROMETHEUS_ACCEPT, "", "application/openmetrics-text", False),
        ("text/plain;version=0.0.4", "gzip, deflate", "text/plain", True),
        ("", "", "text/plain", False),
    ],
)
async def test_metrics_answers_the_format_and_encoding_the_scraper_asks_for(
    job: ScrapeJob, port: WebPort, aiohttp_client: ClientFactory, case: tuple[str, str, str, bool]
) -> None:
    # Protection: /metrics was always text 0.0.4 and never gzipped, whatever was asked.
    accept, encoding, kind, gzipped = case
    await job.scrape_once()
    client = await aiohttp_client(port.app())
    headers = {"Accept": accept, "Accept-Encoding": encoding}
    resp = await client.get("/metrics", headers=headers, auto_decompress=False)
    raw = await resp.read()
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith(kind)
    assert (resp.headers.get("Content-Encoding") == "gzip") is gzipped
    text = (gzip.decompress(raw) if gzipped else raw).decode()
    if kind == "application/openmetrics-text":
        assert text.endswith("# EOF\n")
        # prometheus_client's OpenMetrics parser has no annotations.
        parsed = text_fd_to_metric_families(io.StringIO(text))  # type: ignore[no-untyped-call]
        families = {f.name: f for f in parsed}
        assert families["kvtax_vllm_up"].samples[0].value == 1.0
    else:
        assert one(parse_exposition(text), "kvtax_vllm_up") == 1.0
    form = "openmetrics" if kind.startswith("application") else "text"
    served = parse_exposition((await (await client.get("/metrics")).read()).decode())
    assert (
        one(
            served,
            "kvtax_metrics_requests_total",
            format=form,
            encoding="gzip" if gzipped else "identity",
        )
        == 1.0
    )
