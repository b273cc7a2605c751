"""The Overview's answers added with the objective: attainment, burn and budget left first, then
preemptions per request, how requests finished, the proxy's errors, and the row named Gate.

The objective's panels follow ``kvtax dashboards generate --config`` as its alerts do; the
attainment panel's query is run on a real promtool against the committed records, and must
equal one minus the missed share the alerts read.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtax.delivery.ledger import OUTCOMES
from kvtax.mixin.dashboards import dashboards
from kvtax.mixin.dashboards.common import sum_rate
from kvtax.mixin.dashboards.queries import expand
from kvtax.mixin.rules.configfile import from_mapping
from kvtax_dev.dashboard_lint import panels
from kvtax_dev.promql import series_names
from kvtax_dev.testbed.engine import PREEMPTION_BUCKETS

ROOT = Path(__file__).resolve().parents[2]


def _overview(settings: dict[str, Any] | None = None) -> dict[str, Any]:
    board: dict[str, Any] = dashboards(from_mapping(settings or {}))["kvtax-overview.json"]
    return board


def _panel(board: dict[str, Any], title: str) -> dict[str, Any]:
    return next(p for p in panels(board) if p["title"] == title)


def _row_of(board: dict[str, Any], title: str) -> str:
    row = ""
    for panel in board["panels"]:
        if panel["type"] == "row":
            row = panel["title"]
        elif panel["title"] == title:
            return row
    raise AssertionError(f"no panel {title!r}")


def test_the_objective_leads_the_first_row() -> None:
    board = _overview()
    first = [p["title"] for p in board["panels"][1:4]]
    assert first == ["SLO attainment", "Burn rate", "Error budget left"]
    assert all(_row_of(board, t) == "At a glance" for t in first)
    assert all(_panel(board, t)["type"] == "stat" for t in first)


def test_the_objective_s_panels_read_its_records_and_settings() -> None:
    board = _overview()
    attainment = _panel(board, "SLO attainment")["targets"][0]["expr"]
    assert (
        attainment
        == '1 - model_name:kvtax_slo_missed_requests:ratio_rate28d{model_name=~"$model_name"}'
    )
    burns = [t["expr"] for t in _panel(board, "Burn rate")["targets"]]
    assert burns == [
        f'model_name:kvtax_slo_missed_requests:ratio_rate{w}{{model_name=~"$model_name"}} / 0.01'
        for w in ("1h", "6h")
    ]
    budget = _panel(board, "Error budget left")["targets"][0]["expr"]
    assert series_names(budget) == {"model_name:kvtax_slo_error_budget_requests:remaining28d"}


def test_the_objective_s_panels_follow_the_config_file() -> None:
    board = _overview(
        {
            "slo_unit": "tokens",
            "slo_objective": 0.995,
            "slo_period": "30d",
            "slo_slow_burn": 5,
            "slo_windows": ["5m", "30m", "2h", "6h", "3d"],
            "slo_fast_windows": ["2h", "5m"],
        }
    )
    attainment = _panel(board, "SLO attainment")
    assert series_names(attainment["targets"][0]["expr"]) == {
        "model_name:kvtax_slo_missed_tokens:ratio_rate30d"
    }
    steps = attainment["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert [s["value"] for s in steps] == [None, 0.995]
    burn = _panel(board, "Burn rate")
    assert [t["legendFormat"] for t in burn["targets"]] == [
        "2h {{model_name}}",
        "6h {{model_name}}",
    ]
    assert all(t["expr"].endswith(" / 0.005") for t in burn["targets"])
    assert [s["value"] for s in burn["fieldConfig"]["defaults"]["thresholds"]["steps"]] == [
        None,
        1.0,
        5.0,
    ]
    budget = _panel(board, "Error budget left")["targets"][0]["expr"]
    assert series_names(budget) == {"model_name:kvtax_slo_error_budget_tokens:remaining30d"}


def _promtool() -> str:
    path = shutil.which("promtool") or shutil.which("promtool", path="/usr/bin")
    if path is None:
        pytest.fail("promtool is not installed: run scripts/setup-system.sh", pytrace=False)
    return path


def test_attainment_is_one_minus_the_share_the_alerts_read(tmp_path: Path) -> None:
    # 3 of every 100 requests miss: the panel shows 97 %, the budget panel -2 (overspent threefold
    # over this short history), the burn panel 3x.
    board = _overview()
    records = [
        {"record": f"panel:{name}", "expr": expand(t["expr"], rate_interval="1m")}
        for name, title in (("attainment", "SLO attainment"), ("budget", "Error budget left"))
        for t in _panel(board, title)["targets"]
    ]
    records.append(
        {
            "record": "panel:burn1h",
            "expr": expand(_panel(board, "Burn rate")["targets"][0]["expr"], rate_interval="1m"),
        }
    )
    (tmp_path / "panel.yaml").write_text(
        yaml.safe_dump({"groups": [{"name": "p", "rules": records}]})
    )
    shutil.copy(ROOT / "alerts" / "kvtax-recording.yaml", tmp_path / "recording.yaml")
    where = 'namespace="llm",pod="vllm-0",model_name="tiny-llama"'
    test = {
        "rule_files": ["recording.yaml", "panel.yaml"],
        "evaluation_interval": "1m",
        "group_eval_order": ["kvtax-recording", "p"],
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {
                        "series": f'kvtax_requests_total{{{where},outcome="completed"}}',
                        "values": "0+97x70",
                    },
                    {
                        "series": f'kvtax_requests_total{{{where},outcome="shed"}}',
                        "values": "0+3x70",
                    },
                    {"series": f"kvtax_slo_met_requests_total{{{where}}}", "values": "0+97x70"},
                ],
                "promql_expr_test": [
                    {
                        "expr": f"round({name} * 1000)",
                        "eval_time": "70m",
                        "exp_samples": [{"labels": '{model_name="tiny-llama"}', "value": value}],
                    }
                    for name, value in (
                        ("panel:attainment", 970),
                        ("panel:budget", -2000),
                        ("panel:burn1h", 3000),
                    )
                ],
            }
        ],
    }
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(test))
    result = subprocess.run(
        [_promtool(), "test", "rules", "test.yaml"],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_preemptions_per_request_come_from_vllm_s_histogram() -> None:
    board = _overview()
    preempted = _panel(board, "Requests preempted")
    exprs = [t["expr"] for t in preempted["targets"]]
    assert [t["legendFormat"] for t in preempted["targets"]] == [
        "at least once {{model_name}}",
        "twice or more {{model_name}}",
    ]
    # At least once: all but the 0.5 bucket (never preempted); twice or more: all but le=1.
    assert 'le="0.5"' in exprs[0]
    assert 'le="1.0"' in exprs[1]
    for expr in exprs:
        assert series_names(expr) == {
            "vllm:request_num_preemptions_bucket",
            "vllm:request_num_preemptions_count",
        }
        assert expr.startswith("1 - ")
    # The flag the description advises is the one the testbed's engines run with.
    assert f"--custom-histogram-buckets '{PREEMPTION_BUCKETS}'" in preempted["description"]
    per_request = _panel(board, "Preemptions per request")
    p99, mean = (t["expr"] for t in per_request["targets"])
    assert p99.startswith("histogram_quantile(0.99, ")
    assert series_names(mean) == {
        "vllm:request_num_preemptions_sum",
        "vllm:request_num_preemptions_count",
    }
    assert _row_of(board, "Requests preempted") == "KV pressure"


def test_finished_requests_are_split_by_vllm_s_reason() -> None:
    panel = _panel(_overview(), "Finished requests by reason")
    (target,) = panel["targets"]
    assert target["expr"].startswith("sum by (model_name, finished_reason) (rate(")
    assert series_names(target["expr"]) == {"vllm:request_success_total"}
    for reason in ("stop", "length", "abort", "error"):
        assert reason in panel["description"]


def test_proxy_errors_split_every_failing_outcome_into_4xx_or_5xx() -> None:
    panel = _panel(_overview(), "Proxy 4xx and 5xx")
    four, five = (t["expr"] for t in panel["targets"])

    def outcomes(expr: str) -> set[str]:
        matched = expr.split('outcome=~"', 1)[1].split('"', 1)[0]
        return set(matched.split("|"))

    assert outcomes(four) == {"upstream_4xx", "too_large", "shed"}
    assert outcomes(five) == {"upstream_error", "shutdown"}
    # Every outcome of the ledger is an error of one kind, or not an error of the proxy's.
    assert outcomes(four) | outcomes(five) | {"completed", "client_disconnected"} == set(OUTCOMES)
    # Shares of all the proxy's requests, whatever their outcome.
    every = sum_rate("kvtax_requests_total")
    for expr in (four, five):
        assert expr.endswith(f"/ {every}")


def test_the_gate_row_and_its_panels_are_called_gate() -> None:
    board = _overview()
    rows = [p["title"] for p in board["panels"] if p["type"] == "row"]
    assert rows[-1] == "Gate"
    gate = [p["title"] for p in panels(board) if _row_of(board, p["title"]) == "Gate"]
    assert gate == ["Gate cap", "Gate queue", "Gate answers"]
    titles = " ".join(p["title"] for p in board["panels"])
    assert "Admission" not in titles
