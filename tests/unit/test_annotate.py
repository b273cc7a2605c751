"""``kvtax annotate`` on synthetic reports: the reader, the spans, the errors, Prometheus."""

from __future__ import annotations

import asyncio
import gzip
import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvtax import cli
from kvtax.errors import InputError
from kvtax.tools.loadtest.guidellm import read_guidellm
from kvtax.tools.loadtest.sources import prometheus_scrapes, read_recording
from kvtax.tools.loadtest.timeline import Scrape, Timeline, keep_known

LAB = '{engine="0",model_name="m"}'


def _page(preemptions: float, generated: float, usage: float) -> str:
    return (
        "# TYPE vllm:num_preemptions_total counter\n"
        f"vllm:num_preemptions_total{LAB} {preemptions}\n"
        "# TYPE vllm:generation_tokens_total counter\n"
        f"vllm:generation_tokens_total{LAB} {generated}\n"
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f"vllm:kv_cache_usage_perc{LAB} {usage}\n"
        "# TYPE python_gc_objects_collected_total counter\n"
        'python_gc_objects_collected_total{generation="0"} 5.0\n'
    )


def _bench(start: float, end: float, streams: int) -> dict[str, Any]:
    summary = {"successful": {"mean": 10.0 * streams, "median": 20.0, "percentiles": {"p99": 40.0}}}
    return {
        "start_time": start,
        "end_time": end,
        "config": {"strategy": {"type_": "concurrent", "streams": streams}},
        "metrics": {
            "output_tokens_per_second": summary,
            "requests_per_second": summary,
            "time_to_first_token_ms": summary,
            "inter_token_latency_ms": summary,
        },
    }


# Preemptions: none during the first benchmark (t 10-20), 4 in the second (30-40), 6 in the
# third (50-60). Scrapes every 5 s from t=0 to t=70.
PREEMPTIONS = {
    0: 0,
    5: 0,
    10: 0,
    15: 0,
    20: 0,
    25: 0,
    30: 0,
    35: 1,
    40: 4,
    45: 4,
    50: 4,
    55: 8,
    60: 10,
    65: 10,
    70: 10,
}


def _files(tmp_path: Path) -> tuple[Path, Path]:
    report = {
        "metadata": {"version": 2},
        "benchmarks": [_bench(10.0, 20.0, 1), _bench(30.0, 40.0, 2), _bench(50.0, 60.0, 4)],
    }
    rpath = tmp_path / "run.json"
    rpath.write_text(json.dumps(report))
    rec = tmp_path / "rec.jsonl.gz"
    with gzip.open(rec, "wt") as f:
        for t, p in PREEMPTIONS.items():
            f.write(json.dumps({"t": t, "page": keep_known(_page(p, 100.0 * t, t / 100))}) + "\n")
    return rpath, rec


def test_annotate_adds_each_steps_engine_figures(tmp_path: Path) -> None:
    rpath, rec = _files(tmp_path)
    assert cli.main(["annotate", str(rpath), "--recording", str(rec)]) == 0
    out = json.loads((tmp_path / "run-kvtax.json").read_text())
    added = [b["kvtax"] for b in out["benchmarks"]]
    assert [a["preemptions"] for a in added] == [0, 4, 6]
    assert [a["generation_tokens"] for a in added] == [1000, 1000, 1000]
    assert [a["label"] for a in added] == ["concurrent@1", "concurrent@2", "concurrent@4"]
    assert added[2]["kv_usage_max"] == 0.6
    assert out["kvtax"]["knees"]["preemption"] == {"step": 1, "level": 2, "confirmed": True}
    # The tool's own fields are all still there.
    assert out["metadata"] == {"version": 2}
    assert out["benchmarks"][0]["start_time"] == 10.0
    page = (tmp_path / "run-kvtax.md").read_text()
    assert "preemption knee: step 1, concurrency 2" in page


def test_keep_known_drops_what_no_concept_reads() -> None:
    kept = keep_known(_page(1, 2, 0.5))
    assert "python_gc" not in kept
    assert "vllm:num_preemptions_total" in kept


@pytest.mark.parametrize(
    ("report", "field"),
    [
        ([], "REPORT: is not a JSON object"),
        ({"benchmarks": []}, "REPORT benchmarks: missing or empty"),
        ({"benchmarks": [{"end_time": 2}]}, "REPORT benchmarks[0].start_time: missing"),
        ({"benchmarks": [{"start_time": 5, "end_time": 2}]}, "REPORT benchmarks[0].end_time:"),
        (
            {"benchmarks": [{"start_time": 1, "end_time": 2, "config": {}}]},
            "REPORT benchmarks[0].metrics: missing",
        ),
    ],
)
def test_a_malformed_report_names_the_field(report: Any, field: str) -> None:
    with pytest.raises(InputError) as err:
        read_guidellm(report)
    assert str(err.value).startswith(field)


def test_cli_errors_are_one_line_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rpath, rec = _files(tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    cases = [
        (["annotate", str(bad), "--recording", str(rec)], "kvtax annotate: REPORT: "),
        (["annotate", str(rpath)], "kvtax annotate: --recording: give exactly one"),
        (
            ["annotate", str(rpath), "--recording", str(tmp_path / "none")],
            "kvtax annotate: --recording: ",
        ),
        (
            ["annotate", str(rpath), "--recording", str(rec), "--model", "x"],
            "kvtax annotate: --model: ",
        ),
        (["annotate", "--record", str(tmp_path / "r.jsonl")], "kvtax annotate: --metrics-url: "),
        (
            [
                "annotate",
                "--record",
                str(tmp_path / "r.jsonl"),
                "--metrics-url",
                "http://127.0.0.1:9/metrics",
                "--duration",
                "1",
            ],
            "kvtax annotate: --metrics-url: cannot reach",
        ),
    ]
    for argv, start in cases:
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith(start), (argv, err)


def test_a_step_the_recording_does_not_cover_is_too_short_to_measure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rpath, _ = _files(tmp_path)
    rec = tmp_path / "short.jsonl"
    rec.write_text("".join(json.dumps({"t": t, "page": _page(0, t, 0)}) + "\n" for t in (0, 15)))
    assert cli.main(["annotate", str(rpath), "--recording", str(rec)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvtax annotate: REPORT benchmarks[0]: step concurrent@1")
    assert "too short to measure" in err


def test_a_malformed_recording_line_is_named(tmp_path: Path) -> None:
    rec = tmp_path / "r.jsonl"
    rec.write_text('{"t": 1, "page": ""}\n{"x": 2}\n')
    with pytest.raises(InputError, match=r"^--recording line 2: "):
        read_recording(rec)
    with pytest.raises(InputError, match=r"^--recording: holds 1 scrape"):
        Timeline([Scrape(0.0, _page(0, 0, 0))], field="--recording")


async def test_prometheus_range_queries_become_scrapes() -> None:
    seen: dict[str, str] = {}

    async def query_range(request: web.Request) -> web.Response:
        seen.update(request.query)
        metric = {"__name__": "vllm:num_preemptions_total", "engine": "0", "model_name": "m"}
        other = {"__name__": "vllm:unknown_thing", "model_name": "m"}
        return web.json_response(
            {
                "status": "success",
                "data": {
                    "resultType": "matrix",
                    "result": [
                        {"metric": metric, "values": [[10, "0"], [11, "3"], [12, "5"]]},
                        {"metric": other, "values": [[10, "1"]]},
                    ],
                },
            }
        )

    app = web.Application()
    app.router.add_get("/api/v1/query_range", query_range)
    server = TestServer(app)
    await server.start_server()
    try:
        scrapes = await prometheus_scrapes(str(server.make_url("")), 5.0, 15.0, 1.0)
    finally:
        await server.close()
    assert seen["step"] == "1"
    assert [s.t for s in scrapes] == [10, 11, 12]
    timeline = Timeline(scrapes, field="--prometheus")
    points = timeline.span("m", 10.0, 12.0)
    assert points[-1].counters["preemptions"] - points[0].counters["preemptions"] == 5


async def test_an_unreachable_prometheus_is_named() -> None:
    with pytest.raises(InputError, match=r"^--prometheus: cannot query"):
        await prometheus_scrapes("http://127.0.0.1:9", 0.0, 1.0, 1.0)


async def test_the_recorder_stops_cleanly_on_sigint_even_when_started_ignoring_it(
    tmp_path: Path,
) -> None:
    import os
    import signal
    import subprocess
    import sys

    from kvtax_dev import dev_env
    from tests.unit.loadtest_fake import PreemptingServer

    server = TestServer(PreemptingServer().app())
    await server.start_server()
    out = tmp_path / "rec.jsonl.gz"
    cmd = [
        sys.executable,
        "-m",
        "kvtax.cli.main",
        "annotate",
        "--record",
        str(out),
        "--metrics-url",
        str(server.make_url("/metrics")),
        "--interval",
        "0.1",
    ]

    def ignore_sigint() -> None:  # what a shell does to a command it starts in the background
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    log = tmp_path / "recorder.log"
    with log.open("w") as err:
        # preexec_fn runs in the child before exec; this test starts no thread of its own.
        child = subprocess.Popen(
            cmd,
            env=dev_env(os.environ),
            preexec_fn=ignore_sigint,  # noqa: PLW1509
            stderr=err,
        )
    try:
        for _ in range(200):
            await asyncio.sleep(0.1)
            if out.exists() and out.stat().st_size > 200:
                break
        await asyncio.sleep(0.5)
        child.send_signal(signal.SIGINT)
        for _ in range(100):
            if child.poll() is not None:
                break
            await asyncio.sleep(0.1)
    finally:
        if child.poll() is None:
            child.kill()
        await server.close()
    assert child.wait(timeout=5) == 0, log.read_text()
    scrapes = read_recording(out)  # a complete gzip stream: it was closed, not cut off
    assert len(scrapes) >= 2
    assert "vllm:num_preemptions_total" in scrapes[0].page
