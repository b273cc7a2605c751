"""A JSON Schema (draft 2020-12) for the subset of Grafana's dashboard model kvtax generates.

Grafana publishes no standalone schema for dashboard JSON that validates offline, so this one
spells out what kvtax relies on: the variables, row and data panels (time series, stat, bar
gauge), grid positions, field config with a unit, thresholds and value mappings, and Prometheus
targets that can only point at the ``${datasource}`` variable. The tests validate every
committed dashboard against it with ``jsonschema``. Pure data.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SCHEMA"]

_DATASOURCE = {
    "type": "object",
    "required": ["type", "uid"],
    "properties": {"type": {"const": "prometheus"}, "uid": {"const": "${datasource}"}},
    "additionalProperties": False,
}

_GRID = {
    "type": "object",
    "required": ["x", "y", "w", "h"],
    "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 23},
        "y": {"type": "integer", "minimum": 0},
        "w": {"type": "integer", "minimum": 1, "maximum": 24},
        "h": {"type": "integer", "minimum": 1},
    },
    "additionalProperties": False,
}

_COLOR = {"type": "string", "minLength": 1}

_THRESHOLDS = {
    "type": "object",
    "required": ["mode", "steps"],
    "properties": {
        "mode": {"enum": ["absolute", "percentage"]},
        "steps": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["color", "value"],
                "properties": {"color": _COLOR, "value": {"type": ["number", "null"]}},
                "additionalProperties": False,
            },
        },
    },
}

_MAPPING = {
    "type": "object",
    "required": ["type", "options"],
    "properties": {
        "type": {"const": "value"},
        "options": {
            "type": "object",
            "patternProperties": {
                "^-?[0-9]+$": {
                    "type": "object",
                    "required": ["text", "color", "index"],
                    "properties": {
                        "text": {"type": "string"},
                        "color": _COLOR,
                        "index": {"type": "integer"},
                    },
                }
            },
            "additionalProperties": False,
        },
    },
}

_TARGET = {
    "type": "object",
    "required": ["refId", "datasource", "expr", "legendFormat", "range", "instant"],
    "properties": {
        "refId": {"type": "string", "pattern": "^[A-Z]$"},
        "datasource": {"$ref": "#/$defs/datasource"},
        "expr": {"type": "string", "minLength": 1},
        "legendFormat": {"type": "string", "minLength": 1},
        "range": {"type": "boolean"},
        "instant": {"type": "boolean"},
        "editorMode": {"enum": ["code", "builder"]},
    },
    "additionalProperties": False,
}

_PANEL = {
    "type": "object",
    "required": [
        "id",
        "type",
        "title",
        "description",
        "datasource",
        "gridPos",
        "fieldConfig",
        "options",
        "targets",
    ],
    "properties": {
        "id": {"type": "integer", "minimum": 1},
        "type": {"enum": ["timeseries", "stat", "bargauge"]},
        "title": {"type": "string", "minLength": 1},
        "description": {"type": "string", "minLength": 20},
        "datasource": {"$ref": "#/$defs/datasource"},
        "gridPos": {"$ref": "#/$defs/gridPos"},
        "links": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["title", "url"],
                "properties": {
                    "title": {"type": "string"},
                    "url": {"type": "string", "pattern": "^https?://"},
                    "targetBlank": {"type": "boolean"},
                },
            },
        },
        "fieldConfig": {
            "type": "object",
            "required": ["defaults", "overrides"],
            "properties": {
                "defaults": {
                    "type": "object",
                    "required": ["unit", "thresholds"],
                    "properties": {
                        "unit": {"type": "string", "minLength": 1},
                        "min": {"type": "number"},
                        "max": {"type": "number"},
                        "thresholds": {"$ref": "#/$defs/thresholds"},
                        "mappings": {"type": "array", "items": {"$ref": "#/$defs/mapping"}},
                        "color": {"type": "object", "required": ["mode"]},
                        "custom": {"type": "object"},
                    },
                },
                "overrides": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["matcher", "properties"],
                        "properties": {
                            "matcher": {
                                "type": "object",
                                "required": ["id", "options"],
                                "properties": {"id": {"const": "byFrameRefID"}},
                            },
                            "properties": {
                                "type": "array",
                                "items": {"type": "object", "required": ["id", "value"]},
                            },
                        },
                    },
                },
            },
        },
        "options": {"type": "object"},
        "targets": {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/target"}},
    },
    "additionalProperties": False,
}

_ROW = {
    "type": "object",
    "required": ["id", "type", "title", "collapsed", "gridPos", "panels"],
    "properties": {
        "id": {"type": "integer", "minimum": 1},
        "type": {"const": "row"},
        "title": {"type": "string", "minLength": 1},
        "collapsed": {"type": "boolean"},
        "gridPos": {"$ref": "#/$defs/gridPos"},
        "panels": {"type": "array", "maxItems": 0},
    },
    "additionalProperties": False,
}

_VARIABLE = {
    "type": "object",
    "required": ["name", "type", "label", "hide", "current"],
    "properties": {"name": {"type": "string", "pattern": "^[a-z_]+$"}},
    "oneOf": [
        {
            "properties": {
                "type": {"const": "datasource"},
                "query": {"const": "prometheus"},
                "name": {"const": "datasource"},
            },
            "required": ["query"],
        },
        {
            "properties": {
                "type": {"const": "query"},
                "datasource": {"$ref": "#/$defs/datasource"},
                "definition": {"type": "string", "pattern": "^label_values\\("},
                "query": {
                    "type": "object",
                    "required": ["query", "refId"],
                    "properties": {"query": {"type": "string", "pattern": "^label_values\\("}},
                },
                "includeAll": {"const": True},
                "allValue": {"const": ".*"},
                "multi": {"type": "boolean"},
            },
            "required": ["datasource", "definition", "query", "includeAll", "allValue"],
        },
    ],
}

SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "https://kvtax.invalid/schemas/grafana-dashboard-subset.json",
    "title": "The subset of Grafana's dashboard JSON that kvtax generates",
    "type": "object",
    "required": [
        "uid",
        "title",
        "description",
        "tags",
        "schemaVersion",
        "time",
        "templating",
        "panels",
    ],
    "properties": {
        "uid": {"type": "string", "pattern": "^[a-z0-9-]{1,40}$"},
        "title": {"type": "string", "minLength": 1},
        "description": {"type": "string", "minLength": 1},
        "tags": {"type": "array", "items": {"type": "string"}, "contains": {"const": "kvtax"}},
        "schemaVersion": {"type": "integer", "minimum": 36},
        "version": {"type": "integer"},
        "editable": {"type": "boolean"},
        "graphTooltip": {"enum": [0, 1, 2]},
        "refresh": {"type": "string"},
        "timezone": {"type": "string"},
        "time": {
            "type": "object",
            "required": ["from", "to"],
            "properties": {"from": {"type": "string"}, "to": {"type": "string"}},
        },
        "annotations": {"type": "object"},
        "links": {"type": "array"},
        "templating": {
            "type": "object",
            "required": ["list"],
            "properties": {"list": {"type": "array", "items": {"$ref": "#/$defs/variable"}}},
        },
        "panels": {
            "type": "array",
            "minItems": 1,
            "items": {
                "if": {"properties": {"type": {"const": "row"}}},
                "then": {"$ref": "#/$defs/row"},
                "else": {"$ref": "#/$defs/panel"},
            },
        },
    },
    "additionalProperties": False,
    "$defs": {
        "datasource": _DATASOURCE,
        "gridPos": _GRID,
        "thresholds": _THRESHOLDS,
        "mapping": _MAPPING,
        "target": _TARGET,
        "panel": _PANEL,
        "row": _ROW,
        "variable": _VARIABLE,
    },
}
