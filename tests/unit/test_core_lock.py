"""The test bed's per-core lock: engines bound to a core share it, one that must compute alone
waits for them, and a wait that never ends fails naming the core."""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path

import pytest

from kvtax_dev.testbed.engine import CoreLock, EngineStartError


@pytest.fixture(autouse=True)
def _own_tempdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def test_engines_bound_to_a_core_share_it() -> None:
    first, second = CoreLock("1"), CoreLock("1")
    first.acquire()
    second.acquire()  # would wait (and fail after `wait`) if either held it alone
    first.release()
    second.release()


def test_an_engine_that_must_compute_alone_waits_for_the_others() -> None:
    # Protection: the fleet's calm engine ran beside another lane's overload on its core.
    shared = CoreLock("0-1")
    shared.acquire()
    alone = CoreLock("1", exclusive=True)
    got = threading.Event()

    def take() -> None:
        alone.acquire()
        got.set()

    thread = threading.Thread(target=take)
    thread.start()
    assert not got.wait(timeout=1.5)  # core 1 is still shared
    shared.release()
    assert got.wait(timeout=10)
    thread.join()
    # While it computes alone, another engine bound there waits in turn.
    later = CoreLock("1", wait=0.6)
    with pytest.raises(EngineStartError, match="core 1"):
        later.acquire()
    alone.release()
    later.acquire()
    later.release()
