"""A dashboard's variables (Grafana's templating), and the cluster narrowing of its queries.

:func:`variables` writes the ``datasource`` variable and the namespace/pod/model_name ones
(model_name as in vLLM's own dashboards, so a link carries the choice across), each narrowed by
the ones before it; with a cluster label a ``cluster`` variable comes first.
:func:`with_cluster` narrows and groups a query by that label. Pure: no I/O.
"""

from __future__ import annotations

import re

from kvtax.mixin.dashboards.model import DATASOURCE, JSON, Board

__all__ = ["variables", "with_cluster"]

# A selector that takes the model_name or pod variable, and a by/on grouping (empty or not).
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


def variables(board: Board, anchor_metric: str, cluster_label: str) -> list[JSON]:
    """The templating list of ``board``: the datasource, then its variables, all set to All."""
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
