"""``kvtax annotate`` on hostile files: one line naming the file or field, exit 2, no traceback.

A report nested deeper than Python's parser goes raised RecursionError; a ``.json.gz`` that
inflates to gigabytes was decompressed whole and ended in MemoryError. The report is now read
in a stream up to ``MAX_REPORT_BYTES`` (1 GiB; patched small here, no gigabytes are written),
and the recording line by line with a bound.
"""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path
from typing import Any

import pytest

from kvtax import cli
from kvtax.cli import annotate as annotate_cli
from kvtax.errors import InputError
from kvtax.tools.loadtest import sources
from kvtax.tools.loadtest.guidellm import read_guidellm
from kvtax.tools.loadtest.sources import read_recording
from tests.unit.test_annotate import _bench, _files

DEEP = "[" * 100_000 + "]" * 100_000


def annotate(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert cli.main(["annotate", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1, captured.err
    assert len(captured.err) < 400
    return captured.err


@pytest.mark.parametrize("name", ["deep.json", "deep.json.gz"])
def test_a_deeply_nested_report_is_one_line_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    _, rec = _files(tmp_path)
    report = tmp_path / name
    data = DEEP.encode()
    report.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    err = annotate([str(report), "--recording", str(rec)], capsys)
    assert err == f"kvtax annotate: REPORT: {report} is JSON nested too deeply to read\n"


def test_the_limit_is_one_gib_of_json() -> None:
    assert annotate_cli.MAX_REPORT_BYTES == 2**30


def test_a_gzip_bomb_is_refused_at_the_limit_without_inflating_it_whole(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, rec = _files(tmp_path)
    monkeypatch.setattr(annotate_cli, "MAX_REPORT_BYTES", 2**20)
    reads: list[int] = []
    real_read = gzip.GzipFile.read

    def read(self: gzip.GzipFile, size: int = -1) -> bytes:
        reads.append(size)
        return real_read(self, size)

    monkeypatch.setattr(gzip.GzipFile, "read", read)
    bomb = tmp_path / "bomb.json.gz"
    # 64 MiB of JSON (whitespace, then an object): valid, and 64 times the patched limit.
    with gzip.open(bomb, "wb") as f:
        for _ in range(64):
            f.write(b" " * 2**20)
        f.write(b"{}")
    err = annotate([str(bomb), "--recording", str(rec)], capsys)
    assert err == (
        f"kvtax annotate: REPORT: {bomb} holds more than 1 MiB of JSON once decompressed, "
        "kvtax annotate's limit\n"
    )
    assert reads == [2**20 + 1]  # one bounded read: never the whole 64 MiB


def test_a_plain_report_over_the_limit_is_refused_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    rpath, rec = _files(tmp_path)
    monkeypatch.setattr(annotate_cli, "MAX_REPORT_BYTES", 1024)
    rpath.write_text(rpath.read_text() + " " * 2048)
    err = annotate([str(rpath), "--recording", str(rec)], capsys)
    assert err.startswith(f"kvtax annotate: REPORT: {rpath} holds more than 1 KiB of JSON,")


def test_a_report_at_the_limit_is_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    rpath, rec = _files(tmp_path)
    gz = tmp_path / "run.json.gz"
    gz.write_bytes(gzip.compress(rpath.read_bytes()))
    monkeypatch.setattr(annotate_cli, "MAX_REPORT_BYTES", len(rpath.read_bytes()))
    assert cli.main(["annotate", str(gz), "--recording", str(rec)]) == 0
    assert json.loads((tmp_path / "run-kvtax.json").read_text())["kvtax"]["model"] == "m"


def test_corrupt_gzip_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, rec = _files(tmp_path)
    report = tmp_path / "bad.json.gz"
    good = gzip.compress(b'{"benchmarks": []}' * 100)
    report.write_bytes(good[:20] + b"\xff" * 40 + good[60:])
    err = annotate([str(report), "--recording", str(rec)], capsys)
    assert err.startswith(f"kvtax annotate: REPORT: cannot read {report}: ")


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("start_time", math.nan, "benchmarks[0].start_time: missing or not a finite number"),
        ("end_time", math.inf, "benchmarks[0].end_time: missing or not a finite number"),
        ("start_time", 10**400, "benchmarks[0].start_time: missing or not a finite number"),
        ("config", 5, "benchmarks[0].config: is not an object"),
    ],
)
def test_non_finite_report_numbers_name_the_field(field: str, value: Any, named: str) -> None:
    bench = {**_bench(10.0, 20.0, 1), field: value}
    with pytest.raises(InputError) as caught:
        read_guidellm({"benchmarks": [bench]})
    assert str(caught.value).startswith(f"REPORT {named}")
    assert len(str(caught.value)) < 200


def test_huge_or_nan_strategy_and_metrics_are_no_measurement() -> None:
    bench = _bench(10.0, 20.0, 1)
    bench["config"]["strategy"] = {"type_": "constant", "rate": 10**400, "streams": math.nan}
    bench["metrics"]["requests_per_second"] = {"successful": {"mean": 10**400}}
    bench["metrics"]["output_tokens_per_second"] = {"successful": {"mean": math.inf}}
    (step,) = read_guidellm({"benchmarks": [bench]})
    assert (step.rate, step.concurrency, step.label) == (None, None, "constant")
    assert (step.requests_per_s, step.output_tokens_per_s) == (None, None)


@pytest.mark.parametrize(
    ("content", "named"),
    [
        ('{"t": 1, "page": ""}\n' + DEEP + "\n", "--recording line 2: JSON nested too deeply"),
        ('{"t": 1e400, "page": ""}\n', "--recording line 1: t is not a finite time (inf)"),
        ('{"t": NaN, "page": ""}\n', "--recording line 1: t is not a finite time (nan)"),
        ('{"t": 1' + "0" * 400 + ', "page": ""}\n', '--recording line 1: not a {"t", "page"}'),
        ('{"t": 1, "page": 5}\n', "--recording line 1: page is not text"),
    ],
)
def test_hostile_recording_lines_are_named(tmp_path: Path, content: str, named: str) -> None:
    rec = tmp_path / "r.jsonl"
    rec.write_text(content)
    with pytest.raises(InputError) as caught:
        read_recording(rec)
    assert str(caught.value).startswith(named)


def test_a_recording_line_past_the_bound_is_refused_unread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sources, "MAX_LINE_CHARS", 2**20)
    rec = tmp_path / "r.jsonl.gz"
    with gzip.open(rec, "wt") as f:
        f.write('{"t": 1, "page": ""}\n')
        f.write('{"t": 2, "page": "' + "x" * (3 * 2**20) + '"}\n')
    with pytest.raises(InputError, match=r"^--recording line 2: longer than 1 Mi characters"):
        read_recording(rec)


def test_a_binary_recording_is_named(tmp_path: Path) -> None:
    rec = tmp_path / "r.jsonl"
    rec.write_bytes(b'{"t": 1, "page": ""}\n\xff\xfe\n')
    with pytest.raises(InputError, match=r"^--recording: .*r\.jsonl is not UTF-8 text"):
        read_recording(rec)
