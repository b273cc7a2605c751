"""``kvtax loadtest`` against the real vLLM CPU engine finds where preemption begins.

The session engine's pool holds 2,048 tokens (16 blocks of 128). Each request here is 40 prompt
tokens and 500 generated (``ignore_eos``): 5 blocks at its end, so two fit with room to spare
and four cannot all fit while they run in step (three would fill the pool to the last block,
too close to call, so the sweep skips it). The sweep runs concurrency 1, 2, 4, 6, 8.

Each step's first requests start in step whatever the machine's load: the test holds the
engine still (:mod:`kvtax_dev.testbed.freeze`) from the end of one step until vLLM has taken
every request the next one opens with, then lets it go: on a busy machine vLLM's API server
takes the requests in one by one while it streams the others, and the engine can finish some
before the last comes in, so that a step above the knee runs without a preemption. While it
runs, the test samples the engine's own
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
import urllib.parse
from functools import partial
from itertools import pairwise
from pathlib import Path

import requests

from kvtax_dev import dev_env
from kvtax_dev.process import HANG_GUARD_S, poll_until
from kvtax_dev.testbed import VllmEngine
from kvtax_dev.testbed.freeze import Freezer

_PREEMPTIONS = re.compile(r"^vllm:num_preemptions_total\{[^}]*\} (\S+)$", re.MULTILINE)
_PNG = b"\x89PNG\r\n\x1a\n"
LEVELS = (1, 2, 4, 6, 8)
_RECEIVED = re.compile(r"\bbytes_received:(\d+)")


class _Sampler(threading.Thread):
    """The engine's preemptions every 0.2 s, read straight from its page, each sample with the
    times its page was asked for and came: a page that came before a step began counts as
    before it, one asked for after it ended as after (a slow page counts as neither)."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.samples: list[tuple[float, float, float]] = []  # asked, came, preemptions
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            asked = time.time()
            try:
                page = requests.get(f"{self.url}/metrics", timeout=10).text
            except requests.RequestException:
                continue
            values = [float(v) for v in _PREEMPTIONS.findall(page)]
            self.samples.append((asked, time.time(), sum(values)))
            self.done.wait(0.2)

    def asked_since(self, moment: float) -> bool:
        return any(asked >= moment for asked, _, _ in self.samples)

    def increase(self, start: float, end: float) -> float:
        before = [v for _, came, v in self.samples if came <= start]
        after = [v for asked, _, v in self.samples if asked >= end]
        assert before, "no sample before the step began"
        assert after, "no sample after the step ended"
        return after[0] - before[-1]


def _after_line(proc: subprocess.Popen[bytes], log: Path, prefix: str, after: int) -> int | None:
    """Where the sweep's output goes on past its first line from ``after`` on that starts with
    ``prefix`` (the line's index + 1); None while there is none. The sweep ending without it
    fails at once, with what it printed."""
    ended = proc.poll() is not None  # before the read: an ended sweep's output is all there
    lines = log.read_text().splitlines()
    found = next((i + 1 for i in range(after, len(lines)) if lines[i].startswith(prefix)), None)
    assert found or not ended, f"the sweep ended without a line {prefix!r}:\n{log.read_text()}"
    return found


def _wait_line(proc: subprocess.Popen[bytes], log: Path, prefix: str, after: int) -> int:
    found = poll_until(partial(_after_line, proc, log, prefix, after), timeout=HANG_GUARD_S)
    assert found, f"the sweep printed no line {prefix!r}:\n{log.read_text()}"
    return found


def _answered(pid: int, port: int) -> int:
    """How many of process ``pid``'s open connections to ``port`` have had bytes back. vLLM
    sends a stream's head as it takes the request, before any token, so with its engine held
    still this counts the requests vLLM holds (and a metrics scrape in flight, if any: the
    count may run one ahead, the last request then taken a moment after the engine goes)."""
    listing = subprocess.run(
        ["ss", "-H", "-t", "-i", "-p", "state", "established", "dport", "=", f":{port}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    # Each connection is a line naming its process, then an indented line of its counters.
    return sum(
        1
        for head, info in pairwise(listing)
        if f"pid={pid}," in head and (m := _RECEIVED.search(info)) and int(m.group(1)) > 0
    )


def _taken(pid: int, port: int, count: int) -> bool:
    return _answered(pid, port) >= count


def _hold_each_step_until_its_requests_are_in(
    freezer: Freezer, proc: subprocess.Popen[bytes], log: Path, port: int
) -> None:
    """The engine is held still from the end of one step until vLLM has taken each request
    the next step opens with (as many as its clients), then let go for the step."""
    seen = 0
    for index, level in enumerate(LEVELS):
        seen = _wait_line(proc, log, f"step {index + 1}/{len(LEVELS)}:", seen)
        assert poll_until(partial(_taken, proc.pid, port, level), timeout=HANG_GUARD_S), (
            f"vLLM did not take the {level} requests of step {index + 1}"
        )
        freezer.go()
        # The step's own line ("  concurrency 4: ..."), printed before the rest between steps.
        seen = _wait_line(proc, log, f"  concurrency {level}:", seen)
        freezer.halt()


def test_loadtest_finds_the_preemption_knee(vllm_engine: VllmEngine, tmp_path: Path) -> None:
    sampler = _Sampler(vllm_engine.url)
    sampler.start()
    assert poll_until(lambda: sampler.samples, timeout=HANG_GUARD_S), "vLLM's page never came"
    cmd = [
        sys.executable,
        "-m",
        "kvtax.cli.main",
        "loadtest",
        vllm_engine.url,
        "--levels",
        ",".join(map(str, LEVELS)),
        "--step-duration",
        "5",
        "--scrape-interval",
        "0.5",
        "--rest",
        "2",
        "--prompt-tokens",
        "const:40",
        "--output-tokens",
        "const:500",
        "--out",
        str(tmp_path),
    ]
    port = urllib.parse.urlsplit(vllm_engine.url).port
    assert port is not None
    log = tmp_path / "sweep.log"
    try:
        with vllm_engine.freezer() as freezer, log.open("wb") as out:
            proc = subprocess.Popen(cmd, env=dev_env(os.environ), stdout=out, stderr=out)
            try:
                _hold_each_step_until_its_requests_are_in(freezer, proc, log, port)
            finally:
                freezer.go()
                try:
                    proc.wait(300)
                finally:
                    if proc.poll() is None:
                        proc.kill()
                        proc.wait()
        ended = time.time()
        assert poll_until(lambda: sampler.asked_since(ended), timeout=HANG_GUARD_S)
    finally:
        sampler.done.set()
        sampler.join(timeout=HANG_GUARD_S)
    printed = log.read_text()
    assert proc.returncode == 0, printed
    # Progress went to the terminal while it ran: one line per step at least.
    assert printed.count("step ") >= 5, printed
    report = json.loads((tmp_path / "report.json").read_text())
    steps = report["steps"]
    assert [s["level"] for s in steps] == list(LEVELS)
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
