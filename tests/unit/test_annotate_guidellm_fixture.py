"""``kvtax annotate`` on a real guidellm 0.8.1 run against the real vLLM CPU engine.

The fixture (tests/fixtures/guidellm, made by ``bench/tools/guidellm_run.py``; its README has the
commands) holds guidellm's report and kvtax's recording of the engine's /metrics during the
run. The check: the preemptions annotate adds to each benchmark equal the engine's own counter
increase over that benchmark's span, read here from the recorded pages with a regular
expression rather than with kvtax's parser.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from kvtax import cli
from tests.unit.recorded_counter import increase, preemption_series

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "guidellm"


def test_annotated_preemptions_equal_the_engines_counter_over_each_step(tmp_path: Path) -> None:
    report_path = FIXTURE / "guidellm-report.json.gz"
    report = json.loads(gzip.decompress(report_path.read_bytes()))
    assert report["metadata"]["guidellm_version"] == "0.8.1"
    code = cli.main(
        [
            "annotate",
            str(report_path),
            "--recording",
            str(FIXTURE / "recording.jsonl.gz"),
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    out = json.loads((tmp_path / "guidellm-report-kvtax.json").read_text())
    series = preemption_series(FIXTURE / "recording.jsonl.gz")
    annotated = [b["kvtax"]["preemptions"] for b in out["benchmarks"]]
    engine = [increase(series, b["start_time"], b["end_time"]) for b in report["benchmarks"]]
    assert annotated == engine
    # Not vacuous: the run has steps without preemptions and steps with them.
    assert 0 in engine
    assert any(c > 0 for c in engine)
    knee = out["kvtax"]["knees"]["preemption"]
    assert knee is not None
    assert all(c == 0 for c in engine[: knee["step"]])
    for name in ("throughput", "tax", "latency"):
        assert (tmp_path / f"guidellm-report-kvtax-{name}.png").read_bytes()[:4] == b"\x89PNG"
