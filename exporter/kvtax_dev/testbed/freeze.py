"""Stops a running vLLM engine's computing and lets it go again, in slices of a set length.

A test whose outcome must not depend on how fast the engine is (a long stream must still be
running when a grace period ends; a client must leave before vLLM finishes its request) freezes
the engine, and lets it compute only in short slices until the state it needs has come:

    with Freezer(engine_pid) as freezer:       # frozen from here
        send_requests()
        await freezer.run_until(short_streams_ended)   # frozen again when this returns
        ...                                     # nothing the engine does can overtake this

Only the API server's children are stopped (the engine core and its workers, with SIGSTOP):
the API server keeps taking requests, answering ``/metrics`` and seeing clients leave.

Why a helper process: the test process cannot time a slice itself. Right after SIGCONT the
engine's threads take both cores, and the test process, descheduled, stopped it 0.6-2.4 s after
a 50 ms slice in a run here; the engine generated 700 tokens meanwhile. The helper runs at
real-time priority (SCHED_FIFO, which root has here), so a slice ends when it should; where
the priority is refused, it runs as an ordinary process and says so (:attr:`Freezer.realtime`).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable
from types import TracebackType
from typing import Self

from kvtax_dev.process import until

# The helper: one command a line on stdin, "ok" on stdout once it is done. It stops the root's
# children (those known first, then any the engine started meanwhile) and continues them; at
# the end of its input, whatever the cause, it continues everything, so that the engine is never
# left stopped by a test that died.
_HELPER = r"""
import os, signal, sys, time
import psutil

root = psutil.Process(int(sys.argv[1]))
try:
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(int(sys.argv[2])))
    print("realtime", flush=True)
except OSError as exc:
    print(f"ordinary ({exc})", flush=True)
stopped = {}

def signal_all(procs, signum):
    for proc in procs:
        try:
            proc.send_signal(signum)
        except psutil.NoSuchProcess:
            stopped.pop(proc.pid, None)

def stop():
    signal_all(list(stopped.values()), signal.SIGSTOP)
    fresh = [p for p in root.children(recursive=True) if p.pid not in stopped]
    signal_all(fresh, signal.SIGSTOP)
    stopped.update((p.pid, p) for p in fresh)

def cont():
    signal_all(list(stopped.values()), signal.SIGCONT)

try:
    for line in sys.stdin:
        command, *arg = line.split()
        if command == "stop":
            stop()
        elif command == "cont":
            cont()
        elif command == "slice":
            cont()
            time.sleep(float(arg[0]))
            stop()
        print("ok", flush=True)
finally:
    cont()
"""
# Below the kernel's own real-time threads (50 for interrupt handlers), above every ordinary
# process.
_PRIORITY = 40


class Freezer:
    """The children of process ``root`` (vLLM's API server) stopped while inside, except for
    the slices :meth:`run_until` lets them run; continued on the way out, whatever happens."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.realtime = False
        self.slices = 0
        self._helper: subprocess.Popen[str] | None = None

    def __enter__(self) -> Self:
        helper = subprocess.Popen(
            [sys.executable, "-c", _HELPER, str(self.root), str(_PRIORITY)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._helper = helper
        assert helper.stdout is not None
        mode = helper.stdout.readline().strip()
        self.realtime = mode == "realtime"
        if not self.realtime:
            print(f"kvtax_dev.testbed.freeze: helper runs {mode}: slices may run long")
        self._command("stop")
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        helper, self._helper = self._helper, None
        if helper is None:
            return
        assert helper.stdin is not None
        helper.stdin.close()  # the helper continues everything and ends
        try:
            helper.wait(10)
        except subprocess.TimeoutExpired:
            helper.kill()
            helper.wait()
        finally:
            assert helper.stdout is not None
            helper.stdout.close()

    def go(self) -> None:
        """Let the engine compute freely, until :meth:`halt` or the way out."""
        self._command("cont")

    def halt(self) -> None:
        """Stop the engine again (and any process it started meanwhile)."""
        self._command("stop")

    def _command(self, line: str) -> None:
        helper = self._helper
        if helper is None:
            raise RuntimeError("the freezer is not in use: enter it first")
        assert helper.stdin is not None
        assert helper.stdout is not None
        helper.stdin.write(line + "\n")
        helper.stdin.flush()
        answer = helper.stdout.readline().strip()
        if answer != "ok":
            raise RuntimeError(f"the freeze helper answered {answer!r} to {line!r}")

    async def run_until(
        self,
        done: Callable[[], bool],
        *,
        slice_s: float = 0.02,
        settle_s: float = 0.2,
        limit: float = 120.0,
    ) -> bool:
        """Let the engine compute ``slice_s`` at a time until ``done()`` holds: after each slice
        it is stopped again, and the caller's event loop has up to ``settle_s`` to take in what
        came (``done`` is polled meanwhile; 0 checks it once). Stopped on return; whether
        ``done()`` came within ``limit`` seconds, a guard against hangs only.

        The engine runs at most a slice past the state the caller waits for, however fast it is
        and however loaded the machine.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit
        while loop.time() < deadline:
            await asyncio.to_thread(self._command, f"slice {slice_s}")
            self.slices += 1
            if await until(done, limit=settle_s):
                return True
        return False
