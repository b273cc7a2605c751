"""The join pairs the ledger with a vLLM page it could not read at the same instant.

kvtax reads vLLM's page over HTTP and parses it in a worker, seconds later on a starved machine,
while the proxy goes on settling requests and delivering tokens. These tests drive the whole
stack (``serve.wiring.build``) against a stand-in vLLM whose ``/metrics`` lets the test settle
requests in the ledger while its page is in flight, or while it is being parsed, and check that
neither the join coverage nor the counters Prometheus divides by the engine's are thrown off.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.exposition import generate_latest

from kvtax.delivery.ledger import RequestRecord
from kvtax.engine.snapshot import VllmSnapshot
from kvtax.figures.derive import coverage
from kvtax.figures.window import Point, delivered_at_page
from kvtax.serve.config import load_config
from kvtax.serve.scrape.parsepool import ParsePool
from kvtax.serve.wiring import Stack, build
from tests.unit.conftest import FakeClock, one, parse_exposition, read_fixture

MODEL = "tiny-llama"
SERVED = re.compile(r'^(http_requests_total\{handler="/v1/completions"[^}]*\}) \S+$', re.M)
GENERATED = re.compile(r"^(vllm:generation_tokens_total\{[^}]*\}) \S+$", re.M)
BASE_GENERATED = 6770  # the recorded page's count


class Vllm:
    """Serves the recorded 0.32 page with ``served`` completions counted; ``in_flight`` runs
    after the page is written and before it reaches kvtax (what settled meanwhile)."""

    def __init__(self) -> None:
        self.text = read_fixture("0.32-preempting.prom")
        self.served = 0
        self.generated = 0  # tokens generated since the recording
        self.in_flight: Callable[[], None] = lambda: None

    async def metrics(self, request: web.Request) -> web.Response:
        body = SERVED.sub(rf"\g<1> {float(self.served)}", self.text)
        body = GENERATED.sub(rf"\g<1> {float(BASE_GENERATED + self.generated)}", body)
        self.in_flight()
        return web.Response(text=body, content_type="text/plain")

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/metrics", self.metrics)
        return app


@pytest.fixture(scope="module")
def parser() -> Iterator[ParsePool]:
    pool = ParsePool()
    yield pool
    pool.close()


@pytest.fixture
def vllm() -> Vllm:
    return Vllm()


@pytest.fixture
async def stack(
    vllm: Vllm, aiohttp_server: Any, parser: ParsePool, clock: FakeClock
) -> AsyncIterator[Stack]:
    server: TestServer = await aiohttp_server(vllm.app())
    config = load_config(
        {
            "vllm.url": f"http://127.0.0.1:{server.port}",
            "proxy.listen_address": "off",
            "scrape.interval": "10s",
            "scrape.timeout": "5s",
            "window": "5m",
        },
        env={},
        file=None,
    )
    stack = build(config, clock=clock, parser=parser)
    yield stack
    await stack.scrape.close()


def settle(stack: Stack, requests: int, tokens: int = 0, undelivered: int = 0) -> None:
    for _ in range(requests):
        stack.ledger.settle(
            RequestRecord(
                MODEL, "completed", delivered_tokens=tokens, undelivered_tokens=undelivered
            )
        )


def page(stack: Stack) -> dict[str, Any]:
    return parse_exposition(generate_latest(stack.web.registry).decode())


async def test_requests_settled_while_the_page_is_in_flight_never_lower_coverage(
    stack: Stack, vllm: Vllm, clock: FakeClock
) -> None:
    # Measured on the fleet e2e's calm pod, where every request went through the proxy: vLLM's
    # page said 1 served, and two more requests settled in the ledger before kvtax read it at
    # the fold, after the fetch and the parse. Read at the fold alone, the window's base
    # paired 3 joined with 1 served, and coverage read (9 - 3) / (9 - 1) = 0.75.
    settle(stack, 1)
    vllm.served = 1
    vllm.in_flight = lambda: settle(stack, 2)
    await stack.scrape.scrape_once()
    vllm.in_flight = lambda: None
    settle(stack, 6)
    vllm.served = 9
    clock.advance(5)
    await stack.scrape.scrape_once()
    assert one(page(stack), "kvtax_join_coverage_ratio", model_name=MODEL) == 1.0
    first, last = stack.window.points(MODEL)
    assert (first.joined_before, first.joined_requests, last.joined_requests) == (1, 3, 9)


async def test_coverage_still_sees_traffic_that_bypasses_the_proxy(
    stack: Stack, vllm: Vllm, clock: FakeClock
) -> None:
    vllm.served = 4
    await stack.scrape.scrape_once()
    settle(stack, 3)
    vllm.served = 10  # 6 more served, 3 of them through the proxy
    clock.advance(5)
    await stack.scrape.scrape_once()
    assert one(page(stack), "kvtax_join_coverage_ratio", model_name=MODEL) == 0.5


def test_coverage_runs_from_the_read_before_the_first_page_to_the_read_after_the_last() -> None:
    first = Point(0.0, served_requests=1, joined_requests=3, joined_before=1)
    last = Point(5.0, served_requests=9, joined_requests=9, joined_before=8)
    assert coverage(first, last) == 1.0
    # Without a read before the page, both reads are the one count.
    assert coverage(Point(0.0, served_requests=1, joined_requests=3), last) == 0.75


async def test_the_join_counters_move_only_with_a_scrape_of_vllm(
    stack: Stack, vllm: Vllm, clock: FakeClock
) -> None:
    await stack.scrape.scrape_once()  # the ledger learns the model's name
    settle(stack, 1, tokens=10)
    clock.advance(1)
    await stack.scrape.scrape_once()
    m = page(stack)
    assert one(m, "kvtax_join_delivered_tokens_total", model_name=MODEL) == 10.0
    assert one(m, "kvtax_join_undelivered_tokens_total", model_name=MODEL) == 0.0
    generated = one(m, "kvtax_engine_generation_tokens_total", model_name=MODEL)
    # A stream settles after the scrape: the live counter counts it at once; the join counters,
    # like the engine's, wait for the next scrape of vLLM.
    settle(stack, 1, tokens=25, undelivered=4)
    m = page(stack)
    assert one(m, "kvtax_delivered_tokens_total", model_name=MODEL, source="proxy") == 35.0
    assert one(m, "kvtax_undelivered_tokens_total", model_name=MODEL, source="proxy") == 4.0
    assert one(m, "kvtax_join_delivered_tokens_total", model_name=MODEL) == 10.0
    assert one(m, "kvtax_join_undelivered_tokens_total", model_name=MODEL) == 0.0
    assert one(m, "kvtax_engine_generation_tokens_total", model_name=MODEL) == generated
    clock.advance(1)
    await stack.scrape.scrape_once()
    m = page(stack)
    assert one(m, "kvtax_join_delivered_tokens_total", model_name=MODEL) == 35.0
    assert one(m, "kvtax_join_undelivered_tokens_total", model_name=MODEL) == 4.0


async def test_the_join_counters_are_read_as_the_page_arrives_not_after_its_parse(
    stack: Stack, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    await stack.scrape.scrape_once()  # the ledger learns the model's name
    settle(stack, 1, tokens=10)
    parse = stack.scrape.parser.normalize

    async def slow_parse(*args: Any, **kwargs: Any) -> VllmSnapshot:
        # Streams go on delivering while a starved machine parses the page.
        settle(stack, 1, tokens=7)
        return await parse(*args, **kwargs)

    monkeypatch.setattr(stack.scrape.parser, "normalize", slow_parse)
    clock.advance(1)
    await stack.scrape.scrape_once()
    m = page(stack)
    assert one(m, "kvtax_delivered_tokens_total", model_name=MODEL, source="proxy") == 17.0
    assert one(m, "kvtax_join_delivered_tokens_total", model_name=MODEL) == 10.0
    # The request still counts as joined: the count after the parse bounds the page's from above.
    assert stack.window.points(MODEL)[-1].joined_requests == 2


async def test_a_page_with_new_models_is_paired_with_the_ledger_after_its_names(
    stack: Stack, vllm: Vllm, clock: FakeClock
) -> None:
    # The first page teaches the ledger the names it labels running streams with: a stream
    # credited before them would count as "other". So the ledger is read at the fold then.
    credited: list[str] = []
    feed = stack.scrape.feed
    assert feed is not None

    def credit() -> None:
        credited.append(stack.ledger.names.label(MODEL))
        stack.ledger.credit(MODEL, 5)

    stack.scrape.feed = type(feed)(feed.names, feed.ledger, credit)
    await stack.scrape.scrape_once()
    assert credited == [MODEL]
    assert stack.window.points(MODEL)[-1].ledger.delivered == 5.0
    assert "other" not in stack.ledger.totals()


async def test_tokens_relayed_while_the_page_is_in_flight_wait_for_the_page_that_counts_them(
    stack: Stack, vllm: Vllm, clock: FakeClock
) -> None:
    # Measured on the fleet e2e's calm pod at its load's end: kvtax, starved after vLLM wrote its
    # page, relayed the tokens generated meanwhile before it read the ledger. Paired with that
    # page, delivered led generated (3,208 against 3,183), and the 20 s windows based on the
    # point read a yield of 0.78 as they slid past the load: KvtaxGoodputDiverging pending.
    await stack.scrape.scrape_once()  # the ledger learns the model's name
    vllm.generated = 100
    settle(stack, 1, tokens=100)
    vllm.in_flight = lambda: settle(stack, 1, tokens=40)  # generated after the page was written
    clock.advance(1)
    await stack.scrape.scrape_once()
    m = page(stack)
    assert one(m, "kvtax_delivered_tokens_total", model_name=MODEL, source="proxy") == 140.0
    assert one(m, "kvtax_join_delivered_tokens_total", model_name=MODEL) == 100.0
    vllm.in_flight = lambda: None
    vllm.generated = 140
    clock.advance(1)
    await stack.scrape.scrape_once()
    assert one(page(stack), "kvtax_join_delivered_tokens_total", model_name=MODEL) == 140.0
    # Each point's delivered increase is the engine's: the window's yield is exactly 1.
    first, *_, last = stack.window.points(MODEL)
    assert last.delivered_paired - first.delivered_paired == 140.0


async def test_tokens_generated_for_no_client_still_lower_the_join_count(
    stack: Stack, vllm: Vllm, clock: FakeClock
) -> None:
    await stack.scrape.scrape_once()
    vllm.generated = 100
    settle(stack, 1, tokens=60, undelivered=40)  # the client left after 60 tokens
    clock.advance(1)
    await stack.scrape.scrape_once()
    assert one(page(stack), "kvtax_join_delivered_tokens_total", model_name=MODEL) == 60.0


def test_the_count_as_of_the_page_stays_inside_the_reads_and_never_falls() -> None:
    """For any sequence of scrapes: the count lies between the reads on either side of the
    page, never falls, and grows by no more than the engine generated unless the read before
    the page shows more delivered."""

    # The suite's full profile runs 10,000 examples, sized for the HTTP differential; a pure
    # function of four numbers needs far fewer (10,000 lists of up to 30 steps took 135 s of the
    # unit lane beside the engine lanes).
    @settings(max_examples=500)
    @given(
        st.lists(
            st.tuples(
                st.integers(0, 500), st.integers(0, 500), st.integers(0, 500)
            ),  # delivered before the fetch, during it, tokens generated
            min_size=1,
            max_size=30,
        )
    )
    def check(steps: list[tuple[int, int, int]]) -> None:
        ledger, previous = 0.0, None
        for before_fetch, during, generated in steps:
            ledger += before_fetch
            before, arrived = ledger, ledger + during
            ledger = arrived
            count = delivered_at_page(previous, float(generated), before, arrived)
            assert before <= count <= arrived
            if previous is not None:
                assert count >= previous
                assert count <= max(before, previous + generated)
            previous = count

    check()
