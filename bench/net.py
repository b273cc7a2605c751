"""The benches' ports and waits: a free loopback port, and the wait for a child to listen."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from pathlib import Path

from kvtax_dev.testbed.engine import free_port

__all__ = ["free_port", "wait_port"]


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
