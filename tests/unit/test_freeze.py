"""The harness's engine freezer on a stand-in for vLLM: a parent (the API server) whose child
(the engine core) counts into a file. Inside the freezer the child counts nothing, the parent
goes on; a slice lets it count; on the way out, or when the test's side of the helper is gone,
it counts again."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvtax_dev.process import poll_until
from kvtax_dev.testbed.freeze import Freezer

# The child writes its count every 2 ms; the parent its own, to show it is never stopped.
_COUNTER = """
import sys, time
path, n = sys.argv[1], 0
while True:
    n += 1
    with open(path, "w") as f:
        f.write(str(n))
    time.sleep(0.002)
"""
_PARENT = f"""
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", {_COUNTER!r}, sys.argv[1]])
n = 0
while child.poll() is None:
    n += 1
    with open(sys.argv[2], "w") as f:
        f.write(str(n))
    time.sleep(0.002)
"""


class Stand:
    def __init__(self, tmp_path: Path) -> None:
        self.child_file = tmp_path / "child"
        self.parent_file = tmp_path / "parent"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _PARENT, str(self.child_file), str(self.parent_file)],
            start_new_session=True,
        )
        assert poll_until(lambda: self.count(self.child_file) > 0, timeout=30)

    @staticmethod
    def count(path: Path) -> int:
        try:
            return int(path.read_text() or 0)
        except (FileNotFoundError, ValueError):  # not written yet, or caught mid-write
            return 0

    def child(self) -> int:
        return self.count(self.child_file)

    def parent(self) -> int:
        return self.count(self.parent_file)

    def moves(self, read: Callable[[], int]) -> bool:
        """Whether the count ``read()`` gives rises, within a guard against hangs."""
        first = read()
        return poll_until(lambda: read() > first, timeout=30) is not None


@pytest.fixture
def stand(tmp_path: Path) -> Iterator[Stand]:
    stand = Stand(tmp_path)
    yield stand
    subprocess.run(["pkill", "-CONT", "-g", str(stand.proc.pid)], check=False)
    subprocess.run(["pkill", "-KILL", "-g", str(stand.proc.pid)], check=False)
    stand.proc.wait()


def _stopped(stand: Stand) -> bool:
    """The child's count stays put across many of its 2 ms periods, its parent's moves."""
    before = stand.child()
    assert stand.moves(stand.parent)
    assert stand.moves(stand.parent)
    return stand.child() == before


def test_inside_the_child_stops_and_the_parent_goes_on(stand: Stand) -> None:
    with Freezer(stand.proc.pid):
        assert _stopped(stand)
    assert stand.moves(stand.child)


def test_a_slice_lets_the_child_run_and_it_is_stopped_after(stand: Stand) -> None:
    with Freezer(stand.proc.pid) as freezer:
        start = stand.child()
        target = start + 5

        async def run() -> bool:
            return await freezer.run_until(lambda: stand.child() >= target, slice_s=0.02)

        assert asyncio.run(run())
        assert freezer.slices >= 1
        assert _stopped(stand)
    assert stand.moves(stand.child)


def test_go_lets_the_child_run_until_halt(stand: Stand) -> None:
    with Freezer(stand.proc.pid) as freezer:
        freezer.go()
        assert stand.moves(stand.child)
        freezer.halt()
        assert _stopped(stand)
    assert stand.moves(stand.child)


def test_the_child_goes_on_when_the_test_side_dies(stand: Stand) -> None:
    freezer = Freezer(stand.proc.pid).__enter__()
    assert _stopped(stand)
    helper = freezer._helper
    assert helper is not None
    # As when the test process dies: its end of the pipe closes, not the helper's own way out.
    assert helper.stdin is not None
    helper.stdin.close()
    assert helper.wait(30) == 0
    assert stand.moves(stand.child)
    freezer._helper = None
    assert helper.stdout is not None
    helper.stdout.close()


def test_a_command_outside_the_with_block_is_refused() -> None:
    async def run() -> bool:
        return await Freezer(1).run_until(lambda: True)

    with pytest.raises(RuntimeError, match="enter it first"):
        asyncio.run(run())


_SET_FIFO = "import os; os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))"


def _may_run_realtime() -> bool:
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os; os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))",
        ],
        check=False,
        capture_output=True,
    )
    return probe.returncode == 0


def test_the_helper_runs_at_real_time_priority_where_the_machine_allows_it(stand: Stand) -> None:
    with Freezer(stand.proc.pid) as freezer:
        assert freezer.realtime == _may_run_realtime()
