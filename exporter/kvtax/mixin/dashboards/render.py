"""A :class:`.model.Board` rendered into Grafana's dashboard JSON.

:func:`render` lays the panels out on Grafana's 24-column grid, numbers them, and writes the
variables (:mod:`.templating`), the shared tag, the links to kvtax's and vLLM's dashboards and
a uid derived from the title. With a cluster label it adds a ``cluster`` variable and narrows
and groups every query by it (:func:`.templating.with_cluster`); threshold steps tied to a
rules setting take the configured value, and queries that depend on the settings are made
from them. Only this module and the two it uses
(:mod:`.panels`, :mod:`.templating`) know the shape of Grafana's JSON. Pure: no I/O.

    >>> from kvtax.mixin.dashboards.overview import OVERVIEW
    >>> from kvtax.mixin.rules.config import DEFAULT
    >>> render(OVERVIEW, rules=DEFAULT, anchor_metric="kvtax_kv_capacity_tokens")["uid"]
    'kvtax-overview'
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace

from kvtax.mixin.dashboards.model import (
    GRID_WIDTH,
    JSON,
    SCHEMA_VERSION,
    TAG,
    Board,
    Configured,
    Panel,
    Row,
)
from kvtax.mixin.dashboards.panels import panel_json
from kvtax.mixin.dashboards.templating import variables, with_cluster
from kvtax.mixin.rules.config import RulesConfig

__all__ = ["render", "uid_for"]

# vLLM's official Grafana dashboards carry the tag "vllm" and a model_name variable.
VLLM_DASHBOARDS_TAG = "vllm"


def uid_for(title: str) -> str:
    """A stable uid from the title, like kubernetes-mixin's uids from file names."""
    return "kvtax-" + re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


def render(board: Board, *, rules: RulesConfig, anchor_metric: str) -> JSON:
    """Grafana dashboard JSON for ``board``; ``anchor_metric`` feeds the variables' label_values.

    ``rules`` gives the runbook links, each threshold's configured value (by its RulesConfig
    field name), the queries and legends that depend on the settings, and the cluster label,
    which adds the cluster variable and grouping.
    """
    cluster_label = rules.cluster_label

    def setting(name: str) -> float:
        return float(getattr(rules, name))

    def query(expr: str) -> str:
        return with_cluster(expr, cluster_label) if cluster_label else expr

    def draw(panel: Panel, pid: int, pos: JSON) -> JSON:
        targets = tuple(
            replace(t, expr=_made(t.expr, rules), legend=_made(t.legend, rules))
            for t in panel.targets
        )
        made = replace(panel, targets=targets)
        return panel_json(made, pid, pos, rules.runbook_url, setting=setting, query=query)

    return {
        "uid": uid_for(board.title),
        "title": f"kvtax / {board.title}",
        "description": board.description,
        "tags": [TAG, *board.tags],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "browser",
        "annotations": {"list": []},
        "links": _links(),
        "templating": {"list": variables(board, anchor_metric, cluster_label)},
        "panels": _layout(board, draw),
    }


def _made(value: str | Configured, rules: RulesConfig) -> str:
    return value(rules) if callable(value) else value


def _layout(board: Board, draw: Callable[[Panel, int, JSON], JSON]) -> list[JSON]:
    """Every row header and panel of ``board``, numbered from 1 and placed on the grid.

    Panels fill a line left to right and wrap when the next one would pass the grid's width;
    a line is as tall as its tallest panel.
    """
    panels: list[JSON] = []
    pid = 0
    y = 0
    for row in board.rows:
        pid += 1
        panels.append(_row_header(row, pid, y))
        y += 1
        x, line_height = 0, 0
        for panel in row.panels:
            if x + panel.width > GRID_WIDTH:
                x, y, line_height = 0, y + line_height, 0
            pid += 1
            pos = {"x": x, "y": y, "w": panel.width, "h": panel.height}
            panels.append(draw(panel, pid, pos))
            x += panel.width
            line_height = max(line_height, panel.height)
        y += line_height
    return panels


def _row_header(row: Row, pid: int, y: int) -> JSON:
    return {
        "id": pid,
        "type": "row",
        "title": row.title,
        "collapsed": False,
        "gridPos": {"x": 0, "y": y, "w": GRID_WIDTH, "h": 1},
        "panels": [],
    }


def _links() -> list[JSON]:
    # A fresh list per board: callers may edit one dashboard's JSON without touching another.
    return [
        {
            "title": "kvtax dashboards",
            "type": "dashboards",
            "tags": [TAG],
            "asDropdown": True,
            "includeVars": True,
            "keepTime": True,
        },
        {
            # vLLM's own dashboards: the model_name variable carries over.
            "title": "vLLM dashboards",
            "type": "dashboards",
            "tags": [VLLM_DASHBOARDS_TAG],
            "asDropdown": True,
            "includeVars": True,
            "keepTime": True,
        },
    ]
