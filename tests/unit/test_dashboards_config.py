"""``kvtax dashboards generate --config FILE.yaml``: thresholds, runbooks and the cluster label.

The same file as ``kvtax rules --config``. With ``cluster_label`` each board gets a ``cluster``
variable that narrows the others, every query takes it and groups by it, and every query still
parses as PromQL. The boards link vLLM's own dashboards (tag ``vllm``) with the variables, so
``model_name`` carries over.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import promql_parser
import pytest

from kvtax.cli.main import main
from kvtax.mixin.dashboards import dashboards
from kvtax.mixin.dashboards.queries import expand
from kvtax.mixin.rules.configfile import from_mapping
from kvtax_dev.dashboard_lint import problems, queries

CLUSTERED = from_mapping(
    {
        "cluster_label": "cluster",
        "tax_warning": 0.1,
        "tax_critical": 0.3,
        "runbook_url_base": "https://wiki.example.com/kvtax/runbooks.md",
    }
)


@pytest.fixture(scope="module")
def boards() -> dict[str, dict[str, Any]]:
    return dashboards(CLUSTERED)


def exprs(doc: dict[str, Any]) -> list[str]:
    return [str(target["expr"]) for _, target in queries(doc)]


def test_the_cluster_variable_comes_first_and_narrows_the_others(
    boards: dict[str, dict[str, Any]],
) -> None:
    for doc in boards.values():
        variables = {v["name"]: v for v in doc["templating"]["list"]}
        assert list(variables) == ["datasource", "cluster", "namespace", "pod", "model_name"]
        assert variables["cluster"]["definition"].endswith(", cluster)")
        for name in ("namespace", "pod", "model_name"):
            assert 'cluster=~"$cluster"' in variables[name]["definition"], name


def test_every_query_takes_the_cluster_and_groups_by_it(
    boards: dict[str, dict[str, Any]],
) -> None:
    for name, doc in boards.items():
        for expr in exprs(doc):
            for selector in re.findall(r"\{[^{}]*\}", expr):
                if "$model_name" in selector:
                    assert 'cluster=~"$cluster"' in selector, (name, expr)
            for labels in re.findall(r"\b(?:by|on)\s*\(([^)]*)\)", expr):
                assert labels.split(",")[0].strip() == "cluster", (name, expr)
            # Still PromQL: filled in as Grafana would, the query parses.
            promql_parser.parse(expand(expr, rate_interval="1m"))


def test_default_boards_have_no_cluster() -> None:
    text = json.dumps(dashboards())
    assert "cluster" not in text


def test_thresholds_and_runbooks_follow_the_config(boards: dict[str, dict[str, Any]]) -> None:
    steps = {
        step["value"]
        for doc in boards.values()
        for panel in doc["panels"]
        for step in panel.get("fieldConfig", {})
        .get("defaults", {})
        .get("thresholds", {})
        .get("steps", [])
    }
    assert {0.1, 0.3} <= steps
    assert not {0.05, 0.2} & steps
    text = json.dumps(boards)
    assert "https://wiki.example.com/kvtax/runbooks.md#" in text


def test_the_boards_link_vllms_dashboards_with_their_variables() -> None:
    for doc in dashboards().values():
        (link,) = [x for x in doc["links"] if x.get("tags") == ["vllm"]]
        assert link["type"] == "dashboards"
        assert link["includeVars"] is True
        assert link["keepTime"] is True


def test_the_clustered_boards_pass_the_lint() -> None:
    # The lint knows the default runbook base only; the rest of its checks hold.
    clustered = dashboards(from_mapping({"cluster_label": "cluster"}))
    for name, doc in clustered.items():
        assert problems(doc) == [], name


def test_the_cli_writes_configured_boards_and_refuses_a_bad_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "rules.yaml"
    config.write_text("cluster_label: cluster\n")
    out = tmp_path / "boards"
    assert main(["dashboards", "generate", "--config", str(config), "--out", str(out)]) == 0
    overview = json.loads((out / "kvtax-overview.json").read_text())
    assert overview["templating"]["list"][1]["name"] == "cluster"
    config.write_text("cluster_label: 'not a label'\n")
    assert main(["dashboards", "generate", "--config", str(config), "--out", str(out)]) == 2
    assert "cluster_label: expected a Prometheus label name" in capsys.readouterr().err
