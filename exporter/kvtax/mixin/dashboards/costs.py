"""The Overview's cost panels: one headline per number, then the tax by method.

"At a glance" shows each number once, from the exporter's window gauge that owns it (tax, waste,
goodput, SLO goodput); the tax's headline names the method it used. The per-method detail
computes each method's tax from its own counter, with the same formula (docs/tax.md, "The one
definition"), so the methods can be compared. Pure: no I/O.
"""

from __future__ import annotations

from kvtax.mixin.dashboards.common import (
    MODEL,
    TAX_DEFINITION,
    TAX_THRESHOLDS,
    TOK_S,
    gen_rate,
    goodput,
    sum_rate,
    tax_of,
)
from kvtax.mixin.dashboards.model import Panel, Target
from kvtax.mixin.dashboards.queries import by, kvtax
from kvtax.mixin.rules.recording import METHOD_PREFERENCE, RECOMPUTE_COUNTERS

# The estimates' legends say what they are: preemptions x mean context ignores what the prefix
# cache (and a KV connector) still held, so it reads high (70 % against a measured 30 % once).
_ESTIMATE_LEGEND = {"estimated": "estimated, an upper bound", "stall_estimated": "stall_estimated"}


def _estimate_labelled(expr: str) -> str:
    """``expr`` (a series with a method label) with method="estimated" renamed for its legend."""
    return (
        f'label_replace({expr}, "method", "{_ESTIMATE_LEGEND["estimated"]}", "method", "estimated")'
    )


def _only_unmeasured(expr: str) -> str:
    """``expr`` per model, kept only for models whose pods publish no measured recompute."""
    return f"{expr} unless on ({MODEL}) {sum_rate(RECOMPUTE_COUNTERS['measured'])}"


__all__ = [
    "GOODPUT_NOW",
    "GOODPUT_VS_ENGINE",
    "SLO_GOODPUT_NOW",
    "TAX_BY_METHOD",
    "TAX_NOW",
    "TAX_OVER_TIME",
    "WASTE_NOW",
]

# The headline reads the exporter's window gauge: one series per model and pod, the best method.
TAX_NOW = Panel(
    "Preemption tax",
    "stat",
    (
        Target(
            _estimate_labelled(
                by("model_name, method", "max", kvtax("kvtax_preemption_tax_ratio"))
            ),
            "{{model_name}} ({{method}})",
        ),
    ),
    "percentunit",
    "The tax: the share of engine token work that was recompute, R / (Pc + G + R), from the "
    "exporter's gauge kvtax_preemption_tax_ratio over kvtax's --window (default 300 s), worst "
    "pod per model. In brackets, the method R came from: the best one the pod has, measured, "
    "then estimated (an upper bound: it ignores what the prefix cache still held), then "
    "stall_estimated. The Fleet board computes the same formula with the "
    "same method order as a 5-minute ratio of sums over pods; they differ only by window and "
    "alignment. Per-method values are in 'Tax by method' below. A token share, not time. "
    + TAX_DEFINITION,
    "KvtaxPreemptionTaxHigh",
    width=4,
    height=5,
    thresholds=TAX_THRESHOLDS,
)


WASTE_NOW = Panel(
    "Waste",
    "stat",
    (
        Target(
            by("model_name, method", "max", kvtax("kvtax_waste_ratio")),
            "{{model_name}} ({{method}})",
        ),
    ),
    "percentunit",
    "Share of engine token work no client received, (R + U) / (Pc + G + R), from the exporter's "
    "gauge kvtax_waste_ratio over --window, worst pod per model, R from the same method as the "
    "tax. Above the tax, the difference is tokens generated for clients that had gone.",
    "KvtaxGoodputDiverging",
    width=4,
    height=5,
    thresholds=TAX_THRESHOLDS,
)


GOODPUT_NOW = Panel(
    "Goodput",
    "stat",
    (Target(by(MODEL, "sum", kvtax("kvtax_goodput_tokens_per_second")), "{{model_name}}"),),
    TOK_S,
    "Completion tokens per second written to clients that were still connected, over kvtax's "
    "--window, summed over pods (the exporter's gauge kvtax_goodput_tokens_per_second). "
    "Complete only while join coverage is 1.",
    "KvtaxGoodputDiverging",
    width=4,
    height=5,
    base_color="green",
)


SLO_GOODPUT_NOW = Panel(
    "SLO goodput",
    "stat",
    (Target(by(MODEL, "sum", kvtax("kvtax_slo_goodput_tokens_per_second")), "{{model_name}}"),),
    TOK_S,
    "Delivered tokens per second of the requests that met both the TTFT and the ITL SLO "
    "(DistServe's goodput), over --window, summed over pods (the exporter's gauge "
    "kvtax_slo_goodput_tokens_per_second). Far below goodput: clients get their tokens late.",
    "KvtaxTtftSloBreach",
    width=4,
    height=5,
    base_color="green",
)


GOODPUT_VS_ENGINE = Panel(
    "Goodput against engine throughput",
    "timeseries",
    (
        Target(gen_rate(), "engine generated {{model_name}}", color="blue", dashed=True),
        Target(goodput(), "delivered (goodput) {{model_name}}", color="green", stack=True),
        Target(
            f"{sum_rate('kvtax_undelivered_tokens_total')} or {goodput()} * 0",
            "undelivered (waste) {{model_name}}",
            color="red",
            stack=True,
        ),
    ),
    TOK_S,
    "Tokens per second the engine generated (dashed) against tokens that reached a connected "
    "client (green), with the tokens generated for clients that had gone stacked on top (red): "
    "that band is the waste. The ledger counts a request when it ends, so over short ranges "
    "the stack trails the engine line while requests are in flight. Recompute is not in this "
    "picture; see the tax panel.",
    "KvtaxGoodputDiverging",
    width=8,
    min=0,
)


TAX_OVER_TIME = Panel(
    "Preemption tax and waste",
    "timeseries",
    (
        Target(
            _estimate_labelled(
                by("model_name, method", "max", kvtax("kvtax_preemption_tax_ratio"))
            ),
            "tax {{model_name}} ({{method}})",
        ),
        Target(
            _estimate_labelled(by("model_name, method", "max", kvtax("kvtax_waste_ratio"))),
            "waste {{model_name}} ({{method}})",
            dashed=True,
        ),
    ),
    "percentunit",
    "The headline tax and waste over time: the exporter's gauges over --window, worst pod per "
    "model, each with the method it used (estimated only where no pod measures; it is an upper "
    "bound). The orange and red lines are the warning and critical alert thresholds. "
    + TAX_DEFINITION,
    "KvtaxPreemptionTaxHigh",
    width=8,
    min=0,
    thresholds=TAX_THRESHOLDS,
    threshold_lines=True,
)


# Detail: each method's tax from its own counter. The estimates only where nothing measures: next
# to a measurement they are noise that reads as an alarm (the estimate said 63 % where the
# plugin measured 25 %, docs/tax.md's worked example).
TAX_BY_METHOD = Panel(
    "Tax by method",
    "timeseries",
    tuple(
        Target(
            tax_of(RECOMPUTE_COUNTERS[m])
            if m == "measured"
            else _only_unmeasured(tax_of(RECOMPUTE_COUNTERS[m])),
            f"{_ESTIMATE_LEGEND.get(m, m)} {{{{model_name}}}}",
            dashed=m != "measured",
        )
        for m in METHOD_PREFERENCE
    ),
    "percentunit",
    "The same formula with R from each method's counter, over the panel's rate interval. "
    "measured is exact (the stat-logger plugin counts the tokens prefilled again, or V0's "
    "counters) and, where a model has it, the only line drawn. Where it has none: estimated is "
    "preemptions x mean context, an upper bound that ignores what the prefix cache still held "
    "(often several times the measurement); stall_estimated is preemptions x mean context at "
    "the stream stalls the proxy saw. The headline uses the first one present in that order. "
    + TAX_DEFINITION,
    "KvtaxPreemptionTaxHigh",
    width=8,
    min=0,
    thresholds=TAX_THRESHOLDS,
    threshold_lines=True,
)
