"""Alert rules as data, each with a severity, a static summary, a templated description and a
runbook URL, built from one :class:`~kvtax.mixin.rules.config.RulesConfig`.

Alerts aggregate ``by (namespace, pod, model_name)``: the labels a PodMonitor attaches, which a
static scrape lacks and which then simply drop out. Where a warning/critical pair fits (tax,
delivery yield), both rules share one alert name and differ by ``severity``; Alertmanager
inhibits the warning while the critical fires. vLLM names come only from the vocabulary, kvtax
names from the catalog, ratios from the recording rules. Pure: no I/O.

The tax alert reads the per-pod tax record: the one definition of docs/tax.md, with one
recompute method per pod, the best one present (measured, then estimated, then
stall_estimated), named in a ``method`` label that travels into the alert so the page says
whether the number is exact.

Example::

    >>> [a.alert for a in alert_rules()][:2]
    ['KvtaxVllmPreempting', 'KvtaxKvCacheNearFull']
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from kvtax.engine.vocabulary import CONCEPTS
from kvtax.mixin.rules import slo
from kvtax.mixin.rules.config import DEFAULT, RulesConfig
from kvtax.mixin.rules.recording import per_pod

__all__ = [
    "THRESHOLD_ALERT",
    "AlertRule",
    "alert_names",
    "alert_rules",
    "every_alert_name",
    "groups",
]

# The objective's alert of slo_alerting "threshold"; "burn_rate" has slo.ALERT instead.
THRESHOLD_ALERT = "KvtaxTtftSloBreach"

# Where an alert happened, for descriptions. A static scrape has no pod label: the
# "on namespace/pod" part then drops out instead of reading "on /".
ON_POD = "{{ with $labels.pod }} on {{ $labels.namespace }}/{{ . }}{{ end }}"
WHERE = "{{ $labels.model_name }}" + ON_POD
# Rates and ratios to three significant digits: humanize would print 0.5 as "500m".
VALUE = '{{ printf "%.3g" $value }}'


@dataclass(frozen=True, slots=True)
class AlertRule:
    """One alerting rule as Prometheus reads it, plus the group it belongs to."""

    group: str
    alert: str
    expr: str
    for_: str
    severity: str
    summary: str
    description: str
    runbook_url: str = ""
    # Labels besides severity, e.g. a burn-rate alert's windows.
    labels: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    def to_dict(self) -> dict[str, Any]:
        """The rule as it appears in a rule file."""
        return {
            "alert": self.alert,
            "expr": self.expr,
            "for": self.for_,
            "labels": {"severity": self.severity, **self.labels},
            "annotations": {
                "summary": self.summary,
                "description": self.description,
                "runbook_url": self.runbook_url,
            },
        }


def _vllm(config: RulesConfig, concept: str, suffix: str = "") -> str:
    names = tuple(name + suffix for name in CONCEPTS[concept].names)
    return config.name_selector(names, config.vllm_selector)


def _over_time(config: RulesConfig, function: str, concept: str, window: str) -> str:
    """``function(name[window])`` for every name of ``concept``, newest name first.

    One selector matching several names would collide: once a range function drops the
    names, vLLM 0.10's two copies of KV usage carry identical labels and the query fails.
    ``or`` keeps the newest name's series and adds an older name only where it is alone.
    """
    return " or ".join(
        f"{function}({config.selector(name, config.vllm_selector)}[{window}])"
        for name in CONCEPTS[concept].names
    )


def alert_rules(config: RulesConfig = DEFAULT) -> tuple[AlertRule, ...]:
    """Every alert rule, in file order, with its runbook URL filled in."""
    c = config
    w = c.rate_window
    pod = ", ".join(c.pod_labels)
    target = ", ".join(c.target_labels)
    k = c.kvtax_selector
    preemptions = f"sum by ({pod}) (rate({_vllm(c, 'preemptions')}[{w}]))"
    usage_avg = f"max by ({pod}) ({_over_time(c, 'avg_over_time', 'kv_usage', w)})"
    rules: list[AlertRule] = []

    def add(  # noqa: PLR0917 - one call per alert reads best positionally
        group: str,
        alert: str,
        expr: str,
        for_: str,
        severity: str,
        summary: str,
        description: str,
        labels: Mapping[str, str] = MappingProxyType({}),
    ) -> None:
        severity = c.severity_overrides.get(alert, severity)
        rules.append(
            AlertRule(group, alert, expr, for_, severity, summary, description, labels=labels)
        )

    # -- the engine: what vLLM users already watch ---------------------------------------------
    add(
        "kvtax-engine",
        "KvtaxVllmPreempting",
        f"{preemptions} > 0",
        c.preemption_for,
        "warning",
        "vLLM keeps preempting running sequences.",
        f"{WHERE} has preempted {VALUE} sequences/s for "
        f"{c.preemption_for}; every preemption throws away KV and prefills it again.",
    )
    add(
        "kvtax-engine",
        "KvtaxKvCacheNearFull",
        f"{usage_avg} > {c.kv_near_full_usage}",
        c.kv_near_full_for,
        "warning",
        "The vLLM KV cache is nearly full.",
        f"{WHERE} has averaged {{{{ $value | humanizePercentage }}}} KV-cache usage over "
        f"{w} (threshold {c.kv_near_full_usage:.0%}); new sequences will soon force preemptions.",
    )
    add(
        "kvtax-engine",
        "KvtaxThrashing",
        f"{preemptions} > 0"
        f" and on ({pod}) {usage_avg} >= {c.thrash_usage}"
        f" and on ({pod}) sum by ({pod}) "
        f"(max_over_time({_vllm(c, 'requests_waiting')}[{w}])) > 0",
        c.thrash_for,
        "critical",
        "vLLM is thrashing: preempting with a full KV cache and a queue.",
        f"{WHERE} preempts {VALUE} sequences/s while its KV cache is above "
        f"{c.thrash_usage:.0%} and requests wait; throughput is going into recompute.",
    )
    waiting = _vllm(c, "requests_waiting")
    finished = _vllm(c, "request_success")
    q = c.queue_window
    add(
        "kvtax-engine",
        "KvtaxQueueGrowing",
        f"sum by ({pod}) (deriv({waiting}[{q}])) > 0"
        f" and on ({pod}) sum by ({pod}) (min_over_time({waiting}[{q}])) > 0"
        f" and on ({pod}) (sum by ({pod}) (rate({finished}[{q}]))"
        f" <= sum by ({pod}) (rate({finished}[{q}] offset {q})))",
        c.queue_for,
        "warning",
        "vLLM's waiting queue keeps growing while completions stay flat.",
        f"{WHERE} has had requests waiting for {q}, the queue growing by "
        f"{VALUE} requests/s, and no more completions than the {q} before.",
    )

    # -- the tax and the delivery join ---------------------------------------------------------
    tax = per_pod("kvtax_preemption_tax", f"ratio_rate{w}")
    for severity, threshold in (("warning", c.tax_warning), ("critical", c.tax_critical)):
        add(
            "kvtax-tax",
            "KvtaxPreemptionTaxHigh",
            f"{tax} > {threshold}",
            c.tax_for,
            severity,
            "A large share of engine work is recompute after preemption.",
            f"Recompute was {{{{ $value | humanizePercentage }}}} of the token work of {WHERE} "
            f"over {w} (method {{{{ $labels.method }}}}, threshold {threshold:.0%}).",
        )
    yield_ = per_pod("kvtax_delivery_yield", f"ratio_rate{w}")
    coverage = f"max by ({pod}) ({c.selector('kvtax_join_coverage_ratio', k)})"
    for severity, threshold in (("warning", c.yield_warning), ("critical", c.yield_critical)):
        add(
            "kvtax-tax",
            "KvtaxGoodputDiverging",
            # Only where the proxy sees all traffic: a partial join lowers the yield by itself.
            f"{yield_} < {threshold} and on ({pod}) {coverage} >= {c.join_coverage_min}",
            c.yield_for,
            severity,
            "Goodput is falling behind engine throughput.",
            f"Only {{{{ $value | humanizePercentage }}}} of the tokens {WHERE} generated over "
            f"{w} reached a client (threshold {threshold:.0%}).",
        )
    add(
        "kvtax-tax",
        "KvtaxOverAdmitted",
        f"max by ({pod}) ({c.selector('kvtax_over_admission_ratio', k)})"
        f" > {c.over_admission_ratio}",
        c.over_admission_for,
        "warning",
        "vLLM admits more sequences than its KV cache can hold.",
        f"{WHERE} runs with max_num_seqs {VALUE}x the value its KV capacity "
        f"supports at the p95 request length (threshold {c.over_admission_ratio}x).",
    )
    add(
        "kvtax-tax",
        "KvtaxJoinCoverageLow",
        f"{coverage} < {c.join_coverage_min}",
        c.join_coverage_for,
        "warning",
        "Some of vLLM's traffic bypasses kvtax, so goodput is partial.",
        f"kvtax saw {{{{ $value | humanizePercentage }}}} of the requests {WHERE} served; "
        "delivered tokens, goodput and yield undercount the rest.",
    )

    # -- what clients see ----------------------------------------------------------------------
    if c.slo_alerting == "threshold":
        quantile = c.slo_ttft_quantile
        client = (
            f"histogram_quantile({quantile}, sum by ({pod}, le) "
            f"(rate({c.selector('kvtax_client_ttft_seconds_bucket', k)}[{w}])))"
        )
        engine = (
            f"histogram_quantile({quantile}, sum by ({pod}, le) "
            f"(rate({_vllm(c, 'ttft', '_bucket')}[{w}])))"
        )
        add(
            "kvtax-clients",
            THRESHOLD_ALERT,
            # The client's view when the proxy is in the path, else the engine's.
            f"({client} or on ({pod}) {engine}) > {c.slo_ttft_seconds}",
            c.slo_for,
            "warning",
            "Time to first token is above its SLO.",
            f"p{quantile * 100:g} time to first token of {WHERE} is "
            f"{{{{ $value | humanizeDuration }}}} over {w}, above the {c.slo_ttft_seconds:g}s "
            "SLO.",
        )
    add(
        "kvtax-clients",
        "KvtaxStreamStalls",
        f"sum by ({pod}) (rate({c.selector('kvtax_stream_stall_seconds_count', k)}[{w}]))"
        f" / sum by ({pod}) (rate({c.selector('kvtax_requests_total', k)}[{w}]))"
        f" > {c.stalls_per_request}",
        c.stalls_for,
        "warning",
        "Client streams stall mid-answer.",
        f"Streams of {WHERE} stalled {VALUE} times per request over {w} "
        f"(threshold {c.stalls_per_request:g}); a stall is usually a preempted sequence.",
    )
    # vLLM's own admission limits (0.32+): --max-num-queued-reqs/-tokens full, answered 503 (the
    # proxy's outcome upstream_error). A 4xx from vLLM (upstream_4xx) is not counted: those are
    # malformed requests, not a lack of capacity; the Overview's rejections panel shows both.
    add(
        "kvtax-clients",
        "KvtaxLoadShedding",
        f"sum by ({pod}) (rate({_vllm(c, 'admission_rejections')}[{w}])) > {c.shed_per_second:g}",
        c.shed_for,
        "warning",
        "vLLM is turning requests away for lack of capacity.",
        f"vLLM serving {WHERE} has rejected {VALUE} requests/s at admission over {w} "
        "with 503 (its own queue limits, --max-num-queued-reqs or --max-num-queued-tokens).",
    )

    # -- the pipeline itself -------------------------------------------------------------------
    add(
        "kvtax-health",
        "KvtaxVllmScrapeFailing",
        f"{c.selector('kvtax_vllm_up', k)} == 0",
        c.vllm_scrape_for,
        "warning",
        "kvtax cannot read vLLM's metrics.",
        f"kvtax{ON_POD} ({{{{ $labels.instance }}}}) has failed "
        f"to scrape vLLM for {c.vllm_scrape_for}; every kvtax number for it is stale.",
    )
    add(
        "kvtax-health",
        "KvtaxVllmMetricsAbsent",
        f"max by ({target}) ({c.selector('kvtax_vllm_up', k)} == 1)"
        f" unless on ({target}) max by ({target}) ({_vllm(c, 'kv_usage')})",
        c.vllm_absent_for,
        "warning",
        "Prometheus holds no vLLM KV-cache metrics for a pod kvtax watches.",
        f"kvtax reads vLLM{ON_POD}, but Prometheus has no "
        "vLLM KV-usage series for it: vLLM is not scraped, or it renamed the metric.",
    )
    add(
        "kvtax-health",
        "KvtaxSidecarDown",
        f"{c.selector('up', c.kvtax_job_selector)} == 0",
        c.sidecar_down_for,
        "warning",
        "The kvtax sidecar cannot be scraped.",
        f"Prometheus has failed to scrape kvtax at {{{{ $labels.instance }}}}{ON_POD} "
        f"for {c.sidecar_down_for}; "
        "kvtax's alerts are blind there.",
    )

    restarts = c.selector("kvtax_proxy_worker_restarts_total", k)
    add(
        "kvtax-health",
        "KvtaxProxyWorkerRestarting",
        f"increase({restarts}[{c.worker_restart_window}]) > 0",
        c.worker_restart_for,
        "warning",
        "A kvtax proxy worker ended and was started again.",
        f"kvtax{ON_POD} counted {VALUE} proxy worker restart(s) over "
        f"{c.worker_restart_window} (--proxy.workers): each restarted worker had crashed or "
        "stopped answering, and its clients' streams broke.",
    )

    # -- the proxy's gate (docs/gate.md) -------------------------------------------------------
    shed_reasons = 'reason=~"queue_full|wait_predicted|wait_expired"'  # the gate's 429s
    shed = c.selector("kvtax_gate_rejections_total", k, shed_reasons)
    shed_rate = f"sum by ({pod}) (rate({shed}[{w}]))"
    admitted_rate = f"sum by ({pod}) (rate({c.selector('kvtax_gate_admitted_total', k)}[{w}]))"
    add(
        "kvtax-clients",
        "KvtaxGateShedding",
        f"{shed_rate} / ({shed_rate} + {admitted_rate}) > {c.gate_shed_ratio:g}",
        c.gate_shed_for,
        "warning",
        "The gate in the kvtax proxy is answering many requests with 429.",
        f"The gate{ON_POD} has shed {{{{ $value | humanizePercentage }}}} of "
        f"requests (queue full, wait predicted or expired) over {w}, for {c.gate_shed_for}.",
    )

    # -- the objective on delivered work (kvtax.mixin.rules.slo), per model across its pods --
    if c.slo_alerting == "burn_rate":
        _burn_rate_alerts(c, add)

    # The final pass, as mixins do it: every alert gets its runbook section.
    return tuple(replace(r, runbook_url=c.runbook_url(r.alert)) for r in rules)


def _burn_rate_alerts(c: RulesConfig, add: Callable[..., None]) -> None:
    """KvtaxErrorBudgetBurn: the two pages and the ticket of kvtax.mixin.rules.slo, per model
    across its pods (and per cluster with a cluster label)."""
    unit = "requests" if c.slo_unit == "requests" else "delivered tokens"
    where = "{{ $labels.model_name }}" + (
        f"{{{{ with $labels.{c.cluster_label} }}}} in {{{{ . }}}}{{{{ end }}}}"
        if c.cluster_label
        else ""
    )
    objective = (
        f"{c.slo_objective * 100:g}% of {unit} with a first token within {c.slo_ttft_seconds:g}s "
        f"and no gap above {c.slo_itl_seconds:g}s over {c.slo_period}"
    )
    for burn in slo.burn_alerts(c):
        spent = slo.budget_share(c, burn.burn, burn.long)
        add(
            "kvtax-objective",
            slo.ALERT,
            burn.expr,
            burn.for_,
            burn.severity,
            "The objective on delivered work is spending its error budget too fast.",
            f"{where} is spending its error budget {VALUE}x as fast as its objective allows "
            f"over the last {burn.long}, and still over the last {burn.short} (threshold "
            f"{burn.burn:g}x: {spent:.2%} of the budget in {burn.long}). Objective: {objective}.",
            burn.labels,
        )


def alert_names(config: RulesConfig = DEFAULT) -> tuple[str, ...]:
    """Distinct alert names in file order (a warning/critical pair counts once)."""
    return tuple(dict.fromkeys(r.alert for r in alert_rules(config)))


def every_alert_name(config: RulesConfig = DEFAULT) -> tuple[str, ...]:
    """The names of ``config``'s alerts and of those the other slo_alerting would make: what a
    severity override or a runbook link may name, whichever the file chooses."""
    other = "threshold" if config.slo_alerting == "burn_rate" else "burn_rate"
    both = (*alert_names(config), *alert_names(replace(config, slo_alerting=other)))
    return tuple(dict.fromkeys(both))


def groups(config: RulesConfig = DEFAULT) -> list[dict[str, Any]]:
    """The alert rules as Prometheus rule groups, in file order."""
    by_group: dict[str, list[dict[str, Any]]] = {}
    for rule in alert_rules(config):
        by_group.setdefault(rule.group, []).append(rule.to_dict())
    return [{"name": name, "rules": rules} for name, rules in by_group.items()]
