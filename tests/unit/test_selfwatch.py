"""LoopWatch: the event loop's lateness and task count, as kvtax publishes them."""

from __future__ import annotations

import asyncio
import time

from kvtax.serve.schedule import new_scheduler
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
    other = asyncio.get_running_loop().create_task(asyncio.Event().wait())
    await asyncio.sleep(0.03)
    time.sleep(0.2)  # the loop cannot start the watch's job while this runs
    await asyncio.sleep(0.03)
    samples = {s.metric: s.value for s in watch.samples()}
    await watch.stop()
    other.cancel()
    assert samples["kvtax_event_loop_lag_seconds"] >= 0.15
    assert samples["kvtax_event_loop_tasks"] >= 2  # this test and the task it started


async def test_a_stall_longer_than_the_interval_shows_whole_on_the_shared_scheduler() -> None:
    # The runs the stall missed start as one (coalesced), measured from the first due time
    # it missed, not from the last: a 0.3 s stall reads 0.3 s, not at most one interval.
    scheduler = new_scheduler()
    watch = LoopWatch(interval=0.05, scheduler=scheduler)
    watch.start()
    scheduler.start()
    try:
        await asyncio.sleep(0.12)
        time.sleep(0.3)
        await asyncio.sleep(0.02)
        assert watch.lag >= 0.25
        assert [job.id for job in scheduler.get_jobs()] == ["loopwatch"]
        await watch.stop()
        assert scheduler.get_jobs() == []
    finally:
        await watch.stop()
        scheduler.shutdown(wait=False)
