"""JSON schemas for offline validation, derived from the vendored Prometheus Operator CRDs.

deploy/schemas/crds/ holds the operator's CustomResourceDefinitions as published upstream (see
deploy/schemas/README.md). :func:`json_schema` turns one into the JSON Schema (draft 2020-12)
that ``check-jsonschema`` validates kvtax's rendered PodMonitors, ServiceMonitors and
PrometheusRules against. Every type, enum, pattern, bound and required list of the CRD's
``openAPIV3Schema`` is kept; what changes, and why:

- objects that list ``properties`` reject unknown fields (``additionalProperties: false``). The
  API server would prune them silently, which is how a misspelt ``podMetricEndpoints`` becomes
  a PodMonitor that scrapes nothing;
- ``apiVersion`` and ``kind`` must be the CRD's, and ``metadata`` needs a name and string maps
  for labels and annotations (the server checks ObjectMeta itself; the CRD says only ``object``);
- a PrometheusRule's rule sets exactly one of ``alert`` and ``record``: the CRD says so in
  prose and the operator's admission webhook enforces it;
- ``(?i)`` in a pattern becomes explicit letter classes: JSON Schema's regex dialect (ECMA 262)
  has no inline flags;
- descriptions, ``format: int32/int64`` and the ``x-kubernetes-*`` annotations are dropped.

Run ``python -m kvtax_dev.crdschema`` to rewrite deploy/schemas/*.schema.json, ``--check`` to
fail when they differ from what the CRDs give (tests/unit/test_kubernetes.py runs the check).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from kvtax_dev import repo_root

__all__ = ["SCHEMAS", "json_schema", "main", "render"]

Node = dict[str, Any]

# Output file -> vendored CRD file, both under deploy/schemas/.
SCHEMAS = {
    "podmonitor.schema.json": "crds/monitoring.coreos.com_podmonitors.yaml",
    "servicemonitor.schema.json": "crds/monitoring.coreos.com_servicemonitors.yaml",
    "prometheusrule.schema.json": "crds/monitoring.coreos.com_prometheusrules.yaml",
}
_DROPPED = {"description", "x-kubernetes-int-or-string", "x-kubernetes-map-type"}
_METADATA: Node = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "namespace": {"type": "string"},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}


def _case_insensitive(pattern: str) -> str:
    """``^(?i)abc`` as ``^[aA][bB][cC]``: letters outside classes and escapes get both cases."""
    head, _, rest = pattern.partition("(?i)")
    out: list[str] = []
    in_class = escaped = False
    for char in rest:
        if escaped:
            out.append(char)
            escaped = False
        elif char == "\\":
            out.append(char)
            escaped = True
        elif char == "[":
            in_class = True
            out.append(char)
        elif char == "]":
            in_class = False
            out.append(char)
        elif char.isascii() and char.isalpha() and not in_class:
            out.append(f"[{char.lower()}{char.upper()}]")
        else:
            out.append(char)
    return head + "".join(out)


def _convert(node: Any) -> Any:
    if isinstance(node, list):
        return [_convert(item) for item in node]
    if not isinstance(node, dict):
        return node
    out: Node = {}
    for key, value in node.items():
        if key in _DROPPED or key.startswith("x-kubernetes-"):
            continue
        if key == "format" and value in ("int32", "int64"):
            continue
        if key == "pattern":
            out[key] = _case_insensitive(value) if "(?i)" in value else value
        else:
            out[key] = _convert(value)
    if "properties" in out and "additionalProperties" not in out:
        preserve = node.get("x-kubernetes-preserve-unknown-fields") is True
        if not preserve:
            out["additionalProperties"] = False
    return out


def json_schema(crd: Node, source: str) -> Node:
    """The JSON Schema of the CRD's storage version, with the changes listed above."""
    names = crd["spec"]["names"]
    group = crd["spec"]["group"]
    (version,) = [v for v in crd["spec"]["versions"] if v.get("storage")]
    schema: Node = _convert(version["schema"]["openAPIV3Schema"])
    props = schema["properties"]
    props["apiVersion"] = {"const": f"{group}/{version['name']}"}
    props["kind"] = {"const": names["kind"]}
    props["metadata"] = _METADATA
    schema["required"] = sorted({"apiVersion", "kind", "metadata", *schema.get("required", [])})
    if names["kind"] == "PrometheusRule":
        rule = props["spec"]["properties"]["groups"]["items"]["properties"]["rules"]["items"]
        rule["oneOf"] = [{"required": ["alert"]}, {"required": ["record"]}]
    operator_version = crd["metadata"]["annotations"]["operator.prometheus.io/version"]
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": (
            f"{names['kind']} ({group}/{version['name']}), Prometheus Operator v{operator_version}"
        ),
        "description": (
            f"Generated by kvtax_dev.crdschema from deploy/schemas/{source}, the operator's own "
            "CRD (see deploy/schemas/README.md). Do not edit: regenerate."
        ),
        **schema,
    }


def render(folder: Path) -> dict[str, str]:
    """Each output file name and its text, from the CRDs under ``folder``."""
    out = {}
    for name, source in SCHEMAS.items():
        crd = yaml.safe_load((folder / source).read_text())
        out[name] = json.dumps(json_schema(crd, source), indent=1, sort_keys=False) + "\n"
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvtax_dev.crdschema",
        description="Write deploy/schemas/*.schema.json from the vendored operator CRDs.",
    )
    parser.add_argument(
        "--check", action="store_true", help="fail if a schema file is not what the CRDs give"
    )
    args = parser.parse_args(argv)
    folder = repo_root() / "deploy" / "schemas"
    stale = []
    for name, text in render(folder).items():
        path = folder / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    if stale:
        print(f"stale: {', '.join(stale)}; run python -m kvtax_dev.crdschema", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
