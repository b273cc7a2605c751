"""The generated rules: no drift from the generator, mixin conventions, and only known series."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtax.cli.main import main
from kvtax.expose import catalog
from kvtax.expose.catalog import MetricSpec
from kvtax.mixin.rules import (
    DEFAULT,
    TEST_PROFILE,
    fleet,
    per_pod,
    record_names,
    recording_rules,
    short_profile,
)
from kvtax.mixin.rules.alertmanager import alertmanager_config
from kvtax.mixin.rules.alerts import (
    THRESHOLD_ALERT,
    AlertRule,
    alert_names,
    alert_rules,
    every_alert_name,
)
from kvtax.mixin.rules.configfile import from_mapping, read
from kvtax.mixin.rules.recording import RecordingRule
from kvtax.mixin.rules.render import render_files
from kvtax.mixin.rules.slo import ALERT as BURN
from kvtax.mixin.rules.slo import UNITS
from kvtax_dev.promql import series_names, unknown_series

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "alerts"
RULE_FILES = ("kvtax-recording.yaml", "kvtax-alerts.yaml")
# The same rules for users without an objective (slo_alerting: threshold), generated from the
# settings file beside them.
THRESHOLD = ALERTS / "threshold"
THRESHOLD_CONFIG = from_mapping({"slo_alerting": "threshold"})


def _load(name: str, folder: Path = ALERTS) -> Any:
    return yaml.safe_load((folder / name).read_text())


def _committed_rules() -> list[dict[str, Any]]:
    """Every rule in the committed rule files and in the PrometheusRule wrappers, of both
    folders."""
    groups = []
    for folder in (ALERTS, THRESHOLD):
        groups += [g for name in RULE_FILES for g in _load(name, folder)["groups"]]
        groups += _load("kvtax-prometheusrule.yaml", folder)["spec"]["groups"]
    return [rule for group in groups for rule in group["rules"]]


# Both choices of slo_alerting: every test of an alert's shape runs on each.
MODES = (DEFAULT, THRESHOLD_CONFIG)


# -- drift -------------------------------------------------------------------------------------


def test_committed_files_match_the_generator() -> None:
    for name, text in render_files().items():
        assert (ALERTS / name).read_text() == text, f"alerts/{name} is stale: run `kvtax rules`"


def test_the_threshold_folder_is_its_settings_file_rendered() -> None:
    settings = THRESHOLD / "kvtax-rules.yaml"
    assert read(settings) == THRESHOLD_CONFIG
    fix = f"kvtax rules --config {settings.relative_to(ROOT)} --out {THRESHOLD.relative_to(ROOT)}"
    for name, text in render_files(THRESHOLD_CONFIG).items():
        assert (THRESHOLD / name).read_text() == text, f"alerts/threshold/{name}: run `{fix}`"


def test_rules_check_exits_1_on_drift(tmp_path: Path) -> None:
    assert main(["rules", "--out", str(tmp_path), "--check"]) == 1  # nothing written yet
    assert main(["rules", "--out", str(tmp_path)]) == 0
    assert main(["rules", "--out", str(tmp_path), "--check"]) == 0
    alerts = tmp_path / "kvtax-alerts.yaml"
    alerts.write_text(alerts.read_text().replace("for: 10m", "for: 11m"))
    assert main(["rules", "--out", str(tmp_path), "--check"]) == 1


# -- recording rules ---------------------------------------------------------------------------


def test_recording_rules_are_named_level_metric_operations() -> None:
    # The objective's shares carry their own windows and the budget its period (28d).
    windows = "|".join((*DEFAULT.slo_windows, DEFAULT.slo_period))
    for record in record_names():
        level, metric, operation = record.split(":")
        assert level in {"namespace_pod_model_name", "model_name"}, record
        assert not metric.endswith("_total"), record
        assert re.fullmatch(
            rf"(rate5m|ratio_rate5m|max|min|sum|avg|ratio_rate({windows})|remaining28d)",
            operation,
        ), record


# The objective is the model's, across its pods: its shares and budget exist fleet-wide only.
FLEET_ONLY = re.compile(r"kvtax_slo_(missed|error_budget)_(requests|tokens)")


def test_every_recording_rule_exists_per_pod_and_fleet_wide() -> None:
    metrics = {(r.split(":")[0], r.split(":")[1]) for r in record_names()}
    pod = {m for level, m in metrics if level == "namespace_pod_model_name"}
    fleet = {m for level, m in metrics if level == "model_name" and not FLEET_ONLY.fullmatch(m)}
    assert pod == fleet
    assert {m for _, m in metrics if FLEET_ONLY.fullmatch(m)} == {
        f"kvtax_slo_{kind}_{unit}" for kind in ("missed", "error_budget") for unit in UNITS
    }
    for needed in (
        "kvtax_delivered_tokens",  # goodput
        "kvtax_engine_generation_tokens",  # engine throughput
        "kvtax_preemption_tax",
        "kvtax_waste",
        "vllm_kv_cache_usage",
        "kvtax_kv_capacity_tokens",
    ):
        assert needed in pod


def test_fleet_rules_only_read_per_pod_records_defined_before_them() -> None:
    seen: set[str] = set()
    for rule in recording_rules():
        if rule.record.startswith("model_name:"):
            reads = {s for s in series_names(rule.expr) if ":" in s and not s.startswith("vllm:")}
            assert reads, rule.record
            assert reads <= seen, rule.record
        seen.add(rule.record)


def test_ledger_over_engine_ratios_read_the_join_counters() -> None:
    # kvtax_delivered_tokens_total counts live, the engine's counters as of kvtax's last scrape
    # of vLLM: right after streams settle the live one leads by their tokens, and a window
    # starting there read a yield of 0.72-0.89 on the fleet e2e's calm pod, which lost nothing.
    # The join counters are as of the same scrape as the engine's.
    exprs = {r.record: r.expr for r in recording_rules()}
    for level in (per_pod, fleet):
        yield_ = series_names(exprs[level("kvtax_delivery_yield", "ratio_rate5m")])
        waste = series_names(exprs[level("kvtax_waste", "ratio_rate5m")])
        assert level("kvtax_join_delivered_tokens", "rate5m") in yield_
        assert level("kvtax_join_undelivered_tokens", "rate5m") in waste
        live = {level(m, "rate5m") for m in ("kvtax_delivered_tokens", "kvtax_undelivered_tokens")}
        assert not live & (yield_ | waste)
    for metric in ("kvtax_join_delivered_tokens", "kvtax_join_undelivered_tokens"):
        assert series_names(exprs[per_pod(metric, "rate5m")]) == {f"{metric}_total"}
    # Goodput stays live: it must keep counting while vLLM's /metrics is down.
    assert series_names(exprs[per_pod("kvtax_delivered_tokens", "rate5m")]) == {
        "kvtax_delivered_tokens_total"
    }


def test_recompute_prefers_measured_then_estimated_then_stall_estimated() -> None:
    expr = next(r.expr for r in recording_rules() if "kvtax_recomputed_tokens:rate" in r.record)
    methods = ("measured", "estimated", "stall_estimated")
    clauses = expr.split(" or on (namespace, pod, model_name) ")
    assert len(clauses) == 3
    for method, clause in zip(methods, clauses, strict=True):
        # Each clause reads its own counter and names it, so panels and alerts can say which.
        assert series_names(clause) == {f"kvtax_recomputed_tokens_{method}_total"}
        assert clause.startswith("label_replace(")
        assert clause.endswith(f'"method", "{method}", "", "")')


def test_every_recompute_counter_of_the_catalog_feeds_the_recording_rule() -> None:
    expr = next(r.expr for r in recording_rules() if "kvtax_recomputed_tokens:rate" in r.record)
    counters = {n for n in catalog.METRICS if n.startswith("kvtax_recomputed_tokens_")}
    assert len(counters) == 3
    assert series_names(expr) == counters


def test_no_rule_reads_a_method_label_of_a_counter() -> None:
    # 0.2 split the counter; a method matcher on any input series would select nothing.
    rules: tuple[RecordingRule | AlertRule, ...] = (*recording_rules(), *alert_rules())
    for rule in rules:
        assert 'method="' not in rule.expr.replace('"method", "', ""), rule


def test_load_shedding_counts_vllm_rejections_and_claims_no_kvtax_429() -> None:
    shed = next(r for r in alert_rules() if r.alert == "KvtaxLoadShedding")
    assert series_names(shed.expr) == {"vllm:admission_rejections_total"}
    assert "outcome" not in shed.expr
    assert "429" not in shed.description + shed.summary
    assert "kvtax" not in (shed.description + shed.summary).lower()


def test_short_profile_shrinks_every_window_and_for() -> None:
    assert {r.for_ for r in alert_rules(TEST_PROFILE)} == {"5s"}
    # Every range is the rate window or one of the objective's, each 30 times shorter.
    short = {"20s", *TEST_PROFILE.slo_windows, TEST_PROFILE.slo_period}
    for rule in recording_rules(TEST_PROFILE):
        assert set(re.findall(r"\[(\w+)\]", rule.expr)) <= short, rule.record
    assert TEST_PROFILE.slo_windows == ("10s", "1m", "2m", "4m", "12m", "48m", "2h24m")
    assert "model_name:kvtax_preemption_tax:ratio_rate20s" in record_names(TEST_PROFILE)
    assert "model_name:kvtax_slo_missed_requests:ratio_rate2m" in record_names(TEST_PROFILE)
    custom = short_profile(window="1m", hold="30s", slo_scale=60)
    assert {r.for_ for r in alert_rules(custom)} == {"30s"}
    assert custom.slo_fast_windows == ("1m", "5s")


# -- alert conventions -------------------------------------------------------------------------

REQUIRED_ALERTS = {
    "KvtaxVllmPreempting",
    "KvtaxKvCacheNearFull",
    "KvtaxPreemptionTaxHigh",
    "KvtaxGoodputDiverging",
    "KvtaxThrashing",
    "KvtaxQueueGrowing",
    "KvtaxOverAdmitted",
    "KvtaxErrorBudgetBurn",
    "KvtaxStreamStalls",
    "KvtaxLoadShedding",
    "KvtaxJoinCoverageLow",
    "KvtaxVllmScrapeFailing",
    "KvtaxVllmMetricsAbsent",
    "KvtaxSidecarDown",
    "KvtaxGateShedding",
    "KvtaxProxyWorkerRestarting",
}


def test_the_issue_alerts_all_exist() -> None:
    assert set(alert_names()) == REQUIRED_ALERTS
    # Without an objective, the TTFT threshold pages in the error budget's place.
    assert set(alert_names(THRESHOLD_CONFIG)) == REQUIRED_ALERTS - {BURN} | {THRESHOLD_ALERT}
    assert set(every_alert_name()) == REQUIRED_ALERTS | {THRESHOLD_ALERT}


@pytest.mark.parametrize(
    "rule",
    [r for config in MODES for r in alert_rules(config)],
    ids=lambda r: f"{r.alert}-{r.severity}-{r.labels.get('long_window', '')}",
)
def test_alert_follows_mixin_conventions(rule: Any) -> None:
    assert re.fullmatch(r"Kvtax([A-Z][a-z0-9]+)+", rule.alert)
    assert rule.severity in {"critical", "warning", "info"}
    assert rule.summary.endswith(".")
    assert "{{" not in rule.summary
    assert "$labels." in rule.description
    assert rule.runbook_url == f"{DEFAULT.runbook_url_base}#{rule.alert.lower()}"
    assert re.fullmatch(r"\d+[smh]", rule.for_)


def test_descriptions_name_model_pod_and_value_where_there_is_one() -> None:
    # The health alerts are about a pod or a target, not a model, and their value is a flag.
    no_model = {
        "KvtaxVllmScrapeFailing",
        "KvtaxVllmMetricsAbsent",
        "KvtaxSidecarDown",
        "KvtaxGateShedding",  # one gate per proxy, in front of every model
        "KvtaxProxyWorkerRestarting",  # the proxy's processes, which serve every model
    }
    for rule in (r for config in MODES for r in alert_rules(config)):
        if rule.alert == BURN:
            # The objective is the model's across its pods: no pod to name.
            assert "$labels.pod" not in rule.description + rule.expr
        else:
            assert "$labels.pod" in rule.description, rule.alert
        if rule.alert not in no_model:
            assert "$labels.model_name" in rule.description, rule.alert
            assert "$value" in rule.description, rule.alert


def test_pairs_share_name_and_summary_and_differ_by_severity() -> None:
    by_name: dict[str, list[Any]] = {}
    for rule in alert_rules():
        by_name.setdefault(rule.alert, []).append(rule)
    pairs = {name: rules for name, rules in by_name.items() if len(rules) > 1}
    assert set(pairs) == {"KvtaxPreemptionTaxHigh", "KvtaxGoodputDiverging", BURN}
    for name, rules in pairs.items():
        # The objective's alert is the workbook's two pages and a ticket, told apart by windows.
        expected = ["critical", "critical", "warning"] if name == BURN else ["critical", "warning"]
        assert sorted(r.severity for r in rules) == expected
        assert len({r.summary for r in rules}) == 1
        assert len({(r.severity, tuple(r.labels.items())) for r in rules}) == len(rules)


def test_thresholds_come_from_the_config() -> None:
    from dataclasses import replace

    cfg = replace(DEFAULT, tax_warning=0.07, tax_critical=0.3, severity_overrides={})
    exprs = {(r.alert, r.severity): r.expr for r in alert_rules(cfg)}
    assert exprs[("KvtaxPreemptionTaxHigh", "warning")].endswith("> 0.07")
    assert exprs[("KvtaxPreemptionTaxHigh", "critical")].endswith("> 0.3")
    loud = replace(DEFAULT, severity_overrides={"KvtaxSidecarDown": "critical"})
    assert {r.alert: r.severity for r in alert_rules(loud)}["KvtaxSidecarDown"] == "critical"


def test_vllm_names_come_from_the_vocabulary_only() -> None:
    # Both KV-usage names, generated from the vocabulary, never one hard-coded name.
    near_full = next(r.expr for r in alert_rules() if r.alert == "KvtaxKvCacheNearFull")
    assert {"vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"} <= series_names(near_full)
    for path in (ROOT / "exporter/kvtax/rules").glob("*.py"):
        assert not re.search(r"[\"']vllm:\w", path.read_text()), path


# -- every series a rule names is known --------------------------------------------------------


def _committed_exprs() -> dict[str, str]:
    exprs = {}
    for i, rule in enumerate(_committed_rules()):
        exprs[f"{rule.get('record') or rule.get('alert')}#{i}"] = rule["expr"]
    return exprs


def test_every_series_in_every_committed_rule_is_known() -> None:
    exprs = _committed_exprs()
    assert len(exprs) > 280  # recording + alerts, twice (plain files and the wrapper), two folders
    assert unknown_series(exprs) == {}


def test_a_renamed_catalog_metric_breaks_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    renamed = {
        ("kvtax_delivered_completion_tokens_total" if n == "kvtax_delivered_tokens_total" else n): (
            MetricSpec("kvtax_delivered_completion_tokens_total", "counter", "renamed")
            if n == "kvtax_delivered_tokens_total"
            else spec
        )
        for n, spec in catalog.METRICS.items()
    }
    monkeypatch.setattr(catalog, "METRICS", renamed)
    broken = unknown_series(_committed_exprs())
    assert broken
    assert all(names == {"kvtax_delivered_tokens_total"} for names in broken.values())
    assert any(
        rule.startswith("namespace_pod_model_name:kvtax_delivered_tokens") for rule in broken
    )


def test_the_check_catches_the_classic_wrong_vllm_name() -> None:
    # Published vLLM alert examples query vllm:num_preemptions, which does not exist.
    broken = unknown_series({"example": "rate(vllm:num_preemptions[5m]) > 0"})
    assert broken == {"example": {"vllm:num_preemptions"}}


def test_series_names_skips_functions_labels_keywords_and_durations() -> None:
    expr = (
        'sum by (pod, le) (rate(a_bucket{job="x", le=~"1|2"}[5m] offset 15m)) > bool 1e3 '
        'and on (pod) b or {__name__=~"c|d:e", x="y"} * ignoring (x) group_left (y) f '
        'or {__name__=~"g.*"}'
    )
    assert series_names(expr) == {"a_bucket", "b", "c", "d:e", "f"}


@pytest.mark.parametrize(
    "expr", ["sum by (pod (rate(a[5m]))", "a unless ignoring (x) group_left b", "rate(a)[5m]"]
)
def test_series_names_refuses_what_prometheus_would_refuse(expr: str) -> None:
    with pytest.raises(ValueError, match=r"."):
        series_names(expr)


# -- the PrometheusRule wrapper and the Alertmanager example -----------------------------------


def test_prometheusrule_wraps_both_rule_files_for_kube_prometheus_stack() -> None:
    wrapper = _load("kvtax-prometheusrule.yaml")
    assert wrapper["apiVersion"] == "monitoring.coreos.com/v1"
    assert wrapper["kind"] == "PrometheusRule"
    assert wrapper["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    plain = [g for name in RULE_FILES for g in _load(name)["groups"]]
    assert wrapper["spec"]["groups"] == plain
    assert "# kube-prometheus-stack ignores" in (ALERTS / "kvtax-prometheusrule.yaml").read_text()


def test_alertmanager_example_routes_groups_and_inhibits() -> None:
    committed = _load("alertmanager.yml")
    assert committed == alertmanager_config()
    route = committed["route"]
    assert route["group_by"] == ["namespace", "model_name"]
    receivers = {r["matchers"][0]: r["receiver"] for r in route["routes"]}
    assert receivers == {
        'severity="critical"': "pager",
        'severity="warning"': "ticket",
        'severity="info"': "blackhole",
    }
    thrash = committed["inhibit_rules"][0]
    assert thrash["source_matchers"] == ['alertname="KvtaxThrashing"']
    assert thrash["equal"] == ["namespace", "pod", "model_name"]
    for target in ("KvtaxKvCacheNearFull", "KvtaxVllmPreempting"):
        assert target in thrash["target_matchers"][0]
        assert target in alert_names()


# -- runbooks ----------------------------------------------------------------------------------


def _runbook_sections() -> dict[str, str]:
    text = (ROOT / "docs/runbooks.md").read_text()
    parts = re.split(r"^## (\S+)\n", text, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


@pytest.mark.parametrize("alert", sorted(every_alert_name()))
def test_every_alert_has_a_runbook_section_with_the_four_parts(alert: str) -> None:
    sections = _runbook_sections()
    assert alert in sections, f"docs/runbooks.md has no '## {alert}' (anchor #{alert.lower()})"
    headings = re.findall(r"^### (\w+)$", sections[alert], flags=re.MULTILINE)
    assert headings == ["Meaning", "Impact", "Diagnosis", "Mitigation"]
    diagnosis = sections[alert].split("### Diagnosis")[1].split("### Mitigation")[0]
    assert "```promql" in diagnosis or "```sh" in diagnosis


def test_runbook_promql_names_only_known_series() -> None:
    text = (ROOT / "docs/runbooks.md").read_text()
    blocks = re.findall(r"```promql\n(.*?)```", text, flags=re.DOTALL)
    exprs = {
        f"runbook#{i}": line.split("#")[0].replace("$POD", "x").replace("$MODEL", "x")
        for i, line in enumerate(line for block in blocks for line in block.splitlines())
    }
    assert len(exprs) > 40
    assert unknown_series(exprs) == {}
