"""kvtax's one mechanism for periodic work: an APScheduler ``AsyncIOScheduler`` on the event loop.

Everything ``kvtax serve`` does on a clock is a job of the one scheduler that
:func:`kvtax.serve.wiring.build` makes and hands to each part:

- ``scrape``: the scrape job scrapes vLLM and folds the page, every ``--scrape.interval``
  (:mod:`kvtax.serve.scrape.job`); after each fold it hands the new figures to its subscribers
  (the gate steps its cap there), so nothing polls for them;
- ``gateway``: the gateway poller, every ``--scrape.interval``, when ``--gateway.url`` is set
  (:mod:`kvtax.serve.sources.push`);
- ``models``: the reader of vLLM's ``/v1/models``, every ``--delivery.models-refresh`` and sooner
  after a failure (:mod:`kvtax.serve.sources.models`);
- ``loopwatch``: the event loop's lateness, every 0.25 s (:mod:`kvtax.serve.selfwatch`).

Nothing else in ``serve/`` sleeps in a loop: a wait for a state (the proxy's requests in flight
reaching zero at shutdown) waits on an :class:`asyncio.Event`, and the remaining timers are
timeouts of one thing (a read, an idle connection), not periodic work.
``tests/unit/test_schedule.py`` holds both to that.

Every job is a coroutine, so it runs on the event loop (APScheduler runs a plain function in a
thread pool), one run at a time. A run the loop could not start on time is never dropped as
missed: the runs it missed are coalesced into one, which starts as soon as the loop is free.
:class:`Periodic` is one job's lifecycle: :meth:`~Periodic.start` adds it,
:meth:`~Periodic.stop` removes it. A part used alone (a test, a benchmark) is handed no
scheduler; its job then gets one of its own, started and shut down with it.

Example::

    scheduler = new_scheduler()
    job = Periodic("scrape", scrape.scrape_once, 15.0, scheduler)
    job.start()
    scheduler.start()  # in the running loop
    ...
    await job.stop()
    scheduler.shutdown(wait=False)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta

from apscheduler.executors.asyncio import AsyncIOExecutor
from apscheduler.job import Job
from apscheduler.jobstores.base import JobLookupError
from apscheduler.schedulers.asyncio import AsyncIOScheduler

__all__ = ["QUIET", "Periodic", "new_scheduler"]

QUIET = "quiet"
"""The executor of jobs that run too often to log each run (the loop watch: four a second)."""


class _BelowWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING


class _NoDebug(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno > logging.DEBUG


_QUIET_RUNS = _BelowWarning()
_NO_WAKEUPS = _NoDebug()


def _quiet_logs() -> None:
    """Even at ``--log.level=debug``: no line per run of a :data:`QUIET` job, and none of the
    scheduler's two DEBUG lines per wake-up ("Looking for jobs to run", "Next wakeup is due"),
    which the loop watch alone would make eight a second. Warnings and errors still show."""
    for name, quiet in (
        (f"apscheduler.executors.{QUIET}", _QUIET_RUNS),
        ("apscheduler.scheduler", _NO_WAKEUPS),
    ):
        logger = logging.getLogger(name)
        if quiet not in logger.filters:
            logger.addFilter(quiet)


def new_scheduler() -> AsyncIOScheduler:
    """The scheduler every periodic job of ``kvtax serve`` runs on; start it in the loop."""
    _quiet_logs()
    return AsyncIOScheduler(
        # UTC: an interval never meets a daylight-saving change.
        timezone=UTC,
        executors={"default": AsyncIOExecutor(), QUIET: AsyncIOExecutor()},
        job_defaults={"max_instances": 1, "coalesce": True, "misfire_grace_time": None},
    )


class Periodic:
    """Runs ``run`` every ``seconds`` on ``scheduler`` between :meth:`start` and :meth:`stop`.

    ``scheduler`` is one :func:`new_scheduler` made (it has the :data:`QUIET` executor). Without
    one, :meth:`start` makes one and starts it, and :meth:`stop` shuts it down. ``now``: the
    first run is at once, not one interval after :meth:`start`.
    """

    def __init__(
        self,
        job_id: str,
        run: Callable[[], Awaitable[None]],
        seconds: float,
        scheduler: AsyncIOScheduler | None = None,
        *,
        now: bool = False,
        executor: str = "default",
    ) -> None:
        self.job_id = job_id
        self.seconds = seconds
        self._run = run
        self._now = now
        self._executor = executor
        self._scheduler = scheduler
        self._own: AsyncIOScheduler | None = None
        self._job: Job | None = None
        self._running: asyncio.Task[object] | None = None

    def start(self) -> None:
        if self._job is not None:
            return
        scheduler = self._scheduler
        if scheduler is None:
            scheduler = self._own = new_scheduler()
        first = {"next_run_time": datetime.now(UTC)} if self._now else {}
        self._job = scheduler.add_job(
            self._once,
            "interval",
            seconds=self.seconds,
            id=self.job_id,
            name=self.job_id,
            executor=self._executor,
            replace_existing=True,
            **first,
        )
        if self._own is not None:
            self._own.start()

    async def _once(self) -> None:
        if self._job is None:
            # Stopped between the scheduler's submitting this run and its first step: stop()
            # could not see it to wait for it, and what it would use may be closed by now (a
            # poller's session: "Session is closed", logged as a failed poll).
            return
        self._running = asyncio.current_task()
        try:
            await self._run()
        except asyncio.CancelledError:
            # stop(cancel=True), or the scheduler's shutdown, ended this run: not an error of the
            # job, which APScheduler would log with a traceback.
            return
        finally:
            self._running = None

    @property
    def due(self) -> datetime | None:
        """When the next run is due (UTC), as the scheduler has it; None when not scheduled.

        Read during a run, it is the run after this one: the scheduler sets it as it starts one.
        """
        job = self._job
        # A job added before its scheduler starts has no run time yet.
        return None if job is None else getattr(job, "next_run_time", None)

    def run_in(self, seconds: float) -> None:
        """Move the next run to ``seconds`` from now; the interval goes on from there."""
        job = self._job
        if job is None:
            return
        with contextlib.suppress(JobLookupError):
            job.modify(next_run_time=datetime.now(UTC) + timedelta(seconds=seconds))

    async def stop(self, *, cancel: bool = True) -> None:
        """Remove the job, then wait for a run in flight to end: cancelled (``cancel``), or
        let finish (its own timeouts bound it)."""
        job, self._job = self._job, None
        if job is not None:
            # Gone already if the scheduler was shut down first.
            with contextlib.suppress(JobLookupError):
                job.remove()
        running = self._running
        if running is not None and running is not asyncio.current_task():
            if cancel:
                running.cancel()
            await asyncio.wait([running])
        own, self._own = self._own, None
        if own is not None and own.running:
            own.shutdown(wait=False)
