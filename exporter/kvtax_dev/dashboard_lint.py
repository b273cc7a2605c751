"""Structural checks of a Grafana dashboard, beyond what a JSON schema can say.

:func:`problems` returns one readable line per violation, so a test can assert the list is
empty and a negative test can assert which rule caught a broken dashboard. The rules: unique
panel ids; panels inside the 24-column grid and never overlapping; every panel and target on the
``datasource`` variable and no data source uid anywhere; a ``$__rate_interval`` range in every
range selector; on every panel a unit and a description linking an alert's runbook section;
the shared tag; and every series a query names known to the catalog, the vLLM vocabulary or
the recording rules.
Pure: no I/O.

Example::

    >>> problems({"uid": "x", "panels": [], "templating": {"list": []}, "tags": []})[:1]
    ['uid x does not start with kvtax-']
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

from kvtax.mixin.dashboards.model import DATASOURCE, GRID_WIDTH, JSON, TAG
from kvtax.mixin.dashboards.queries import RATE_INTERVAL
from kvtax.mixin.rules.alerts import every_alert_name
from kvtax.mixin.rules.config import DEFAULT as RULES
from kvtax_dev.promql import known_series, series_names

__all__ = ["panels", "problems", "queries"]

_RANGE = re.compile(r"\[([^\]]*)\]")
_RUNBOOK = re.compile(r"runbooks\.md#([\w-]+)")


def panels(dashboard: JSON) -> Iterator[JSON]:
    """Every panel that shows data (rows excluded), in order."""
    for panel in dashboard.get("panels", []):
        if panel.get("type") != "row":
            yield panel


def queries(dashboard: JSON) -> Iterator[tuple[JSON, JSON]]:
    """(panel, target) for every query of every panel."""
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            yield panel, target


def _datasource_uids(node: Any, path: str = "") -> Iterator[str]:
    """Paths of data source references that are not the ``$datasource`` variable."""
    if isinstance(node, dict):
        for key, value in node.items():
            here = f"{path}.{key}" if path else key
            if key == "datasource" and value != DATASOURCE and not _is_variable_source(value):
                yield f"{here}={value!r}"
            else:
                yield from _datasource_uids(value, here)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _datasource_uids(value, f"{path}[{i}]")


def _is_variable_source(value: Any) -> bool:
    # The datasource variable's own "query" names the plugin type, not a source.
    return isinstance(value, str) and value.startswith("$")


def _overlaps(a: JSON, b: JSON) -> bool:
    return bool(
        a["x"] < b["x"] + b["w"]
        and b["x"] < a["x"] + a["w"]
        and a["y"] < b["y"] + b["h"]
        and b["y"] < a["y"] + a["h"]
    )


def problems(dashboard: JSON, *, known: Iterable[str] | None = None) -> list[str]:
    """Every structural problem of ``dashboard``; empty when it is sound.

    ``known`` defaults to :func:`kvtax_dev.promql.known_series`: the catalog, the vLLM
    vocabulary, the recording rules and Prometheus' own series.
    """
    names = set(known_series(RULES) if known is None else known)
    # Either choice of slo_alerting: a panel may link the alert of the other (its section exists).
    anchors = {RULES.runbook_url(a).rpartition("#")[2] for a in every_alert_name(RULES)}
    out: list[str] = []
    uid = str(dashboard.get("uid", ""))
    if not uid.startswith("kvtax-"):
        out.append(f"uid {uid} does not start with kvtax-")
    if TAG not in dashboard.get("tags", []):
        out.append(f"tag {TAG!r} missing")
    variables = {v.get("name"): v for v in dashboard.get("templating", {}).get("list", [])}
    source = variables.get("datasource")
    if source is None or source.get("type") != "datasource" or source.get("query") != "prometheus":
        out.append("no datasource variable of type prometheus")

    every = dashboard.get("panels", [])
    ids = [p.get("id") for p in every]
    for dup in sorted({i for i in ids if ids.count(i) > 1}, key=str):
        out.append(f"panel id {dup} used more than once")
    for i, a in enumerate(every):
        pos = a.get("gridPos", {})
        if pos.get("x", -1) < 0 or pos.get("x", 0) + pos.get("w", 0) > GRID_WIDTH:
            out.append(f"panel {a.get('title')!r} outside the grid: {pos}")
        if pos.get("w", 0) <= 0 or pos.get("h", 0) <= 0:
            out.append(f"panel {a.get('title')!r} has no area: {pos}")
        for b in every[i + 1 :]:
            if pos and b.get("gridPos") and _overlaps(pos, b["gridPos"]):
                out.append(f"panels {a.get('title')!r} and {b.get('title')!r} overlap")

    out += [f"hard-coded data source at {p}" for p in _datasource_uids(dashboard)]

    for panel in panels(dashboard):
        title = panel.get("title")
        if panel.get("datasource") != DATASOURCE:
            out.append(f"panel {title!r} does not use the datasource variable")
        if not panel.get("fieldConfig", {}).get("defaults", {}).get("unit"):
            out.append(f"panel {title!r} has no unit")
        linked = _RUNBOOK.findall(str(panel.get("description", "")))
        if not linked:
            out.append(f"panel {title!r} has no description linking a runbook")
        out += [f"panel {title!r} links unknown runbook #{a}" for a in linked if a not in anchors]
        if not panel.get("targets"):
            out.append(f"panel {title!r} has no query")
    for panel, target in queries(dashboard):
        title, expr = panel.get("title"), str(target.get("expr", ""))
        if target.get("datasource") != DATASOURCE:
            out.append(f"a query of {title!r} does not use the datasource variable")
        for window in _RANGE.findall(expr):
            if window != RATE_INTERVAL:
                out.append(f"{title!r}: range [{window}] instead of [{RATE_INTERVAL}]")
        out += [f"{title!r}: unknown series {n}" for n in sorted(series_names(expr) - names)]
    return out
