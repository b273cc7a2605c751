"""The preview's pure parts, its drawing on synthetic data, its Prometheus client and its CLI,
and the committed pictures in docs/img against the dashboards they claim to show."""

from __future__ import annotations

import copy
import json
import math
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import pytest

from kvtax.cli.main import main
from kvtax.mixin.dashboards import dashboards
from kvtax.mixin.rules import TEST_PROFILE
from kvtax.mixin.rules.configfile import document_of, from_mapping
from kvtax_dev import repo_root
from kvtax_dev.dashboard_lint import panels, queries
from kvtax_dev.preview import (
    TargetData,
    draw,
    fetch,
    first_rows,
    format_value,
    legend_text,
    panel_titles,
    panels_without_data,
    rate_interval,
    record_path,
    record_problems,
)
from kvtax_dev.promapi import AlertmanagerApi, PrometheusApi, QueryError, Series

T0 = 1_800_000_000.0


def test_rate_interval_follows_grafana() -> None:
    assert rate_interval(step=1, scrape_interval=15) == "60s"
    assert rate_interval(step=120, scrape_interval=15) == "135s"


@pytest.mark.parametrize(
    ("fmt", "labels", "text"),
    [
        ("{{model_name}} ({{method}})", {"model_name": "m", "method": "measured"}, "m (measured)"),
        ("{{namespace}}/{{pod}} {{model_name}}", {"model_name": "m"}, "m"),
        (
            "{{namespace}}/{{pod}} {{model_name}}",
            {"namespace": "a", "pod": "b", "model_name": "m"},
            "a/b m",
        ),
        ("__auto", {"__name__": "up", "job": "x"}, 'up{job="x"}'),
        ("recommended", {}, "recommended"),
    ],
)
def test_legend_text(fmt: str, labels: dict[str, str], text: str) -> None:
    assert legend_text(fmt, labels) == text


@pytest.mark.parametrize(
    ("value", "unit", "text"),
    [
        (0.281, "percentunit", "28.1%"),
        (0.25, "s", "250 ms"),
        (7.5, "s", "7.50 s"),
        (2048, "suffix:tok", "2,048 tok"),
        (3, "suffix:seqs", "3 seqs"),
        (0.05, "reqps", "0.05 req/s"),
        (math.nan, "short", "NaN"),
    ],
)
def test_format_value(value: float, unit: str, text: str) -> None:
    assert format_value(value, unit) == text


class _FakeApi:
    """Answers every query with one series; remembers what it was asked."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, str]] = []

    def query(self, expr: str, time: float | None = None) -> list[Series]:
        self.asked.append(("instant", expr))
        return [Series({"model_name": "m", "method": "measured"}, ((T0 + 60, 2.0),))]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[Series]:
        self.asked.append(("range", expr))
        if "bad" in expr:
            raise QueryError("bad_data: parse error")
        points = [(start + i * step, float(i % 7)) for i in range(int((end - start) / step))]
        # A missed scrape: the preview must break the line there, not bridge it.
        del points[20:25]
        return [Series({"model_name": "m", "pod": "p"}, tuple(points))]


def _fetch_all(doc: dict[str, Any], api: _FakeApi) -> dict[int, list[TargetData]]:
    return fetch(
        doc,
        api,  # type: ignore[arg-type]
        start=T0,
        end=T0 + 300,
        step=5,
        rate_interval="20s",
        values={"model_name": "m"},
    )


def test_fetch_runs_every_target_with_variables_filled() -> None:
    doc = dashboards()["kvtax-overview.json"]
    api = _FakeApi()
    data = _fetch_all(doc, api)
    assert len(api.asked) == sum(1 for _ in queries(doc))
    assert all("$" not in expr for _, expr in api.asked)
    assert all('model_name=~"m"' in expr for _, expr in api.asked if "model_name=~" in expr)
    # Stat and bar gauge panels ask for the latest value, time series for a range.
    expected = ["range" if p["type"] == "timeseries" else "instant" for p, _ in queries(doc)]
    assert [kind for kind, _ in api.asked] == expected
    assert set(data) == {p["id"] for p in panels(doc)}


def test_fetch_keeps_prometheus_errors_per_target() -> None:
    doc = json.loads(json.dumps(dashboards()["kvtax-capacity.json"]))
    target = next(t for p, t in queries(doc) if p["type"] == "timeseries")
    target["expr"] = "bad(" + target["expr"]
    data = _fetch_all(doc, _FakeApi())
    errors = [d.error for rows in data.values() for d in rows if d.error]
    assert errors == ["bad_data: parse error"]


@pytest.mark.parametrize("name", ["kvtax-overview.json", "kvtax-capacity.json", "kvtax-fleet.json"])
def test_draw_writes_a_png_of_every_dashboard(name: str, tmp_path: Path) -> None:
    doc = dashboards()[name]
    data = _fetch_all(doc, _FakeApi())
    path = draw(doc, data, tmp_path / "out.png", start=T0, end=T0 + 300)
    body = path.read_bytes()
    assert body.startswith(b"\x89PNG\r\n\x1a\n")
    assert len(body) > 30_000


def test_draw_says_no_data_instead_of_failing(tmp_path: Path) -> None:
    doc = dashboards()["kvtax-fleet.json"]
    empty = {p["id"]: [TargetData("A", "", ())] for p in panels(doc)}
    path = draw(doc, empty, tmp_path / "empty.png", start=T0, end=T0 + 300)
    assert path.exists()
    assert json.loads(record_path(path).read_text())["no_data"] == {
        p["title"]: "" for p in panels(doc)
    }


def test_the_record_names_empty_panels_with_their_reason_and_what_tiles_read(
    tmp_path: Path,
) -> None:
    doc = dashboards()["kvtax-overview.json"]
    data = _fetch_all(doc, _FakeApi())
    gate = [p for p in panels(doc) if p["title"] in ("Gate queue", "Gate answers")]
    attainment = next(p for p in panels(doc) if p["title"] == "SLO attainment")
    nan = Series({"model_name": "m"}, ((T0, math.nan),))
    for p in gate:
        data[p["id"]] = [TargetData("A", "", ())]
    data[attainment["id"]] = [TargetData("A", "{{model_name}}", (nan,))]
    png = draw(doc, data, tmp_path / "o.png", start=T0, end=T0 + 300, rules={"x": 1})
    record = json.loads(record_path(png).read_text())
    # An empty query and a NaN are both a panel without a number; a gate panel says why.
    assert record["no_data"] == {
        "SLO attainment": "",
        "Gate queue": "The gate is off (--gate.mode off)",
        "Gate answers": "The gate is off (--gate.mode off)",
    }
    assert record["rules"] == {"x": 1}
    assert record["stats"]["SLO attainment"] == {}
    assert record["stats"]["Burn rate"], record["stats"]
    assert panels_without_data(doc, data) == record["no_data"]


def test_the_first_rows_are_the_panels_the_eye_meets_first() -> None:
    doc = dashboards()["kvtax-overview.json"]
    assert first_rows(doc, 1) == [
        "SLO attainment",
        "Burn rate",
        "Error budget left",
        "Thrash state",
        "Preemption tax",
        "Waste",
    ]
    second = first_rows(doc, 2)[6:]
    assert second[0] == "Goodput"
    assert "Goodput against engine throughput" not in second


# -- the Prometheus client against a stand-in HTTP server -------------------------------------


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        length = int(self.headers["Content-Length"])
        form = parse_qs(self.rfile.read(length).decode())
        expr = form["query"][0]
        body: dict[str, Any]
        if expr == "broken(":
            status, body = 400, {"status": "error", "errorType": "bad_data", "error": "parse error"}
        elif self.path == "/api/v1/query_range":
            values = [[float(form["start"][0]), "1"], [float(form["end"][0]), "2"]]
            status = 200
            body = {
                "status": "success",
                "data": {
                    "resultType": "matrix",
                    "result": [{"metric": {"a": "b"}, "values": values}],
                },
            }
        else:
            status = 200
            body = {"status": "success", "data": {"resultType": "scalar", "result": [T0, "3"]}}
        raw = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self) -> None:
        # Alerts as Prometheus lists them; Alertmanager's own error shape; a proxy's HTML page.
        if self.path == "/api/v1/alerts":
            self._answer(200, {"status": "success", "data": {"alerts": [{"state": "firing"}]}})
        elif self.path.startswith("/api/v2/alerts"):
            self._answer(400, {"code": 400, "message": "bad matcher: active=maybe"})
        else:
            self._answer(200, None)

    def _answer(self, status: int, body: Any) -> None:
        raw = json.dumps(body).encode() if body is not None else b"<html>not an API</html>"
        self.send_response(status)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass


@pytest.fixture
def stand_in() -> Iterator[str]:
    server = HTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_promapi_reads_matrices_and_scalars(stand_in: str) -> None:
    api = PrometheusApi(stand_in)
    assert api.query_range("x", T0, T0 + 10, 5) == [Series({"a": "b"}, ((T0, 1.0), (T0 + 10, 2.0)))]
    assert api.query("1+2") == [Series({}, ((T0, 3.0),))]


def test_promapi_raises_prometheus_reason(stand_in: str) -> None:
    with pytest.raises(QueryError, match="bad_data: parse error"):
        PrometheusApi(stand_in).query("broken(")


def test_promapi_unreachable_is_a_query_error() -> None:
    with pytest.raises(QueryError, match=r"cannot query http://127\.0\.0\.1:9/api/v1/query"):
        PrometheusApi("http://127.0.0.1:9", timeout=2).query("up")


def test_promapi_errors_name_the_url_and_status(stand_in: str) -> None:
    with pytest.raises(QueryError) as raised:
        PrometheusApi(stand_in).vector("broken(")
    assert str(raised.value) == f"{stand_in}/api/v1/query answered 400: bad_data: parse error"


def test_promapi_reads_alerts(stand_in: str) -> None:
    assert PrometheusApi(stand_in).alerts() == [{"state": "firing"}]


def test_alertmanager_errors_carry_its_message(stand_in: str) -> None:
    with pytest.raises(QueryError, match="answered 400: bad matcher: active=maybe"):
        AlertmanagerApi(stand_in).alerts(active="maybe")


def test_an_answer_that_is_not_json_is_a_query_error(stand_in: str) -> None:
    with pytest.raises(QueryError, match=f"{stand_in}/elsewhere/api/v1/rules answered 200 with no"):
        PrometheusApi(f"{stand_in}/elsewhere").rule_groups()


# -- the CLI --------------------------------------------------------------------------------


def test_preview_cli_draws_every_dashboard(
    stand_in: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        ["dashboards", "preview", "--prometheus", stand_in, "--out", str(tmp_path), "--range", "5m"]
    )
    assert code == 0
    assert sorted(p.name for p in tmp_path.glob("*.png")) == [
        "kvtax-capacity.png",
        "kvtax-fleet.png",
        "kvtax-overview.png",
    ]
    assert capsys.readouterr().out.count("0 query errors") == 3
    # Each picture has its record beside it, and it matches the dashboards just drawn.
    current = {doc["uid"]: doc for doc in dashboards().values()}
    for png in tmp_path.glob("*.png"):
        assert record_problems(png, current) == []
        assert json.loads(record_path(png).read_text())["dashboard"] == png.stem


def test_preview_cli_needs_matplotlib(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # None in sys.modules makes "import matplotlib" raise ImportError, as if not installed.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code = main(
        ["dashboards", "preview", "--prometheus", "http://127.0.0.1:9", "--out", str(tmp_path)]
    )
    assert code == 2
    assert "pip install 'kvtax[preview]'" in capsys.readouterr().err


def test_preview_cli_rejects_a_backwards_range(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        [
            "dashboards",
            "preview",
            "--prometheus",
            "http://127.0.0.1:9",
            "--out",
            str(tmp_path),
            "--from",
            "2026-11-29T19:00:00+00:00",
            "--to",
            "2026-11-29T18:00:00+00:00",
        ]
    )
    assert code == 2
    assert "--from must be before --to" in capsys.readouterr().err


def test_preview_cli_fails_when_queries_fail_but_still_draws(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        [
            "dashboards",
            "preview",
            "--prometheus",
            "http://127.0.0.1:9",
            "--out",
            str(tmp_path),
            "--dashboard",
            "kvtax-fleet",
        ]
    )
    assert code == 1
    assert [p.name for p in tmp_path.glob("*.png")] == ["kvtax-fleet.png"]
    assert "cannot query" in capsys.readouterr().err


# -- the committed pictures -----------------------------------------------------------------

PICTURES = repo_root() / "docs" / "img"
COMMITTED = sorted(PICTURES.glob("*.png"))


def _current() -> dict[str, Any]:
    return {doc["uid"]: doc for doc in dashboards().values()}


def test_the_docs_show_committed_previews() -> None:
    assert "kvtax-overview.png" in [p.name for p in COMMITTED]
    # A record without its picture is left over from a picture that was removed.
    for record in PICTURES.glob("*.panels.json"):
        assert record.with_name(record.name.removesuffix(".panels.json") + ".png").is_file()


def _drawn_with(png: Path) -> dict[str, Any]:
    """The dashboards as built from the rules settings the picture's record names."""
    rules = json.loads(record_path(png).read_text()).get("rules") or {}
    return {doc["uid"]: doc for doc in dashboards(from_mapping(rules)).values()}


@pytest.mark.parametrize("png", COMMITTED, ids=[p.name for p in COMMITTED])
def test_a_committed_preview_shows_the_panels_the_dashboards_have(png: Path) -> None:
    # Fails when a panel is renamed, added, removed or moved, until the picture is redrawn:
    # scripts/demo --with-prometheus --previews-out DIR, then copy DIR/<uid>.png and
    # DIR/<uid>.panels.json into docs/img.
    assert record_problems(png, _drawn_with(png)) == []


def test_the_readmes_overview_is_the_demos_with_its_first_rows_full() -> None:
    """The README's picture was drawn by the demo (from the short rules profile the demo's
    Prometheus loads), and none of the Overview's first two rows is empty in it."""
    png = PICTURES / "kvtax-overview.png"
    assert (
        f"]({png.relative_to(repo_root()).as_posix()})" in (repo_root() / "README.md").read_text()
    )
    record = json.loads(record_path(png).read_text())
    assert record["rules"] == document_of(TEST_PROFILE)
    overview = _drawn_with(png)["kvtax-overview"]
    assert not set(first_rows(overview, 2)) & set(record["no_data"]), record["no_data"]


@pytest.fixture
def drawn(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    doc = _current()["kvtax-fleet"]
    return draw(doc, {}, tmp_path / "kvtax-fleet.png", start=T0, end=T0 + 300), doc


def test_the_record_lists_every_panel_drawn(drawn: tuple[Path, dict[str, Any]]) -> None:
    png, doc = drawn
    record = json.loads(record_path(png).read_text())
    assert record["dashboard"] == "kvtax-fleet"
    assert record["panels"] == [p["title"] for p in doc["panels"]]
    assert record_problems(png, {"kvtax-fleet": doc}) == []


def test_a_renamed_panel_makes_the_picture_stale(drawn: tuple[Path, dict[str, Any]]) -> None:
    png, doc = drawn
    now = copy.deepcopy(doc)
    old = now["panels"][1]["title"]
    now["panels"][1]["title"] = "Renamed"
    assert record_problems(png, {"kvtax-fleet": now}) == [
        f"kvtax-fleet.png shows panels the dashboard no longer has: [{old!r}]",
        "kvtax-fleet.png lacks panels the dashboard has: ['Renamed']",
    ]


def test_an_added_or_removed_panel_makes_the_picture_stale(
    drawn: tuple[Path, dict[str, Any]],
) -> None:
    png, doc = drawn
    added = copy.deepcopy(doc)
    added["panels"].append({**doc["panels"][1], "title": "New panel"})
    assert record_problems(png, {"kvtax-fleet": added}) == [
        "kvtax-fleet.png lacks panels the dashboard has: ['New panel']"
    ]
    removed = copy.deepcopy(doc)
    gone = removed["panels"].pop()["title"]
    assert record_problems(png, {"kvtax-fleet": removed}) == [
        f"kvtax-fleet.png shows panels the dashboard no longer has: [{gone!r}]"
    ]
    moved = copy.deepcopy(doc)
    moved["panels"][1], moved["panels"][2] = moved["panels"][2], moved["panels"][1]
    assert panel_titles(moved) != panel_titles(doc)
    assert record_problems(png, {"kvtax-fleet": moved}) == [
        "kvtax-fleet.png shows the panels in another order or number than now"
    ]


def test_a_picture_without_its_record_or_replaced_is_stale(
    drawn: tuple[Path, dict[str, Any]],
) -> None:
    png, doc = drawn
    assert record_problems(png, {}) == [
        "kvtax-fleet.png shows dashboard 'kvtax-fleet', which no longer exists"
    ]
    png.write_bytes(png.read_bytes() + b"\0")
    assert record_problems(png, {"kvtax-fleet": doc}) == [
        "kvtax-fleet.png is not the PNG kvtax-fleet.panels.json was written for"
    ]
    record_path(png).unlink()
    assert record_problems(png, {"kvtax-fleet": doc}) == [
        "kvtax-fleet.png: no kvtax-fleet.panels.json beside it; redraw it with kvtax dashboards "
        "preview"
    ]
