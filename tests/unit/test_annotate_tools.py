"""``kvtax annotate`` on AIPerf and ``vllm bench serve`` reports: the readers, the spans, the
format detection, and the CLI on synthetic reports (the real runs are in
``test_annotate_aiperf_fixture.py`` and ``test_annotate_vllm_bench_fixture.py``)."""

from __future__ import annotations

import gzip
import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from kvtax import cli
from kvtax.errors import InputError
from kvtax.tools.loadtest.aiperf import read_aiperf
from kvtax.tools.loadtest.timeline import keep_known
from kvtax.tools.loadtest.tools import detect_format, read_report
from kvtax.tools.loadtest.vllmbench import SLACK_S, read_vllm_bench
from tests.unit.test_annotate import PREEMPTIONS, _bench, _page

# The synthetic recording's clock: t seconds after this instant (whole seconds, UTC).
T0 = 1_800_000_000.0


@pytest.fixture
def utc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process's local zone is UTC, as on the machine that ran the tools."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def _local(t: float, fmt: str) -> str:
    return datetime.fromtimestamp(T0 + t, UTC).strftime(fmt)


def _vllm_result(end: float, duration: float, concurrency: int | None) -> dict[str, Any]:
    return {
        "date": _local(end, "%Y%m%d-%H%M%S"),
        "endpoint_type": "openai",
        "backend": "openai",
        "num_prompts": 16,
        "request_rate": "inf",
        "burstiness": 1.0,
        "max_concurrency": concurrency,
        "duration": duration,
        "completed": 16,
        "request_throughput": 1.5,
        "output_throughput": 450.0,
        "median_ttft_ms": 20.0,
        "p99_ttft_ms": 80.0,
        "median_itl_ms": 5.0,
        "p99_itl_ms": 40.0,
    }


def _aiperf_export(start: float, end: float, concurrency: int) -> dict[str, Any]:
    def metric(unit: str, avg: float) -> dict[str, Any]:
        return {"unit": unit, "avg": avg, "p50": avg, "p99": 4 * avg}

    fmt = "%Y-%m-%dT%H:%M:%S.%f"
    return {
        "schema_version": "1.4",
        "aiperf_version": "0.13.0",
        "input_config": {
            "phases": [
                {"name": "warmup", "type": "concurrency", "concurrency": 1},
                {"name": "profiling", "type": "concurrency", "concurrency": concurrency},
            ]
        },
        "request_throughput": metric("requests/sec", 1.5),
        "output_token_throughput": metric("tokens/sec", 100.0 * concurrency),
        "time_to_first_token": metric("ms", 20.0),
        "inter_token_latency": metric("ms", 5.0),
        "start_time": _local(start, fmt),
        "end_time": _local(end, fmt),
    }


def _recording(tmp_path: Path) -> Path:
    """The preemptions of tests/unit/test_annotate.py: 0 over t 10-20, 4 over 30-40 and 6 over
    50-60; scrapes every 5 s."""
    rec = tmp_path / "rec.jsonl.gz"
    with gzip.open(rec, "wt") as f:
        for t, p in PREEMPTIONS.items():
            page = keep_known(_page(p, 100.0 * t, t / 100))
            f.write(json.dumps({"t": T0 + t, "page": page}) + "\n")
    return rec


def test_vllm_bench_spans_are_the_date_less_the_duration_with_a_second_each_side() -> None:
    result = _vllm_result(end=20.0, duration=9.0, concurrency=8)
    (step,) = read_vllm_bench([result], tz=UTC)
    assert (step.start, step.end) == (T0 + 11.0 - SLACK_S, T0 + 20.0 + SLACK_S)
    assert (step.label, step.concurrency, step.rate) == ("concurrency@8", 8.0, None)
    assert (step.requests_per_s, step.output_tokens_per_s) == (1.5, 450.0)
    assert (step.ttft_p50, step.ttft_p99, step.itl_p50, step.itl_p99) == (
        0.02,
        0.08,
        0.005,
        0.04,
    )
    # The date is local time: another zone moves the span by its offset.
    (east,) = read_vllm_bench([result], tz=timezone(timedelta(hours=2)))
    assert east.end == step.end - 7200


def test_vllm_bench_labels_rates_and_bursts() -> None:
    rate = {**_vllm_result(20.0, 9.0, None), "request_rate": 4.0}
    burst = _vllm_result(40.0, 9.0, None)
    steps = read_vllm_bench([rate, burst], tz=UTC)
    assert [s.label for s in steps] == ["rate@4/s", "burst@16"]
    assert [s.concurrency for s in steps] == [None, None]


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"date": None}, "REPORT result[0].date: missing or not text"),
        ({"date": "2026-12-01"}, "REPORT result[0].date: '2026-12-01' is not YYYYMMDD-HHMMSS"),
        ({"duration": -1}, "REPORT result[0].duration: missing or not a positive number"),
        ({"duration": float("nan")}, "REPORT result[0].duration: missing or not a positive"),
    ],
)
def test_a_malformed_vllm_bench_result_names_the_field(change: dict[str, Any], named: str) -> None:
    with pytest.raises(InputError) as err:
        read_vllm_bench([{**_vllm_result(20.0, 9.0, 2), **change}], tz=UTC)
    assert str(err.value).startswith(named)


def test_overlapping_vllm_bench_runs_are_refused() -> None:
    runs = [_vllm_result(20.0, 9.0, 2), _vllm_result(21.0, 9.0, 8)]
    with pytest.raises(InputError, match=r"^REPORT result\[1\]: step concurrency@8 overlaps"):
        read_vllm_bench(runs, tz=UTC)


def test_aiperf_steps_are_read_in_the_order_they_ran_with_units_read() -> None:
    exports = [_aiperf_export(50.0, 60.0, 32), _aiperf_export(10.0, 20.0, 2)]
    exports[0]["time_to_first_token"]["unit"] = "s"
    steps, order = read_aiperf(exports, tz=UTC)
    assert order == [1, 0]
    assert [(s.start, s.end) for s in steps] == [(T0 + 10, T0 + 20), (T0 + 50, T0 + 60)]
    assert [s.label for s in steps] == ["concurrency@2", "concurrency@32"]
    assert [s.concurrency for s in steps] == [2.0, 32.0]
    assert [s.output_tokens_per_s for s in steps] == [200.0, 3200.0]
    assert steps[0].ttft_p50 == pytest.approx(0.02)
    assert steps[1].ttft_p50 == 20.0  # seconds, as its unit says
    assert steps[0].itl_p99 == pytest.approx(0.02)


def test_aiperf_rate_phases_and_zoned_times() -> None:
    export = _aiperf_export(10.0, 20.0, 4)
    export["input_config"]["phases"][1] = {"name": "profiling", "type": "poisson", "rate": 2.5}
    export["start_time"] = "2027-01-15T08:00:10.500000+00:00"
    export["end_time"] = "2027-01-15T08:00:20.500000+00:00"
    (step,), _ = read_aiperf([export], tz=timezone(timedelta(hours=5)))  # zone written wins
    assert (step.label, step.rate, step.concurrency) == ("poisson@2.5/s", 2.5, None)
    assert step.start == datetime(2027, 1, 15, 8, 0, 10, 500000, tzinfo=UTC).timestamp()


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"start_time": None}, "REPORT run[0].start_time: missing or not an ISO 8601 time"),
        ({"end_time": "yesterday"}, "REPORT run[0].end_time: 'yesterday' is not an ISO 8601"),
        ({"end_time": "2000-01-01T00:00:00"}, "REPORT run[0].end_time: "),
    ],
)
def test_a_malformed_aiperf_export_names_the_field(change: dict[str, Any], named: str) -> None:
    with pytest.raises(InputError) as err:
        read_aiperf([{**_aiperf_export(10.0, 20.0, 2), **change}], tz=UTC)
    assert str(err.value).startswith(named)


def test_overlapping_aiperf_runs_are_refused() -> None:
    exports = [_aiperf_export(10.0, 20.0, 2), _aiperf_export(15.0, 25.0, 8)]
    with pytest.raises(InputError, match=r"^REPORT run\[1\]: overlaps run\[0\]"):
        read_aiperf(exports, tz=UTC)


def test_the_format_is_told_by_the_fields() -> None:
    aiperf = _aiperf_export(10.0, 20.0, 2)
    vllm = _vllm_result(20.0, 9.0, 2)
    assert detect_format({"benchmarks": [_bench(1, 2, 1)]}) == "guidellm"
    assert detect_format(aiperf) == detect_format([aiperf, aiperf]) == "aiperf"
    assert detect_format(vllm) == detect_format([vllm, vllm]) == "vllm-bench"
    assert detect_format([aiperf, vllm]) is None
    assert detect_format({"date": "x"}) is None
    with pytest.raises(InputError, match=r"^REPORT: is not a report kvtax reads"):
        read_report({"something": "else"})
    with pytest.raises(InputError, match=r"^REPORT: is not an AIPerf export"):
        read_report(vllm, "aiperf")
    report = read_report([vllm], tz=UTC)
    assert (report.tool, report.name, report.step_field) == (
        "vllm-bench",
        "vllm bench serve",
        "REPORT result",
    )
    assert report.document == {"tool": "vllm-bench", "benchmarks": [vllm]}


def test_annotate_reads_vllm_bench_append_result_lines(tmp_path: Path, utc: None) -> None:
    runs = [
        _vllm_result(end=19.0, duration=8.0, concurrency=1),
        _vllm_result(end=39.0, duration=8.0, concurrency=2),
        _vllm_result(end=59.0, duration=8.0, concurrency=4),
    ]
    report = tmp_path / "bench.jsonl"
    # What --append-result writes: json.dump per run, a newline between them.
    report.write_text("\n".join(json.dumps(r) for r in runs))
    assert cli.main(["annotate", str(report), "--recording", str(_recording(tmp_path))]) == 0
    out = json.loads((tmp_path / "bench-kvtax.json").read_text())
    assert out["kvtax"]["tool"] == "vllm-bench"
    assert [b["kvtax"]["preemptions"] for b in out["benchmarks"]] == [0, 4, 6]
    assert [b["kvtax"]["label"] for b in out["benchmarks"]] == [
        "concurrency@1",
        "concurrency@2",
        "concurrency@4",
    ]
    assert [b["max_concurrency"] for b in out["benchmarks"]] == [1, 2, 4]  # the tool's own
    assert out["kvtax"]["knees"]["preemption"] == {"step": 1, "level": 2, "confirmed": True}
    page = (tmp_path / "bench-kvtax.md").read_text()
    assert "vllm bench serve run with the engine's side" in page


def test_annotate_reads_an_aiperf_sweep_directory(tmp_path: Path, utc: None) -> None:
    sweep = tmp_path / "artifacts"
    for level, (start, end) in zip((2, 8, 32), ((10, 20), (30, 40), (50, 60)), strict=True):
        run = sweep / f"concurrency_{level}" / "profile_export_aiperf.json"
        run.parent.mkdir(parents=True)
        data = json.dumps(_aiperf_export(float(start), float(end), level)).encode()
        if level == 8:
            run.with_name(run.name + ".gz").write_bytes(gzip.compress(data))
        else:
            run.write_bytes(data)
    (sweep / "profile_export_aiperf_sweep.json").write_text('{"aggregation_type": "sweep"}')
    rec = _recording(tmp_path)
    out_dir = tmp_path / "out"
    assert cli.main(["annotate", str(sweep), "--recording", str(rec), "--out", str(out_dir)]) == 0
    out = json.loads((out_dir / "artifacts-kvtax.json").read_text())
    assert out["kvtax"]["tool"] == "aiperf"
    # In the order the runs ran, not the directories' (concurrency_2, _32, _8).
    assert [b["kvtax"]["label"] for b in out["benchmarks"]] == [
        "concurrency@2",
        "concurrency@8",
        "concurrency@32",
    ]
    assert [b["kvtax"]["preemptions"] for b in out["benchmarks"]] == [0, 4, 6]
    assert out["kvtax"]["x"] == "concurrency"


def test_annotate_errors_name_the_tools_fields(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], utc: None
) -> None:
    rec = _recording(tmp_path)
    late = tmp_path / "late.json"
    late.write_text(json.dumps(_vllm_result(end=200.0, duration=8.0, concurrency=1)))
    empty = tmp_path / "empty"
    empty.mkdir()
    lines = tmp_path / "bad.jsonl"
    lines.write_text(json.dumps(_vllm_result(19.0, 8.0, 1)) + "\n{oops\n")
    cases = [
        (late, "kvtax annotate: REPORT result[0]: step concurrency@1 "),
        (
            empty,
            f"kvtax annotate: REPORT: {empty} is a directory without a profile_export_aiperf.json",
        ),
        (lines, f"kvtax annotate: REPORT: {lines} line 2 is not JSON"),
    ]
    for report, start in cases:
        assert cli.main(["annotate", str(report), "--recording", str(rec)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        assert err[0].startswith(start), err
    guidellm = tmp_path / "g.json"
    guidellm.write_text(json.dumps({"benchmarks": [_bench(10.0, 20.0, 1)]}))
    argv = ["annotate", str(guidellm), "--recording", str(rec), "--format", "aiperf"]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.startswith("kvtax annotate: REPORT: is not an AIPerf export")
