"""The benches' ports and children: a free loopback port, the wait for a child to listen, and
the children a bench starts and stops."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from pathlib import Path

from kvtax_dev.testbed.engine import free_port

__all__ = ["Children", "free_port", "wait_port"]


def wait_port(port: int, proc: subprocess.Popen[bytes], log: Path, *, timeout: float = 30) -> None:
    """Until something listens on loopback ``port``; fails with the tail of ``log`` if ``proc``
    exits first, and after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited:\n{log.read_text()[-2000:]}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listens on {port}")


class Children:
    """The processes a bench starts, each logging to ``NAME.log`` in ``work``; :meth:`stop`
    ends them in reverse order (terminated, killed after 10 s)."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(
        self,
        name: str,
        args: list[str],
        port: int,
        *,
        core: int | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start ``args`` (on ``core`` alone, if given; else wherever the scheduler puts it)
        and wait until it listens on ``port``."""
        log = self.work / f"{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env)
        if core is not None:
            os.sched_setaffinity(proc.pid, {core})
        self.procs.append(proc)
        wait_port(port, proc, log)
        return proc

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
