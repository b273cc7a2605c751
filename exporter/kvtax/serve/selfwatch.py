"""kvtax watching itself: how late its event loop runs, and how many tasks it carries.

Everything kvtax does in the pod (relaying chunks, answering probes, scraping) shares one event
loop, so the loop's lateness is the latency kvtax adds when it is busy. :class:`LoopWatch` is the
``loopwatch`` job of kvtax's one scheduler (:mod:`kvtax.serve.schedule`), due every ``interval``
seconds: each run records how much later than its due time it started, the due time being the
one the scheduler had set for it (read at the end of the run before). It publishes the worst
lateness of the last :data:`KEEP` runs (a few seconds: short stalls between two Prometheus
scrapes still show) and the number of asyncio tasks alive, which must return to its idle level
once traffic stops. A loop blocked for longer than the interval shows its whole stall: the
scheduler starts the runs it missed as one, and that run measures from the first due time it
missed. The process's own RSS, descriptors and CPU come from prometheus-client's
``ProcessCollector``, registered beside kvtax's collector.

Example::

    watch = LoopWatch(scheduler=scheduler)  # alone, without one: a scheduler of its own
    watch.start()
    ...
    list(watch.samples())  # kvtax_event_loop_lag_seconds, kvtax_event_loop_tasks
    await watch.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Iterator
from datetime import UTC, datetime

from apscheduler.schedulers.asyncio import AsyncIOScheduler

from kvtax.expose.samples import Sample
from kvtax.serve.schedule import QUIET, Periodic

__all__ = ["KEEP", "LoopWatch"]

KEEP = 20


class LoopWatch:
    """Measures event-loop lag as the lateness of its own job. See the module docstring."""

    def __init__(self, interval: float = 0.25, scheduler: AsyncIOScheduler | None = None) -> None:
        self.interval = interval
        self._lags: deque[float] = deque(maxlen=KEEP)
        # Four runs a second: its executor logs none of them.
        self._job = Periodic("loopwatch", self._tick, interval, scheduler, executor=QUIET)
        self._due: datetime | None = None

    @property
    def lag(self) -> float:
        """The worst lateness of the recent runs, in seconds (0 before the first)."""
        return max(self._lags, default=0.0)

    def record(self, lateness: float) -> None:
        self._lags.append(max(0.0, lateness))

    async def _tick(self) -> None:
        due, self._due = self._due, self._job.due
        if due is not None:
            self.record((datetime.now(UTC) - due).total_seconds())

    def start(self) -> None:
        self._job.start()
        self._due = self._job.due  # None until the scheduler starts: the first run then sets it

    async def stop(self) -> None:
        await self._job.stop()

    def samples(self) -> Iterator[Sample]:
        yield Sample("kvtax_event_loop_lag_seconds", (), self.lag)
        with contextlib.suppress(RuntimeError):  # no running loop: nothing to count
            yield Sample("kvtax_event_loop_tasks", (), float(len(asyncio.all_tasks())))
