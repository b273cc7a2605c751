"""LoopWatch: the event loop's lateness and task count, as kvtax publishes them."""

from __future__ import annotations

import asyncio
import time

from kvtax.serve.selfwatch import KEEP, LoopWatch


def test_the_lag_is_the_worst_of_the_recent_wake_ups() -> None:
    watch = LoopWatch()
    assert watch.lag == 0.0
    for lateness in (0.001, 0.3, -0.002, 0.002):
        watch.record(lateness)
    assert watch.lag == 0.3
    for _ in range(KEEP):
        watch.record(0.001)
    assert watch.lag == 0.001  # an old stall ages out


async def test_a_blocked_loop_shows_as_lag_and_tasks_are_counted() -> None:
    watch = LoopWatch(interval=0.01)
    watch.start()
    await asyncio.sleep(0.03)
    time.sleep(0.2)  # the loop cannot wake the watcher while this runs
    await asyncio.sleep(0.03)
    samples = {s.metric: s.value for s in watch.samples()}
    await watch.stop()
    assert samples["kvtax_event_loop_lag_seconds"] >= 0.15
    assert samples["kvtax_event_loop_tasks"] >= 2  # this test and the watcher
