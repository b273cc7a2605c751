"""The committed Grafana dashboards: schema, structure, names, drift and the ConfigMap."""

from __future__ import annotations

import copy
import json
import re
import tempfile
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from kvtax.cli.main import main
from kvtax.engine.vocabulary import CONCEPTS
from kvtax.expose.catalog import METRICS
from kvtax.mixin.dashboards import BOARDS, artifacts, dashboards
from kvtax.mixin.dashboards.generate import CONFIGMAP_FILE
from kvtax.mixin.dashboards.queries import expand, kvtax, vllm
from kvtax.mixin.rules import TEST_PROFILE
from kvtax.mixin.rules.alerts import alert_rules
from kvtax.mixin.rules.configfile import document_of, read
from kvtax.mixin.rules.recording import record_names
from kvtax_dev.dashboard_lint import panels, problems, queries
from kvtax_dev.dashboard_schema import SCHEMA
from kvtax_dev.promql import known_series, series_names

ROOT = Path(__file__).resolve().parents[2]
FOLDER = ROOT / "dashboards"
JSON_FILES = sorted(FOLDER.glob("kvtax-*.json"))


def _load(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


@pytest.fixture(params=[p.name for p in JSON_FILES])
def committed(request: pytest.FixtureRequest) -> dict[str, Any]:
    return _load(FOLDER / request.param)


def test_three_dashboards_are_committed() -> None:
    assert [p.name for p in JSON_FILES] == [
        "kvtax-capacity.json",
        "kvtax-fleet.json",
        "kvtax-overview.json",
    ]
    assert [b.title for b in BOARDS] == ["Overview", "Capacity", "Fleet"]


# -- schema and structure -------------------------------------------------------------------


def test_schema_is_a_valid_draft_2020_12_schema() -> None:
    jsonschema.Draft202012Validator.check_schema(SCHEMA)


def test_committed_dashboards_match_the_schema(committed: dict[str, Any]) -> None:
    jsonschema.Draft202012Validator(SCHEMA).validate(committed)


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("panels", 1, "datasource"), {"type": "prometheus", "uid": "P1809F7CD0C75ACF3"}),
        (("panels", 1, "fieldConfig", "defaults", "unit"), ""),
        (("panels", 1, "gridPos", "w"), 25),
        (("panels", 1, "type"), "graph"),
        (("uid",), "Not A Stable Uid"),
        (("tags",), ["vllm"]),
    ],
)
def test_schema_rejects_what_kvtax_must_not_ship(path: tuple[Any, ...], value: Any) -> None:
    doc = copy.deepcopy(dashboards()["kvtax-overview.json"])
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(SCHEMA).validate(doc)


def test_committed_dashboards_have_no_structural_problems(committed: dict[str, Any]) -> None:
    assert problems(committed) == []


def test_uids_are_stable_and_tagged() -> None:
    docs = dashboards()
    assert {d["uid"] for d in docs.values()} == {"kvtax-overview", "kvtax-capacity", "kvtax-fleet"}
    assert all("kvtax" in d["tags"] for d in docs.values())


def test_every_dashboard_offers_datasource_namespace_pod_and_model_name(
    committed: dict[str, Any],
) -> None:
    variables = {v["name"]: v for v in committed["templating"]["list"]}
    # model_name, as vLLM's own dashboards call it, so the link below carries the choice.
    assert list(variables) == ["datasource", "namespace", "pod", "model_name"]
    assert variables["datasource"]["type"] == "datasource"
    for name in ("namespace", "pod", "model_name"):
        # ".*" for All also matches a missing label (a static scrape has no namespace or pod).
        assert variables[name]["allValue"] == ".*"
        assert variables[name]["definition"].startswith("label_values(kvtax_")


def test_every_panel_and_target_uses_the_datasource_variable(committed: dict[str, Any]) -> None:
    text = json.dumps(committed)
    assert '"uid": "${datasource}"' in text
    for panel, target in queries(committed):
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}


_KVTAX_SELECTOR = re.compile(r"\b(kvtax_[a-z_]+?)(?:_bucket|_sum|_count)?\{([^{}]*)\}")


def test_a_kvtax_series_without_model_name_ignores_the_model_variable(
    committed: dict[str, Any],
) -> None:
    # A chosen model's regex never matches an absent label: such a panel would go empty
    # whenever one model is picked (the gate's series are one per pod, not per model).
    checked = 0
    for panel, target in queries(committed):
        for name, matchers in _KVTAX_SELECTOR.findall(target["expr"]):
            spec = METRICS.get(name) or METRICS.get(name + "_total")
            if spec is None:
                continue
            checked += 1
            takes_model = 'model_name=~"$model_name"' in matchers
            assert takes_model == ("model_name" in spec.labels), (panel["title"], name)
    assert checked


def test_every_rate_uses_rate_interval(committed: dict[str, Any]) -> None:
    exprs = [t["expr"] for _, t in queries(committed)]
    rates = [e for e in exprs if "rate(" in e or "increase(" in e]
    assert rates or committed["uid"] != "kvtax-overview"
    for expr in rates:
        assert expr.count("rate(") == expr.count("[$__rate_interval]"), expr


def test_every_panel_has_a_unit_and_a_runbook_link(committed: dict[str, Any]) -> None:
    for panel in panels(committed):
        assert panel["fieldConfig"]["defaults"]["unit"], panel["title"]
        assert "docs/runbooks.md#kvtax" in panel["description"], panel["title"]


def test_every_linked_runbook_section_exists() -> None:
    headings = {
        line.removeprefix("## ").strip().lower()
        for line in (ROOT / "docs" / "runbooks.md").read_text().splitlines()
        if line.startswith("## ")
    }
    linked = {
        re.search(r"runbooks\.md#([\w-]+)", p["description"]).group(1)  # type: ignore[union-attr]
        for d in dashboards().values()
        for p in panels(d)
    }
    assert linked
    assert linked <= headings, linked - headings


def test_thrash_state_is_a_coloured_stat() -> None:
    overview = dashboards()["kvtax-overview.json"]
    thrash = next(p for p in panels(overview) if p["title"] == "Thrash state")
    assert thrash["type"] == "stat"
    options = thrash["fieldConfig"]["defaults"]["mappings"][0]["options"]
    assert {k: (v["text"], v["color"]) for k, v in options.items()} == {
        "0": ("ok", "green"),
        "1": ("at risk", "orange"),
        "2": ("thrashing", "red"),
    }


def test_kv_usage_panel_draws_the_085_line() -> None:
    overview = dashboards()["kvtax-overview.json"]
    kv = next(p for p in panels(overview) if p["title"] == "KV cache usage")
    steps = kv["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert {"color": "orange", "value": 0.85} in steps
    assert kv["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"] == "line"


def test_overview_answers_the_issue_questions() -> None:
    titles = {p["title"] for p in panels(dashboards()["kvtax-overview.json"])}
    for wanted in (
        "Thrash state",
        "Preemption tax",
        "Goodput against engine throughput",
        "KV cache usage",
        "Preemption rate",
        "Running and waiting requests",
        "Time to first token",
        "Inter-token latency",
        "Stream stalls",
        "Recommended against configured max_num_seqs",
        "Rejected requests",
        "Join coverage",
    ):
        assert wanted in titles


# -- one tax, one headline per number, nothing for a feature that does not exist ---------------

TAX_GAUGE = "kvtax_preemption_tax_ratio"
TAX_RECORDS = {n for n in record_names() if ":kvtax_preemption_tax:" in n}
RECOMPUTE_COUNTERS = {n for n in METRICS if n.startswith("kvtax_recomputed_tokens_")}
METHODS = ("measured", "estimated", "stall_estimated")
# The window gauges 0.2 keeps; each must have a reader (a panel or an alert).
KEPT_WINDOW_GAUGES = (
    "kvtax_preemption_tax_ratio",
    "kvtax_waste_ratio",
    "kvtax_goodput_tokens_per_second",
    "kvtax_slo_goodput_tokens_per_second",
    "kvtax_join_coverage_ratio",
)


def _names(panel: dict[str, Any]) -> set[str]:
    return {n for t in panel["targets"] for n in series_names(t["expr"])}


def _glance() -> list[dict[str, Any]]:
    """The Overview's first row: the panels under its first row header, before the next."""
    board = dashboards()["kvtax-overview.json"]["panels"]
    headers = [i for i, p in enumerate(board) if p["type"] == "row"]
    assert board[headers[0]]["title"] == "At a glance"
    glance: list[dict[str, Any]] = board[headers[0] + 1 : headers[1]]
    return glance


def test_at_a_glance_shows_one_tax_figure_from_the_exporter_gauge_naming_its_method() -> None:
    taxes = [p for p in _glance() if _names(p) & ({TAX_GAUGE} | TAX_RECORDS | RECOMPUTE_COUNTERS)]
    assert [p["title"] for p in taxes] == ["Preemption tax"]
    (tax,) = taxes
    assert tax["type"] == "stat"
    assert len(tax["targets"]) == 1
    assert _names(tax) == {TAX_GAUGE}
    assert "{{method}}" in tax["targets"][0]["legendFormat"]


def test_at_a_glance_reads_each_headline_from_its_own_gauge() -> None:
    read = {p["title"]: _names(p) for p in _glance()}
    assert read["Preemption tax"] == {"kvtax_preemption_tax_ratio"}
    assert read["Waste"] == {"kvtax_waste_ratio"}
    assert read["Goodput"] == {"kvtax_goodput_tokens_per_second"}
    assert read["SLO goodput"] == {"kvtax_slo_goodput_tokens_per_second"}


def test_every_kept_window_gauge_has_a_reader() -> None:
    read = {n for d in dashboards().values() for p in panels(d) for n in _names(p)}
    read |= {n for r in alert_rules() for n in series_names(r.expr)}
    assert [g for g in KEPT_WINDOW_GAUGES if g not in read] == []


def test_tax_by_method_computes_each_method_from_its_counter_and_says_why_they_differ() -> None:
    overview = dashboards()["kvtax-overview.json"]
    detail = next(p for p in panels(overview) if p["title"] == "Tax by method")
    assert detail["gridPos"]["y"] > _glance()[0]["gridPos"]["y"]
    measured = "kvtax_recomputed_tokens_measured_total"
    per_target = [series_names(t["expr"]) & RECOMPUTE_COUNTERS for t in detail["targets"]]
    # Each method from its own counter; an estimate also reads the measured one, to hide itself
    # wherever a model has a measurement.
    assert per_target == [{f"kvtax_recomputed_tokens_{m}_total", measured} for m in METHODS]
    for target, method in zip(detail["targets"], METHODS, strict=True):
        hidden = target["expr"].endswith(
            f"unless on (model_name) sum by (model_name) (rate({measured}"
            '{namespace=~"$namespace", pod=~"$pod", model_name=~"$model_name"}'
            "[$__rate_interval]))"
        )
        assert hidden == (method != "measured"), target["expr"]
    legends = [t["legendFormat"] for t in detail["targets"]]
    assert legends[METHODS.index("estimated")].startswith("estimated, an upper bound")
    for target in detail["targets"]:
        # The one formula: R / (Pc + G + R), the same R twice.
        assert series_names(target["expr"]) - RECOMPUTE_COUNTERS == {
            "kvtax_engine_prompt_computed_tokens_total",
            "kvtax_engine_generation_tokens_total",
        }
    text = detail["description"]
    assert all(m in text for m in METHODS)
    assert "upper bound" in text
    assert "plugin" in text
    assert "stalls" in text


def test_the_estimate_over_time_is_labelled_an_upper_bound() -> None:
    overview = dashboards()["kvtax-overview.json"]
    panel = next(p for p in panels(overview) if p["title"] == "Preemption tax and waste")
    for target in panel["targets"]:
        assert target["expr"].startswith("label_replace(")
        assert '"method", "estimated, an upper bound", "method", "estimated")' in target["expr"]


def test_the_recompute_avoided_row_draws_every_source_of_a_resumed_requests_kv() -> None:
    overview = dashboards()["kvtax-overview.json"]
    titles = [p["title"] for p in overview["panels"]]
    row = titles.index("Recompute avoided")
    assert titles.index("What it costs") < row < titles.index("KV pressure")
    streams, share, beside = overview["panels"][row + 1 : row + 4]
    assert streams["title"] == "Resumed requests' tokens by source"
    sources = [t["expr"] for t in streams["targets"]]
    assert "kvtax_recomputed_tokens_measured_total" in sources[0]
    assert 'source="prefix_cache"' in sources[1]
    assert 'source="kv_connector"' in sources[2]
    # Stacked: the top of the stack is the context the resumes needed.
    assert all(o["properties"] for o in streams["fieldConfig"]["overrides"])
    assert share["title"] == "Recompute avoided by offload"
    assert 'source="kv_connector"' in share["targets"][0]["expr"]
    assert share["fieldConfig"]["defaults"]["unit"] == "percentunit"
    tax, without = (t["expr"] for t in beside["targets"])
    assert 'source="kv_connector"' not in tax
    assert 'source="kv_connector"' in without
    assert "kvtax_engine_generation_tokens_total" in without


def test_every_tax_panel_says_which_tax_it_reads_and_links_the_one_definition() -> None:
    for doc in dashboards().values():
        for panel in panels(doc):
            names = _names(panel)
            if not names & ({TAX_GAUGE} | TAX_RECORDS):
                continue
            assert "tax.md#the-one-definition" in panel["description"], panel["title"]
            said = "--window" in panel["description"] or "5-minute" in panel["description"]
            assert said, panel["title"]


def test_fleet_and_overview_say_why_their_tax_figures_agree() -> None:
    overview = next(
        p for p in panels(dashboards()["kvtax-overview.json"]) if p["title"] == "Preemption tax"
    )
    fleet = next(
        p
        for p in panels(dashboards()["kvtax-fleet.json"])
        if p["title"] == "Fleet preemption tax and waste"
    )
    for panel in (overview, fleet):
        assert "same formula" in panel["description"], panel["title"]
        assert "window" in panel["description"], panel["title"]
        assert "alignment" in panel["description"], panel["title"]


def test_only_the_gate_panels_speak_of_the_admission_gate_and_its_429s() -> None:
    gate_panels = 0
    for doc in dashboards().values():
        for panel in panels(doc):
            for target in panel["targets"]:
                assert 'outcome="rejected"' not in target["expr"], panel["title"]
            if all("kvtax_gate_" in t["expr"] for t in panel["targets"]):
                gate_panels += 1  # the gate's own row: its 429s are real series
                continue
            words = [panel["title"], panel["description"]]
            words += [t["legendFormat"] for t in panel["targets"]]
            for text in words:
                assert "429" not in text, panel["title"]
                assert "admission gate" not in text.lower(), panel["title"]
    assert gate_panels == 3


def test_rejected_requests_are_vllm_rejections_its_4xx_and_kvtax_413() -> None:
    overview = dashboards()["kvtax-overview.json"]
    panel = next(p for p in panels(overview) if p["title"] == "Rejected requests")
    exprs = [t["expr"] for t in panel["targets"]]
    assert "vllm:admission_rejections_total" in series_names(exprs[0])
    assert 'outcome="upstream_4xx"' in exprs[1]
    assert 'outcome="too_large"' in exprs[2]


# -- negative structural checks: each rule catches its own mistake ----------------------------


def _overview() -> dict[str, Any]:
    return copy.deepcopy(dashboards()["kvtax-overview.json"])


def test_duplicate_panel_ids_are_caught() -> None:
    doc = _overview()
    doc["panels"][2]["id"] = doc["panels"][1]["id"]
    assert any("used more than once" in p for p in problems(doc))


def test_overlapping_panels_are_caught() -> None:
    doc = _overview()
    doc["panels"][2]["gridPos"] = dict(
        doc["panels"][1]["gridPos"], x=doc["panels"][1]["gridPos"]["x"] + 1
    )
    assert any("overlap" in p for p in problems(doc))


def test_a_hard_coded_datasource_uid_is_caught() -> None:
    doc = _overview()
    doc["panels"][1]["targets"][0]["datasource"] = {"type": "prometheus", "uid": "abc123"}
    found = problems(doc)
    assert any("hard-coded data source at panels[1].targets[0].datasource" in p for p in found)
    assert any("does not use the datasource variable" in p for p in found)


def test_a_fixed_rate_window_is_caught() -> None:
    doc = _overview()
    panel = next(p for p in panels(doc) if p["title"] == "Preemption rate")
    panel["targets"][0]["expr"] = panel["targets"][0]["expr"].replace("$__rate_interval", "5m")
    assert any("range [5m]" in p for p in problems(doc))


def test_a_panel_without_unit_or_runbook_is_caught() -> None:
    doc = _overview()
    doc["panels"][1]["fieldConfig"]["defaults"]["unit"] = ""
    doc["panels"][1]["description"] = "No link here."
    found = problems(doc)
    assert any("has no unit" in p for p in found)
    assert any("has no description linking a runbook" in p for p in found)


def test_a_runbook_anchor_without_an_alert_is_caught() -> None:
    doc = _overview()
    doc["panels"][1]["description"] += " See docs/runbooks.md#kvtaxnosuchalert."
    assert any("unknown runbook #kvtaxnosuchalert" in p for p in problems(doc))


# -- every series a panel names exists --------------------------------------------------------


def test_every_series_in_a_panel_is_catalog_vocabulary_or_recorded(
    committed: dict[str, Any],
) -> None:
    known = known_series()
    for _, target in queries(committed):
        names = series_names(target["expr"])
        assert names, target["expr"]
        assert names <= known, (names - known, target["expr"])


def test_the_dashboards_use_all_three_sources_of_names() -> None:
    seen = {
        n for d in dashboards().values() for _, t in queries(d) for n in series_names(t["expr"])
    }
    assert seen & set(METRICS)
    assert seen & {n + "_bucket" for c in CONCEPTS.values() for n in c.names}
    assert seen & set(record_names())


def test_a_misspelled_series_fails_the_name_check() -> None:
    doc = _overview()
    panel = next(p for p in panels(doc) if p["title"] == "Preemption rate")
    expr = panel["targets"][0]["expr"]
    # The classic public-example mistake: the counter without _total.
    panel["targets"][0]["expr"] = expr.replace(
        "kvtax_engine_preemptions_total", "vllm:num_preemptions"
    )
    assert problems(doc) == ["'Preemption rate': unknown series vllm:num_preemptions"]


def test_a_misspelled_name_inside_a_name_regex_fails() -> None:
    doc = _overview()
    panel = next(p for p in panels(doc) if p["title"] == "Inter-token latency")
    expr = panel["targets"][0]["expr"]
    panel["targets"][0]["expr"] = expr.replace("vllm:time_per_output", "vllm:time_per_outptu")
    assert problems(doc) == [
        "'Inter-token latency': unknown series vllm:time_per_outptu_token_seconds_bucket"
    ]


def test_a_recorded_name_of_another_window_fails() -> None:
    doc = copy.deepcopy(dashboards()["kvtax-fleet.json"])
    panel = next(p for p in panels(doc) if p["title"] == "Goodput by pod")
    panel["targets"][0]["expr"] = panel["targets"][0]["expr"].replace(":rate5m", ":rate1m")
    assert problems(doc) == [
        "'Goodput by pod': unknown series namespace_pod_model_name:kvtax_delivered_tokens:rate1m"
    ]


def test_selectors_refuse_names_outside_the_tables() -> None:
    with pytest.raises(KeyError):
        kvtax("kvtax_no_such_metric")
    with pytest.raises(KeyError):
        vllm("no_such_concept")
    with pytest.raises(ValueError, match="histogram"):
        kvtax("kvtax_client_ttft_seconds")


def test_vllm_selectors_cover_every_name_of_a_concept() -> None:
    itl = vllm("itl", part="_bucket")
    for name in CONCEPTS["itl"].names:
        assert f"{name}_bucket" in itl
    assert 'source="local_compute"' in vllm("prompt_tokens_local_compute")


def test_expand_fills_variables_as_grafana_does() -> None:
    expr = 'rate(x{pod=~"$pod", model_name=~"${model}"}[$__rate_interval])'
    assert expand(expr, rate_interval="1m", values={"model": "tiny-llama"}) == (
        'rate(x{pod=~".*", model_name=~"tiny-llama"}[1m])'
    )


# -- drift and the ConfigMap ------------------------------------------------------------------


def test_committed_files_equal_the_generator_output() -> None:
    for name, text in artifacts().items():
        path = FOLDER / name
        assert path.exists(), f"{path} missing: run `kvtax dashboards generate`"
        assert path.read_text() == text, f"{path} drifted: run `kvtax dashboards generate`"


def test_generate_check_fails_on_drift(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dashboards", "generate", "--out", str(tmp_path)]) == 0
    assert main(["dashboards", "generate", "--check", "--out", str(tmp_path)]) == 0
    edited = tmp_path / "kvtax-fleet.json"
    edited.write_text(edited.read_text().replace("Fleet goodput", "Fleet goodness"))
    assert main(["dashboards", "generate", "--check", "--out", str(tmp_path)]) == 1
    assert "kvtax-fleet.json" in capsys.readouterr().err


def test_configmap_carries_every_dashboard_with_the_sidecar_label() -> None:
    text = (FOLDER / CONFIGMAP_FILE).read_text()
    doc = yaml.safe_load(text)
    assert doc["kind"] == "ConfigMap"
    assert doc["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert set(doc["data"]) == {p.name for p in JSON_FILES}
    for name, body in doc["data"].items():
        assert json.loads(body) == _load(FOLDER / name)
    # kubectl apply keeps the whole object in an annotation capped at 256 KiB.
    assert len(text.encode()) < 256 * 1024


def test_the_demo_s_dashboards_read_only_what_the_demo_s_prometheus_records() -> None:
    """The demo loads Prometheus with the short test profile's rules; its previews are built
    from that profile too (written to a file the preview's --config reads), so every panel
    queries a window those rules record: the Overview's SLO row reads 2m and 22h24m windows,
    never the default's 1h and 28d, which the demo's Prometheus has no series of."""
    profile_file = Path(tempfile.mkdtemp()) / "rules.yaml"
    profile_file.write_text(yaml.safe_dump(document_of(TEST_PROFILE)))
    profile = read(profile_file)
    assert profile == TEST_PROFILE
    recorded = known_series(TEST_PROFILE)
    for doc in dashboards(profile).values():
        for _, target in queries(doc):
            names = series_names(target["expr"])
            assert names <= recorded, (names - recorded, target["expr"])
    # Without the profile, the Overview would read series the demo's Prometheus never records.
    default_names = {n for _, t in queries(_overview()) for n in series_names(t["expr"])}
    assert default_names - recorded


def test_preview_refuses_a_rules_config_it_cannot_read(tmp_path: Path) -> None:
    bad = tmp_path / "rules.yaml"
    bad.write_text("rate_window: [not a duration]\n")
    code = main(
        ["dashboards", "preview", "--prometheus", "http://127.0.0.1:9", "--out", str(tmp_path),
         "--config", str(bad)]
    )  # fmt: skip
    assert code == 2
