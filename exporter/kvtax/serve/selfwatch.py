"""kvtax watching itself: how late its event loop runs, and how many tasks it carries.

Everything kvtax does in the pod (relaying chunks, answering probes, scraping) shares one event
loop, so the loop's lateness is the latency kvtax adds when it is busy. :class:`LoopWatch` wakes
every ``interval`` seconds and records how much later than asked it woke; it publishes the worst
lateness of the last :data:`KEEP` wake-ups (a few seconds: short stalls between two Prometheus
scrapes still show) and the number of asyncio tasks alive, which must return to its idle level
once traffic stops. The process's own RSS, descriptors and CPU come from prometheus-client's
``ProcessCollector``, registered beside kvtax's collector.

Example::

    watch = LoopWatch()
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

from kvtax.expose.samples import Sample

__all__ = ["KEEP", "LoopWatch"]

KEEP = 20


class LoopWatch:
    """Measures event-loop lag by sleeping and timing the wake-up. See the module docstring."""

    def __init__(self, interval: float = 0.25) -> None:
        self.interval = interval
        self._lags: deque[float] = deque(maxlen=KEEP)
        self._task: asyncio.Task[None] | None = None

    @property
    def lag(self) -> float:
        """The worst lateness of the recent wake-ups, in seconds (0 before the first)."""
        return max(self._lags, default=0.0)

    def record(self, lateness: float) -> None:
        self._lags.append(max(0.0, lateness))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time() + self.interval
            await asyncio.sleep(self.interval)
            self.record(loop.time() - asked)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kvtax-loopwatch")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def samples(self) -> Iterator[Sample]:
        yield Sample("kvtax_event_loop_lag_seconds", (), self.lag)
        with contextlib.suppress(RuntimeError):  # no running loop: nothing to count
            yield Sample("kvtax_event_loop_tasks", (), float(len(asyncio.all_tasks())))
