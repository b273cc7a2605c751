"""The harness's child-process lifecycle, on real child processes (a Python one-liner each)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtax_dev import EXPORTER
from kvtax_dev.ports import refused_port
from kvtax_dev.process import (
    ChildProcess,
    ChildStartError,
    http_ok,
    poll_until,
    port_open,
    until,
)
from kvtax_dev.testbed.sidecar import KvtaxProcess


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


# A child that says hello, marks itself ready with a file, then waits to be stopped.
READY_THEN_WAIT = """
import pathlib, sys, time
print("hello from the child", flush=True)
pathlib.Path(sys.argv[1]).touch()
time.sleep(600)
"""


def ready_child(tmp_path: Path, code: str = READY_THEN_WAIT, **kwargs: object) -> ChildProcess:
    marker = tmp_path / "ready"
    return ChildProcess(
        "child",
        [*python(code), str(marker)],
        log_path=tmp_path / "child.log",
        ready=marker.exists,
        **kwargs,  # type: ignore[arg-type]
    )


def gone(pid: int) -> bool:
    """True once ``pid`` no longer runs (absent, or a zombie waiting for its reaper)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


def test_start_waits_for_ready_and_stop_terminates(tmp_path: Path) -> None:
    with ready_child(tmp_path) as child:
        assert child.running
        assert (tmp_path / "ready").exists()
        assert "hello from the child" in child.log_tail()
    assert not child.running
    assert child.returncode == -signal.SIGTERM


def test_stop_is_idempotent_and_keeps_the_status(tmp_path: Path) -> None:
    child = ready_child(tmp_path).start()
    first = child.stop()
    assert child.stop() == first == -signal.SIGTERM


def test_an_exit_during_start_up_raises_with_the_log_tail(tmp_path: Path) -> None:
    child = ChildProcess(
        "doomed",
        python("print('cannot bind: address in use'); raise SystemExit(3)"),
        log_path=tmp_path / "doomed.log",
        ready=lambda: False,
    )
    with pytest.raises(ChildStartError, match=r"(?s)doomed exited with 3.*address in use"):
        child.start(timeout=60)
    assert not child.running


def test_a_child_never_ready_is_stopped_and_the_error_is_the_callers(tmp_path: Path) -> None:
    class MineError(ChildStartError):
        pass

    child = ready_child(tmp_path, error=MineError)
    marker = tmp_path / "ready"

    def never_ready() -> bool:
        # The child has printed its line and made its marker, but the probe never says yes.
        # The probe waits for the marker rather than the test racing the timeout against the
        # child's start, which a busy machine can make take seconds (the log tail then empty).
        assert poll_until(marker.exists, timeout=60), "the child never started"
        return False

    child._ready = never_ready
    with pytest.raises(MineError, match=r"(?s)child not ready after 1 s.*hello from the child"):
        child.start(timeout=1)
    assert not child.running
    assert child.returncode == -signal.SIGTERM


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    stubborn = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" + READY_THEN_WAIT
    child = ready_child(tmp_path, stubborn).start(timeout=60)
    assert child.stop(grace=0.5) == -signal.SIGKILL


def test_own_group_stops_the_grandchildren_too(tmp_path: Path) -> None:
    # The child starts a grandchild that ignores SIGTERM, as vLLM's workers may.
    spawn = f"""
import pathlib, subprocess, sys
grand = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
pathlib.Path(sys.argv[1] + ".pid").write_text(str(grand.pid))
{READY_THEN_WAIT}
"""
    child = ready_child(tmp_path, spawn, own_group=True).start(timeout=60)
    grandchild = int((tmp_path / "ready.pid").read_text())
    assert not gone(grandchild)
    child.stop(grace=0.5)
    assert poll_until(lambda: gone(grandchild), timeout=30)


def test_a_ctrl_c_inside_popen_still_stops_the_child(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C that lands while Popen is still running, after the child exists, stops that
    child: ChildProcess.start holds the signal until the child is recorded, then stops it and
    lets the KeyboardInterrupt through."""
    # Protection: the demo's Ctrl-C test left vLLM's API server serving after the demo exited.
    # The interrupt came inside Popen (the test signals as soon as the child appears), so
    # start() never held the child's pid and nothing stopped it.
    born: list[int] = []
    real_popen = subprocess.Popen

    def popen_then_ctrl_c(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        proc = real_popen(*args, **kwargs)
        born.append(proc.pid)
        signal.raise_signal(signal.SIGINT)  # the user's Ctrl-C, before Popen returns
        return proc

    monkeypatch.setattr(subprocess, "Popen", popen_then_ctrl_c)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        child = ready_child(tmp_path, own_group=True)
        with pytest.raises(KeyboardInterrupt):
            child.start()
    finally:
        signal.signal(signal.SIGINT, previous)
    (pid,) = born
    assert gone(pid)
    assert not child.running


def test_poll_until_returns_the_first_truthy_value() -> None:
    answers: Iterator[object] = iter([None, [], 0, "yes"])
    assert poll_until(lambda: next(answers), timeout=30, interval=0) == "yes"


def test_poll_until_gives_none_or_the_last_error_at_the_deadline() -> None:
    assert poll_until(lambda: False, timeout=0, interval=0) is None

    def broken() -> bool:
        raise ConnectionError("refused")

    with pytest.raises(ConnectionError, match="refused"):
        poll_until(broken, timeout=0, interval=0, retry_on=(ConnectionError,))


def test_http_ok_is_false_when_nothing_listens() -> None:
    with refused_port() as port:
        assert http_ok(f"http://127.0.0.1:{port}/health", timeout=1) is False


def test_port_open_sees_a_listener_and_only_while_it_listens() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert port_open(port)
    assert not port_open(port)


def test_kvtax_process_runs_this_checkouts_package(monkeypatch: pytest.MonkeyPatch) -> None:
    # An editable install maps one checkout; a worktree's tests must run their own kvtax.
    monkeypatch.setenv("PYTHONPATH", "/somewhere/else")
    kvtax = KvtaxProcess("http://127.0.0.1:9")
    assert kvtax.env["PYTHONPATH"].split(os.pathsep) == [str(EXPORTER), "/somewhere/else"]


async def test_until_waits_on_the_loop_and_says_whether_the_condition_came() -> None:
    flag: list[bool] = []
    asyncio.get_running_loop().call_later(0.05, flag.append, True)
    # The loop runs meanwhile: the timer above fires while until() waits.
    assert await until(lambda: bool(flag))
    assert await until(lambda: False, limit=0.0) is False
