"""The worker-to-parent transport bench (bench.relay.workers) runs, and its parent applies every
record it was sent to its ledger, no more and no fewer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from bench.relay import workers as ipc

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("mode", ipc.MODES)
def test_each_mode_runs_and_the_parent_settles_what_was_sent(mode: str) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "bench.relay.workers", "-n", "300", "--mode", mode],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    rows = [line for line in run.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert [row.split(" | ")[0].strip("| ") for row in rows[1:]] == ["in process (one kvtax)", mode]
    if mode == "asks":
        assert rows[-1].split(" | ")[4] != "-"  # round trips were measured
