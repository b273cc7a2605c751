"""The Fleet dashboard: every replica of a model side by side, built on the recording rules.

Fleet-wide series are ``model_name:`` records (ratios of sums, never averages of ratios);
per-pod ones are ``namespace_pod_model_name:`` records. Pure: no I/O.
"""

from __future__ import annotations

from kvtax.mixin.dashboards.common import (
    KV_THRESHOLDS,
    MODEL,
    POD,
    TAX_DEFINITION,
    TAX_THRESHOLDS,
    THRASH_MAPPINGS,
    THRASH_THRESHOLDS,
    TOK_S,
    TOKENS,
    capacity_tokens,
    kv_usage_ratio,
    length_p95,
    running,
    waiting,
)
from kvtax.mixin.dashboards.model import Board, Configured, Panel, Row, Target
from kvtax.mixin.dashboards.queries import by, kvtax, recorded

__all__ = ["FLEET"]


def _record(metric: str, operation: str, level: str = "pod") -> Configured:
    """A recording rule's selector as the rules the dashboard is built with record it (their
    rate window), checked against them when built."""
    recorded(metric, operation, level=level)  # a rule the defaults record: a typo fails here
    return lambda rules: recorded(metric, operation, level=level, rules=rules)


def _by(labels: str, fn: str, selector: Configured) -> Configured:
    return lambda rules: by(labels, fn, selector(rules))


def _top5(labels: str, selector: Configured) -> Configured:
    return lambda rules: f"topk(5, {by(labels, 'max', selector(rules))})"


_fleet_goodput = _record("kvtax_delivered_tokens", "rate{w}", level="fleet")
_fleet_engine = _record("kvtax_engine_generation_tokens", "rate{w}", level="fleet")
_fleet_tax = _record("kvtax_preemption_tax", "ratio_rate{w}", level="fleet")
_fleet_waste = _record("kvtax_waste", "ratio_rate{w}", level="fleet")
_fleet_capacity = _record("kvtax_kv_capacity_tokens", "sum", level="fleet")
_pod_tax = _record("kvtax_preemption_tax", "ratio_rate{w}")
_pod_waste = _record("kvtax_waste", "ratio_rate{w}")
_pod_goodput = _record("kvtax_delivered_tokens", "rate{w}")
_pod_usage = _record("vllm_kv_cache_usage", "max")

FLEET = Board(
    "Fleet",
    "Every replica of a model side by side: which pods pay the most tax, fleet goodput, and the "
    "sum of KV capacity against demand. Built on kvtax's recording rules (their rate window: "
    "5m by default).",
    rows=(
        Row(
            "Fleet",
            (
                Panel(
                    "Fleet goodput against engine throughput",
                    "timeseries",
                    (
                        Target(_fleet_engine, "engine generated {{model_name}}", dashed=True),
                        Target(_fleet_goodput, "delivered {{model_name}}", color="green"),
                    ),
                    TOK_S,
                    "Summed over every replica of a model: tokens generated against tokens "
                    "delivered to clients. The gap is work no client received.",
                    "KvtaxGoodputDiverging",
                    width=8,
                    min=0,
                ),
                Panel(
                    "Fleet preemption tax and waste",
                    "timeseries",
                    (
                        Target(_by(MODEL, "max", _fleet_tax), "tax {{model_name}}"),
                        Target(
                            _by(MODEL, "max", _fleet_waste), "waste {{model_name}}", dashed=True
                        ),
                    ),
                    "percentunit",
                    "Recompute (tax) and recompute plus undelivered (waste) as shares of the "
                    "whole fleet's engine token work: ratios of sums over pods from the 5-minute "
                    "recording rules, so busy pods weigh more. Each pod's R is its best method "
                    "(measured, then estimated, then stall_estimated), the same formula and order "
                    "as the exporter's gauge the Overview reads over --window; the two differ "
                    "only by window, alignment and the worst-pod versus whole-fleet view. "
                    + TAX_DEFINITION,
                    "KvtaxPreemptionTaxHigh",
                    width=8,
                    min=0,
                    thresholds=TAX_THRESHOLDS,
                    threshold_lines=True,
                ),
                Panel(
                    "Fleet KV capacity against demand",
                    "timeseries",
                    (
                        Target(_fleet_capacity, "capacity {{model_name}}", dashed=True),
                        Target(
                            by(MODEL, "sum", f"{kv_usage_ratio} * {capacity_tokens}"),
                            "in use {{model_name}}",
                        ),
                        Target(
                            by(MODEL, "sum", f"({running} + {waiting}) * {length_p95}"),
                            "demand at p95 {{model_name}}",
                        ),
                    ),
                    TOKENS,
                    "The sum of every replica's KV pool against tokens in use and demand "
                    "(running + waiting requests at p95 length). Demand above capacity across "
                    "the fleet calls for replicas, not tuning.",
                    "KvtaxKvCacheNearFull",
                    width=8,
                    min=0,
                ),
            ),
        ),
        Row(
            "Top pods",
            (
                Panel(
                    "Top pods by preemption tax",
                    "bargauge",
                    (
                        Target(
                            _top5("namespace, pod, model_name", _pod_tax),
                            "{{namespace}}/{{pod}} {{model_name}}",
                            instant=True,
                        ),
                    ),
                    "percentunit",
                    "The five replicas whose engines spend the largest share of token work on "
                    "recompute, now (the per-pod 5-minute tax rule). One pod far above its peers: "
                    "uneven routing or a different configuration. " + TAX_DEFINITION,
                    "KvtaxPreemptionTaxHigh",
                    min=0,
                    max=1,
                    thresholds=TAX_THRESHOLDS,
                ),
                Panel(
                    "Top pods by waste",
                    "bargauge",
                    (
                        Target(
                            _top5(POD, _pod_waste),
                            "{{namespace}}/{{pod}} {{model_name}}",
                            instant=True,
                        ),
                    ),
                    "percentunit",
                    "The five replicas with the largest share of engine work that no client "
                    "received (recompute plus abandoned generations), now.",
                    "KvtaxGoodputDiverging",
                    min=0,
                    max=1,
                    thresholds=TAX_THRESHOLDS,
                ),
            ),
        ),
        Row(
            "Replicas side by side",
            (
                Panel(
                    "Thrash state by pod",
                    "stat",
                    (
                        Target(
                            by(POD, "max", kvtax("kvtax_thrash_state")), "{{pod}} {{model_name}}"
                        ),
                    ),
                    "none",
                    "One tile per replica: ok (green), at risk (orange), thrashing (red).",
                    "KvtaxThrashing",
                    width=24,
                    height=5,
                    thresholds=THRASH_THRESHOLDS,
                    mappings=THRASH_MAPPINGS,
                ),
                Panel(
                    "Goodput by pod",
                    "timeseries",
                    (Target(_by(POD, "sum", _pod_goodput), "{{pod}} {{model_name}}"),),
                    TOK_S,
                    "Delivered tokens per second per replica. Replicas of one model behind one "
                    "balancer should look alike; a low one is starved or thrashing.",
                    "KvtaxGoodputDiverging",
                    width=8,
                    min=0,
                ),
                Panel(
                    "Preemption tax by pod",
                    "timeseries",
                    (
                        Target(
                            _by(f"{POD}, method", "max", _pod_tax),
                            "{{pod}} {{model_name}} ({{method}})",
                        ),
                    ),
                    "percentunit",
                    "Recompute share of engine work per replica (the per-pod 5-minute tax rule), "
                    "with the method used. Compare replicas: the tax follows load and "
                    "configuration, not the model. " + TAX_DEFINITION,
                    "KvtaxPreemptionTaxHigh",
                    width=8,
                    min=0,
                    thresholds=TAX_THRESHOLDS,
                    threshold_lines=True,
                ),
                Panel(
                    "KV cache usage by pod",
                    "timeseries",
                    (Target(_by(POD, "max", _pod_usage), "{{pod}} {{model_name}}"),),
                    "percentunit",
                    "KV usage of each replica's fullest engine, never summed (a sum of fractions "
                    "means nothing). Pods above the orange line are the ones about to preempt.",
                    "KvtaxKvCacheNearFull",
                    width=8,
                    min=0,
                    max=1,
                    thresholds=KV_THRESHOLDS,
                    threshold_lines=True,
                ),
            ),
        ),
    ),
    tags=("vllm", "fleet"),
)
