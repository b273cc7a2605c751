"""The lifecycle every periodic HTTP reader in kvtax shares: poll, count failures, stop cleanly.

A subclass says what one poll reads and folds (:meth:`Poller.read`) and what a failure is
called in the log (:attr:`Poller.what`); this class owns the aiohttp session, the loop task,
the run of consecutive failures (logged once, at its start, so a vLLM that is down for an hour
writes one line, not one a poll) and a clean stop. Any exception a poll raises is a failed poll:
a page nobody foresaw (a body nested deep enough to raise RecursionError) must not end polling
unseen, nor make :meth:`Poller.stop` raise in the middle of kvtax's shutdown. Used by the
gateway poller (:mod:`kvtax.serve.sources.push`) and the model-list reader
(:mod:`kvtax.serve.sources.models`).
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod

import aiohttp

from kvtax.serve.logsafe import redact_url

__all__ = ["Poller"]


class Poller(ABC):
    """Calls :meth:`read` every ``interval`` seconds in the running loop until stopped."""

    what = "a page"
    """What is read, for the log line: "reading <what> at <url> failed"."""

    def __init__(self, *, url: str, interval: float, timeout: float, log: logging.Logger) -> None:
        self.url = url
        self.interval = interval
        self.timeout = timeout
        self.errors = 0
        self._log = log
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None

    @abstractmethod
    async def read(self, session: aiohttp.ClientSession) -> None:
        """Read once and fold what was read; a failure raises ClientError, TimeoutError or
        ValueError (logged with its message). Anything else is a failed poll too, logged by type."""

    def recovered(self) -> None:
        """Called on the first success after a run of failures: the log's matching line."""
        self._log.info("reading %s at %s works again", self.what, redact_url(self.url))

    def delay(self) -> float:
        """Seconds until the next poll."""
        return self.interval

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

    async def _loop(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.delay())

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            # wait, not await: a loop that died of its own exception is logged here, and the
            # shutdown of everything stopped after this poller goes on.
            await asyncio.wait([task])
            died = None if task.cancelled() else task.exception()
            if died is not None:
                self._log.error(
                    "polling %s at %s had stopped: %s",
                    self.what,
                    redact_url(self.url),
                    type(died).__name__,
                )
        if self._session is not None:
            await self._session.close()
            self._session = None
