"""Parse vLLM's page in a worker process, so the event loop the proxy shares never waits on it.

Why a process and not a thread: :func:`~kvtax.normalize.normalize` is pure Python (about 60 us a
series on a 2-core pod), and a thread that holds the GIL delays each socket call of the event
loop by up to the interpreter's switch interval (5 ms), so a relay chunk that needs several calls
waits tens of milliseconds. Measured on this project's 2-core machine, 32 loopback streams doing
ping-pong while a 25,500-series page (60 models) was parsed: round-trip p99 3 ms idle, 134 ms with
the parse in a thread, 7 ms with it in a process (``/tmp`` experiment recorded in
``bench/results/bigpage.md``). The worker costs one more Python process (its RSS is in the same
table); the page bounds (``--scrape.max-bytes``, ``--scrape.max-series``) cap what it holds.

Example::

    pool = ParsePool()
    snap = await pool.normalize(text, timestamp=time.time(), version=None, max_series=50_000)
    pool.close()
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing
import signal
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from .normalize import ParseError, normalize
from .snapshot import VllmSnapshot

__all__ = ["ParsePool"]


def _ignore_interrupts() -> None:
    # Ctrl-C reaches the whole process group; the parent decides when the worker stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class ParsePool:
    """One lazily started worker process that runs :func:`~kvtax.normalize.normalize`."""

    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            # spawn, not fork: the parent runs an event loop and threads, which fork would copy.
            self._pool = ProcessPoolExecutor(
                max_workers=1,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_ignore_interrupts,
            )
        return self._pool

    async def normalize(
        self, text: str, *, timestamp: float, version: str | None, max_series: int | None
    ) -> VllmSnapshot:
        """:func:`~kvtax.normalize.normalize` in the worker. Raises :class:`ParseError`."""
        pool = self._executor()
        call = functools.partial(
            normalize, text, timestamp=timestamp, version=version, max_series=max_series
        )
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, call)
        except BrokenProcessPool as exc:
            # The worker died (killed, out of memory): the next scrape starts a fresh one.
            self.close()
            raise ParseError(f"the parse worker process died: {exc}") from exc

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
