"""Value types for dashboards as code: a :class:`Board` is rows of :class:`Panel` values.

The board definitions (:mod:`.overview`, :mod:`.capacity`, :mod:`.fleet`) build these; they
say what to show, not how Grafana stores it. :mod:`.render` turns a board into Grafana's
dashboard JSON. The constants here (the tag, the grid width, the datasource reference) are the
ones the renderer and the lint share. Pure: no I/O.

Example::

    board = Board("Overview", "...", rows=(Row("Now", (Panel(...),)),))
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from kvtax.mixin.rules.config import RulesConfig

__all__ = [
    "DATASOURCE",
    "GRID_WIDTH",
    "JSON",
    "SCHEMA_VERSION",
    "TAG",
    "Board",
    "Configured",
    "Panel",
    "Row",
    "Setting",
    "Target",
    "Threshold",
    "ValueText",
]

JSON = dict[str, Any]
TAG = "kvtax"
GRID_WIDTH = 24
SCHEMA_VERSION = 39
# Every panel and target points at the variable, never at a uid: the JSON imports into any
# Grafana whose Prometheus data source has any name.
DATASOURCE: JSON = {"type": "prometheus", "uid": "${datasource}"}
PanelKind = Literal["timeseries", "stat", "bargauge"]


# A query or legend that depends on the rules' settings (the objective's unit, windows and
# budget), made from the RulesConfig a dashboard is rendered with.
Configured = Callable[[RulesConfig], str]


@dataclass(frozen=True, slots=True)
class Target:
    """One query of a panel. ``stack`` puts it in the panel's stacking group (areas add up).

    ``expr`` and ``legend`` may be :data:`Configured`: the renderer calls them with its config,
    so ``kvtax dashboards generate --config`` moves the query with the rules it reads.
    """

    expr: str | Configured
    legend: str | Configured = ""
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
    # What the panel shows instead of "No data" (Grafana's noValue), where an empty panel is
    # expected in a common setup: the gate off, no KV connector.
    no_data: str = ""


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


# A threshold's configured value, by its RulesConfig field name.
Setting = Callable[[str], float]
