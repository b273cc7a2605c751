"""The committed rules and Alertmanager example, checked by the real promtool and amtool.

Both tools come from the Debian packages (``scripts/setup-system.sh``); a missing tool fails
these tests rather than skipping them, so a green run always means the tools ran.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtax.mixin.dashboards import dashboards
from kvtax.mixin.dashboards.queries import expand
from kvtax.mixin.rules import DEFAULT, TEST_PROFILE, RulesConfig
from kvtax.mixin.rules.alerts import THRESHOLD_ALERT, AlertRule, alert_rules
from kvtax.mixin.rules.configfile import from_mapping
from kvtax.mixin.rules.recording import recording_rules
from kvtax.mixin.rules.render import alerts_yaml, recording_yaml
from kvtax.mixin.rules.slo import ALERT as BURN
from kvtax_dev.dashboard_lint import panels

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "alerts"
TESTS = sorted((ALERTS / "tests").glob("*.yaml"))
# The tests of alerts/threshold/, the rules for users without an objective.
THRESHOLD_TESTS = sorted((ALERTS / "tests" / "threshold").glob("*.yaml"))
THRESHOLD = from_mapping({"slo_alerting": "threshold"})


def _tool(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path="/usr/bin")
    if path is None:
        pytest.fail(f"{name} is not installed: run scripts/setup-system.sh", pytrace=False)
    return path


def _run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, check=False, cwd=ALERTS
    )


def _seconds(duration: str) -> int:
    units = {"s": 1, "m": 60, "h": 3600}
    return sum(int(n) * units[u] for n, u in re.findall(r"(\d+)([smh])", duration))


# -- promtool ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("folder", "config"), [(".", DEFAULT), ("threshold", THRESHOLD)])
def test_promtool_check_rules_is_clean(folder: str, config: RulesConfig) -> None:
    files = (f"{folder}/kvtax-recording.yaml", f"{folder}/kvtax-alerts.yaml")
    result = _run(_tool("promtool"), "check", "rules", *files)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(recording_rules(config))} rules found" in result.stdout
    assert f"SUCCESS: {len(alert_rules(config))} rules found" in result.stdout


def test_promtool_accepts_the_wrapper_and_the_test_profile(tmp_path: Path) -> None:
    wrapper = yaml.safe_load((ALERTS / "kvtax-prometheusrule.yaml").read_text())
    (tmp_path / "wrapped.yaml").write_text(yaml.safe_dump({"groups": wrapper["spec"]["groups"]}))
    (tmp_path / "short-recording.yaml").write_text(recording_yaml(TEST_PROFILE))
    (tmp_path / "short-alerts.yaml").write_text(alerts_yaml(TEST_PROFILE))
    result = _run(
        _tool("promtool"),
        "check",
        "rules",
        *(tmp_path / n for n in ("wrapped.yaml", "short-recording.yaml", "short-alerts.yaml")),
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_unit_tests_pass() -> None:
    result = _run(_tool("promtool"), "test", "rules", *TESTS, *THRESHOLD_TESTS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == len(TESTS) + len(THRESHOLD_TESTS)


def test_promtool_unit_tests_fail_when_an_alert_changes(tmp_path: Path) -> None:
    # The tests bite: a looser threshold and a longer for: must both be caught.
    (tmp_path / "tests").mkdir()
    (tmp_path / "kvtax-recording.yaml").write_text((ALERTS / "kvtax-recording.yaml").read_text())
    text = (ALERTS / "kvtax-alerts.yaml").read_text()
    (tmp_path / "kvtax-alerts.yaml").write_text(
        text.replace("> 0.85", "> 0.95").replace("for: 10m", "for: 12m")
    )
    for name in ("kv_cache_near_full.yaml", "vllm_preempting.yaml"):
        (tmp_path / "tests" / name).write_text((ALERTS / "tests" / name).read_text())
    result = subprocess.run(
        [_tool("promtool"), "test", "rules", "tests/kv_cache_near_full.yaml"],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
    )
    assert result.returncode != 0
    result = subprocess.run(
        [_tool("promtool"), "test", "rules", "tests/vllm_preempting.yaml"],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
    )
    assert result.returncode != 0


def _cases(tests: list[Path] = TESTS) -> list[tuple[str, dict[str, Any]]]:
    return [
        (path.name, case) for path in tests for case in yaml.safe_load(path.read_text())["tests"]
    ]


def _is(rule: AlertRule, expected: dict[str, Any]) -> bool:
    """Whether an expected alert of a promtool test is one of ``rule``'s (its severity and its
    own labels, such as a burn-rate alert's windows)."""
    labels = expected["exp_labels"]
    return labels.get("severity") == rule.severity and all(
        labels.get(k) == v for k, v in rule.labels.items()
    )


def _checks(case: dict[str, Any], rule: AlertRule) -> list[tuple[int, bool]]:
    """(eval time, fires) of every check of ``case`` on ``rule``'s alert: fires is whether the
    check expects one of ``rule``'s alerts."""
    return [
        (_seconds(c["eval_time"]), any(_is(rule, e) for e in c["exp_alerts"]))
        for c in case.get("alert_rule_test", [])
        if c["alertname"] == rule.alert
    ]


def _condition_shown(case: dict[str, Any], rule: AlertRule, at: int) -> bool:
    """Whether ``case`` shows ``rule``'s condition true at ``at``: a promql test of the rule's
    very expression that expects a sample then."""
    return any(
        " ".join(t["expr"].split()) == " ".join(rule.expr.split())
        and _seconds(t["eval_time"]) == at
        and t["exp_samples"]
        for t in case.get("promql_expr_test", [])
    )


RULES = [(rule, TESTS) for rule in alert_rules()] + [
    (rule, THRESHOLD_TESTS) for rule in alert_rules(THRESHOLD) if rule.alert == THRESHOLD_ALERT
]


@pytest.mark.parametrize(
    ("rule", "tests"),
    RULES,
    ids=[f"{r.alert}-{r.severity}-{r.labels.get('long_window', '')}" for r, _ in RULES],
)
def test_every_alert_has_pending_firing_and_healthy_cases(
    rule: AlertRule, tests: list[Path]
) -> None:
    """Each rule of each alert (both slo_alerting choices) has a case where it fires with exact
    labels and annotations after being quiet while its for: ran, and a case where it stays quiet.

    Quiet while for: runs is shown one of two ways: a quiet check no earlier than one step
    before for: has run since the data began (a shorter for: would already fire there); or, for
    a condition that becomes true later (a burn reaching its factor), a promql test of the
    rule's own expression that finds it true at the quiet check, and the firing check within
    for: and one step of it. The burn-rate alerts must show it the second way."""
    hold = _seconds(rule.for_)
    pending_then_firing = healthy = False
    for _, case in _cases(tests):
        checks = _checks(case, rule)
        if not checks:
            continue
        fires = [t for t, firing in checks if firing]
        quiet = [t for t, firing in checks if not firing]
        for check in case.get("alert_rule_test", []):
            for expected in (e for e in check["exp_alerts"] if _is(rule, e)):
                assert {"model_name", "pod"} & set(expected["exp_labels"])
                assert expected["exp_labels"]["severity"] == rule.severity
                assert set(expected["exp_annotations"]) == {"summary", "description", "runbook_url"}
                assert expected["exp_annotations"]["runbook_url"] == rule.runbook_url
        if fires:
            first = min(fires)
            before = [t for t in quiet if t < first]
            # A burn's condition starts when the burn reaches its factor, not with the data.
            if rule.alert != BURN and any(hold - 60 <= t for t in before):
                pending_then_firing = True
            if any(_condition_shown(case, rule, t) and first - t <= hold + 60 for t in before):
                pending_then_firing = True
        elif quiet:
            healthy = True
    name = f"{rule.alert} ({rule.severity}{', ' if rule.labels else ''}{dict(rule.labels) or ''})"
    assert pending_then_firing, f"{name}: no case shows it pending at for: and firing after"
    assert healthy, f"{name}: no case shows it silent on healthy series"


@pytest.mark.parametrize("alert", ["KvtaxVllmPreempting", "KvtaxKvCacheNearFull"])
def test_preemption_and_near_full_fire_on_pre_0_9_2_names(alert: str) -> None:
    fired_on_old_names = False
    for _, case in _cases():
        series = " ".join(s["series"] for s in case["input_series"])
        old_only = "vllm:gpu_cache_usage_perc" in series and "kv_cache_usage_perc" not in series
        fires = any(
            c["alertname"] == alert and c["exp_alerts"] for c in case.get("alert_rule_test", [])
        )
        fired_on_old_names |= old_only and fires
    assert fired_on_old_names


# -- amtool ------------------------------------------------------------------------------------


def test_amtool_check_config_is_clean() -> None:
    result = _run(_tool("amtool"), "check-config", "alertmanager.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 inhibit rules" in result.stdout


@pytest.mark.parametrize(
    ("labels", "receiver"),
    [
        (["severity=critical", "alertname=KvtaxThrashing"], "pager"),
        (["severity=critical", "alertname=KvtaxPreemptionTaxHigh"], "pager"),
        (["severity=warning", "alertname=KvtaxVllmPreempting"], "ticket"),
        (["severity=info", "alertname=KvtaxSomethingInformational"], "blackhole"),
        (["alertname=SomeoneElsesAlert"], "ticket"),
    ],
)
def test_amtool_routes_by_severity(labels: list[str], receiver: str) -> None:
    result = _run(
        _tool("amtool"),
        "config",
        "routes",
        "test",
        "--config.file=alertmanager.yml",
        f"--verify.receivers={receiver}",
        "namespace=llm",
        "model_name=tiny-llama",
        *labels,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == receiver


def test_amtool_matching_route_is_a_single_severity_route() -> None:
    # No route continues past its match: a critical alert pages once and opens no ticket.
    # (amtool cannot show group_by; grouping is proven on a real Alertmanager in
    # tests/e2e/test_alerting_alertmanager.py.)
    result = _run(
        _tool("amtool"),
        "config",
        "routes",
        "test",
        "--config.file=alertmanager.yml",
        "--tree",
        "severity=critical",
        "namespace=llm",
        "model_name=tiny-llama",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert 'default-route\n    └── {severity="critical"}  receiver: pager' in result.stdout
    assert "ticket" not in result.stdout


def test_tax_by_method_panel_and_the_tax_rule_agree_on_the_one_definition(tmp_path: Path) -> None:
    # The Overview's per-method queries and the per-pod tax record, on the same counters, in a
    # real promtool: the record takes measured (the best method) and matches that panel line.
    # A second model has no measurement: there, and only there, the panel draws the estimate.
    overview = dashboards()["kvtax-overview.json"]
    detail = next(p for p in panels(overview) if p["title"] == "Tax by method")
    records = [
        {
            "record": f"panel:{t['legendFormat'].split()[0].rstrip(',')}",
            "expr": expand(t["expr"], rate_interval="5m"),
        }
        for t in detail["targets"]
    ]
    (tmp_path / "panel.yaml").write_text(
        yaml.safe_dump({"groups": [{"name": "p", "rules": records}]})
    )
    (tmp_path / "recording.yaml").write_text((ALERTS / "kvtax-recording.yaml").read_text())
    where = 'namespace="llm",pod="vllm-0",model_name="tiny-llama"'
    unmeasured = 'namespace="llm",pod="vllm-1",model_name="other"'
    inputs = {  # per minute: Pc 10/s, G 20/s, measured R 10/s, estimated R 90/s
        "kvtax_engine_prompt_computed_tokens_total": 600,
        "kvtax_engine_generation_tokens_total": 1200,
        "kvtax_recomputed_tokens_measured_total": 600,
        "kvtax_recomputed_tokens_estimated_total": 5400,
    }
    series = [
        {"series": f"{name}{{{labels}}}", "values": f"0+{step}x20"}
        for labels in (where, unmeasured)
        for name, step in inputs.items()
        if labels == where or "measured" not in name.replace("estimated", "")
    ]
    model = '{model_name="tiny-llama"}'
    expected: list[tuple[str, list[tuple[str, float]]]] = [
        ("panel:measured", [(model, 0.25)]),
        # Hidden where the measurement is: only the unmeasured model's estimate is drawn.
        ("panel:estimated", [('{model_name="other"}', 0.75)]),
        (
            "namespace_pod_model_name:kvtax_preemption_tax:ratio_rate5m",
            [
                (f'{{{where},method="measured"}}', 0.25),
                (f'{{{unmeasured},method="estimated"}}', 0.75),
            ],
        ),
    ]
    test = {
        "rule_files": ["recording.yaml", "panel.yaml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": series,
                "promql_expr_test": [
                    {
                        "expr": name,
                        "eval_time": "10m",
                        "exp_samples": [
                            {"labels": name + labels, "value": v} for labels, v in want
                        ],
                    }
                    for name, want in expected
                ]
                # No stall-based counter: that line is absent, not 0.
                + [{"expr": "panel:stall_estimated", "eval_time": "10m", "exp_samples": []}],
            }
        ],
    }
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(test))
    result = subprocess.run(
        [_tool("promtool"), "test", "rules", "test.yaml"],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_recompute_avoided_row_computes_its_shares_in_a_real_promtool(tmp_path: Path) -> None:
    # Per second: Pc 10, G 20, recomputed 10, found in the prefix cache 20, loaded by the
    # connector 30. Resumes needed 60: half of it loaded. The tax is 10 / 40; had the loaded
    # tokens been computed again it would have been 40 / 70.
    overview = dashboards()["kvtax-overview.json"]
    titles = [p["title"] for p in overview["panels"]]
    row = titles.index("Recompute avoided")
    targets = [t for p in overview["panels"][row + 1 : row + 4] for t in p["targets"]]
    # Rounded to 4 places: rate()'s extrapolation leaves a last-digit error in 30 / 60 tokens.
    records = [
        {
            "record": f"panel:t{i}",
            "expr": f"round(({expand(t['expr'], rate_interval='5m')}) * 10000) / 10000",
        }
        for i, t in enumerate(targets)
    ]
    (tmp_path / "panel.yaml").write_text(
        yaml.safe_dump({"groups": [{"name": "p", "rules": records}]})
    )
    where = 'namespace="llm",pod="vllm-0",model_name="tiny-llama"'
    inputs = {
        "kvtax_engine_prompt_computed_tokens_total": ("", 600),
        "kvtax_engine_generation_tokens_total": ("", 1200),
        "kvtax_recomputed_tokens_measured_total": ("", 600),
        "kvtax_recompute_avoided_tokens_total": (',source="prefix_cache"', 1200),
        "kvtax_recompute_avoided_tokens_total ": (',source="kv_connector"', 1800),
    }
    series = [
        {"series": f"{name.strip()}{{{where}{extra}}}", "values": f"0+{step}x20"}
        for name, (extra, step) in inputs.items()
    ]
    expected = [10.0, 20.0, 30.0, 0.5, 0.25, 0.5714]
    test = {
        "rule_files": ["panel.yaml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": series,
                "promql_expr_test": [
                    {
                        "expr": f"panel:t{i}",
                        "eval_time": "10m",
                        "exp_samples": [
                            {"labels": f'panel:t{i}{{model_name="tiny-llama"}}', "value": v}
                        ],
                    }
                    for i, v in enumerate(expected)
                ],
            }
        ],
    }
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(test))
    result = subprocess.run(
        [_tool("promtool"), "test", "rules", "test.yaml"],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
