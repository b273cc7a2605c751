"""``kvtax rules --config FILE.yaml``: every RulesConfig field from YAML, and the cluster label.

The rules generated from a config file pass ``promtool check rules`` and the committed
``promtool test rules`` suites; with ``cluster_label`` set, the label leads every ``by (...)``
and ``on (...)``, and a promtool test shows two clusters' pods of the same name stay apart.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtax.cli.main import main
from kvtax.errors import RulesConfigError
from kvtax.mixin.rules import DEFAULT, RulesConfig
from kvtax.mixin.rules.configfile import from_mapping, read
from kvtax.mixin.rules.recording import recording_rules
from kvtax.mixin.rules.render import alerts_yaml

ROOT = Path(__file__).resolve().parents[2]
TESTS = sorted((ROOT / "alerts" / "tests").glob("*.yaml"))


def promtool() -> str:
    path = shutil.which("promtool") or shutil.which("promtool", path="/usr/bin")
    if path is None:
        pytest.fail("promtool is not installed: run scripts/setup-system.sh", pytrace=False)
    return path


# A different valid value of each setting whose kind changed() cannot guess.
CHANGED: dict[str, Any] = {
    "slo_alerting": "threshold",
    "slo_unit": "tokens",
    "slo_period": "30d",
    "slo_windows": ["5m", "30m", "1h", "2h", "6h", "1d", "3d", "7d"],
    "slo_fast_windows": ["2h", "5m"],
    "slo_slow_windows": ["1d", "30m"],
    "slo_ticket_windows": ["7d", "1d"],
    "slo_excluded_outcomes": ["upstream_4xx", "too_large", "client_disconnected"],
}


def changed(name: str, value: Any) -> Any:
    """A different valid value of the same kind, for the round trip."""
    if name in CHANGED:
        return CHANGED[name]
    if isinstance(value, float):
        return value + 0.01 if value < 0.5 else value - 0.01
    if isinstance(value, str):
        if re.fullmatch(r"\d+[smh]", value):
            return "7m"
        if value.startswith("https://"):
            return "https://wiki.example.com/kvtax/runbooks.md"
        if value == "":
            return "cluster"
        return 'job="other"'
    return {"KvtaxQueueGrowing": "info"}


def test_every_field_can_be_set_from_yaml(tmp_path: Path) -> None:
    document = {f.name: changed(f.name, getattr(DEFAULT, f.name)) for f in fields(RulesConfig)}
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(document))
    config = read(path)
    for f in fields(RulesConfig):
        got = getattr(config, f.name)
        want = document[f.name]
        if f.name == "severity_overrides":
            got = dict(got)
        elif isinstance(want, list):
            want = tuple(want)
        assert got == want, f.name
        assert got != getattr(DEFAULT, f.name), f.name


def test_an_empty_file_is_the_defaults(tmp_path: Path) -> None:
    (tmp_path / "empty.yaml").write_text("")
    assert read(tmp_path / "empty.yaml") == DEFAULT


@pytest.mark.parametrize(
    ("document", "named"),
    [
        ({"tax_warnin": 0.1}, "tax_warnin: not a rules setting"),
        ({"tax_warning": "high"}, "tax_warning: expected a number"),
        ({"tax_warning": True}, "tax_warning: expected a number"),
        ({"tax_for": "15 minutes"}, "tax_for: expected a Prometheus duration"),
        ({"rate_window": 5}, "rate_window: expected text"),
        ({"cluster_label": "k8s-cluster"}, "cluster_label: expected a Prometheus label name"),
        ({"runbook_url_base": "wiki/runbooks"}, "runbook_url_base: expected an http"),
        ({"severity_overrides": {"KvtaxNope": "info"}}, "'KvtaxNope' is not one of"),
        ({"severity_overrides": {"KvtaxThrashing": "page"}}, "'page' is not one of"),
        ({"tax_warning": 0.3}, "tax_critical: must not be below tax_warning"),
        # The objective on delivered work.
        ({"slo_alerting": "p99"}, "slo_alerting: expected one of burn_rate, threshold, not 'p99'"),
        ({"slo_unit": "bytes"}, "slo_unit: expected one of requests, tokens, not 'bytes'"),
        ({"slo_objective": 1}, "slo_objective: expected a share above 0 and below 1"),
        ({"slo_objective": 99.9}, "slo_objective: expected a share above 0 and below 1"),
        ({"slo_period": "4 weeks"}, "slo_period: expected a Prometheus duration"),
        ({"slo_period": "1d"}, "slo_period: 1d is shorter than the longest window, 3d"),
        ({"slo_windows": "5m"}, "slo_windows: expected a list of windows, shortest first"),
        ({"slo_windows": ["1h", "5m"]}, "slo_windows: expected windows shortest first"),
        ({"slo_windows": ["5m", "0s"]}, "slo_windows: a window must be longer than 0"),
        ({"slo_fast_windows": ["5m", "1h"]}, "slo_fast_windows: expected two windows, the long"),
        ({"slo_slow_windows": ["6h"]}, "slo_slow_windows: expected two windows, the long one"),
        ({"slo_fast_windows": ["1h", "10m"]}, "slo_fast_windows: 10m is not among slo_windows"),
        ({"slo_objective": 0.9}, "slo_fast_burn: 14.4 x (1 - slo_objective 0.9) is above 1"),
        ({"slo_ticket_burn": 0}, "slo_ticket_burn: expected a number above 0, not 0"),
        ({"slo_excluded_outcomes": ["completed"]}, "slo_excluded_outcomes: completed requests"),
        ({"slo_excluded_outcomes": ["4xx"]}, "slo_excluded_outcomes: '4xx' is not one of"),
        ({"slo_excluded_outcomes": "upstream_4xx"}, "slo_excluded_outcomes: expected a list"),
    ],
)
def test_a_bad_setting_names_the_key(document: dict[str, Any], named: str) -> None:
    with pytest.raises(RulesConfigError, match=r"rules\.yaml: ") as caught:
        from_mapping(document, source="rules.yaml")
    assert named in str(caught.value)


def test_the_cli_prints_one_line_and_exits_2_for_a_bad_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "rules.yaml").write_text("tax_for: soon\n")
    assert main(["rules", "--config", str(tmp_path / "rules.yaml"), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "rules.yaml: tax_for: expected a Prometheus duration" in err


# -- the cluster label ------------------------------------------------------------------------

CLUSTER = from_mapping({"cluster_label": "cluster"})


def groupings(expr: str) -> list[str]:
    return re.findall(r"\b(?:by|on)\s*\(([^)]*)\)", expr)


def test_the_cluster_label_leads_every_recording_rule_by() -> None:
    rules = recording_rules(CLUSTER)
    for rule in rules:
        found = groupings(rule.expr)
        by = re.findall(r"\bby\s*\(([^)]*)\)", rule.expr)
        # Every rule aggregates, directly or by reading a per-pod record it sums up.
        assert by or ":" in rule.expr, rule.record
        for labels in found:
            assert labels.split(",")[0].strip() == "cluster", (rule.record, labels)
    # The rules without a by of their own are ratios of records that have one.
    assert sum(bool(re.search(r"\bby\s*\(", r.expr)) for r in rules) >= len(rules) // 2


def test_the_cluster_label_leads_every_alert_grouping_and_is_absent_by_default() -> None:
    with_cluster = alerts_yaml(CLUSTER)
    found = groupings(with_cluster)
    assert found
    for labels in found:
        if labels.strip() in ("method", "le"):
            continue
        assert labels.split(",")[0].strip() == "cluster", labels
    assert "cluster" not in alerts_yaml(DEFAULT)
    assert all("cluster" not in r.expr for r in recording_rules(DEFAULT))


def generate(tmp_path: Path, settings: str) -> Path:
    config = tmp_path / "rules.yaml"
    config.write_text(settings)
    out = tmp_path / "alerts"
    assert main(["rules", "--config", str(config), "--out", str(out)]) == 0
    return out


def test_rules_from_a_config_file_pass_promtool_check_and_the_committed_tests(
    tmp_path: Path,
) -> None:
    out = generate(
        tmp_path,
        "cluster_label: cluster\nrelease_label: monitoring\n"
        "runbook_url_base: https://wiki.example.com/kvtax/runbooks.md\n",
    )
    check = subprocess.run(
        [promtool(), "check", "rules", "kvtax-recording.yaml", "kvtax-alerts.yaml"],
        cwd=out,
        capture_output=True,
        text=True,
        check=False,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    wrapper = yaml.safe_load((out / "kvtax-prometheusrule.yaml").read_text())
    assert wrapper["metadata"]["labels"]["release"] == "monitoring"
    # The committed suites, against the generated files: series without a cluster label (one
    # Prometheus) still give every alert. Their runbook URLs follow the config's base.
    (out / "tests").mkdir()
    for test in TESTS:
        text = test.read_text().replace(DEFAULT.runbook_url_base, CLUSTER_BASE)
        (out / "tests" / test.name).write_text(text)
    result = subprocess.run(
        [promtool(), "test", "rules", *sorted(p.name for p in (out / "tests").iterdir())],
        cwd=out / "tests",
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == len(TESTS)


CLUSTER_BASE = "https://wiki.example.com/kvtax/runbooks.md"

# Two clusters each run llm/vllm-0: with the cluster label the per-pod records stay two series.
# (Long lines: promtool test files, kept as promtool reads them.)
POD_RECORD = "namespace_pod_model_name:kvtax_engine_generation_tokens:rate5m"
FLEET_RECORD = "model_name:kvtax_engine_generation_tokens:rate5m"


def _pod(name: str, cluster: str) -> str:
    return f'{name}{{cluster="{cluster}",namespace="llm",pod="vllm-0",model_name="m"}}'


TWO_CLUSTERS = yaml.safe_dump(
    {
        "rule_files": ["../kvtax-recording.yaml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {"series": _pod("kvtax_engine_generation_tokens_total", c), "values": v}
                    for c, v in (("east", "0+600x10"), ("west", "0+1200x10"))
                ],
                "promql_expr_test": [
                    {
                        "expr": POD_RECORD,
                        "eval_time": "10m",
                        "exp_samples": [
                            {"labels": _pod(POD_RECORD, "east"), "value": 10},
                            {"labels": _pod(POD_RECORD, "west"), "value": 20},
                        ],
                    },
                    {
                        "expr": FLEET_RECORD,
                        "eval_time": "10m",
                        "exp_samples": [
                            {
                                "labels": f'{FLEET_RECORD}{{cluster="{c}",model_name="m"}}',
                                "value": v,
                            }
                            for c, v in (("east", 10), ("west", 20))
                        ],
                    },
                ],
            }
        ],
    }
)


@pytest.mark.parametrize(("cluster", "passes"), [("cluster", True), ("", False)])
def test_pods_of_the_same_name_in_two_clusters_stay_apart(
    tmp_path: Path, cluster: str, passes: bool
) -> None:
    out = generate(tmp_path, f"cluster_label: '{cluster}'\n")
    (out / "tests").mkdir()
    (out / "tests" / "clusters.yaml").write_text(TWO_CLUSTERS)
    result = subprocess.run(
        [promtool(), "test", "rules", "clusters.yaml"],
        cwd=out / "tests",
        capture_output=True,
        text=True,
        check=False,
    )
    # Without the label the two pods merge into one sum: the same test must fail.
    assert (result.returncode == 0) is passes, result.stdout + result.stderr


def test_docs_name_every_setting() -> None:
    text = (ROOT / "docs" / "rules.md").read_text()
    missing = [f.name for f in fields(RulesConfig) if f"`{f.name}`" not in text]
    assert not missing
