"""``kvtax loadtest`` against the real vLLM CPU engine finds where preemption begins.

The session engine's pool holds 2,048 tokens (16 blocks of 128). Each request here is 40 prompt
tokens and 500 generated (``ignore_eos``): 5 blocks at its end, so two fit with room to spare
and four cannot all fit while they run in step (three would fill the pool to the last block,
too close to call, so the sweep skips it). Four out of step hold about 3 blocks each and may
fit: beside CI's other lanes the clients drifted apart and 4 did not preempt, leaving the
knee at the last step, unconfirmed. Six cannot fit either way, and eight confirms it. The
sweep runs concurrency 1, 2, 4, 6, 8. While it runs, the test samples the engine's own
``vllm:num_preemptions_total`` from its /metrics with a regular expression (not kvtax's
parser), and checks against those samples that no step below the knee kvtax reports preempted
and every step from the knee on did.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import requests

from kvtax_dev import dev_env
from kvtax_dev.testbed import VllmEngine

_PREEMPTIONS = re.compile(r"^vllm:num_preemptions_total\{[^}]*\} (\S+)$", re.MULTILINE)
_PNG = b"\x89PNG\r\n\x1a\n"


class _Sampler(threading.Thread):
    """(time, preemptions) of the engine every 0.2 s, read straight from its page."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.samples: list[tuple[float, float]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            try:
                page = requests.get(f"{self.url}/metrics", timeout=10).text
            except requests.RequestException:
                continue
            values = [float(v) for v in _PREEMPTIONS.findall(page)]
            self.samples.append((time.time(), sum(values)))
            self.done.wait(0.2)

    def increase(self, start: float, end: float) -> float:
        before = [v for t, v in self.samples if t <= start]
        after = [v for t, v in self.samples if t >= end]
        assert before, "no sample before the step began"
        assert after, "no sample after the step ended"
        return after[0] - before[-1]


def test_loadtest_finds_the_preemption_knee(vllm_engine: VllmEngine, tmp_path: Path) -> None:
    sampler = _Sampler(vllm_engine.url)
    sampler.start()
    time.sleep(0.5)
    cmd = [
        sys.executable,
        "-m",
        "kvtax.cli.main",
        "loadtest",
        vllm_engine.url,
        "--levels",
        "1,2,4,6,8",
        "--step-duration",
        "5",
        "--scrape-interval",
        "0.5",
        "--prompt-tokens",
        "const:40",
        "--output-tokens",
        "const:500",
        "--out",
        str(tmp_path),
    ]
    try:
        run = subprocess.run(
            cmd, env=dev_env(os.environ), check=False, capture_output=True, text=True, timeout=300
        )
        time.sleep(0.5)
    finally:
        sampler.done.set()
        sampler.join(timeout=15)
    assert run.returncode == 0, run.stderr
    # Progress went to the terminal while it ran: one line per step at least.
    assert run.stderr.count("step ") >= 5, run.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    steps = report["steps"]
    assert [s["level"] for s in steps] == [1, 2, 4, 6, 8]
    knee = report["knees"]["preemption"]
    assert knee is not None, [s["engine"]["preemptions"] for s in steps]
    assert knee["confirmed"] is True
    engine_counts = [sampler.increase(s["start"], s["end"]) for s in steps]
    below, above = engine_counts[: knee["step"]], engine_counts[knee["step"] :]
    assert below, f"the first step already preempted: {engine_counts}"
    assert all(c == 0 for c in below), engine_counts
    assert all(c > 0 for c in above), engine_counts
    # kvtax's own per-step counts say the same as the engine's.
    assert [s["engine"]["preemptions"] for s in steps] == engine_counts
    assert all(s["ok"] > 0 and s["failed"] == 0 for s in steps), steps
    for name in ("throughput", "tax", "latency"):
        png = tmp_path / f"report-{name}.png"
        data = png.read_bytes()
        assert data.startswith(_PNG), png
        assert len(data) > 5_000, png
    page = (tmp_path / "report.md").read_text()
    assert "preemption knee: step" in page
    assert "report-throughput.png" in page
