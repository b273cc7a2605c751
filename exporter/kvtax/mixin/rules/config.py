"""The one config object the rule generator reads: selectors, windows, thresholds and severities.

Users change this object, never the generated YAML. The defaults follow the monitoring-mixin
conventions (``for: 15m`` unless a comment gives a reason); :func:`short_profile` (and
:data:`TEST_PROFILE`) shrinks every window and ``for:`` so an end-to-end test can watch the
alerts fire in seconds. Pure: no I/O.

Example::

    cfg = replace(DEFAULT, tax_warning=0.1, vllm_selector='job="vllm"')
    cfg.selector("kvtax_vllm_up", cfg.kvtax_selector)  # 'kvtax_vllm_up'
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any

__all__ = [
    "DEFAULT",
    "FLEET",
    "POD",
    "POSITIVE",
    "SHARES",
    "TEST_PROFILE",
    "RulesConfig",
    "short_profile",
    "threshold_problem",
]

# Aggregation levels. Per pod keeps namespace and pod, which Prometheus attaches through a
# PodMonitor; in a plain static scrape they are absent and ``by (namespace, pod, model_name)``
# simply degrades to per model, so the same rules work in both places.
POD: tuple[str, ...] = ("namespace", "pod", "model_name")
FLEET: tuple[str, ...] = ("model_name",)


@dataclass(frozen=True, slots=True)
class RulesConfig:
    """Everything the generated rules depend on. Durations are Prometheus durations."""

    # -- selectors: extra label matchers, without braces ------------------------------------
    # kvtax's own series have unique names, so no selector is needed; set e.g. 'job="kvtax"'
    # when several kvtax deployments share one Prometheus and need telling apart.
    kvtax_selector: str = ""
    # The production-stack router re-exports vllm: names without model_name: requiring the
    # label keeps those copies out of every sum.
    vllm_selector: str = 'model_name!=""'
    # Picks kvtax's scrape targets for the sidecar-down alert (``up`` has no other clue). The
    # PodMonitor in deploy/ scrapes vLLM and kvtax under one job, so the default keys on the
    # container label the Prometheus Operator attaches; with static scrape configs use the
    # job instead, e.g. 'job="kvtax"'.
    kvtax_job_selector: str = 'container="kvtax"'
    # The label that names the cluster under Thanos, Mimir or any global view (often
    # "cluster"); empty for a single Prometheus. When set it leads every aggregation's
    # by (...) and on (...), so pods of the same namespace/name in two clusters never merge.
    # Record names stay the same (as the kubernetes mixin does), so queries need not change.
    cluster_label: str = ""
    # kube-prometheus-stack only loads PrometheusRule objects labelled release: <its release>.
    release_label: str = "kube-prometheus-stack"

    # -- windows -------------------------------------------------------------------------------
    # Range of every rate() in recording rules and alerts. 5m holds enough scrapes at 30s.
    rate_window: str = "5m"
    # The queue alert fits a slope over this range: long enough to ignore one burst.
    queue_window: str = "15m"

    # -- runbooks ------------------------------------------------------------------------------
    runbook_url_base: str = "https://github.com/kvtax/kvtax/blob/main/docs/runbooks.md"

    # -- thresholds and for: durations, alert by alert -----------------------------------------
    # Preemption: any preemption in every window for 10m, the alert users already know.
    # Shorter than 15m because a preempting engine is already degrading latency.
    preemption_for: str = "10m"
    kv_near_full_usage: float = 0.85
    kv_near_full_for: str = "15m"
    # The tax is the share of engine token work that was recompute. vLLM's RFC measured
    # 10-23 % under pressure: 5 % is early warning, 20 % pages.
    tax_warning: float = 0.05
    tax_critical: float = 0.20
    tax_for: str = "15m"
    # Delivery yield: delivered / generated. Below 0.9 clients leave before their answer.
    yield_warning: float = 0.9
    yield_critical: float = 0.5
    yield_for: str = "15m"
    # The yield is only meaningful when the proxy sees all traffic.
    join_coverage_min: float = 0.99
    join_coverage_for: str = "30m"
    # Thrashing: cache above this usage while preempting with a queue. 5m: at this point
    # throughput is collapsing, so waiting longer only adds to the damage.
    thrash_usage: float = 0.9
    thrash_for: str = "5m"
    queue_for: str = "15m"
    # Over-admission: configured max_num_seqs / recommended. 1.5 leaves room for estimates.
    over_admission_ratio: float = 1.5
    over_admission_for: str = "30m"
    # TTFT SLO, the same value as kvtax serve --slo.ttft; quantile of the alert.
    slo_ttft_seconds: float = 2.0
    slo_ttft_quantile: float = 0.99
    slo_for: str = "15m"
    # Stream stalls per request through the proxy.
    stalls_per_request: float = 0.1
    stalls_for: str = "15m"
    # Requests vLLM rejects at admission per second (vLLM 0.32+ counts them).
    # Any sustained shedding means capacity is short, so the default threshold is 0.
    shed_per_second: float = 0.0
    shed_for: str = "15m"
    # The proxy's gate (docs/gate.md): share of requests it sheds (429) over the rate window.
    gate_shed_ratio: float = 0.05
    gate_shed_for: str = "10m"
    # Scrape health: shorter than 15m because every other alert is blind meanwhile.
    vllm_scrape_for: str = "5m"
    vllm_absent_for: str = "15m"
    sidecar_down_for: str = "5m"

    # -- severities ----------------------------------------------------------------------------
    # Alert name -> severity for the single-severity alerts; pairs carry both severities.
    severity_overrides: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def pod_labels(self) -> tuple[str, ...]:
        """The per-pod aggregation labels, the cluster label first when one is set."""
        return self._with_cluster(POD)

    @property
    def fleet_labels(self) -> tuple[str, ...]:
        """The fleet-wide per-model aggregation labels, the cluster label first when set."""
        return self._with_cluster(FLEET)

    @property
    def target_labels(self) -> tuple[str, ...]:
        """Labels that name one scrape target's pod: namespace and pod, plus the cluster."""
        return self._with_cluster(("namespace", "pod"))

    def _with_cluster(self, labels: tuple[str, ...]) -> tuple[str, ...]:
        return (self.cluster_label, *labels) if self.cluster_label else labels

    def selector(self, metric: str, *matchers: str) -> str:
        """``metric{a,b}`` from non-empty matcher strings, or the bare name."""
        inner = ",".join(m for m in matchers if m)
        return f"{metric}{{{inner}}}" if inner else metric

    def name_selector(self, names: tuple[str, ...], *matchers: str) -> str:
        """A selector matching any of ``names`` (a concept's versions), plus ``matchers``."""
        if len(names) == 1:
            return self.selector(names[0], *matchers)
        pattern = "|".join(names)
        inner = ",".join([f'__name__=~"{pattern}"', *(m for m in matchers if m)])
        return f"{{{inner}}}"

    def runbook_url(self, alert: str) -> str:
        """Runbook section of ``alert``: GitHub anchors are the heading in lower case."""
        return f"{self.runbook_url_base}#{alert.lower()}"

    def docs_url(self, page: str, anchor: str) -> str:
        """A section of another page in the runbooks' folder, e.g. the tax's one definition."""
        return f"{self.runbook_url_base.rpartition('/')[0]}/{page}#{anchor}"


DEFAULT = RulesConfig()

# The range of every number above. Shares lie from 0 to 1: a KV usage, a tax, a yield, a
# coverage, a shed ratio, a quantile. The SLO and the over-admission ratio must be above 0 (an
# alert at 0 would fire on every sample); any other threshold must not be negative.
SHARES: frozenset[str] = frozenset(
    {
        "kv_near_full_usage",
        "tax_warning",
        "tax_critical",
        "yield_warning",
        "yield_critical",
        "join_coverage_min",
        "thrash_usage",
        "slo_ttft_quantile",
        "gate_shed_ratio",
    }
)
POSITIVE: frozenset[str] = frozenset({"over_admission_ratio", "slo_ttft_seconds"})


def threshold_problem(name: str, value: float) -> str | None:
    """What is wrong with ``value`` for the number setting ``name``; None when it is fine.

    >>> threshold_problem("tax_warning", 1.5)
    'expected a share from 0 to 1, not 1.5'
    >>> threshold_problem("shed_per_second", float("nan")) is None
    False
    """
    if not math.isfinite(value):
        return f"expected a finite number, not {value}"
    if name in SHARES and not 0 <= value <= 1:
        return f"expected a share from 0 to 1, not {value:g}"
    if name in POSITIVE and value <= 0:
        return f"expected a number above 0, not {value:g}"
    if value < 0:
        return f"expected a number of 0 or more, not {value:g}"
    return None


def short_profile(
    base: RulesConfig = DEFAULT, *, window: str = "20s", hold: str = "5s"
) -> RulesConfig:
    """``base`` with every window set to ``window`` and every ``for:`` to ``hold``.

    For end-to-end tests that scrape and evaluate every second.
    """
    holds: dict[str, Any] = {f.name: hold for f in fields(base) if f.name.endswith("_for")}
    return replace(base, rate_window=window, queue_window=window, **holds)


# The profile the end-to-end test evaluates: 1s scrape and evaluation intervals assumed, and a
# static scrape whose kvtax job is called "kvtax".
TEST_PROFILE = short_profile(replace(DEFAULT, kvtax_job_selector='job="kvtax"'))
