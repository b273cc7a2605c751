"""``kvtax annotate`` on a real AIPerf 0.13.0 sweep against the real vLLM CPU engine.

The fixture (tests/fixtures/aiperf, made by ``bench/tools/annotate_tools_run.py``; its README has
the commands) holds AIPerf's ``profile_export_aiperf.json`` of each run of a ``--concurrency
2,8,32`` sweep and kvtax's recording of the engine's /metrics during the sweep. The check: the
preemptions annotate adds to each run equal the engine's own counter increase over that run's span,
read here from AIPerf's JSON with the standard library and from the recorded pages with a regular
expression, not with kvtax's readers.
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

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "aiperf"


@pytest.fixture
def utc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The machine that ran AIPerf kept UTC: its times carry no zone."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def _exports() -> list[dict[str, Any]]:
    paths = sorted((FIXTURE / "artifacts").rglob("profile_export_aiperf.json.gz"))
    return [json.loads(gzip.decompress(p.read_bytes())) for p in paths]


def _seconds(iso: str) -> float:
    return datetime.fromisoformat(iso).replace(tzinfo=UTC).timestamp()


def test_the_fixture_is_a_real_aiperf_sweep() -> None:
    exports = _exports()
    assert len(exports) == 3
    assert {e["aiperf_version"] for e in exports} == {"0.13.0"}
    assert {e["schema_version"] for e in exports} == {"1.4"}
    assert all(e["is_complete"] and not e["was_cancelled"] for e in exports)
    levels = sorted(
        e["run_info"]["variation_values"]["phases.profiling.concurrency"] for e in exports
    )
    assert levels == [2, 8, 32]


def test_the_reader_takes_each_runs_span_level_and_latencies(utc: None) -> None:
    exports = _exports()
    report = read_report(exports)
    assert report.tool == "aiperf"
    by_start = sorted(exports, key=lambda e: _seconds(e["start_time"]))
    assert report.document["benchmarks"] == by_start
    for step, export in zip(report.steps, by_start, strict=True):
        assert step.start == pytest.approx(_seconds(export["start_time"]), abs=1e-6)
        assert step.end == pytest.approx(_seconds(export["end_time"]), abs=1e-6)
        level = export["run_info"]["variation_values"]["phases.profiling.concurrency"]
        assert (step.concurrency, step.label) == (level, f"concurrency@{level}")
        assert step.output_tokens_per_s == export["output_token_throughput"]["avg"]
        assert step.requests_per_s == export["request_throughput"]["avg"]
        assert export["time_to_first_token"]["unit"] == "ms"
        assert step.ttft_p99 == pytest.approx(export["time_to_first_token"]["p99"] / 1000)
        assert step.itl_p50 == pytest.approx(export["inter_token_latency"]["p50"] / 1000)
        # The span AIPerf writes is the one it measured over.
        duration = export["benchmark_duration"]
        assert duration["unit"] == "sec"
        assert step.end - step.start == pytest.approx(duration["avg"], abs=0.1)


def test_annotated_preemptions_equal_the_engines_counter_over_each_run(
    tmp_path: Path, utc: None
) -> None:
    code = cli.main(
        [
            "annotate",
            str(FIXTURE / "artifacts"),
            "--recording",
            str(FIXTURE / "recording.jsonl.gz"),
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    out = json.loads((tmp_path / "artifacts-kvtax.json").read_text())
    assert out["kvtax"]["tool"] == "aiperf"
    series = preemption_series(FIXTURE / "recording.jsonl.gz")
    runs = sorted(_exports(), key=lambda e: _seconds(e["start_time"]))
    engine = [increase(series, _seconds(e["start_time"]), _seconds(e["end_time"])) for e in runs]
    annotated = [b["kvtax"]["preemptions"] for b in out["benchmarks"]]
    assert annotated == engine
    assert [b["kvtax"]["label"] for b in out["benchmarks"]] == [
        "concurrency@2",
        "concurrency@8",
        "concurrency@32",
    ]
    # Not vacuous: the sweep has a run without preemptions and runs with them.
    assert engine[0] == 0
    assert all(c > 0 for c in engine[1:])
    # And nothing preempted outside the runs: the steps hold every preemption recorded.
    assert sum(engine) == series[-1][1] - series[0][1]
    knee = out["kvtax"]["knees"]["preemption"]
    assert knee == {"step": 1, "level": 8, "confirmed": True}
    for name in ("throughput", "tax", "latency"):
        assert (tmp_path / f"artifacts-kvtax-{name}.png").read_bytes()[:4] == b"\x89PNG"
