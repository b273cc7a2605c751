"""End to end: vLLM overload -> Prometheus rules -> Alertmanager -> the webhook a test runs.

Everything is real and on loopback: the session's vLLM CPU engine, a ``kvtax serve`` watching
it, Prometheus scraping both every second and evaluating the generated rules in the test
profile (20s windows, ``for: 5s``), and Alertmanager with the example routing pointed at this
test's webhook receiver. 32 concurrent streams of 300 tokens against a 2,048-token KV pool
make vLLM preempt; the preemption alert must reach the ticket receiver with the right labels
and a runbook URL, and the recorded preemption tax must show the recompute.
"""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

import pytest

from kvtax.engine.vocabulary import CONCEPTS
from kvtax.mixin.rules import TEST_PROFILE, per_pod
from kvtax.mixin.rules.alertmanager import alertmanager_config
from kvtax.mixin.rules.recording import METHOD_PREFERENCE
from kvtax.mixin.rules.render import alerts_yaml, dump, recording_yaml
from kvtax.serve.config.values import parse_duration
from kvtax_dev.process import HANG_GUARD_S
from kvtax_dev.testbed import VllmEngine
from kvtax_dev.testbed.load import RequestResult, drive
from kvtax_dev.testbed.promstack import AlertmanagerProcess, PrometheusProcess, prometheus_config
from kvtax_dev.testbed.sidecar import KvtaxProcess, parse_metrics
from kvtax_dev.testbed.webhook import Notification, WebhookReceiver

pytestmark = pytest.mark.e2e

ALERT = "KvtaxVllmPreempting"
PREEMPTIONS = CONCEPTS["preemptions"].names[0]
TAX = per_pod("kvtax_preemption_tax", f"ratio_rate{TEST_PROFILE.rate_window}")


def _address(url: str) -> str:
    return urllib.parse.urlsplit(url).netloc


def _preempting(received: list[Notification]) -> list[tuple[str, dict[str, Any]]]:
    return [
        (path, alert)
        for path, body in received
        for alert in body["alerts"]
        if alert["labels"].get("alertname") == ALERT and alert["status"] == "firing"
    ]


def test_preemption_alert_reaches_the_webhook(vllm_engine: VllmEngine, tmp_path: Path) -> None:
    rules = [tmp_path / "kvtax-recording.yaml", tmp_path / "kvtax-alerts.yaml"]
    rules[0].write_text(recording_yaml(TEST_PROFILE))
    rules[1].write_text(alerts_yaml(TEST_PROFILE))
    with WebhookReceiver() as hook:
        am_config = alertmanager_config(
            pager_url=hook.url + "/pager",
            ticket_url=hook.url + "/ticket",
            group_wait="1s",
            group_interval="1s",
            repeat_interval="1h",
        )
        with (
            AlertmanagerProcess(dump(am_config), log_path=tmp_path / "am.log") as am,
            KvtaxProcess(vllm_engine.url, log_path=tmp_path / "kvtax.log") as kvtax,
        ):
            config = prometheus_config(
                {"vllm": [_address(vllm_engine.url)], "kvtax": [_address(kvtax.base_url)]},
                interval="1s",
                alertmanager_url=am.url,
            )
            with PrometheusProcess(config, rules, log_path=tmp_path / "prom.log") as prom:
                prom.wait_for(
                    lambda: sum(t["health"] == "up" for t in prom.targets()) == 2,
                    what="vLLM and kvtax scraped",
                )
                prom.wait_for(
                    lambda: prom.query('kvtax_vllm_up == 1 and on () up{job="vllm"} == 1'),
                    what="kvtax reading vLLM",
                )
                # The engine is idle: its preemption counter does not move, nothing fires.
                assert not [a for a in prom.alerts() if a["labels"]["alertname"] == ALERT]
                preempted_before = _preemptions(prom)

                results: list[RequestResult] = []
                load = threading.Thread(target=lambda: results.extend(_overload(vllm_engine)))
                load.start()
                try:
                    received, tax_seen, series_per_poll = _wait_for_alert(hook, prom)
                    # The tax is a ratio of rates over the window: its first positive sample
                    # can trail the alert, which reads vLLM's own counter directly.
                    _watch_tax(prom, load, tax_seen, series_per_poll)
                finally:
                    load.join(HANG_GUARD_S)
                assert not load.is_alive(), "the overload did not finish"

            assert results
            assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
            preempted = _preemptions_after(vllm_engine) - preempted_before
            assert preempted > 0

    path, alert = _preempting(received)[0]
    # A warning: routed to the ticket receiver, not the pager.
    assert path == "/ticket"
    body = next(b for p, b in received if p == path and alert in b["alerts"])
    assert body["receiver"] == "ticket"
    # A static scrape has no namespace or pod: the rule's by() degrades to the model.
    assert body["groupLabels"] == {"model_name": vllm_engine.model_name}
    assert alert["labels"] == {
        "alertname": ALERT,
        "severity": "warning",
        "model_name": vllm_engine.model_name,
    }
    annotations = alert["annotations"]
    assert annotations["runbook_url"] == (
        "https://github.com/kvtax/kvtax/blob/main/docs/runbooks.md#kvtaxvllmpreempting"
    )
    assert annotations["summary"] == "vLLM keeps preempting running sequences."
    # No pod label in a static scrape: the description names the model alone.
    assert annotations["description"].startswith(f"{vllm_engine.model_name} has preempted ")
    # The tax record saw recompute while the alert fired, and says how it was counted: one
    # method per model at a time (one kvtax, static scrape), the best of the three counters.
    assert tax_seen, f"{TAX} never rose above 0 (are the three recompute counters published?)"
    assert {labels["method"] for labels, _ in tax_seen} <= set(METHOD_PREFERENCE)
    assert max(series_per_poll) == 1, series_per_poll
    peak, method = max((value, labels["method"]) for labels, value in tax_seen)
    print(
        f"\nalerting e2e: {preempted:.0f} preemptions; {ALERT} delivered: "
        f"{annotations['description']!r}; peak {TAX} {peak:.1%} ({method})"
    )


def _overload(engine: VllmEngine) -> list[RequestResult]:
    return asyncio.run(
        # 32 x (41 + 300) tokens, five times the 2,048-token pool: it preempts within seconds,
        # and the alert (20 s windows, for: 5s) fires from those.
        drive(engine.url, engine.model_name, concurrency=32, max_tokens=300, stream=True)
    )


def _preemptions(prom: PrometheusProcess) -> float:
    result = prom.query(f'sum({PREEMPTIONS}{{job="vllm"}})')
    return float(result[0]["value"][1]) if result else 0.0


def _preemptions_after(engine: VllmEngine) -> float:
    return sum(
        value
        for key, value in parse_metrics(engine.metrics_text()).items()
        if key.split("{")[0] == PREEMPTIONS
    )


def _poll_tax(
    prom: PrometheusProcess, tax_seen: list[tuple[dict[str, str], float]], series: list[int]
) -> None:
    taxes = prom.query(TAX)
    series.append(len(taxes))
    tax_seen += [(r["metric"], float(r["value"][1])) for r in taxes if float(r["value"][1]) > 0]


def _watch_tax(
    prom: PrometheusProcess,
    load: threading.Thread,
    tax_seen: list[tuple[dict[str, str], float]],
    series: list[int],
) -> None:
    """Poll the tax record until it shows recompute, or until the overload ended and one rate
    window more has passed (after that, no recompute of this load can still enter it)."""
    window_s = parse_duration(TEST_PROFILE.rate_window)
    ended: float | None = None
    deadline = time.monotonic() + HANG_GUARD_S
    while not tax_seen and time.monotonic() < deadline:
        _poll_tax(prom, tax_seen, series)
        if ended is None and not load.is_alive():
            ended = time.monotonic()
        if ended is not None and time.monotonic() - ended > window_s:
            return
        time.sleep(0.5)


def _wait_for_alert(
    hook: WebhookReceiver, prom: PrometheusProcess
) -> tuple[list[Notification], list[tuple[dict[str, str], float]], list[int]]:
    """Poll until the alert reaches the webhook, noting every positive tax sample on the way
    and how many tax series each poll returned."""
    tax_seen: list[tuple[dict[str, str], float]] = []
    series_per_poll = [0]
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline:
        _poll_tax(prom, tax_seen, series_per_poll)
        received = hook.received
        if _preempting(received):
            return received, tax_seen, series_per_poll
        time.sleep(0.5)
    raise AssertionError(
        f"{ALERT} never reached the webhook; Prometheus alerts: {prom.alerts()}; "
        f"webhook got: {hook.received}"
    )
