"""``kvtax annotate`` on real ``vllm bench serve`` runs against the real vLLM CPU engine.

The fixture (tests/fixtures/vllm-bench, made by ``bench/tools/annotate_tools_run.py``; its README
has the commands) holds the ``--save-result --append-result`` file of three ``vllm bench serve``
runs (vLLM 0.32.0 CPU; max concurrency 2, 8 and 32) and kvtax's recording of the engine's
/metrics during them. The check: the preemptions annotate adds to each run equal the engine's
own counter increase over that run, read here from the JSON lines with the standard library and
from the recorded pages with a regular expression, not with kvtax's readers.

vLLM's result names no exact start (its request times are ``perf_counter`` values): each run is
the ``duration`` seconds before ``date`` (local time, whole seconds, read just after the run),
with a second each side for the rounding, as docs/loadtest.md says.
"""

from __future__ import annotations

import gzip
import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from kvtax import cli
from kvtax.tools.loadtest.tools import read_report
from tests.unit.recorded_counter import increase, preemption_series

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-bench"
REPORT = FIXTURE / "vllm-bench.jsonl.gz"


@pytest.fixture
def utc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The machine that ran vLLM's benchmark kept UTC: its dates carry no zone."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def _results() -> list[dict[str, Any]]:
    lines = gzip.decompress(REPORT.read_bytes()).decode().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _span(result: dict[str, Any]) -> tuple[float, float]:
    end = datetime.strptime(result["date"], "%Y%m%d-%H%M%S").replace(tzinfo=UTC).timestamp()
    return end - result["duration"] - 1.0, end + 1.0


def test_the_fixture_is_three_real_runs_appended() -> None:
    results = _results()
    assert [r["max_concurrency"] for r in results] == [2, 8, 32]
    assert all(r["failed"] == 0 and r["completed"] == r["num_prompts"] for r in results)
    assert all(r["total_output_tokens"] == 300 * r["completed"] for r in results)  # ignore_eos
    # --append-result writes one object per line: the file is not one JSON value.
    with pytest.raises(json.JSONDecodeError, match="Extra data"):
        json.loads(gzip.decompress(REPORT.read_bytes()))


def test_the_reader_takes_each_runs_span_level_and_latencies(utc: None) -> None:
    results = _results()
    report = read_report(results)
    assert report.tool == "vllm-bench"
    for step, result in zip(report.steps, results, strict=True):
        assert (step.start, step.end) == _span(result)
        level = result["max_concurrency"]
        assert (step.concurrency, step.label) == (level, f"concurrency@{level}")
        assert step.output_tokens_per_s == result["output_throughput"]
        assert step.requests_per_s == result["request_throughput"]
        assert step.ttft_p50 == pytest.approx(result["median_ttft_ms"] / 1000)
        assert step.ttft_p99 == pytest.approx(result["p99_ttft_ms"] / 1000)
        assert step.itl_p99 == pytest.approx(result["p99_itl_ms"] / 1000)


def test_annotated_preemptions_equal_the_engines_counter_over_each_run(
    tmp_path: Path, utc: None
) -> None:
    code = cli.main(
        [
            "annotate",
            str(REPORT),
            "--recording",
            str(FIXTURE / "recording.jsonl.gz"),
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    out = json.loads((tmp_path / "vllm-bench-kvtax.json").read_text())
    assert out["kvtax"]["tool"] == "vllm-bench"
    series = preemption_series(FIXTURE / "recording.jsonl.gz")
    engine = [increase(series, *_span(r)) for r in _results()]
    annotated = [b["kvtax"]["preemptions"] for b in out["benchmarks"]]
    assert annotated == engine
    assert [b["kvtax"]["label"] for b in out["benchmarks"]] == [
        "concurrency@2",
        "concurrency@8",
        "concurrency@32",
    ]
    # Not vacuous: one run without preemptions, two with them.
    assert engine[0] == 0
    assert all(c > 0 for c in engine[1:])
    # Nothing preempted outside the runs, so the second of slack each side took none from a
    # neighbour: the steps hold every preemption recorded.
    assert sum(engine) == series[-1][1] - series[0][1]
    knee = out["kvtax"]["knees"]["preemption"]
    assert knee == {"step": 1, "level": 8, "confirmed": True}
    for name in ("throughput", "tax", "latency"):
        assert (tmp_path / f"vllm-bench-kvtax-{name}.png").read_bytes()[:4] == b"\x89PNG"
