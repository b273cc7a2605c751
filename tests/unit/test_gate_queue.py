"""The gate's queue on its own, without a proxy: who is admitted, and when."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace

from kvtax.admission.cap import CapSettings
from kvtax.admission.order import Order
from kvtax.serve.gate import Gate, GateSettings


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
    # admitted now; it used to be queued and wait for the next leave or scrape.
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
