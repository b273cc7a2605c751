"""Fail fast: a request whose wait is foretold past --gate.max-wait is refused at arrival.

The wait is foretold from the requests' service time (admission to leave), so the tests place
admissions and leaves in time by hand, on a fake clock: the service time is exact and no test
waits for it. A refusal is checked to come without any await: the coroutine of ``enter``
finishes on its first step.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import deque
from collections.abc import Coroutine
from dataclasses import replace
from typing import Any

import pytest

from kvtax.expose.samples import Sample
from kvtax.gate.cap import CapSettings
from kvtax.gate.order import (
    FORETOLD_SHARE,
    OUTLIVED_SHARE,
    RATE_ENOUGH,
    SERVICE_SAMPLES,
    Order,
    ServiceTime,
    foretold_wait,
)
from kvtax.serve.proxy.gatekeeper import REASONS, Gate, GateSettings, Ticket

T0 = 1000.0


def test_the_wait_is_when_the_requests_in_flight_have_freed_a_slot_for_each_ahead() -> None:
    def wait(ahead: int, ages: list[float], cap: int, durations: list[float]) -> float | None:
        return foretold_wait(
            ahead=ahead, ages=ages, cap=cap, samples=3, durations=durations, mean=10.0
        )

    # 3 in flight just admitted, 10 s each: they leave together at 10 s, and the next 3 at 20.
    assert wait(2, [0.0, 0.0, 0.0], 3, []) == 10.0
    assert wait(3, [0.0, 0.0, 0.0], 3, []) == 20.0
    # Little's law read the first 5 s (3 slots at 10/3 s each): half the wait, half the time.
    assert wait(0, [0.0, 0.0], 2, []) == 10.0
    # An older request leaves sooner: 7 s gone of 10, 3 s left.
    assert wait(0, [7.0, 1.0], 2, []) == 3.0
    # Past its age, what the recent ones that lasted longer took: 14 and 18 s, 16 on average,
    # 4 s left at 12 s of age (not the mean's -2).
    assert wait(0, [12.0, 0.0], 2, [4.0, 6.0, 14.0, 18.0]) == 4.0
    # A request older than every recent one still holds its slot a while.
    assert wait(0, [60.0], 1, [10.0] * 3) == OUTLIVED_SHARE * 10.0
    # A cap cut below those in flight: its first leave lets nobody in.
    assert wait(0, [8.0, 0.0, 0.0], 2, []) == 10.0
    # Too little to say: unknown, never a guess.
    for samples in (0, 2):
        assert (
            foretold_wait(ahead=1, ages=[0.0], cap=1, samples=samples, durations=[], mean=5.0)
            is None
        )


def test_the_service_time_is_the_mean_of_the_last_requests() -> None:
    service = ServiceTime()
    assert service.reading() == (0, 0.0)
    for seconds in range(1, 1001):
        service.add(float(seconds))
    # The last 32: 969..1000 s, a mean of 984.5; memory bounded, the total not drifted.
    assert service.reading() == (SERVICE_SAMPLES, 984.5)
    assert len(service._durations) == SERVICE_SAMPLES
    # A huge duration gone leaves no trace: adding to it and taking it away rounded the
    # running total (a 1e15 s total holds no tenths), which the exact re-sum puts right.
    service.add(1e15)
    for _ in range(2 * SERVICE_SAMPLES - 1):
        service.add(0.1)
    assert service.reading()[1] == pytest.approx(0.1, rel=1e-9)


def _at_once(coroutine: Coroutine[Any, Any, str | None]) -> str | None:
    """What ``enter`` says without ever awaiting: a refusal at arrival."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coroutine.close()
    raise AssertionError("enter() awaited: the request was queued, not refused at once")


class Bench:
    """A gate with ``cap`` slots on a fake clock, the tickets in flight (oldest admission
    first) and those queued. ``bound`` is the longest foretold wait let into the queue: its
    ``--gate.max-wait`` is that over :data:`FORETOLD_SHARE`."""

    def __init__(self, cap: int = 1, bound: float = 30.0, order: Order = "fifo") -> None:
        self.now = T0
        settings = GateSettings(
            cap=CapSettings(mode="static", static_cap=cap),
            max_wait=bound / FORETOLD_SHARE,
            max_queue=1000,
            order=order,
        )
        self.gate = Gate(settings, clock=lambda: self.now)
        self.running: deque[Ticket] = deque()
        self.queued: list[tuple[Ticket, asyncio.Task[str | None]]] = []

    async def run(self, n: int = 1) -> None:
        """Let ``n`` requests in now (the slots are free)."""
        for _ in range(n):
            ticket = self.gate.ticket(1, 1)
            assert await self.gate.enter(ticket) is None
            self.running.append(ticket)

    async def queue(self, max_tokens: int = 1) -> Ticket:
        """One more request that must wait, and does (it is not refused)."""
        ticket = self.gate.ticket(1, max_tokens)
        task = asyncio.ensure_future(self.gate.enter(ticket))
        await asyncio.sleep(0)
        assert not task.done(), f"queued request answered {task.result()!r}"
        self.queued.append((ticket, task))
        return ticket

    def finish(self, n: int = 1) -> None:
        """The ``n`` requests in flight longest end now; those let in instead start now."""
        for _ in range(n):
            self.gate.leave(self.running.popleft())
            self.running.extend(t for t, _ in self.queued if t.admitted)
            self.queued = [(t, task) for t, task in self.queued if not t.admitted]

    async def serve(self, n: int, seconds: float) -> None:
        """``n`` requests of ``seconds`` each, one after the other, nobody queued."""
        for _ in range(n):
            await self.run()
            self.now += seconds
            self.finish()

    def arrive(self, max_tokens: int = 1) -> str | None:
        return _at_once(self.gate.enter(self.gate.ticket(1, max_tokens)))

    async def close(self) -> None:
        for _, task in self.queued:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


@pytest.fixture
async def bench() -> Any:
    made: list[Bench] = []

    def make(cap: int = 1, bound: float = 30.0, order: Order = "fifo") -> Bench:
        made.append(Bench(cap, bound, order))
        return made[-1]

    yield make
    for b in made:
        await b.close()


async def _slow_engine(make: Any, order: Order = "fifo") -> Bench:
    """3 slots whose requests take 10 s each: 3 served, then 3 in flight and nobody queued.
    A slot frees every 10/3 s, so 8 ahead is 30 s, the bound, and 9 ahead is past it."""
    b: Bench = make(cap=3, bound=30.0, order=order)
    await b.run(3)
    b.now += 10.0
    b.finish(3)
    await b.run(3)
    return b


async def test_a_slow_engine_refuses_once_three_requests_have_completed(bench: Any) -> None:
    # 3 in flight of 10 s each complete 0.3 a second: a backlog's 10 completions take 33 s,
    # past the 30 s bound. The service time is known after 3, 10 s after the queue formed.
    b = bench(cap=3, bound=30.0)
    for at in (0.0, 4.0, 8.0):
        b.now = T0 + at
        await b.run()
    for _ in range(20):
        await b.queue()  # nothing has ended: the wait is unknown, so they queue
    for done, at in enumerate((10.0, 14.0, 18.0), start=1):
        b.now = T0 + at
        b.finish()  # 10 s after its admission; the head of the queue takes the slot
        while b.gate.queued < 20:
            await b.queue()
        if done < 3:
            await b.queue()  # 20 ahead: unknown still, so it queues
    assert b.gate.queued == 20
    assert b.gate.rejections["wait_predicted"] == 0
    # 3 completions, far from the RATE_ENOUGH a backlog's rate needed: 21 x 10 / 3 = 70 s.
    assert b.gate._done.reading(b.now)[0] == 3 < RATE_ENOUGH
    assert b.arrive() == "wait_predicted"
    assert b.now - (T0 + 8.0) == 10.0  # seconds since the queue formed
    assert b.gate.queued == 20  # answered without awaiting: it never queued
    assert b.gate.rejections["wait_predicted"] == 1
    assert b.gate.rejections["wait_expired"] == b.gate.rejections["queue_full"] == 0
    # Retry-After: the queue's wait at the completion rate, at most --gate.max-wait.
    assert b.gate.retry_after() == b.gate.settings.max_wait == 60
    assert "wait_predicted" in REASONS
    shed = {
        s.labels: s.value
        for s in b.gate.samples()
        if isinstance(s, Sample) and s.metric == "kvtax_gate_rejections_total"
    }
    assert shed[("wait_predicted",)] == 1.0


async def test_a_wait_foretold_past_half_the_max_wait_is_refused_at_arrival() -> None:
    """A foretold wait is of means: one of 10 s is let into the queue under a 25 s
    --gate.max-wait and refused at arrival under a 15 s one, which it would fit but with no
    room for the requests ahead to run long (FORETOLD_SHARE)."""
    assert FORETOLD_SHARE == 0.5
    for max_wait, verdict in ((15.0, "wait_predicted"), (25.0, None)):
        b = Bench(cap=1, bound=max_wait * FORETOLD_SHARE)
        assert b.gate.settings.max_wait == max_wait
        await b.serve(3, seconds=10.0)
        await b.run()  # in flight: the next one waits 10 s
        if verdict is None:
            await b.queue()
        else:
            assert b.arrive() == verdict
        await b.close()


async def test_a_request_that_would_fit_is_queued(bench: Any) -> None:
    b = await _slow_engine(bench)
    for _ in range(9):
        await b.queue()  # 0 to 8 ahead: 3.3 s to 30 s, none past the bound
    assert b.arrive() == "wait_predicted"  # 9 ahead: 33.3 s
    assert b.gate.rejections["wait_predicted"] == 1


async def test_the_first_request_to_queue_is_judged_too(bench: Any) -> None:
    # The first request to queue waits for a slot of those in flight: 10 s requests on one
    # slot are 10 s, past a 5 s bound, though no backlog has formed yet.
    b = bench(cap=1, bound=5.0)
    await b.serve(3, seconds=10.0)
    await b.run()
    assert b.gate.queued == 0
    assert b.arrive() == "wait_predicted"


async def test_below_three_completions_the_wait_is_unknown(bench: Any) -> None:
    # Protection: SERVICE_ENOUGH. With no completion, and with two of 10 s each (one queued
    # would read 10 s against a 2 s bound), nobody is refused.
    for completions in (0, 2):
        b = bench(cap=1, bound=2.0)
        await b.serve(completions, seconds=10.0)
        await b.run()
        for _ in range(21):
            await b.queue()
        assert b.gate.rejections["wait_predicted"] == 0


async def test_the_traffic_of_a_quiet_gate_is_not_its_pace(bench: Any) -> None:
    # Protection: the service time, not the completion rate. A quiet gate served 12 requests of
    # 0.1 s in a minute, one every 5 s (0.2/s); two then arrive while one runs. At 0.2/s they
    # would read 5 s and 10 s, past the 2 s bound, though each waits for 0.1 s requests.
    b = bench(cap=1, bound=2.0)
    for _ in range(12):
        await b.serve(1, seconds=0.1)
        b.now += 4.9
    await b.run()
    await b.queue()
    await b.queue()
    assert b.gate.rejections["wait_predicted"] == 0


async def test_the_service_time_counts_from_admission_not_arrival(bench: Any) -> None:
    # Protection: the time a request waited in the queue is not service. 40 requests of 1 s
    # each, each after 10 s queued: from arrival they would read 11 s, and 10 ahead 121 s.
    b = bench(cap=1, bound=30.0)
    await b.run()
    for _ in range(10):
        await b.queue()
    for _ in range(40):
        await b.queue()  # 10 ahead at 1 s a request: 11 s
        b.now += 1.0
        b.finish()
    while b.gate.queued < 30:
        await b.queue()  # up to 29 ahead: 30 s


async def test_the_service_time_is_that_of_the_last_requests(bench: Any) -> None:
    # Protection: the window of SERVICE_SAMPLES. 32 requests of 60 s, then 32 of 0.1 s: the
    # requests now are short, and 5 queued behind one read 0.6 s, not half a minute each.
    b = bench(cap=1, bound=2.0)
    await b.serve(SERVICE_SAMPLES, seconds=60.0)
    await b.serve(SERVICE_SAMPLES, seconds=0.1)
    await b.run()
    for _ in range(5):
        await b.queue()
    assert b.gate.rejections["wait_predicted"] == 0


@pytest.mark.parametrize("order", ["fifo", "shortest"])
async def test_shortest_counts_only_the_requests_it_would_follow(bench: Any, order: Order) -> None:
    # 3 in flight of 10 s: 4 queued of 2 tokens, then 5 of 1,001 (8 ahead is the bound).
    b = await _slow_engine(bench, order)
    for max_tokens in (1,) * 4 + (1000,) * 5:
        await b.queue(max_tokens)
    # One of 501 tokens: `shortest` serves it after the 4 small ones only (16.7 s), FIFO after
    # all 9 (33.3 s).
    if order == "shortest":
        await b.queue(500)
        assert b.gate.queued == 10
    else:
        assert b.arrive(500) == "wait_predicted"
    # The largest yet follows every queued request in either order: 33.3 s, or 36.7 s.
    assert b.arrive(2000) == "wait_predicted"
    assert b.gate.rejections["wait_predicted"] == (2 if order == "fifo" else 1)


async def test_a_wait_foretold_to_fit_is_never_refused_later(bench: Any) -> None:
    # wait_expired stays the backstop: a request let into the queue is refused only once it
    # has waited --gate.max-wait, whatever the estimate said at its arrival.
    b = bench(cap=1, bound=60.0)
    await b.serve(20, seconds=0.01)  # 0.01 s a request: one ahead is 0.02 s
    await b.run()
    b.gate.settings = replace(b.gate.settings, max_wait=0.05)
    late = asyncio.ensure_future(b.gate.enter(b.gate.ticket(1, 1)))
    await asyncio.sleep(0)
    assert not late.done()  # queued: 0.01 s fits in 0.05 s
    assert await late == "wait_expired"  # nothing ended: the backstop answered
    assert b.gate.rejections["wait_predicted"] == 0
    assert b.gate.rejections["wait_expired"] == 1


def test_the_count_ahead_is_the_queued_tickets_with_smaller_keys() -> None:
    # The heap walk that counts who is ahead in `shortest`, against a plain count, with the
    # entries of leavers left in the heap.
    rng = random.Random(25)

    async def scenario() -> None:
        gate = Gate(GateSettings(cap=CapSettings(mode="static"), order="shortest", max_queue=500))
        gate.state = replace(gate.state, cap=0)  # every request queues
        tasks = [
            asyncio.ensure_future(gate.enter(gate.ticket(1, rng.randint(1, 40))))
            for _ in range(300)
        ]
        await asyncio.sleep(0)
        leaving = rng.sample(tasks, 100)
        for task in leaving:
            task.cancel()
        await asyncio.gather(*leaving, return_exceptions=True)
        assert gate.queued == 200
        for footprint in range(45):
            key = (0, 0, (footprint, rng.randint(0, 310)))  # band 0, round 0: no fair shares
            plain = sum(1 for k, t in gate._queue if t.queued and k < key)
            assert gate._ahead(key) == plain
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(scenario())


async def test_budget_mode_foretells_the_wait_from_the_blocks_it_holds() -> None:
    """In budget mode the count cap is the ceiling; the wait is foretold from as many requests
    of the newcomer's size as the KV blocks hold: two of 5 blocks in 10, each 10 s long, make
    a third wait past a 5 s bound, and it is refused at arrival, not after 5 s."""
    now = [T0]
    gate = Gate(
        GateSettings(cap=CapSettings(mode="budget", ceiling=64), max_wait=5.0, max_queue=1000),
        clock=lambda: now[0],
    )
    gate.state = replace(gate.state, cap=64, budget_blocks=10)
    for _ in range(3):  # three served, 10 s each: the service time is known
        done = gate.ticket(16, 64)  # 5 blocks of 16 tokens
        assert await gate.enter(done) is None
        now[0] += 10.0
        gate.leave(done)
    for _ in range(2):
        assert await gate.enter(gate.ticket(16, 64)) is None
    assert gate.blocks_in_flight == 10
    assert _at_once(gate.enter(gate.ticket(16, 64))) == "wait_predicted"
