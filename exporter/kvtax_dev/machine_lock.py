"""The machine's one lock for heavy work: every vLLM engine of the test bed, and every bench.

An engine or a bench takes a core or more of a small machine, and two at once starve each
other. One lock file, :data:`LOCK_PATH` (``/tmp/kvtax-e2e.lock``), orders them all:

- a bench takes the whole file alone, as its docs say: ``flock /tmp/kvtax-e2e.lock
  .venv/bin/python -m bench.relay``;
- the test bed's engines take the whole file shared (:class:`MachineLock`), so the suite's
  lanes may run engines side by side while no bench does, and a bench waits for them (and
  they for it);
- an engine also locks the cores it is bound to, one byte of the same file per core: shared,
  or exclusive for one that must compute alone there (the fleet's calm replica), which waits
  until no other engine is bound to its core, while the session's engine computes on another.

The whole file is locked with ``flock``, as ``flock(1)`` locks it; the cores with open file
description locks (``F_OFD_SETLK``, Linux 3.15), which belong to one open file as ``flock``'s
do and never meet ``flock``'s.

A process started under ``flock /tmp/kvtax-e2e.lock ...`` (a bench that starts engines, an
end-to-end module run by hand) holds the file through that ancestor: taking it again, on a new
open file, would wait on itself. A lock an ancestor holds therefore counts as held
(:func:`held_by_ancestor`, from ``/proc/locks``); the cores are still locked.

Example::

    lock = MachineLock(cores=[1], exclusive=False, wait=900.0)
    lock.acquire()  # waits while a bench holds the file; LockTimeout after `wait` seconds
    ...
    lock.release()
"""

from __future__ import annotations

import fcntl
import functools
import os
import struct
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

__all__ = ["LOCK_PATH", "LockTimeout", "MachineLock", "held_by_ancestor"]

# One path, as the docs spell it: not the temp dir, which a test run may move (TMPDIR).
LOCK_PATH = Path("/tmp/kvtax-e2e.lock")


class LockTimeout(RuntimeError):
    """The lock stayed held by someone else for the whole wait."""


def _ancestors(pid: int) -> set[int]:
    """``pid``'s parent, its parent, and so on up to init (``pid`` itself excluded)."""
    found: set[int] = set()
    while pid > 1:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses; the last ")" ends it.
        pid = int(stat.rsplit(")", 1)[1].split()[1])
        found.add(pid)
    return found


def held_by_ancestor(path: Path = LOCK_PATH, *, locks: str | None = None) -> bool:
    """An ancestor of this process holds a flock on ``path`` (``locks``: /proc/locks' text,
    read when None). False where /proc/locks cannot be read."""
    try:
        st = path.stat()
        text = locks if locks is not None else Path("/proc/locks").read_text()
    except OSError:
        return False
    # /proc/locks names a file as "MAJOR:MINOR:INODE", the device numbers in hex.
    file_id = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    holders = {
        int(fields[4])
        for fields in (line.split() for line in text.splitlines())
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == file_id
    }
    return bool(holders & _ancestors(os.getpid()))


# struct flock on Linux x86-64 and arm64: l_type, l_whence (short), l_start, l_len (off_t), l_pid
# (pid_t, 0 for an open file description lock), padded to 32 bytes.
_FLOCK = struct.Struct("hhqqi4x")


def _lock_core(handle: IO[str], core: int, *, exclusive: bool) -> bool:
    """Lock byte ``core`` of the file, without waiting; False while another open file holds it
    in a way that excludes this one."""
    kind = fcntl.F_WRLCK if exclusive else fcntl.F_RDLCK
    try:
        fcntl.fcntl(handle, fcntl.F_OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, core, 1, 0))
    except (BlockingIOError, PermissionError):
        return False
    return True


class MachineLock:
    """The machine's lock, and the ``cores`` an engine is bound to, shared or ``exclusive``
    (the whole file is always shared: only a bench takes it alone). :meth:`acquire` waits up
    to ``wait`` seconds and then raises :class:`LockTimeout` naming what stayed held, rather
    than hang."""

    def __init__(
        self,
        *,
        cores: Sequence[int] = (),
        exclusive: bool = False,
        wait: float = 900.0,
        path: Path = LOCK_PATH,
        on_wait: Callable[[str], None] | None = None,
    ) -> None:
        self.cores = sorted(set(cores))
        # Told once, when a wait begins, what holds the lock: a wait of minutes says why.
        self.on_wait = on_wait
        self.exclusive = exclusive
        self.wait = wait
        self.path = path
        self._file: IO[str] | None = None

    def acquire(self) -> None:
        if self._file is not None:
            return
        handle = self.path.open("a+")  # read and write: a shared core lock needs read access
        deadline = time.monotonic() + self.wait
        try:
            if not held_by_ancestor(self.path):
                self._until(deadline, "a bench", functools.partial(_flock_shared, handle))
            for core in self.cores:
                lock = functools.partial(_lock_core, handle, core, exclusive=self.exclusive)
                self._until(deadline, f"core {core} (another engine bound to it)", lock)
        except BaseException:
            handle.close()
            raise
        self._file = handle

    def _until(self, deadline: float, what: str, attempt: Callable[[], bool]) -> None:
        if attempt():
            return
        if self.on_wait is not None:
            self.on_wait(f"waiting for {self.path}: {what} holds it")
        while not attempt():
            if time.monotonic() > deadline:
                raise LockTimeout(f"{self.path}: {what} held it for {self.wait:g} s")
            time.sleep(0.5)

    def release(self) -> None:
        handle, self._file = self._file, None
        if handle is not None:
            handle.close()  # closing the open file drops both kinds of lock


def _flock_shared(handle: IO[str]) -> bool:
    try:
        fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True
