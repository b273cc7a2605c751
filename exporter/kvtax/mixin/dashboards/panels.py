"""One panel of a board as Grafana's panel JSON: field config, options and targets.

Every panel and target points at the ``datasource`` variable; a panel's description and links
end in its runbook section; threshold steps tied to a rules setting take the configured value.
Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable

from kvtax.mixin.dashboards.model import DATASOURCE, JSON, Configured, Panel, Setting, Threshold

__all__ = ["panel_json"]


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
    if panel.no_data:
        defaults["noValue"] = panel.no_data
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


def _made(value: str | Configured) -> str:
    if not isinstance(value, str):
        raise TypeError("a configured query reached the panel: render() makes it first")
    return value


def _ref_ids(panel: Panel) -> list[str]:
    return [chr(ord("A") + i) for i in range(len(panel.targets))]


def panel_json(
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
                "expr": query(_made(t.expr)),
                "legendFormat": _made(t.legend) or "__auto",
                "range": not (t.instant or panel.kind != "timeseries"),
                "instant": t.instant or panel.kind != "timeseries",
                "editorMode": "code",
            }
            for ref, t in zip(_ref_ids(panel), panel.targets, strict=True)
        ],
    }
