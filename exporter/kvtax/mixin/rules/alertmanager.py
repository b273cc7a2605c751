"""The example Alertmanager configuration: routing by severity, grouping, inhibition.

``critical`` pages (the pager receiver), ``warning`` opens a ticket, ``info`` goes nowhere.
Notifications group by namespace and model, so one overloaded deployment is one page, not
one per alert. Two inhibitions keep pages to the cause: thrashing silences "near full" and
"preempting" for the same pod and model (they are its symptoms), and a critical alert silences
its own warning twin. Receivers are webhooks; the e2e test points them at its own receiver.
Pure: no I/O.

Example:

    >>> cfg = alertmanager_config(pager_url="http://127.0.0.1:9/pager", group_wait="1s")
    >>> cfg["route"]["group_by"], cfg["route"]["group_wait"]
    (['namespace', 'model_name'], '1s')
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "GROUP_BY",
    "INHIBITED_BY_THRASHING",
    "alertmanager_config",
]

GROUP_BY: tuple[str, ...] = ("namespace", "model_name")
# Symptoms of thrashing: while it fires for a pod and model, these add nothing.
INHIBITED_BY_THRASHING: tuple[str, ...] = ("KvtaxKvCacheNearFull", "KvtaxVllmPreempting")
_SAME_PLACE = ["namespace", "pod", "model_name"]


def alertmanager_config(
    *,
    pager_url: str = "https://pager.example.com/alertmanager",
    ticket_url: str = "https://tickets.example.com/alertmanager",
    group_wait: str = "30s",
    group_interval: str = "5m",
    repeat_interval: str = "4h",
) -> dict[str, Any]:
    """The config as a dict; timings are parameters so a test can make them short."""

    def webhook(name: str, url: str) -> dict[str, Any]:
        return {"name": name, "webhook_configs": [{"url": url, "send_resolved": True}]}

    return {
        "route": {
            # Anything without a known severity still reaches a human, as a ticket.
            "receiver": "ticket",
            "group_by": list(GROUP_BY),
            "group_wait": group_wait,
            "group_interval": group_interval,
            "repeat_interval": repeat_interval,
            "routes": [
                {"matchers": ['severity="critical"'], "receiver": "pager"},
                {"matchers": ['severity="warning"'], "receiver": "ticket"},
                {"matchers": ['severity="info"'], "receiver": "blackhole"},
            ],
        },
        "receivers": [
            webhook("pager", pager_url),
            webhook("ticket", ticket_url),
            {"name": "blackhole"},
        ],
        "inhibit_rules": [
            {
                "source_matchers": ['alertname="KvtaxThrashing"'],
                "target_matchers": [f'alertname=~"{"|".join(INHIBITED_BY_THRASHING)}"'],
                "equal": _SAME_PLACE,
            },
            {
                "source_matchers": ['severity="critical"'],
                "target_matchers": ['severity="warning"'],
                "equal": ["alertname", *_SAME_PLACE],
            },
        ],
    }
