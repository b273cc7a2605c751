"""The example Alertmanager config on a real Alertmanager: routing, grouping and inhibition.

Alerts are posted through Alertmanager's API exactly as Prometheus posts them; the test then
reads which ones Alertmanager inhibited and what reached the webhook receivers it runs.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from kvtax.mixin.rules.alertmanager import alertmanager_config
from kvtax.mixin.rules.render import dump
from kvtax_dev.testbed.promstack import AlertmanagerProcess
from kvtax_dev.testbed.webhook import WebhookReceiver

pytestmark = pytest.mark.e2e


@pytest.fixture
def stack() -> Iterator[tuple[AlertmanagerProcess, WebhookReceiver]]:
    with WebhookReceiver() as hook:
        config = alertmanager_config(
            pager_url=hook.url + "/pager",
            ticket_url=hook.url + "/ticket",
            group_wait="1s",
            group_interval="1s",
            repeat_interval="1h",
        )
        with AlertmanagerProcess(dump(config)) as am:
            yield am, hook


def _alert(
    name: str, severity: str, pod: str, model: str = "tiny-llama", ns: str = "llm"
) -> dict[str, Any]:
    return {
        "labels": {
            "alertname": name,
            "severity": severity,
            "namespace": ns,
            "pod": pod,
            "model_name": model,
        },
        "annotations": {"summary": f"{name}."},
    }


def _key(alert: dict[str, Any]) -> tuple[str, str, str]:
    labels = alert["labels"]
    return labels["alertname"], labels["pod"], labels["severity"]


def test_thrashing_inhibits_its_symptoms_for_the_same_pod_and_model(
    stack: tuple[AlertmanagerProcess, WebhookReceiver],
) -> None:
    am, hook = stack
    am.post_alerts(
        [
            _alert("KvtaxThrashing", "critical", "vllm-0"),
            _alert("KvtaxKvCacheNearFull", "warning", "vllm-0"),
            _alert("KvtaxVllmPreempting", "warning", "vllm-0"),
            # Same pod, other model; same model, other pod: not inhibited.
            _alert("KvtaxVllmPreempting", "warning", "vllm-0", model="other-model"),
            _alert("KvtaxKvCacheNearFull", "warning", "vllm-1"),
            # Not a symptom of thrashing: stays.
            _alert("KvtaxStreamStalls", "warning", "vllm-0"),
        ]
    )
    am.wait_for(
        lambda: len(am.alerts(inhibited="true", active="false")) >= 2,
        what="two inhibited alerts",
    )
    inhibited = am.alerts(inhibited="true", active="false")
    assert sorted(_key(a) for a in inhibited) == [
        ("KvtaxKvCacheNearFull", "vllm-0", "warning"),
        ("KvtaxVllmPreempting", "vllm-0", "warning"),
    ]
    for alert in inhibited:
        assert alert["status"]["state"] == "suppressed"
        assert alert["status"]["inhibitedBy"]
    active = am.alerts(active="true", inhibited="false")
    assert {(_key(a), a["labels"]["model_name"]) for a in active} == {
        (("KvtaxThrashing", "vllm-0", "critical"), "tiny-llama"),
        (("KvtaxVllmPreempting", "vllm-0", "warning"), "other-model"),
        (("KvtaxKvCacheNearFull", "vllm-1", "warning"), "tiny-llama"),
        (("KvtaxStreamStalls", "vllm-0", "warning"), "tiny-llama"),
    }
    # And what was inhibited never reaches a receiver.
    hook.wait_for(
        lambda got: len({_key(a) for p, b in got for a in b["alerts"]}) >= 4,
        what="the four uninhibited alerts",
    )
    delivered = {_key(a) for _, a in hook.alerts()}
    assert ("KvtaxKvCacheNearFull", "vllm-0", "warning") not in delivered
    assert ("KvtaxVllmPreempting", "vllm-0", "warning") in delivered  # the other-model one


def test_critical_inhibits_its_warning_twin(
    stack: tuple[AlertmanagerProcess, WebhookReceiver],
) -> None:
    am, _ = stack
    am.post_alerts(
        [
            _alert("KvtaxPreemptionTaxHigh", "warning", "vllm-0"),
            _alert("KvtaxPreemptionTaxHigh", "critical", "vllm-0"),
            _alert("KvtaxPreemptionTaxHigh", "warning", "vllm-1"),
        ]
    )
    inhibited = am.wait_for(
        lambda: am.alerts(inhibited="true", active="false"), what="an inhibited alert"
    )
    assert [_key(a) for a in inhibited] == [("KvtaxPreemptionTaxHigh", "vllm-0", "warning")]


def test_critical_pages_warning_tickets_grouped_by_namespace_and_model(
    stack: tuple[AlertmanagerProcess, WebhookReceiver],
) -> None:
    am, hook = stack
    am.post_alerts(
        [
            _alert("KvtaxPreemptionTaxHigh", "critical", "vllm-0"),
            _alert("KvtaxThrashing", "critical", "vllm-1"),
            _alert("KvtaxStreamStalls", "warning", "vllm-0"),
            _alert("KvtaxOverAdmitted", "warning", "vllm-1"),
            _alert("KvtaxOverAdmitted", "warning", "vllm-9", ns="staging"),
            _alert("KvtaxOverAdmitted", "warning", "vllm-0", model="other-model"),
        ]
    )
    # A group may be sent more than once while it fills; the last send of each is complete.
    received = hook.wait_for(
        lambda got: (
            len({json.dumps(a["labels"], sort_keys=True) for _, b in got for a in b["alerts"]}) >= 6
        ),
        what="six alerts",
    )
    by_group = {
        (path, body["receiver"], tuple(sorted(body["groupLabels"].items()))): sorted(
            a["labels"]["alertname"] for a in body["alerts"]
        )
        for path, body in received
    }
    llm = (("model_name", "tiny-llama"), ("namespace", "llm"))
    assert by_group == {
        # Two pods, one page: grouped by namespace and model, not by pod or alert.
        ("/pager", "pager", llm): ["KvtaxPreemptionTaxHigh", "KvtaxThrashing"],
        ("/ticket", "ticket", llm): ["KvtaxOverAdmitted", "KvtaxStreamStalls"],
        ("/ticket", "ticket", (("model_name", "tiny-llama"), ("namespace", "staging"))): [
            "KvtaxOverAdmitted"
        ],
        ("/ticket", "ticket", (("model_name", "other-model"), ("namespace", "llm"))): [
            "KvtaxOverAdmitted"
        ],
    }
    groups = {
        (g["receiver"]["name"], tuple(sorted(g["labels"].items()))): len(g["alerts"])
        for g in am.groups()
    }
    assert groups[("pager", llm)] == 2
    assert groups[("ticket", llm)] == 2
