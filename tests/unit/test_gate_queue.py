"""The gate's queue on its own, without a proxy: who is admitted, and when, at what cost."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import pytest

from kvtax.figures.derive import ModelFigures
from kvtax.gate.cap import CapSettings
from kvtax.gate.footprint import MAX_FOOTPRINT
from kvtax.gate.order import RATE_RECENT, RATE_SPAN, CompletionRate, Order, queue_key
from kvtax.serve.proxy import gatekeeper as gate_module
from kvtax.serve.proxy.gatekeeper import CLOSED, Gate, GateSettings


def _budget_gate(order: Order, blocks: int) -> Gate:
    gate = Gate(GateSettings(cap=CapSettings(mode="budget", ceiling=64), order=order))
    # As if a scrape had set the budget: room for many requests, few blocks.
    gate.state = replace(gate.state, cap=64, budget_blocks=blocks)
    return gate


async def _cancel(*tasks: asyncio.Future[str | None]) -> None:
    for task in tasks:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_shortest_admits_at_once_a_request_that_fits_ahead_of_a_big_head() -> None:
    # Protection: in `shortest` order a request smaller than the queue's head that fits now is
    # admitted now, not queued to wait for the next leave or scrape.
    gate = _budget_gate("shortest", blocks=10)
    running = gate.ticket(16, 64)  # 5 blocks of 16 tokens
    assert await gate.enter(running) is None
    big = gate.ticket(16, 144)  # 10 blocks: no room beside the running one
    queued = asyncio.ensure_future(gate.enter(big))
    await asyncio.sleep(0)
    assert gate.queued == 1
    small = gate.ticket(16, 16)  # 2 blocks: fits beside the running one
    entering = asyncio.ensure_future(gate.enter(small))
    await asyncio.sleep(0)  # one step: enough for an admission that needs no wait
    try:
        assert small.admitted
        assert entering.done()
        assert entering.result() is None
        assert gate.queued == 1
        assert not big.admitted
        assert gate.blocks_in_flight == 7
    finally:
        await _cancel(queued, entering)


async def test_fifo_never_lets_a_newcomer_pass_the_queue() -> None:
    gate = _budget_gate("fifo", blocks=10)
    assert await gate.enter(gate.ticket(16, 64)) is None
    queued = asyncio.ensure_future(gate.enter(gate.ticket(16, 144)))
    await asyncio.sleep(0)
    small = gate.ticket(16, 16)
    entering = asyncio.ensure_future(gate.enter(small))
    await asyncio.sleep(0)
    try:
        assert not small.admitted
        assert gate.queued == 2
    finally:
        await _cancel(queued, entering)


def _held_gate(order: Order = "fifo", **settings: Any) -> Gate:
    """A gate that admits nothing: every request queues."""
    gate = Gate(GateSettings(cap=CapSettings(mode="static"), order=order, **settings))
    gate.state = replace(gate.state, cap=0)
    return gate


class _Key:
    """A queue key that counts the comparisons the queue makes with it."""

    calls = 0

    def __init__(self, key: tuple[int, int]) -> None:
        self.key = key

    def __lt__(self, other: _Key) -> bool:
        _Key.calls += 1
        return self.key < other.key

    def __eq__(self, other: object) -> bool:
        _Key.calls += 1
        return isinstance(other, _Key) and self.key == other.key

    __hash__ = None  # type: ignore[assignment]


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> type[_Key]:
    real = queue_key  # the gate's own, which the patch below replaces in its module
    monkeypatch.setattr(gate_module, "queue_key", lambda *a, **k: _Key(real(*a, **k)))
    _Key.calls = 0
    return _Key


N = 2000


async def _fill(gate: Gate, n: int) -> list[asyncio.Task[str | None]]:
    tasks = [asyncio.ensure_future(gate.enter(gate.ticket(16, 16 + i % 7))) for i in range(n)]
    await asyncio.sleep(0)
    assert gate.queued == n
    return tasks


@pytest.mark.parametrize("order", ["fifo", "shortest"])
async def test_clients_leaving_at_once_cost_linear_work(order: Order, counted: type[_Key]) -> None:
    # Protection: each leaver rebuilt the whole heap, O(N) each and O(N**2) together: 5,000
    # clients leaving at once stalled the loop 2.7 s, the cancel-all of 10,000 took 14.7 s.
    gate = _held_gate(order, max_queue=N)
    tasks = await _fill(gate, N)
    counted.calls = 0
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert gate.queued == 0
    # O(N log N) at most (heap pops and compactions); the rebuilds made about N**2.
    assert counted.calls < 30 * N


async def test_waits_expiring_at_once_cost_linear_work(counted: type[_Key]) -> None:
    gate = _held_gate(max_queue=N, max_wait=0.01)
    tasks = await _fill(gate, N)
    counted.calls = 0
    assert set(await asyncio.gather(*tasks)) == {"wait_expired"}
    assert gate.queued == 0
    assert gate.rejections["wait_expired"] == N
    assert counted.calls < 30 * N


async def test_leavers_never_block_the_ones_behind_them() -> None:
    # Leavers' entries stay in the heap until they reach its head: they must never be admitted,
    # counted as waiting, or stand in the way of one who waits behind them.
    gate = _held_gate("shortest", max_queue=100)
    tasks = await _fill(gate, 100)
    for task in tasks[:99]:
        task.cancel()
    await asyncio.gather(*tasks[:99], return_exceptions=True)
    assert gate.queued == 1
    gate.state = replace(gate.state, cap=1)
    gate._pump()
    assert await tasks[99] is None
    assert gate.in_flight == 1
    assert gate.admitted == 1


async def test_close_turns_away_only_those_still_queued() -> None:
    gate = _held_gate(max_queue=10)
    tasks = await _fill(gate, 10)
    await _cancel(*tasks[:5])
    gate.close()
    assert await asyncio.gather(*tasks[5:]) == [CLOSED] * 5
    assert gate.queued == 0


def test_a_ticket_holds_every_sequence_of_the_request() -> None:
    # Protection: a ticket counted one sequence, whatever n and the prompt list said.
    gate = Gate(GateSettings(cap=CapSettings(mode="budget", block_size=16)))
    one = gate.ticket(10, 64)
    assert (one.footprint, one.blocks) == (74, 5)
    many = gate.ticket(10, 64, n=50)
    assert (many.footprint, many.blocks) == (50 * 74, 50 * 5)
    listed = gate.ticket(100, 64, prompts=50)  # 50 prompts of 2 tokens each
    assert listed.footprint == 100 + 50 * 64
    assert listed.blocks == 50 * 5


@pytest.mark.parametrize("exponent", [309, 310, 5000])
def test_a_huge_max_tokens_leaves_the_controller_working(exponent: int) -> None:
    # Protection: max_tokens = 10**309 raised OverflowError in footprint_p95 (the follower
    # died, the cap stayed at the floor for good); 10**310 raised it in the ticket (a 500).
    gate = Gate(GateSettings(cap=CapSettings(mode="adaptive", floor=2, ceiling=64)))
    ticket = gate.ticket(10, 10**exponent, n=10**exponent)
    assert ticket.footprint <= MAX_FOOTPRINT
    p95 = gate.footprint_p95
    assert p95 is not None
    assert math.isfinite(p95)
    gate.observe({"m": ModelFigures(engine=True, totals={}, kv_capacity_tokens=4096.0)})
    assert list(gate.samples())


def test_an_error_of_one_step_is_logged_and_the_next_scrape_steps_the_cap(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Protection: one exception in a step ended the follower task, silently; the cap never
    # moved again and shutdown exited 1 with its traceback. The scrape now hands each fold's
    # figures to Gate.on_figures, which logs a failed step and takes the next one as usual.
    gate = Gate(GateSettings(cap=CapSettings(mode="adaptive")))
    seen: list[Mapping[str, ModelFigures]] = []

    def observe(figures: Mapping[str, ModelFigures]) -> None:
        seen.append(figures)
        if len(seen) == 1:
            raise OverflowError("int too large to convert to float")

    monkeypatch.setattr(gate, "observe", observe)
    gate.on_figures({})  # raises nothing
    gate.on_figures({})
    assert len(seen) == 2
    assert "stepping the cap failed" in caplog.text
    assert "OverflowError" in caplog.text


def _rate_gate(clock: list[float]) -> Gate:
    gate = Gate(
        GateSettings(
            cap=CapSettings(mode="static", static_cap=10**6), max_wait=60.0, max_queue=1000
        ),
        clock=lambda: clock[0],
    )
    return gate


async def _complete(gate: Gate, clock: list[float], per_second: float, seconds: float) -> None:
    for _ in range(round(per_second * seconds)):
        ticket = gate.ticket(1, 1)
        assert await gate.enter(ticket) is None
        clock[0] += 1 / per_second
        gate.leave(ticket)


async def test_retry_after_follows_the_current_completion_rate() -> None:
    # Protection: the rate window kept 4,096 completions but divided by 60 s: at 200/s it
    # read 68/s, and Retry-After said 15 s where the wait was about 6 s.
    clock = [1000.0]
    gate = _rate_gate(clock)
    await _complete(gate, clock, per_second=200, seconds=30)
    gate.state = replace(gate.state, cap=0)
    queued = [asyncio.ensure_future(gate.enter(gate.ticket(1, 1))) for _ in range(999)]
    await asyncio.sleep(0)
    try:
        assert gate.queued == 999
        assert gate.retry_after() in (5, 6)  # 1,000 requests at 200/s
        # The rate falls to 20/s: Retry-After follows within the recent window.
        gate.state = replace(gate.state, cap=10**6)
        await _cancel(*queued)
        await _complete(gate, clock, per_second=20, seconds=15)
        gate.state = replace(gate.state, cap=0)
        queued = [asyncio.ensure_future(gate.enter(gate.ticket(1, 1))) for _ in range(199)]
        await asyncio.sleep(0)
        assert gate.retry_after() in (10, 11)  # 200 requests at 20/s
    finally:
        await _cancel(*queued)


def test_the_completion_rate_is_bounded_in_memory_and_falls_back_when_sparse() -> None:
    rate = CompletionRate(started=0.0)
    for i in range(100_000):
        rate.add(i / 1000)  # 1,000/s for 100 s
    assert len(rate._slots) <= RATE_SPAN / 0.25 + 2
    completions, span = rate.reading(100.0)
    assert span == RATE_RECENT
    assert 9_900 <= completions <= 10_300
    sparse = CompletionRate(started=0.0)
    for t in (5.0, 25.0, 45.0):
        sparse.add(t)
    assert sparse.reading(50.0) == (3, 50.0)  # too few in the last 10 s: the last 60 s
    assert sparse.reading(200.0) == (0, RATE_SPAN)


async def test_budget_mode_keeps_a_quiet_key_s_slot_in_blocks() -> None:
    """With --gate.fair-reserve in budget mode (the count cap is the ceiling), tenant a holding
    one request of 5 blocks in a budget of 10 does not take the other 5 while tenant b, seen
    lately, holds none; b's request then goes in at once."""
    gate = Gate(
        GateSettings(
            cap=CapSettings(mode="budget", ceiling=64),
            fairness_header=b"x-tenant",
            fair_reserve=True,
        )
    )
    gate.state = replace(gate.state, cap=64, budget_blocks=10)

    def ticket(tenant: bytes) -> Any:
        return gate.ticket(16, 64, headers=[(b"x-tenant", tenant)])  # 5 blocks of 16

    seen = ticket(b"b")
    assert await gate.enter(seen) is None
    gate.leave(seen)
    first, second = ticket(b"a"), ticket(b"a")
    assert await gate.enter(first) is None
    waiting = asyncio.ensure_future(gate.enter(second))
    await asyncio.sleep(0)
    try:
        assert not second.admitted  # the last 5 blocks are kept for b
        quiet = ticket(b"b")
        assert await gate.enter(quiet) is None
        assert gate.blocks_in_flight == 10
    finally:
        await _cancel(waiting)
