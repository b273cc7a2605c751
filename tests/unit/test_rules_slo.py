"""The objective on delivered work: what its settings change in the generated rules, shown on a
real promtool where it is behaviour (which alert fires), and on the rules themselves where it is
shape (which series they read, which windows they name).

The committed cases (alerts/tests/error_budget_burn.yaml, error_budget_blip.yaml) run against
the default settings; here the same inputs run against rules generated from other settings, and
must give other alerts.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtax.cli.main import main
from kvtax.mixin.rules import DEFAULT, TEST_PROFILE, RulesConfig, record_names
from kvtax.mixin.rules.alerts import alert_rules
from kvtax.mixin.rules.configfile import from_mapping
from kvtax.mixin.rules.recording import recording_rules
from kvtax.mixin.rules.slo import ALERT, burn_alerts, missed_record
from kvtax_dev.promql import series_names
from tests.unit.test_rules_config import promtool

ROOT = Path(__file__).resolve().parents[2]
BURN_TESTS = ROOT / "alerts" / "tests" / "error_budget_burn.yaml"


# The committed cases, in file order, each known by the outcome that spends its budget.
FAST, SLOW, TICKET = 0, 1, 2
_SPENT_BY = {FAST: 'outcome="completed"', SLOW: 'outcome="shed"', TICKET: "client_disconnected"}


def _case(index: int) -> dict[str, Any]:
    """The inputs of a committed case, without its checks."""
    case = dict(yaml.safe_load(BURN_TESTS.read_text())["tests"][index])
    assert _SPENT_BY[index] in " ".join(s["series"] for s in case["input_series"])
    case.pop("alert_rule_test", None)
    case.pop("promql_expr_test", None)
    return case


def _firing(tmp_path: Path, settings: str, case: dict[str, Any], at: str) -> list[dict[str, Any]]:
    """The KvtaxErrorBudgetBurn alerts of ``case`` at ``at`` under rules generated from
    ``settings``: promtool is asked to expect none, and its failure lists what fired."""
    config = tmp_path / "rules.yaml"
    config.write_text(settings)
    out = tmp_path / "alerts"
    assert main(["rules", "--config", str(config), "--out", str(out)]) == 0
    check = {"eval_time": at, "alertname": ALERT, "exp_alerts": []}
    test = {
        "rule_files": ["kvtax-recording.yaml", "kvtax-alerts.yaml"],
        "evaluation_interval": "1m",
        "group_eval_order": ["kvtax-recording", "kvtax-objective"],
        "tests": [{**case, "alert_rule_test": [check]}],
    }
    (out / "test.yaml").write_text(yaml.safe_dump(test))
    result = subprocess.run(
        [promtool(), "test", "rules", "test.yaml"],
        cwd=out,
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode == 0:
        return []
    # promtool prints a failed check on stderr, with what it got.
    assert "got:" in result.stderr, result.stdout + result.stderr
    got = result.stderr.split("got:", 1)[1]
    return [
        dict(re.findall(r'(\w+)="([^"]*)"', labels))
        for labels in re.findall(r"Labels:\{([^}]*)\}", got)
    ]


def _windows(alerts: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return sorted((a["severity"], a["long_window"]) for a in alerts)


def test_the_ticket_case_pages_when_the_objective_counts_tokens(tmp_path: Path) -> None:
    # 3 % of requests miss, but they are the long ones: 10 % of delivered tokens.
    case = _case(TICKET)
    assert _windows(_firing(tmp_path, "", case, "61m")) == [("warning", "3d")]
    tokens = _firing(tmp_path, "slo_unit: tokens\n", case, "61m")
    # 10x: the slow page's 6x too (fired after its 15m), and the ticket; not the fast page.
    assert _windows(tokens) == [("critical", "6h"), ("warning", "3d")]


def test_clients_that_leave_stop_counting_when_excluded(tmp_path: Path) -> None:
    # The ticket case's misses are all clients that left before the end.
    case = _case(TICKET)
    excluded = "slo_excluded_outcomes: [upstream_4xx, too_large, client_disconnected]\n"
    assert _firing(tmp_path, excluded, case, "61m") == []


def test_a_looser_objective_does_not_page_where_the_default_does(tmp_path: Path) -> None:
    # 80 % of requests miss from 60m: a burn of 80x against 1 %, but 8x against 10 %.
    case = _case(FAST)
    assert ("critical", "1h") in _windows(_firing(tmp_path, "", case, "76m"))
    assert _firing(tmp_path, "slo_objective: 0.9\nslo_fast_burn: 10\n", case, "76m") == []


def test_the_threshold_choice_has_no_burn_rate_alert_and_keeps_the_ttft_one() -> None:
    threshold = from_mapping({"slo_alerting": "threshold"})
    names = {r.alert for r in alert_rules(threshold)}
    assert ALERT not in names
    assert "KvtaxTtftSloBreach" in names
    assert "KvtaxTtftSloBreach" not in {r.alert for r in alert_rules(DEFAULT)}
    # The records are the same either way: the dashboards show the budget in both.
    assert record_names(threshold) == record_names(DEFAULT)


@pytest.mark.parametrize("unit", ["requests", "tokens"])
def test_the_alerts_read_the_configured_unit_and_windows(unit: str) -> None:
    config = from_mapping({"slo_unit": unit, "slo_objective": 0.995})
    rules = [r for r in alert_rules(config) if r.alert == ALERT]
    assert [(r.severity, r.for_) for r in rules] == [
        ("critical", "2m"),
        ("critical", "15m"),
        ("warning", "1h"),
    ]
    for rule, (long, short) in zip(rules, (("1h", "5m"), ("6h", "30m"), ("3d", "6h")), strict=True):
        assert series_names(rule.expr) == {missed_record(unit, long), missed_record(unit, short)}
        # The burn is the missed share over the budget, 1 - 0.995.
        assert rule.expr.count("/ 0.005 >") == 2
        assert dict(rule.labels) == {"long_window": long, "short_window": short}
        assert f"99.5% of {'requests' if unit == 'requests' else 'delivered tokens'}" in (
            rule.description
        )


def test_every_window_an_alert_reads_is_recorded_in_every_profile() -> None:
    custom = from_mapping(
        {
            "slo_windows": ["1m", "10m", "1h", "7h", "3d"],
            "slo_fast_windows": ["1h", "1m"],
            "slo_slow_windows": ["7h", "10m"],
            "slo_ticket_windows": ["3d", "7h"],
            "slo_period": "30d",
        }
    )
    for config in (DEFAULT, TEST_PROFILE, custom):
        records = set(record_names(config))
        for rule in (r for r in alert_rules(config) if r.alert == ALERT):
            assert series_names(rule.expr) <= records, rule.expr
        assert f"model_name:kvtax_slo_error_budget_requests:remaining{config.slo_period}" in (
            records
        )


def test_long_windows_read_the_per_model_records_not_every_pod_s_counters() -> None:
    # A 3-day rate() over every pod's raw counters reads millions of samples at fleet size.
    rules = {r.record: r.expr for r in recording_rules(DEFAULT)}
    for unit in ("requests", "tokens"):
        for window in (*DEFAULT.slo_windows, DEFAULT.slo_period):
            read = series_names(rules[missed_record(unit, window)])
            assert read, window
            assert all(name.startswith("model_name:") for name in read), (window, read)
    # Only the first window's per-pod rates read raw counters, over that window alone.
    raw = [expr for expr in rules.values() if "kvtax_slo_met_requests_total" in expr]
    assert raw == ["sum by (namespace, pod, model_name) (rate(kvtax_slo_met_requests_total[5m]))"]


def test_the_request_objective_leaves_out_exactly_the_excluded_outcomes() -> None:
    rules = {r.record: r.expr for r in recording_rules(DEFAULT)}
    counted = rules["namespace_pod_model_name:kvtax_slo_requests:rate5m"]
    assert 'kvtax_requests_total{outcome!~"upstream_4xx|too_large"}' in counted
    none = from_mapping({"slo_excluded_outcomes": [], "kvtax_selector": 'job="kvtax"'})
    counted = {r.record: r.expr for r in recording_rules(none)}[
        "namespace_pod_model_name:kvtax_slo_requests:rate5m"
    ]
    assert 'kvtax_requests_total{job="kvtax"}' in counted


def test_burn_alerts_follow_the_factors_of_the_config() -> None:
    config: RulesConfig = from_mapping({"slo_fast_burn": 20, "slo_ticket_burn": 2})
    assert [a.burn for a in burn_alerts(config)] == [20.0, 6.0, 2.0]
    assert all(a.expr.endswith(f"> {a.burn:g}") for a in burn_alerts(config))


def test_a_severity_override_may_name_either_choice_s_alert() -> None:
    # Keys are read in any order: the override of the threshold alert is valid before the file
    # has said slo_alerting: threshold, and an override of the burn alert with it.
    first = from_mapping(
        {"severity_overrides": {"KvtaxTtftSloBreach": "info"}, "slo_alerting": "threshold"}
    )
    assert {r.alert: r.severity for r in alert_rules(first)}["KvtaxTtftSloBreach"] == "info"
    burn = from_mapping({"severity_overrides": {ALERT: "warning"}})
    assert {r.severity for r in alert_rules(burn) if r.alert == ALERT} == {"warning"}
