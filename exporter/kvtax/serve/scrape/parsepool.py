"""Parse vLLM's page in a worker process, so the event loop the proxy shares never waits on it.

Why a process and not a thread: :func:`~kvtax.engine.normalize.normalize` is pure Python (about 50
us a series on a 2-core machine), and a thread that holds the GIL delays each socket call of the
event loop by up to the interpreter's switch interval (5 ms), so work that needs several calls waits
hundreds of milliseconds. ``bench.scrape.parselag`` measures it: 32 loopback ping-pong streams on
the loop while a 42,000-series page (100 models, the largest the default bounds accept) is parsed.
Round trip p99: 4 ms idle; 478 ms with the parse in a thread (100 round trips/s instead of 2,400); 5
ms in this worker; and none at all for 2.1 s on the loop. The worker
(:mod:`kvtax.serve.scrape.parseworker`) is a plain child process, not a ``multiprocessing`` pool,
because a spawned pool worker re-imports the CLI and brings a resource tracker: 53 MiB against 24
MiB.

The pipe I/O and the pickling run in a thread (blocking reads and writes release the GIL; the
pickles are C code), so the class works from any event loop. One page is parsed at a time.

Example::

    pool = ParsePool()
    snap = await pool.normalize(text, timestamp=time.time(), version=None, max_series=50_000)
    pool.close()
"""

from __future__ import annotations

import asyncio
import pickle
import subprocess
import sys
import threading
from collections.abc import Collection

from kvtax.engine.normalize import ParseError
from kvtax.engine.snapshot import VllmSnapshot
from kvtax.serve.scrape.parseworker import receive_frame, send_frame

__all__ = ["ParsePool"]


class ParsePool:
    """One lazily started worker process that runs :func:`~kvtax.engine.normalize.normalize`."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    async def normalize(
        self,
        text: str,
        *,
        timestamp: float,
        version: str | None,
        max_series: int | None,
        tracked: Collection[str] = (),
        max_models: int | None = None,
    ) -> VllmSnapshot:
        """:func:`~kvtax.engine.normalize.normalize` in the worker. Raises :class:`ParseError`.

        With ``max_models``, only :func:`~kvtax.figures.window.candidates` come back.
        """
        request = (text, timestamp, version, max_series, frozenset(tracked), max_models)
        return await asyncio.to_thread(self._call, request)

    def _call(self, request: tuple[object, ...]) -> VllmSnapshot:
        with self._lock:
            proc = self._started()
            assert proc.stdin is not None
            assert proc.stdout is not None
            try:
                send_frame(proc.stdin, pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL))
                frame = receive_frame(proc.stdout)
                if frame is None:
                    raise EOFError("the worker closed its output")
                status, value = pickle.loads(frame)
            except (OSError, EOFError, pickle.UnpicklingError) as exc:
                # The worker died (killed, out of memory): the next scrape starts a fresh one.
                self._stop()
                raise ParseError(f"the parse worker process failed: {exc!r}") from exc
        if status == "error":
            assert isinstance(value, ParseError)
            raise value
        assert isinstance(value, VllmSnapshot)
        return value

    def _started(self) -> subprocess.Popen[bytes]:
        if self._proc is not None and self._proc.poll() is not None:
            self._stop()  # it died between pages: close its pipes, start another
        if self._proc is None:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "kvtax.serve.scrape.parseworker"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
        return self._proc

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()  # EOF on its stdin: a healthy worker exits at once
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        """Stop the worker at once; the next :meth:`normalize` would start another.

        A parse in flight ends with a :class:`ParseError` rather than holding up the caller.
        """
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()  # the thread blocked on its output gets EOF, and cleans up
        with self._lock:
            self._stop()
