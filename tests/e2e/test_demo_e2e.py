"""``kvtax demo --short`` end to end, as a newcomer runs it: real engine, real kvtax, real load.

The demo starts its own engine (a second one beside the session's), so these tests check the
whole first-run path: summary figures, exit status, and that nothing it started survives it,
on a normal exit, on Ctrl-C and on a kill. None can share the session's engine: starting and
stopping an engine is part of what they test. The signals come while vLLM starts, so only the
normal run starts an engine to the end. The demo's engine computes on the core beside the session
engine's (``VLLM_CPU_OMP_THREADS_BIND``, which the demo passes on), as the suite runs these in
the lane beside the session engine's (tests/e2e/conftest.py).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtax.mixin.dashboards import dashboards
from kvtax.mixin.rules import TEST_PROFILE
from kvtax_dev import dev_env
from kvtax_dev.preview import first_rows
from kvtax_dev.process import HANG_GUARD_S, poll_until
from kvtax_dev.testbed.engine import beside_cores

_cores = beside_cores()
_BESIDE = {"VLLM_CPU_OMP_THREADS_BIND": _cores} if _cores is not None else {}


def _demo(*args: str, sigint_ignored: bool = False) -> subprocess.Popen[str]:
    """The demo, its output piped; ``sigint_ignored``: started as a script's background job
    starts it, with SIGINT ignored (bash does that, and a child inherits it across exec)."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if sigint_ignored else None
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "kvtax.cli.main", "demo", "--short", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            # As scripts/demo runs it: the child imports kvtax_dev from this checkout's exporter/.
            env={**dev_env(os.environ), "PYTHONUNBUFFERED": "1", **_BESIDE},
        )
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _ports(output: str) -> list[str]:
    """Loopback ports of the engine and of kvtax, as the demo announced them."""
    return re.findall(r"http://127\.0\.0\.1:(\d+)", output)


def _alive(port: str) -> list[str]:
    found = subprocess.run(
        ["pgrep", "-af", f"127.0.0.1:{port}\\b|--port {port}\\b"],
        capture_output=True,
        text=True,
        check=False,
    )
    return [line for line in found.stdout.splitlines() if "pgrep" not in line]


def test_demo_summary_shows_tax_in_overload_and_none_after(tmp_path: Path) -> None:
    """The demo with Prometheus, as the README runs it: a tax in the overload and none after,
    its previews full where the eye starts, and a nothing-started-survives exit."""
    proc = _demo("--with-prometheus", "--previews-out", str(tmp_path))
    output, _ = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode == 0, output[-3000:]
    _first_rows_full_and_agreeing_with_the_page(tmp_path, output)
    rows = {
        m.group(1): float(m.group(2))
        for m in re.finditer(r"^(overload|calm)\s.*?([\d.]+)%$", output, flags=re.M)
    }
    assert rows["overload"] > 0, output[-2000:]
    assert rows["calm"] == 0, output[-2000:]
    assert "kvtax recommends --max-num-seqs=" in output
    for port in set(_ports(output)):
        assert not _alive(port), f"port {port} still served after the demo: {_alive(port)}"


def _first_rows_full_and_agreeing_with_the_page(previews: Path, output: str) -> None:
    """No panel of the Overview's first two rows is empty in the demo's preview, and its SLO
    row reads what the burn-rate page said: a burn over the page's long window at or above the
    page's threshold, and an attainment that makes that burn."""
    record = json.loads((previews / "kvtax-overview.panels.json").read_text())
    overview = dashboards(TEST_PROFILE)["kvtax-overview.json"]
    assert not set(first_rows(overview, 2)) & set(record["no_data"]), record["no_data"]
    assert "Panels the previews drew without data:" in output
    page = re.search(
        r"KvtaxErrorBudgetBurn .*?over the last (\S+), .*?\(threshold ([\d.]+)x", output
    )
    assert page, output[-3000:]
    window, threshold = page.group(1), float(page.group(2))
    tiles = record["stats"]
    burn = next(v for name, v in tiles["Burn rate"].items() if name.startswith(f"{window} "))
    assert burn >= threshold, tiles
    (attained,) = tiles["SLO attainment"].values()
    assert (1 - attained) / (1 - TEST_PROFILE.slo_objective) == pytest.approx(burn, rel=0.15)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "kill"])
def test_a_signal_stops_everything_the_demo_started(sig: signal.Signals) -> None:
    """Ctrl-C and a kill while vLLM starts (kvtax already watching it, vLLM's processes up
    but not yet serving: the longest wait a newcomer interrupts) end the demo with status 130
    and leave nothing it started running, with SIGINT ignored at start as a script's
    background job has it."""
    # Protection: the demo's own handlers. Started with SIGINT ignored, as from a script's
    # background (the suite's lanes are such jobs), it ran on through Ctrl-C to its summary;
    # and SIGTERM ended it with no cleanup, its engine left serving.
    proc = _demo(sigint_ignored=True)
    assert proc.stdout is not None
    seen: list[str] = []
    deadline = time.monotonic() + HANG_GUARD_S
    for line in proc.stdout:
        seen.append(line)
        if "starting vLLM on" in line or time.monotonic() > deadline:
            break
    assert "starting vLLM on" in seen[-1], "".join(seen)[-3000:]
    ports = set(_ports("".join(seen)))
    assert len(ports) == 3, "".join(seen)  # kvtax's two and the engine's
    # kvtax and the engine's processes exist before the signal: stopping them is what is tested.
    assert poll_until(lambda: all(_alive(port) for port in ports), timeout=HANG_GUARD_S)
    proc.send_signal(sig)
    rest, _ = proc.communicate(timeout=HANG_GUARD_S)
    output = "".join(seen) + rest
    assert proc.returncode == 130, output[-3000:]
    assert "interrupted" in output
    for port in set(_ports(output)):
        assert not _alive(port), f"port {port} still served after {sig.name}: {_alive(port)}"
