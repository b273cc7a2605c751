"""The machine's one lock: a bench holding it (as its docs say, with flock) makes engines wait
and they it; engines share it and their cores, one that must compute alone waits for the
engines bound to its core only; a run under flock is not blocked by its own lock; and a wait
that never ends fails naming what held it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from kvtax_dev.machine_lock import LockTimeout, MachineLock, held_by_ancestor


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "kvtax-e2e.lock"


def _waits(lock: MachineLock, seconds: float) -> tuple[threading.Event, threading.Thread]:
    """Start ``lock.acquire()`` in a thread; the event is set once it holds the lock."""
    got = threading.Event()

    def take() -> None:
        lock.acquire()
        got.set()

    thread = threading.Thread(target=take, daemon=True)
    thread.start()
    assert not got.wait(timeout=seconds)
    return got, thread


def test_engines_share_the_machine_and_their_cores(path: Path) -> None:
    first, second = MachineLock(cores=[1], path=path), MachineLock(cores=[0, 1], path=path)
    first.acquire()
    second.acquire()  # would wait (and fail after `wait`) if either held anything alone
    first.release()
    second.release()


def test_an_engine_that_must_compute_alone_waits_for_the_engines_on_its_core(path: Path) -> None:
    # Protection: the fleet's calm engine ran beside another lane's overload on its core.
    elsewhere = MachineLock(cores=[0], path=path)  # the session's engine, on the other core
    elsewhere.acquire()
    shared = MachineLock(cores=[0, 1], path=path)
    shared.acquire()
    alone = MachineLock(cores=[1], exclusive=True, path=path)
    got, thread = _waits(alone, 1.5)  # core 1 is still shared
    shared.release()
    assert got.wait(timeout=10)  # the engine on core 0 alone does not hold it back
    thread.join()
    # While it computes alone, another engine bound there waits in turn, and says why.
    later = MachineLock(cores=[1], wait=0.6, path=path)
    with pytest.raises(LockTimeout, match="core 1"):
        later.acquire()
    alone.release()
    later.acquire()
    later.release()
    elsewhere.release()


def test_a_bench_holding_the_lock_makes_an_engine_wait(path: Path) -> None:
    # The bench takes the whole file alone, as bench/README.md says: `flock FILE COMMAND`.
    path.touch()
    # Its own session, so that ending it ends the command too, which holds the lock as well.
    bench = subprocess.Popen(["flock", str(path), "sleep", "30"], start_new_session=True)
    try:
        _wait_for_flock(path)
        told: list[str] = []
        with pytest.raises(LockTimeout, match="a bench"):
            MachineLock(cores=[1], wait=0.6, path=path, on_wait=told.append).acquire()
        assert told == [f"waiting for {path}: a bench holds it"]  # said once, as the wait began
        waiting = MachineLock(cores=[1], path=path)
        got, thread = _waits(waiting, 0.5)
        os.killpg(bench.pid, signal.SIGTERM)
        bench.wait()
        assert got.wait(timeout=10)
        thread.join()
        # And a bench waits for the engine: flock's own non-blocking try fails while it runs.
        assert subprocess.run(["flock", "-n", str(path), "true"], check=False).returncode == 1
        waiting.release()
        assert subprocess.run(["flock", "-n", str(path), "true"], check=False).returncode == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(bench.pid, signal.SIGKILL)
        bench.wait()


def test_a_run_under_flock_is_not_held_back_by_its_own_lock(path: Path) -> None:
    # An end-to-end module run by hand as `flock FILE scripts/test ...`: its engines' lock is
    # held by an ancestor, so taking it again on a new open file would wait on itself.
    script = textwrap.dedent(
        f"""
        from pathlib import Path
        from kvtax_dev.machine_lock import MachineLock, held_by_ancestor
        path = Path({str(path)!r})
        assert held_by_ancestor(path)
        lock = MachineLock(cores=[1], exclusive=True, wait=2, path=path)
        lock.acquire()
        lock.release()
        print("took it")
        """
    )
    path.touch()
    run = subprocess.run(
        ["flock", str(path), sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "took it"
    assert not held_by_ancestor(path)  # this process's ancestors hold nothing on it


def test_a_lock_of_the_same_inode_on_another_device_is_not_ours(path: Path) -> None:
    path.touch()
    st = path.stat()
    parent = os.getppid()
    ours = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    other = f"{os.major(st.st_dev) + 1:02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    line = "1: FLOCK  ADVISORY  WRITE {pid} {file} 0 EOF"
    assert held_by_ancestor(path, locks=line.format(pid=parent, file=ours))
    assert not held_by_ancestor(path, locks=line.format(pid=parent, file=other))
    assert not held_by_ancestor(path, locks=line.format(pid=os.getpid(), file=ours))
    posix = "1: POSIX  ADVISORY  WRITE {pid} {file} 0 EOF"
    assert not held_by_ancestor(path, locks=posix.format(pid=parent, file=ours))


def _wait_for_flock(path: Path) -> None:
    """Until some process holds a flock on ``path`` (flock(1) has taken it)."""
    for _ in range(200):
        if subprocess.run(["flock", "-n", str(path), "true"], check=False).returncode == 1:
            return
        threading.Event().wait(0.05)
    raise AssertionError(f"nothing took {path}")
