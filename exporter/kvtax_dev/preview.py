"""Dashboard previews as PNG: every panel's queries run against a live Prometheus, drawn with
matplotlib in the dashboard's own grid layout.

Grafana cannot run everywhere (it cannot run here), yet a picture belongs in bug reports and
docs. :func:`fetch` fills in the template variables as Grafana would and runs every target
through Prometheus' HTTP API; :func:`draw` lays the panels out by their ``gridPos`` and draws
time series (stacking, dashed lines, threshold lines), stat tiles (value mappings and threshold
colours) and bar gauges. It reads the dashboard JSON, not the Python definitions, so the picture
is of what Grafana would load. Beside each PNG it writes ``<uid>.panels.json``, the titles of
the panels it drew and the PNG's sha256: :func:`record_problems` compares that record with the
current dashboards, so a committed picture that no longer shows them fails a test. matplotlib
comes from the ``preview`` extra. :func:`run_preview` is the ``kvtax dashboards preview``
command; its flags stay in :mod:`kvtax.cli.dashboards`, so that an installed kvtax, which has no
preview, can still say where to find one.

Example::

    api = PrometheusApi("http://127.0.0.1:9090")
    data = fetch(dashboard, api, start=t0, end=t1, step=15, rate_interval="1m")
    draw(dashboard, data, Path("overview.png"), start=t0, end=t1)
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import math
import re
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvtax.errors import RulesConfigError
from kvtax.mixin.dashboards.generate import dashboards
from kvtax.mixin.dashboards.model import GRID_WIDTH, JSON
from kvtax.mixin.dashboards.queries import expand
from kvtax.mixin.rules.config import DEFAULT
from kvtax.mixin.rules.configfile import document_of, read
from kvtax.serve.config import parse_duration
from kvtax_dev.dashboard_lint import panels
from kvtax_dev.promapi import PrometheusApi, QueryError, Series

__all__ = [
    "PreviewUnavailableError",
    "TargetData",
    "draw",
    "fetch",
    "first_rows",
    "format_value",
    "legend_text",
    "panel_titles",
    "panels_without_data",
    "rate_interval",
    "record_path",
    "record_problems",
    "require_matplotlib",
    "run_preview",
    "stat_values",
]


class PreviewUnavailableError(RuntimeError):
    """matplotlib is not installed."""


@dataclass(frozen=True, slots=True)
class TargetData:
    """What one target of one panel returned (or the error Prometheus gave)."""

    ref: str
    legend: str
    series: tuple[Series, ...]
    error: str | None = None


def rate_interval(step: float, scrape_interval: float) -> str:
    """Grafana's ``$__rate_interval``: max(4 x scrape interval, step + scrape interval)."""
    return f"{math.ceil(max(4 * scrape_interval, step + scrape_interval))}s"


def legend_text(fmt: str, labels: Mapping[str, str]) -> str:
    """A series name from a ``{{label}}`` legend format, as Grafana builds it."""
    if fmt in ("", "__auto"):
        inner = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()) if k != "__name__")
        return labels.get("__name__", "") + (f"{{{inner}}}" if inner else "") or "value"
    text = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt)
    text = re.sub(r"\s+", " ", text).replace("()", "").strip()
    # Empty labels (no namespace or pod in a static scrape) leave a stray separator.
    return text.removeprefix("/").strip() or "value"


def format_value(value: float, unit: str) -> str:
    if math.isnan(value):
        return "NaN"
    if unit == "percentunit":
        return f"{value * 100:.1f}%"
    if unit == "s":
        return f"{value * 1000:.0f} ms" if abs(value) < 1 else f"{value:.2f} s"
    suffix = {"reqps": " req/s"}.get(unit, "")
    if unit.startswith("suffix:"):
        suffix = " " + unit.removeprefix("suffix:")
    number = f"{value:,.0f}" if abs(value) >= 100 or value == int(value) else f"{value:.3g}"
    return number + suffix


def fetch(
    dashboard: JSON,
    api: PrometheusApi,
    *,
    start: float,
    end: float,
    step: float,
    rate_interval: str,
    values: Mapping[str, str] | None = None,
) -> dict[int, list[TargetData]]:
    """Panel id -> the data of each target, queried over [start, end] (instants at ``end``)."""
    out: dict[int, list[TargetData]] = {}
    for panel in panels(dashboard):
        rows = out.setdefault(int(panel["id"]), [])
        for target in panel.get("targets", []):
            expr = expand(target["expr"], rate_interval=rate_interval, values=dict(values or {}))
            try:
                if target.get("instant") and not target.get("range"):
                    series = api.query(expr, end)
                else:
                    series = api.query_range(expr, start, end, step)
                rows.append(
                    TargetData(target["refId"], target.get("legendFormat", ""), tuple(series))
                )
            except QueryError as exc:
                rows.append(
                    TargetData(target["refId"], target.get("legendFormat", ""), (), str(exc))
                )
    return out


# -- drawing ---------------------------------------------------------------------------------


def require_matplotlib() -> None:
    """Raise :class:`PreviewUnavailableError` with the install hint unless matplotlib imports."""
    _pyplot()


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise PreviewUnavailableError(
            "kvtax dashboards preview needs matplotlib: pip install 'kvtax[preview]'"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _threshold_color(value: float, defaults: JSON) -> str:
    color = "grey"
    for step in defaults.get("thresholds", {}).get("steps", []):
        if step.get("value") is None or value >= step["value"]:
            color = step["color"]
    return color


def _mapped(value: float, defaults: JSON) -> tuple[str, str] | None:
    for mapping in defaults.get("mappings", []):
        hit = mapping.get("options", {}).get(str(int(value))) if value == int(value) else None
        if hit:
            return str(hit["text"]), str(hit["color"])
    return None


def _overrides(panel: JSON) -> dict[str, dict[str, Any]]:
    """refId -> {"color", "stack", "dashed"} from byFrameRefID overrides."""
    out: dict[str, dict[str, Any]] = {}
    for o in panel.get("fieldConfig", {}).get("overrides", []):
        if o.get("matcher", {}).get("id") != "byFrameRefID":
            continue
        props = out.setdefault(o["matcher"]["options"], {})
        for p in o.get("properties", []):
            if p["id"] == "color":
                props["color"] = p["value"].get("fixedColor")
            elif p["id"] == "custom.stacking":
                props["stack"] = p["value"].get("mode") == "normal"
            elif p["id"] == "custom.lineStyle":
                props["dashed"] = True
    return out


def _with_gaps(points: tuple[tuple[float, float], ...]) -> list[tuple[float, float]]:
    """The points with a NaN wherever samples are missing, so lines break as in Grafana.

    A missed scrape leaves a hole in a range query's steps; bridging it would draw a trend
    that was never measured.
    """
    if len(points) < 3:
        return list(points)
    steps = sorted(b[0] - a[0] for a, b in itertools.pairwise(points))
    usual = steps[len(steps) // 2]
    out = [points[0]]
    for prev, point in itertools.pairwise(points):
        if point[0] - prev[0] > 1.5 * usual:
            out.append(((prev[0] + point[0]) / 2, math.nan))
        out.append(point)
    return out


def _last(series: Series) -> float | None:
    return series.points[-1][1] if series.points else None


def _no_data(ax: Any, data: list[TargetData], why: str = "") -> None:
    """What an empty panel says: the first query error, else the panel's own reason (Grafana's
    noValue), else "no data"."""
    errors = [d.error for d in data if d.error]
    ax.text(
        0.5,
        0.5,
        "query error: " + errors[0][:80] if errors else why or "no data",
        ha="center",
        va="center",
        transform=ax.transAxes,
        color="grey",
        fontsize=8,
    )


def _draw_timeseries(ax: Any, panel: JSON, data: list[TargetData]) -> None:
    from matplotlib.ticker import FuncFormatter

    defaults = panel["fieldConfig"]["defaults"]
    unit = defaults.get("unit", "short")
    styles = _overrides(panel)
    stack_base: dict[float, float] = {}
    drawn = 0
    for target in data:
        style = styles.get(target.ref, {})
        for series in target.series:
            if not series.points:
                continue
            points = _with_gaps(series.points)
            times = [datetime.fromtimestamp(t, UTC) for t, _ in points]
            values = [v for _, v in points]
            label = legend_text(target.legend, series.labels)
            if style.get("stack"):
                low = [stack_base.get(t, 0.0) for t, _ in points]
                high = [lo + v for lo, v in zip(low, values, strict=True)]
                ax.fill_between(times, low, high, alpha=0.45, color=style.get("color"), label=label)
                for (t, _), h in zip(points, high, strict=True):
                    stack_base[t] = h
            else:
                ax.plot(
                    times,
                    values,
                    linewidth=1.2,
                    linestyle="--" if style.get("dashed") else "-",
                    color=style.get("color"),
                    label=label,
                )
            drawn += 1
    if not drawn:
        _no_data(ax, data, str(defaults.get("noValue", "")))
    if defaults.get("custom", {}).get("thresholdsStyle", {}).get("mode") == "line":
        for step in defaults.get("thresholds", {}).get("steps", []):
            if step.get("value") is not None:
                ax.axhline(step["value"], color=step["color"], linewidth=1, linestyle=":")
    if "min" in defaults:
        ax.set_ylim(bottom=defaults["min"])
    if "max" in defaults:
        ax.set_ylim(top=defaults["max"])
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: format_value(v, unit)))
    ax.xaxis.set_major_formatter(
        # Matplotlib date numbers are days since its epoch, 1970-01-01 by default.
        FuncFormatter(lambda v, _pos: f"{datetime.fromtimestamp(v * 86400, UTC):%H:%M:%S}")
    )
    ax.tick_params(labelsize=6)
    ax.grid(True, alpha=0.3)
    if drawn:
        ax.legend(fontsize=5.5, loc="upper left", framealpha=0.6, ncol=1 if drawn < 4 else 2)


def _draw_stat(ax: Any, panel: JSON, data: list[TargetData]) -> None:
    defaults = panel["fieldConfig"]["defaults"]
    unit = defaults.get("unit", "none")
    tiles = [
        (legend_text(t.legend, s.labels), v)
        for t in data
        for s in t.series
        if (v := _last(s)) is not None
    ]
    ax.set_axis_off()
    if not tiles:
        _no_data(ax, data, str(defaults.get("noValue", "")))
        return
    width = 1 / len(tiles)
    # Scale text to the tile: a panel split into three tiles gets smaller print.
    span = ax.get_position().width * len(tiles) ** -1
    big, small = min(16.0, 130 * span), min(8.0, 75 * span)
    # Characters that fit across one tile at the label's size (about 0.55 em per character).
    fits = max(8, int(span * ax.figure.get_figwidth() * 72 / (0.55 * small)))
    for i, (name, value) in enumerate(tiles):
        label = name.replace(" (", "\n(", 1) if len(name) > fits else name
        mapped = _mapped(value, defaults)
        text, color = mapped or (format_value(value, unit), _threshold_color(value, defaults))
        ax.add_patch(_rect((i * width + 0.01, 0.02), width - 0.02, 0.96, color, ax.transAxes))
        ax.text(
            i * width + width / 2,
            0.55,
            text,
            ha="center",
            va="center",
            fontsize=big,
            color="white",
            weight="bold",
            transform=ax.transAxes,
        )
        ax.text(
            i * width + width / 2,
            0.18,
            label,
            ha="center",
            va="center",
            fontsize=small,
            color="white",
            transform=ax.transAxes,
        )


def _rect(xy: tuple[float, float], w: float, h: float, color: str, transform: Any) -> Any:
    from matplotlib.patches import Rectangle

    return Rectangle(xy, w, h, color=color, transform=transform, alpha=0.85)


def _draw_bargauge(ax: Any, panel: JSON, data: list[TargetData]) -> None:
    from matplotlib.ticker import FuncFormatter

    defaults = panel["fieldConfig"]["defaults"]
    unit = defaults.get("unit", "short")
    bars = [
        (legend_text(t.legend, s.labels), v)
        for t in data
        for s in t.series
        if (v := _last(s)) is not None
    ]
    if not bars:
        ax.set_axis_off()
        _no_data(ax, data, str(defaults.get("noValue", "")))
        return
    bars.sort(key=lambda b: b[1])
    labels = [b[0] for b in bars]
    values = [b[1] for b in bars]
    colors = [_threshold_color(v, defaults) for v in values]
    ax.barh(range(len(bars)), values, color=colors, height=0.6)
    ax.set_yticks([])
    top = defaults.get("max", max(values) * 1.1 if max(values) > 0 else 1)
    ax.set_xlim(defaults.get("min", 0), top)
    for i, (label, v) in enumerate(zip(labels, values, strict=True)):
        ax.text(0, i + 0.32, label, va="bottom", fontsize=7)
        ax.text(v, i, " " + format_value(v, unit), va="center", fontsize=8, weight="bold")
    ax.set_ylim(-0.5, len(bars) - 0.1)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: format_value(v, unit)))
    ax.tick_params(labelsize=6.5)


def _fit(text: Any, inches: float, dpi: int) -> None:
    """Shrink ``text`` until it is at most ``inches`` wide, as a panel header never overflows
    its panel (Grafana cuts it short; a smaller font keeps every word)."""
    renderer = text.figure.canvas.get_renderer()
    # Glyph widths do not scale exactly with the size (hinting): shrink until it fits.
    for _ in range(8):
        width = text.get_window_extent(renderer=renderer).width / dpi
        if width <= inches or text.get_fontsize() <= 5:
            return
        text.set_fontsize(max(5.0, text.get_fontsize() * inches / width * 0.97))


# Inches around a panel's plot area inside its grid cell: left, bottom, right, top (title).
_PADDING = {
    "timeseries": (0.62, 0.28, 0.08, 0.26),
    "stat": (0.06, 0.06, 0.06, 0.26),
    "bargauge": (0.08, 0.22, 0.5, 0.26),
    "row": (0.0, 0.0, 0.0, 0.0),
}


def draw(
    dashboard: JSON,
    data: Mapping[int, list[TargetData]],
    path: Path,
    *,
    start: float,
    end: float,
    width_inches: float = 14.0,
    dpi: int = 80,
    rules: Mapping[str, Any] | None = None,
) -> Path:
    """Draw every panel at its grid position into one PNG at ``path``, and record beside it
    (:func:`record_path`) the dashboard's uid, the span drawn, the PNG's sha256, the title of
    every panel drawn, those without data, and ``rules``: the settings document
    (:func:`~kvtax.mixin.rules.configfile.document_of`) the dashboards were built from."""
    plt = _pyplot()
    every = dashboard.get("panels", [])
    rows = max((p["gridPos"]["y"] + p["gridPos"]["h"] for p in every), default=1)
    # Grafana's grid unit is 30 px high against columns 1/24 of a ~1,800 px screen.
    unit_w = width_inches / GRID_WIDTH
    unit_h = unit_w * 0.45
    header = 0.45
    height = header + rows * unit_h
    fig = plt.figure(figsize=(width_inches, height), dpi=dpi)
    span = (
        f"{datetime.fromtimestamp(start, UTC):%Y-%m-%d %H:%M:%S} to "
        f"{datetime.fromtimestamp(end, UTC):%H:%M:%S} UTC"
    )
    fig.text(0.005, 1 - 0.3 / height, f"{dashboard.get('title', '')}   ({span})", fontsize=12)
    for panel in every:
        pos = panel["gridPos"]
        left, bottom, right, top = _PADDING.get(panel["type"], _PADDING["timeseries"])
        x0 = pos["x"] * unit_w + left
        y_top = header + pos["y"] * unit_h + top
        w = pos["w"] * unit_w - left - right
        h = pos["h"] * unit_h - top - bottom
        ax = fig.add_axes(
            (x0 / width_inches, 1 - (y_top + h) / height, w / width_inches, h / height)
        )
        if panel["type"] == "row":
            ax.set_axis_off()
            ax.text(0.005, 0.3, panel["title"], fontsize=10, weight="bold", transform=ax.transAxes)
            continue
        # The title sits in the top padding, like a Grafana panel header.
        inset = left if panel["type"] == "timeseries" else 0.0
        title = ax.text(
            -inset / w,
            1 + 0.06 / h,
            panel["title"],
            fontsize=8.5,
            weight="bold",
            transform=ax.transAxes,
        )
        _fit(title, pos["w"] * unit_w - (left - inset) - 0.05, dpi)
        rows_data = data.get(int(panel["id"]), [])
        if panel["type"] == "timeseries":
            _draw_timeseries(ax, panel, rows_data)
            # The dashboard's time range, drawn or not: an empty panel keeps the same axis.
            ax.set_xlim(datetime.fromtimestamp(start, UTC), datetime.fromtimestamp(end, UTC))
        elif panel["type"] == "stat":
            _draw_stat(ax, panel, rows_data)
        else:
            _draw_bargauge(ax, panel, rows_data)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    _write_record(dashboard, path, data, start=start, end=end, rules=rules)
    return path


# -- what a picture shows --------------------------------------------------------------------


def panel_titles(dashboard: JSON) -> list[str]:
    """The title of every panel :func:`draw` draws (rows included), in the dashboard's order."""
    return [str(p["title"]) for p in dashboard.get("panels", [])]


def _has_value(rows: list[TargetData]) -> bool:
    return any(
        not math.isnan(value) for row in rows for series in row.series for _, value in series.points
    )


def panels_without_data(dashboard: JSON, data: Mapping[int, list[TargetData]]) -> dict[str, str]:
    """The panels (rows aside) none of whose queries gave a number, what the picture shows
    empty or NaN: title -> the reason the panel gives for it (its noValue), or ``""``."""
    return {
        str(p["title"]): str(p.get("fieldConfig", {}).get("defaults", {}).get("noValue", ""))
        for p in panels(dashboard)
        if not _has_value(list(data.get(int(p["id"]), [])))
    }


def stat_values(
    dashboard: JSON, data: Mapping[int, list[TargetData]]
) -> dict[str, dict[str, float]]:
    """What each stat tile reads: panel title -> series name -> its last finite value."""
    out: dict[str, dict[str, float]] = {}
    for panel in panels(dashboard):
        if panel["type"] != "stat":
            continue
        tiles = out.setdefault(str(panel["title"]), {})
        for row in data.get(int(panel["id"]), []):
            for series in row.series:
                last = _last(series)
                if last is not None and not math.isnan(last):
                    tiles[legend_text(row.legend, series.labels)] = last
    return out


def first_rows(dashboard: JSON, count: int) -> list[str]:
    """The titles of the panels in the first ``count`` rows of the grid, as the eye meets them:
    panels that start at one of the ``count`` smallest heights (row headers aside)."""
    drawn = list(panels(dashboard))
    heights = sorted({int(p["gridPos"]["y"]) for p in drawn})[:count]
    return [str(p["title"]) for p in drawn if int(p["gridPos"]["y"]) in heights]


def record_path(png: Path) -> Path:
    """Where the record of what ``png`` shows lies: ``kvtax-overview.png`` ->
    ``kvtax-overview.panels.json``."""
    return png.with_suffix(".panels.json")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write_record(
    dashboard: JSON,
    png: Path,
    data: Mapping[int, list[TargetData]],
    *,
    start: float,
    end: float,
    rules: Mapping[str, Any] | None,
) -> Path:
    record = {
        "dashboard": dashboard.get("uid", ""),
        "title": dashboard.get("title", ""),
        "from": datetime.fromtimestamp(start, UTC).isoformat(timespec="seconds"),
        "to": datetime.fromtimestamp(end, UTC).isoformat(timespec="seconds"),
        "png_sha256": _sha256(png),
        "panels": panel_titles(dashboard),
        # What a reader checks first: which panels the picture shows empty, and which rules
        # settings the dashboards were built from (the demo's short profile or the default).
        "no_data": panels_without_data(dashboard, data),
        "stats": stat_values(dashboard, data),
        "rules": dict(rules) if rules is not None else None,
    }
    path = record_path(png)
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return path


def record_problems(png: Path, current: Mapping[str, JSON]) -> list[str]:
    """Why the picture ``png`` no longer shows the dashboards ``current`` (uid -> JSON), or
    ``[]``. It must have its record, be the PNG that record was written for, show a dashboard
    that still exists, and show exactly its panel titles in its order."""
    where = record_path(png)
    if not where.is_file():
        return [f"{png.name}: no {where.name} beside it; redraw it with kvtax dashboards preview"]
    record = json.loads(where.read_text(encoding="utf-8"))
    problems = []
    if record.get("png_sha256") != _sha256(png):
        problems.append(f"{png.name} is not the PNG {where.name} was written for")
    uid = record.get("dashboard")
    if uid not in current:
        return [*problems, f"{png.name} shows dashboard {uid!r}, which no longer exists"]
    drawn, now = list(record.get("panels", [])), panel_titles(current[uid])
    gone = [t for t in drawn if t not in now]
    missing = [t for t in now if t not in drawn]
    if gone:
        problems.append(f"{png.name} shows panels the dashboard no longer has: {gone}")
    if missing:
        problems.append(f"{png.name} lacks panels the dashboard has: {missing}")
    if drawn != now and not gone and not missing:
        problems.append(f"{png.name} shows the panels in another order or number than now")
    return problems


# -- the command -----------------------------------------------------------------------------


def _time(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return datetime.fromisoformat(text).timestamp()


def run_preview(args: argparse.Namespace) -> int:
    """``kvtax dashboards preview``, whose flags :mod:`kvtax.cli.dashboards` defines: draw every
    chosen dashboard, then exit 1 if any query failed, 2 on bad flags or without matplotlib."""
    try:
        require_matplotlib()
    except PreviewUnavailableError as exc:
        print(f"kvtax: {exc}", file=sys.stderr)
        return 2

    try:
        end = _time(args.end) if args.end else time.time()
        start = _time(args.start) if args.start else end - parse_duration(args.time_range)
        step = parse_duration(args.step) if args.step else max(1.0, (end - start) / args.points)
        scrape = parse_duration(args.scrape_interval)
        values = dict(v.split("=", 1) for v in args.var)
    except ValueError as exc:
        print(f"kvtax dashboards preview: {exc}", file=sys.stderr)
        return 2
    if not start < end:
        print("kvtax dashboards preview: --from must be before --to", file=sys.stderr)
        return 2
    api = PrometheusApi(args.prometheus)
    try:
        rules = DEFAULT if args.rules_config is None else read(args.rules_config)
    except RulesConfigError as exc:
        print(f"kvtax dashboards preview: {exc}", file=sys.stderr)
        return 2
    chosen = {
        name: doc
        for name, doc in dashboards(rules).items()
        if not args.dashboard or doc["uid"] in args.dashboard
    }
    interval = rate_interval(math.ceil(step), scrape)
    settings = document_of(rules)
    failed = 0
    for doc in chosen.values():
        data = fetch(
            doc, api, start=start, end=end, step=step, rate_interval=interval, values=values
        )
        path = draw(doc, data, args.out / f"{doc['uid']}.png", start=start, end=end, rules=settings)
        errors = [d.error for rows in data.values() for d in rows if d.error]
        empty = panels_without_data(doc, data)
        print(
            f"{path}: {len(errors)} query errors, {len(empty)} panels without data"
            + (f": {', '.join(empty)}" if empty else "")
        )
        if errors:
            print(f"kvtax dashboards preview: first error: {errors[0]}", file=sys.stderr)
        failed += len(errors)
    # The pictures are written either way (a bug report wants them); the status tells CI.
    return 1 if failed else 0
