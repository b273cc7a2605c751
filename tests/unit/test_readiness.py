"""``/readyz`` under a flood of probes: vLLM's /health asked once, the scraper left alone.

``/readyz`` needs no credentials, so a loop of hits (or several probers while vLLM is slow) must
neither send vLLM one /health each nor take the connections the periodic scrape needs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvtax.serve.scrape.job import ScrapeJob
from kvtax.serve.scrape.parsepool import ParsePool
from kvtax.serve.scrape.readiness import FRESH_FOR, HEALTH_MAX_BYTES, HealthCheck
from kvtax.serve.scrape.scraper import Scraper
from kvtax.serve.web.port import WebPort
from tests.unit.conftest import FakeClock, web_port
from tests.unit.test_sidecar import ClientFactory, FakeVllm, ServerFactory, make_job


@dataclass
class CountingVllm(FakeVllm):
    """Counts /health requests; while ``hold`` is set, each waits for ``answer``."""

    health_hits: int = 0
    hold: bool = False
    health_delay: float = 0.0

    def __post_init__(self) -> None:
        self.arrived = asyncio.Event()
        self.answer = asyncio.Event()

    async def _health(self, request: web.Request) -> web.Response:
        self.health_hits += 1
        self.arrived.set()
        if self.hold:
            await self.answer.wait()
        await asyncio.sleep(self.health_delay)
        return await super()._health(request)


@pytest.fixture
def vllm() -> CountingVllm:
    return CountingVllm()


@pytest.fixture
async def server(vllm: CountingVllm, aiohttp_server: ServerFactory) -> TestServer:
    return await aiohttp_server(vllm.app())


@pytest.fixture(scope="module")
def parser() -> Iterator[ParsePool]:
    pool = ParsePool()
    yield pool
    pool.close()


@pytest.fixture
async def job(server: TestServer, clock: FakeClock, parser: ParsePool) -> AsyncIterator[ScrapeJob]:
    assert server.port is not None
    made = make_job(server.port, clock, parser)
    yield made
    await made.close()


@pytest.fixture
def port(job: ScrapeJob) -> WebPort:
    return web_port(job)


@pytest.fixture
async def health(server: TestServer, clock: FakeClock) -> AsyncIterator[HealthCheck]:
    check = HealthCheck(
        Scraper(f"http://127.0.0.1:{server.port}", 2.0, HEALTH_MAX_BYTES), clock=clock
    )
    yield check
    await check.close()


async def test_a_flood_of_readyz_asks_vllm_once_or_twice(
    vllm: CountingVllm, port: WebPort, aiohttp_client: ClientFactory
) -> None:
    vllm.health_delay = 0.05  # long enough for the hits to overlap
    client = await aiohttp_client(port.app())

    async def readyz() -> int:
        async with client.get("/readyz") as resp:
            await resp.read()
            return resp.status

    statuses = await asyncio.gather(*(readyz() for _ in range(50)))
    assert 1 <= vllm.health_hits <= 2
    assert statuses == [200] * 50


async def test_callers_share_the_check_in_flight_and_a_hang_up_does_not_cancel_it(
    vllm: CountingVllm, health: HealthCheck
) -> None:
    health.fresh_for = 0.0  # no reuse: only sharing can keep the count at one
    vllm.hold = True
    waiters = [asyncio.ensure_future(health.failure()) for _ in range(10)]
    await vllm.arrived.wait()
    waiters[0].cancel()  # a prober that hung up
    await asyncio.sleep(0)
    vllm.answer.set()
    assert await asyncio.gather(*waiters[1:]) == [None] * 9
    assert vllm.health_hits == 1
    assert await health.failure() is None
    assert vllm.health_hits == 2


async def test_the_answer_is_reused_for_a_moment_then_asked_again(
    vllm: CountingVllm, health: HealthCheck, clock: FakeClock
) -> None:
    assert await health.failure() is None
    vllm.healthy = False
    assert await health.failure() is None  # the answer of a moment ago
    assert vllm.health_hits == 1
    clock.advance(FRESH_FOR)
    failure = await health.failure()
    assert failure is not None
    assert failure.reason == "http_status"
    assert vllm.health_hits == 2


async def test_probes_held_by_a_slow_vllm_leave_the_scrape_its_connections(
    vllm: CountingVllm, job: ScrapeJob, port: WebPort, aiohttp_client: ClientFactory
) -> None:
    vllm.hold = True  # /health hangs; /metrics answers at once
    client = await aiohttp_client(port.app())
    probes = [asyncio.ensure_future(client.get("/readyz")) for _ in range(4)]
    await vllm.arrived.wait()
    await job.scrape_once()
    assert job.health.up, job.health.last_error
    vllm.answer.set()
    for probe in probes:  # answered either way (200, or 503 once the check timed out)
        (await probe).release()
