"""One child process's life, for every server the harness starts: start, wait, log, stop.

The vLLM engine, Prometheus, Alertmanager, ``kvtax serve`` and the benchmarks' stand-ins all
need the same steps: launch with the output in a log file, poll a readiness probe while
watching for an early exit, and stop with SIGTERM, then SIGKILL after a grace period. A failed
start raises :class:`ChildStartError` (or the caller's subclass) with the log's last lines,
because the reason is almost always there. :func:`poll_until` is the polling loop on its own,
for conditions after start; :func:`http_ok` is the usual readiness probe, :func:`port_open`
the one for servers with no health endpoint.

Example::

    child = ChildProcess("prometheus", [binary, "--config.file=p.yml"], log_path=log,
                         ready=lambda: http_ok(f"{url}/-/ready"))
    with child:  # start() and wait; stop() on the way out
        ...  # child.running, child.log_tail()
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self, TypeVar

import requests

__all__ = [
    "HANG_GUARD_S",
    "ChildProcess",
    "ChildStartError",
    "http_ok",
    "poll_until",
    "port_open",
    "tail",
]

T = TypeVar("T")
TAIL_LINES = 40


class ChildStartError(RuntimeError):
    """A child exited during start-up or was not ready in time; the message ends with its log."""


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    """The last ``lines`` lines of a log file, or a note saying why there are none."""
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"(no log at {path}: {exc})"
    return "\n".join(text.splitlines()[-lines:])


def http_ok(url: str, timeout: float = 2.0, verify: Path | None = None) -> bool:
    """True when ``GET url`` answers 200; any connection error is just "not yet".

    ``verify``: the CA file an https URL's certificate is checked against.
    """
    trust: str | bool = str(verify) if verify is not None else True
    try:
        return requests.get(url, timeout=timeout, verify=trust).status_code == 200
    except requests.RequestException:
        return False


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    """True when something accepts TCP connections on ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


# The one hang guard of the end-to-end tests and the harness: every wait for a condition (a
# page, a scrape, an alert, a process ready or gone, a pip install) ends there at the latest. A
# wait that reaches it is a hang, not a slow machine, so it is set far above any wait seen on a
# loaded two-core CI runner (the longest, a cold pip install, a few minutes). Waits are for
# conditions; nothing is timed against it.
HANG_GUARD_S = 900.0


async def until(condition: Callable[[], bool], limit: float = 30.0) -> bool:
    """On the running event loop, wait for ``condition``; whether it became true.

    ``limit`` only guards against hangs: a test asserts the result, and nothing times anything.
    The loop is given back between checks, so the servers a test runs on it keep going.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    while not condition():
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.005)
    return True


def poll_until(
    probe: Callable[[], T],
    *,
    timeout: float,
    interval: float = 0.25,
    retry_on: tuple[type[BaseException], ...] = (),
) -> T | None:
    """Call ``probe`` until it returns something truthy and return that, or None at ``timeout``.

    Exceptions listed in ``retry_on`` count as "not yet"; one raised by the last call, at the
    deadline, propagates, so the caller's message can carry the real reason.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = probe()
        except retry_on:
            if time.monotonic() >= deadline:
                raise
        else:
            if value:
                return value
            if time.monotonic() >= deadline:
                return None
        time.sleep(interval)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM while a child is launched and recorded, then deliver them.

    A KeyboardInterrupt raised inside ``subprocess.Popen`` after its fork (Python runs the
    handler at the next bytecode, and Popen still runs Python after the child exists) leaves a
    child nobody holds the pid of; in its own session it outlives everything. Held, the signal
    reaches the handler once the child is recorded, where :meth:`ChildProcess.start` stops it.
    Handlers can only be changed in the main thread: elsewhere, nothing is held."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in previous:
        signal.signal(sig, lambda signum, _frame: held.append(signum))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if handler is not None:  # None: not set from Python, and cannot be set back
                signal.signal(sig, handler)
        for signum in held:
            signal.raise_signal(signum)


class ChildProcess:
    """A child process with its output in ``log_path``, ready when ``ready()`` says so.

    ``own_group`` starts it in a new session so that :meth:`stop` signals every process it
    spawned too (vLLM's workers); otherwise only the child is signalled. ``error`` is the
    exception class a failed start raises, so callers keep their own error types.
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        log_path: Path,
        ready: Callable[[], bool],
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        own_group: bool = False,
        startup_timeout: float = 60.0,
        error: type[ChildStartError] = ChildStartError,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self._ready = ready
        self._own_group = own_group
        self._error = error
        self.startup_timeout = startup_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self.returncode: int | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        """True while the child is alive."""
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout: float | None = None) -> Self:
        """Launch and wait until ready (``startup_timeout`` unless given); on failure stop it
        and raise with the log tail."""
        if self._proc is not None:
            return self
        self.returncode = None
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with _signals_held():
                with self.log_path.open("wb") as log:  # the child keeps its own descriptor
                    self._proc = subprocess.Popen(
                        self.argv,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=self.env,
                        cwd=self.cwd,
                        start_new_session=self._own_group,
                    )
                # Never leave an orphan behind when a caller forgets stop() or the run crashes.
                atexit.register(self.stop)
            self._wait_ready(self.startup_timeout if timeout is None else timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout: float) -> None:
        proc = self._proc
        assert proc is not None

        def outcome() -> str | None:
            if proc.poll() is not None:
                return "exited"
            return "ready" if self._ready() else None

        reached = poll_until(outcome, timeout=timeout, interval=0.2)
        if reached == "exited":
            raise self._error(
                f"{self.name} exited with {proc.returncode} during start-up; "
                f"{self.log_path} ends with:\n{self.log_tail()}"
            )
        if reached is None:
            raise self._error(
                f"{self.name} not ready after {timeout:g} s; "
                f"{self.log_path} ends with:\n{self.log_tail()}"
            )

    def stop(self, signum: int = signal.SIGTERM, grace: float = 20.0) -> int | None:
        """Send ``signum``, wait ``grace`` seconds, then SIGKILL. Idempotent; returns the status.

        With ``own_group`` the whole group gets both signals: workers may outlive the leader.
        """
        proc, self._proc = self._proc, None
        if proc is None:
            return self.returncode
        atexit.unregister(self.stop)
        self._signal(proc, signum)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace)
        if self._own_group or proc.poll() is None:
            self._signal(proc, signal.SIGKILL)
        self.returncode = proc.wait()
        return self.returncode

    def _signal(self, proc: subprocess.Popen[bytes], signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            if self._own_group:
                os.killpg(proc.pid, signum)  # a new session made the child its group's leader
            elif proc.poll() is None:
                proc.send_signal(signum)

    def log_tail(self, lines: int = TAIL_LINES) -> str:
        """The last lines of the child's log, for error messages."""
        return tail(self.log_path, lines)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
