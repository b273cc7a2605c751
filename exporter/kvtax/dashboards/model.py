"""Value types for dashboards as code, and their rendering into Grafana's dashboard JSON.

A :class:`Board` is rows of :class:`Panel` values; :func:`render` lays the panels out on
Grafana's 24-column grid, numbers them, attaches the ``datasource`` variable to every panel and
every target, and writes the namespace/pod/model_name variables (model_name as in vLLM's own
dashboards, so a link carries the choice across), the shared tag and a uid derived from the
title. With a cluster label it adds a ``cluster`` variable and narrows and groups every query by
it (:func:`with_cluster`); threshold steps tied to a rules setting take the configured value.
Only this module knows the shape of Grafana's JSON; the board definitions say what to show, not
how Grafana stores it. Pure: no I/O.

Example::

    board = Board("Overview", "...", rows=(Row("Now", (Panel(...),)),))
    render(board, runbook_url=RULES.runbook_url, anchor_metric="kvtax_kv_capacity_tokens")
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "DATASOURCE",
    "GRID_WIDTH",
    "JSON",
    "SCHEMA_VERSION",
    "TAG",
    "Board",
    "Panel",
    "Row",
    "Target",
    "Threshold",
    "ValueText",
    "render",
    "uid_for",
    "with_cluster",
]

JSON = dict[str, Any]
TAG = "kvtax"
GRID_WIDTH = 24
SCHEMA_VERSION = 39
# Every panel and target points at the variable, never at a uid: the JSON imports into any
# Grafana whose Prometheus data source has any name.
DATASOURCE: JSON = {"type": "prometheus", "uid": "${datasource}"}
PanelKind = Literal["timeseries", "stat", "bargauge"]


@dataclass(frozen=True, slots=True)
class Target:
    """One query of a panel. ``stack`` puts it in the panel's stacking group (areas add up)."""

    expr: str
    legend: str = ""
    color: str | None = None
    stack: bool = False
    dashed: bool = False
    instant: bool = False


@dataclass(frozen=True, slots=True)
class Threshold:
    """A colour step. ``setting`` names the RulesConfig field it mirrors (empty: fixed)."""

    value: float
    color: str
    setting: str = ""


@dataclass(frozen=True, slots=True)
class ValueText:
    """A value mapping: the number ``value`` shows as ``text`` in ``color``."""

    value: int
    text: str
    color: str


@dataclass(frozen=True, slots=True)
class Panel:
    """What one panel shows. ``runbook`` names the alert whose runbook section explains it."""

    title: str
    kind: PanelKind
    targets: tuple[Target, ...]
    unit: str
    description: str
    runbook: str
    width: int = 12
    height: int = 8
    min: float | None = None
    max: float | None = None
    base_color: str = "green"
    thresholds: tuple[Threshold, ...] = ()
    # Draw the thresholds as horizontal lines on a time series (e.g. the 0.85 KV line).
    threshold_lines: bool = False
    mappings: tuple[ValueText, ...] = ()


@dataclass(frozen=True, slots=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


@dataclass(frozen=True, slots=True)
class Board:
    title: str
    description: str
    rows: tuple[Row, ...]
    tags: tuple[str, ...] = ()
    # Variables the board offers; the datasource variable is always there.
    variables: tuple[Literal["namespace", "pod", "model_name"], ...] = (
        "namespace",
        "pod",
        "model_name",
    )


Setting = Callable[[str], float]
# vLLM's official Grafana dashboards carry the tag "vllm" and a model_name variable.
VLLM_DASHBOARDS_TAG = "vllm"
_SELECTOR = re.compile(r'\{(?=[^{}]*(?:model_name=~"\$model_name"|pod=~"\$pod"))')
_GROUPING = re.compile(r"\b(by|on)\s*\(\s*(\))?")


def with_cluster(expr: str, label: str) -> str:
    """``expr`` narrowed to ``$cluster`` and grouped by ``label`` wherever it groups.

    Every selector that takes the model_name or pod variable gains ``label=~"$cluster"``, and every
    ``by (...)`` and ``on (...)`` starts with ``label``: pods of one name in two clusters stay
    two series, as in the rules.
    """
    narrowed = _SELECTOR.sub("{" + f'{label}=~"$cluster", ', expr)
    return _GROUPING.sub(
        lambda m: f"{m.group(1)} ({label})" if m.group(2) else f"{m.group(1)} ({label}, ",
        narrowed,
    )


def uid_for(title: str) -> str:
    """A stable uid from the title, like kubernetes-mixin's uids from file names."""
    return "kvtax-" + re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


def _variables(board: Board, anchor_metric: str, cluster_label: str) -> list[JSON]:
    out: list[JSON] = [
        {
            "name": "datasource",
            "label": "Data source",
            "type": "datasource",
            "query": "prometheus",
            "current": {},
            "hide": 0,
            "refresh": 1,
            "regex": "",
            "includeAll": False,
            "multi": False,
            "options": [],
        }
    ]
    # Each variable narrows the next: pods of the chosen namespaces, models of those pods.
    scopes = {
        "namespace": ("namespace", "Namespace", ""),
        "pod": ("pod", "Pod", 'namespace=~"$namespace"'),
        "model_name": ("model_name", "Model", 'namespace=~"$namespace", pod=~"$pod"'),
    }
    names: list[str] = list(board.variables)
    if cluster_label:
        # The cluster comes first and narrows all the others.
        names.insert(0, "cluster")
        scopes = {
            k: (label, title, ", ".join(filter(None, [f'{cluster_label}=~"$cluster"', scope])))
            for k, (label, title, scope) in scopes.items()
        }
        scopes["cluster"] = (cluster_label, "Cluster", "")
    for name in names:
        label, title, scope = scopes[name]
        query = f"label_values({anchor_metric}{{{scope}}}, {label})"
        out.append(
            {
                "name": name,
                "label": title,
                "type": "query",
                "datasource": dict(DATASOURCE),
                "query": {"query": query, "refId": f"{name}-variable", "qryType": 1},
                "definition": query,
                "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
                "includeAll": True,
                # ".*" also matches an absent label, so a static scrape still shows data.
                "allValue": ".*",
                "multi": True,
                "refresh": 2,
                "regex": "",
                "sort": 1,
                "hide": 0,
                "options": [],
            }
        )
    return out


def _field_config(panel: Panel, setting: Setting | None) -> JSON:
    def value(t: Threshold) -> float:
        return setting(t.setting) if setting is not None and t.setting else t.value

    steps: list[JSON] = [{"color": panel.base_color, "value": None}]
    steps += [{"color": t.color, "value": value(t)} for t in panel.thresholds]
    defaults: JSON = {
        "unit": panel.unit,
        "thresholds": {"mode": "absolute", "steps": steps},
        "color": {"mode": "thresholds" if panel.kind != "timeseries" else "palette-classic"},
        "mappings": [],
    }
    if panel.min is not None:
        defaults["min"] = panel.min
    if panel.max is not None:
        defaults["max"] = panel.max
    if panel.mappings:
        defaults["mappings"] = [
            {
                "type": "value",
                "options": {
                    str(m.value): {"text": m.text, "color": m.color, "index": i}
                    for i, m in enumerate(panel.mappings)
                },
            }
        ]
    overrides: list[JSON] = []
    if panel.kind == "timeseries":
        defaults["custom"] = {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 10,
            "showPoints": "never",
            "spanNulls": False,
            "stacking": {"mode": "none", "group": "A"},
            "thresholdsStyle": {"mode": "line" if panel.threshold_lines else "off"},
        }
        for ref, target in zip(_ref_ids(panel), panel.targets, strict=True):
            props: list[JSON] = []
            if target.color:
                props.append(
                    {"id": "color", "value": {"mode": "fixed", "fixedColor": target.color}}
                )
            if target.stack:
                props += [
                    {"id": "custom.stacking", "value": {"mode": "normal", "group": "stack"}},
                    {"id": "custom.fillOpacity", "value": 40},
                ]
            if target.dashed:
                props.append(
                    {"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}}
                )
            if props:
                overrides.append(
                    {"matcher": {"id": "byFrameRefID", "options": ref}, "properties": props}
                )
    return {"defaults": defaults, "overrides": overrides}


def _options(panel: Panel) -> JSON:
    if panel.kind == "timeseries":
        return {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
    reduce = {"calcs": ["lastNotNull"], "fields": "", "values": False}
    if panel.kind == "stat":
        return {
            "reduceOptions": reduce,
            "colorMode": "background",
            "graphMode": "none",
            "justifyMode": "auto",
            "orientation": "auto",
            "textMode": "value_and_name",
        }
    return {
        "reduceOptions": reduce,
        "displayMode": "gradient",
        "orientation": "horizontal",
        "showUnfilled": True,
    }


def _ref_ids(panel: Panel) -> list[str]:
    return [chr(ord("A") + i) for i in range(len(panel.targets))]


def _panel(
    panel: Panel,
    pid: int,
    pos: JSON,
    runbook_url: Callable[[str], str],
    *,
    setting: Setting | None,
    query: Callable[[str], str],
) -> JSON:
    link = runbook_url(panel.runbook)
    return {
        "id": pid,
        "type": panel.kind,
        "title": panel.title,
        "description": f"{panel.description} [Runbook]({link})",
        "datasource": dict(DATASOURCE),
        "gridPos": pos,
        "fieldConfig": _field_config(panel, setting),
        "options": _options(panel),
        "links": [{"title": "Runbook", "url": link, "targetBlank": True}],
        "targets": [
            {
                "refId": ref,
                "datasource": dict(DATASOURCE),
                "expr": query(t.expr),
                "legendFormat": t.legend or "__auto",
                "range": not (t.instant or panel.kind != "timeseries"),
                "instant": t.instant or panel.kind != "timeseries",
                "editorMode": "code",
            }
            for ref, t in zip(_ref_ids(panel), panel.targets, strict=True)
        ],
    }


def render(
    board: Board,
    *,
    runbook_url: Callable[[str], str],
    anchor_metric: str,
    setting: Setting | None = None,
    cluster_label: str = "",
) -> JSON:
    """Grafana dashboard JSON for ``board``; ``anchor_metric`` feeds the variables' label_values.

    ``setting`` gives a threshold's configured value by its RulesConfig field name;
    ``cluster_label`` adds the cluster variable and grouping.
    """

    def query(expr: str) -> str:
        return with_cluster(expr, cluster_label) if cluster_label else expr

    panels: list[JSON] = []
    pid = 0
    y = 0
    for row in board.rows:
        pid += 1
        panels.append(
            {
                "id": pid,
                "type": "row",
                "title": row.title,
                "collapsed": False,
                "gridPos": {"x": 0, "y": y, "w": GRID_WIDTH, "h": 1},
                "panels": [],
            }
        )
        y += 1
        x, line_height = 0, 0
        for panel in row.panels:
            if x + panel.width > GRID_WIDTH:
                x, y, line_height = 0, y + line_height, 0
            pid += 1
            pos = {"x": x, "y": y, "w": panel.width, "h": panel.height}
            panels.append(_panel(panel, pid, pos, runbook_url, setting=setting, query=query))
            x += panel.width
            line_height = max(line_height, panel.height)
        y += line_height
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
        "links": [
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
        ],
        "templating": {"list": _variables(board, anchor_metric, cluster_label)},
        "panels": panels,
    }
