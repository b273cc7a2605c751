"""The lifecycle every periodic HTTP reader in kvtax shares: poll, count failures, stop cleanly.

A subclass says what one poll reads and folds (:meth:`Poller.read`), what a failure is called in
the log (:attr:`Poller.what`) and the name of its job (:attr:`Poller.job_id`); this class owns
the aiohttp session, the job on kvtax's one scheduler (:mod:`kvtax.serve.schedule`: the first
poll at start, then one every ``interval``), the run of consecutive failures (logged once, at its
start, so a vLLM that is down for an hour writes one line, not one a poll) and a clean stop. Any
exception a poll raises is a failed poll: a page nobody foresaw (a body nested deep enough to
raise RecursionError) must not end polling unseen, nor make :meth:`Poller.stop` raise in the
middle of kvtax's shutdown. A subclass may ask for the next poll sooner after a failure
(:meth:`Poller.retry_in`). Used by the gateway poller (:mod:`kvtax.serve.sources.push`) and the
model-list reader (:mod:`kvtax.serve.sources.models`).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod

import aiohttp
from apscheduler.schedulers.asyncio import AsyncIOScheduler

from kvtax.serve.logsafe import redact_url
from kvtax.serve.schedule import Periodic

__all__ = ["Poller"]


class Poller(ABC):
    """Calls :meth:`read` every ``interval`` seconds, as a job of ``scheduler``, until stopped.

    Without a scheduler (a poller used alone) the job runs on one of its own.
    """

    what = "a page"
    """What is read, for the log line: "reading <what> at <url> failed"."""

    job_id = "poll"
    """The job's name on the scheduler."""

    def __init__(
        self,
        *,
        url: str,
        interval: float,
        timeout: float,
        log: logging.Logger,
        scheduler: AsyncIOScheduler | None = None,
    ) -> None:
        self.url = url
        self.interval = interval
        self.timeout = timeout
        self.errors = 0
        self._log = log
        self._session: aiohttp.ClientSession | None = None
        self._job = Periodic(self.job_id, self._poll, interval, scheduler, now=True)

    @abstractmethod
    async def read(self, session: aiohttp.ClientSession) -> None:
        """Read once and fold what was read; a failure raises ClientError, TimeoutError or
        ValueError (logged with its message). Anything else is a failed poll too, logged by type."""

    def recovered(self) -> None:
        """Called on the first success after a run of failures: the log's matching line."""
        self._log.info("reading %s at %s works again", self.what, redact_url(self.url))

    def retry_in(self) -> float | None:
        """Seconds until the next poll when it should come sooner than the interval (after a
        failure), or None to keep to the interval."""
        return None

    async def poll_once(self) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        try:
            await self.read(self._session)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            # A timeout has no message of its own; its type says what happened.
            self._failed(str(exc) or type(exc).__name__)
        except Exception as exc:
            # One unforeseen page must not end polling. Its type only: the message of an
            # exception nobody foresaw may quote the body.
            self._failed(f"{type(exc).__name__} (unexpected)")
        else:
            if self.errors:
                self.recovered()
            self.errors = 0

    def _failed(self, why: str) -> None:
        if self.errors == 0:
            self._log.warning("reading %s at %s failed: %s", self.what, redact_url(self.url), why)
        self.errors += 1

    async def _poll(self) -> None:
        """One run of the job: a poll, then the time of the next one if it comes sooner."""
        await self.poll_once()
        try:
            retry = self.retry_in()
            if retry is not None:
                self._job.run_in(retry)
        except Exception as exc:
            # A bug between two polls: said here, and the next poll comes on the interval.
            self._log.error(
                "polling %s at %s: choosing the next poll failed: %s",
                self.what,
                redact_url(self.url),
                type(exc).__name__,
            )

    def start(self) -> None:
        self._job.start()

    async def stop(self) -> None:
        # A poll in flight is cancelled and waited for, so the session closes after it.
        await self._job.stop(cancel=True)
        session, self._session = self._session, None
        if session is not None:
            await session.close()
