"""The scrape edge against hostile vLLM stand-ins: redirects, floods, cut pages, NaN, name churn.

Every stand-in is a real aiohttp server on loopback. Each test reads kvtax's own /metrics, the
way an operator would, and asserts on counts, never on time.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client.exposition import generate_latest

from kvtax.engine import normalize as normalize_module
from kvtax.serve.config import load_config
from kvtax.serve.scrape import job as job_module
from kvtax.serve.scrape.job import ScrapeJob
from kvtax.serve.scrape.parsepool import ParsePool
from tests.unit.conftest import FakeClock, Labels, one, parse_exposition, web_port

ServerFactory = Callable[..., Awaitable[TestServer]]


def gen_page(tokens: str, *, models: tuple[str, ...] = ("m",), usage: str = "0.5") -> str:
    lines = ["# TYPE vllm:generation_tokens counter"]
    lines += [f'vllm:generation_tokens_total{{model_name="{m}"}} {tokens}' for m in models]
    lines += ["# TYPE vllm:kv_cache_usage_perc gauge"]
    lines += [f'vllm:kv_cache_usage_perc{{model_name="{m}"}} {usage}' for m in models]
    return "\n".join(lines) + "\n"


@dataclass
class Stand:
    """A vLLM stand-in whose /metrics answer a test sets: a body, a handler, or a redirect."""

    body: str = field(default_factory=lambda: gen_page("5000"))
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]] | None = None
    hits: int = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/version", self._version)
        return app

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        self.hits += 1
        if self.handler is not None:
            return await self.handler(request)
        return web.Response(text=self.body)

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "0.32.0"})


@pytest.fixture(scope="module")
def parser() -> Iterator[ParsePool]:
    pool = ParsePool()
    yield pool
    pool.close()


@pytest.fixture
def stand() -> Stand:
    return Stand()


@pytest.fixture
async def make(
    stand: Stand, aiohttp_server: ServerFactory, clock: FakeClock, parser: ParsePool
) -> AsyncIterator[Callable[..., Awaitable[ScrapeJob]]]:
    made: list[ScrapeJob] = []

    async def factory(**flags: str) -> ScrapeJob:
        server = await aiohttp_server(stand.app())
        config = load_config(
            {
                "vllm.url": f"http://127.0.0.1:{server.port}",
                "scrape.interval": "1s",
                "scrape.timeout": "500ms",
                "window": "1m",
                **flags,
            },
            env={},
            file=None,
        )
        made.append(ScrapeJob(config, clock=clock, parser=parser))
        return made[-1]

    yield factory
    for sc in made:
        await sc.close()


def page(sc: ScrapeJob) -> str:
    """kvtax's /metrics as the web port in front of ``sc`` renders it."""
    return generate_latest(web_port(sc).registry).decode()


def page_of(sc: ScrapeJob) -> dict[str, dict[Labels, float]]:
    return parse_exposition(page(sc))


def errors(sc: ScrapeJob, reason: str) -> float:
    return one(page_of(sc), "kvtax_scrape_errors_total", reason=reason)


def last_error(sc: ScrapeJob) -> dict[str, float]:
    series = page_of(sc)["kvtax_last_scrape_error"]
    return {dict(labels)["reason"]: value for labels, value in series.items()}


GEN = "kvtax_engine_generation_tokens_total"


# -- redirects (finding 11) ------------------------------------------------------------------


async def test_a_redirect_to_another_host_is_an_error_and_never_followed(
    stand: Stand, make: Callable[..., Awaitable[ScrapeJob]]
) -> None:
    foreign = Stand(body=gen_page("999999", models=("foreign",)))
    other = TestServer(foreign.app(), host="127.0.0.2")
    await other.start_server()
    try:

        async def redirect(request: web.Request) -> web.StreamResponse:
            raise web.HTTPFound(f"http://127.0.0.2:{other.port}/metrics")

        stand.handler = redirect
        sc = await make()
        await sc.scrape_once()
    finally:
        await other.close()
    assert foreign.hits == 0
    assert one(page_of(sc), "kvtax_vllm_up") == 0.0
    assert errors(sc, "http_status") == 1.0
    assert sc.health.last_error is not None
    assert "redirect" in sc.health.last_error
    assert "--vllm.url" in sc.health.last_error
    assert "foreign" not in page(sc)


# -- page size (finding 7) -------------------------------------------------------------------


async def test_an_oversized_page_in_many_small_writes_stops_at_the_bound(
    stand: Stand, make: Callable[..., Awaitable[ScrapeJob]]
) -> None:
    total = 64 * 1024 * 1024
    line = ("unrelated_filler " + "1" * 1006 + "\n").encode()  # 1 KiB per write
    sent = 0
    done = asyncio.Event()

    async def flood(request: web.Request) -> web.StreamResponse:
        nonlocal sent
        resp = web.StreamResponse()  # chunked: no Content-Length to refuse up front
        await resp.prepare(request)
        try:
            while sent < total:
                await resp.write(line)
                sent += len(line)
        except ConnectionError:
            pass  # kvtax hung up: what the test wants
        finally:
            done.set()
        return resp

    stand.handler = flood
    sc = await make(**{"scrape.max_bytes": "256KiB"})
    await sc.scrape_once()
    await asyncio.wait_for(done.wait(), 30)  # a hang guard, not a timing assertion
    assert errors(sc, "too_large") == 1.0
    assert last_error(sc)["too_large"] == 1.0
    assert sc.health.last_error is not None
    assert "--scrape.max-bytes=262144" in sc.health.last_error
    # kvtax hung up near the bound; only socket buffers' worth more was ever sent.
    assert sent < total / 4


async def test_an_announced_oversized_page_is_refused_before_reading(
    stand: Stand, make: Callable[..., Awaitable[ScrapeJob]]
) -> None:
    stand.body = gen_page("1") + "#" * (1024 * 1024) + "\n"
    sc = await make(**{"scrape.max_bytes": "256KiB"})
    await sc.scrape_once()
    assert errors(sc, "too_large") == 1.0
    assert sc.health.last_error is not None
    assert f"is {len(stand.body)} bytes" in sc.health.last_error


async def test_a_series_flood_fails_too_many_series(
    stand: Stand, make: Callable[..., Awaitable[ScrapeJob]]
) -> None:
    flood = "".join(f'unrelated{{i="{i}"}} 1\n' for i in range(2_000))
    stand.body = "# TYPE unrelated gauge\n" + flood + gen_page("1")
    sc = await make(**{"scrape.max_series": "1000"})
    await sc.scrape_once()
    assert errors(sc, "too_many_series") == 1.0
    assert one(page_of(sc), "kvtax_vllm_up") == 0.0


# -- truncated pages and bad numbers (findings 4 and 5) ---------------------------------------


async def test_a_page_cut_mid_number_is_truncated_and_not_a_restart(
    stand: Stand, make: Callable[..., Awaitable[ScrapeJob]], clock: FakeClock
) -> None:
    sc = await make()
    await sc.scrape_once()
    good = gen_page("5000")
    stand.body = good[: good.index("5000") + 2]  # "... 50" and no final newline
    clock.advance(1)
    await sc.scrape_once()
    m = page_of(sc)
    assert one(m, "kvtax_scrape_errors_total", reason="truncated") == 1.0
    assert one(m, "kvtax_last_scrape_error", reason="truncated") == 1.0
    assert one(m, GEN, model_name="m") == 5000.0
    assert one(m, "kvtax_vllm_restarts_total") == 0.0
    stand.body = gen_page("5010")
    clock.advance(1)
    await sc.scrape_once()
    assert one(page_of(sc), GEN, model_name="m") == 5010.0


@pytest.mark.parametrize("bad", ["NaN", "+Inf", "-7"])
async def test_a_bad_counter_keeps_the_total_and_is_counted(
    bad: str, stand: Stand, make: Callable[..., Awaitable[ScrapeJob]], clock: FakeClock
) -> None:
    sc = await make()
    await sc.scrape_once()
    stand.body = gen_page(bad, usage="NaN")
    clock.advance(1)
    await sc.scrape_once()
    m = page_of(sc)
    assert all(math.isfinite(v) for series in m.values() for v in series.values())
    assert one(m, GEN, model_name="m") == 5000.0
    assert one(m, "kvtax_vllm_restarts_total") == 0.0
    rejected = {dict(k)["reason"]: v for k, v in m["kvtax_scrape_rejected_samples_total"].items()}
    negative = bad.startswith("-")
    # The counter's own reason, plus the NaN KV usage on the same page.
    assert rejected == {"non_finite": 1.0 + (not negative), "negative": float(negative)}
    # A NaN gauge is not published at all rather than published as NaN.
    assert frozenset({("model_name", "m")}) not in m.get("kvtax_kv_cache_usage_ratio", {})
    stand.body = gen_page("5010")
    clock.advance(1)
    await sc.scrape_once()
    m = page_of(sc)
    assert one(m, GEN, model_name="m") == 5010.0
    assert one(m, "kvtax_vllm_restarts_total") == 0.0


# -- engine-side model names (finding 8) ------------------------------------------------------


async def test_ten_thousand_rotating_model_names_keep_the_output_bounded(
    stand: Stand, make: Callable[..., Awaitable[ScrapeJob]], clock: FakeClock
) -> None:
    sc = await make(**{"scrape.max_models": "8"})
    for scrape in range(20):
        names = tuple(f"model-{scrape * 500 + i:05d}" for i in range(500))
        stand.body = gen_page(str(100 + scrape), models=names)
        clock.advance(5)
        await sc.scrape_once()
        m = page_of(sc)
        models = {dict(k)["model_name"] for k in m.get("kvtax_kv_cache_usage_ratio", {})}
        assert 0 < len(models) <= 8
        assert sum(len(series) for series in m.values()) < 200
    assert one(m, "kvtax_scrape_dropped_models_total") == 20 * (500 - 8)
    # Only this scrape's names remain: the earlier ones left with their models.
    assert all(name >= "model-09500" for name in models)


# -- why the last scrape failed (finding 13) --------------------------------------------------


async def test_the_last_scrape_error_tells_slow_from_down_and_clears_on_success(
    stand: Stand, make: Callable[..., Awaitable[ScrapeJob]]
) -> None:
    release = asyncio.Event()

    async def slow(request: web.Request) -> web.StreamResponse:
        await release.wait()
        return web.Response(text=gen_page("1"))

    sc = await make()
    stand.handler = slow
    try:
        await sc.scrape_once()
    finally:
        release.set()
    assert {r for r, v in last_error(sc).items() if v == 1.0} == {"timeout"}
    stand.handler = None
    await sc.scrape_once()
    assert set(last_error(sc).values()) == {0.0}
    assert one(page_of(sc), "kvtax_vllm_up") == 1.0


# -- parsing off the event loop (finding 7) ---------------------------------------------------


async def test_the_page_is_parsed_in_the_worker_process_not_on_the_event_loop(
    make: Callable[..., Awaitable[ScrapeJob]], monkeypatch: pytest.MonkeyPatch
) -> None:
    def not_here(*args: object, **kwargs: object) -> None:
        raise AssertionError("parsed in the event loop's process")

    monkeypatch.setattr(job_module, "normalize", not_here)
    monkeypatch.setattr(normalize_module, "text_string_to_metric_families", not_here)
    sc = await make()
    await sc.scrape_once()
    assert sc.health.last_error is None
    assert one(page_of(sc), GEN, model_name="m") == 5000.0
