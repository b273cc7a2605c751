"""Recording rules as data: goodput, engine throughput, tax, waste, cache usage and capacity.

Every rule exists twice, per pod and model (``namespace_pod_model_name:``) and fleet-wide per
model (``model_name:``); fleet rules sum the per-pod records, so ratios are ratios of sums, never
averages of ratios. Names follow ``level:metric:operations``: ``_total`` dropped after rate(),
the range in the name (``rate5m``), ratios of rates as ``ratio_rate5m``. The Grafana dashboards
and the alert rules query these names; :func:`record_names` lists them. Pure: no I/O.

Recompute comes as one counter per method (measured, estimated, stall_estimated). The per-pod
recompute rate takes exactly one of them per pod, the best one present, and names it in a
``method`` label so a reader sees which; everything built on it (tax, waste, fleet sums) inherits
that choice. This is the tax of docs/tax.md ("The one definition"), the same formula and method
order as the exporter's ``kvtax_preemption_tax_ratio``, over the rules' rate window.

Example::

    >>> [r.record for r in recording_rules()][0]
    'namespace_pod_model_name:kvtax_delivered_tokens:rate5m'
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtax.engine.vocabulary import CONCEPTS
from kvtax.expose.publish import RECOMPUTED_COUNTERS
from kvtax.figures.recompute import METHODS
from kvtax.mixin.rules import slo
from kvtax.mixin.rules.config import DEFAULT, FLEET, POD, RulesConfig

__all__ = [
    "METHOD_PREFERENCE",
    "RECOMPUTE_COUNTERS",
    "RecordingRule",
    "fleet",
    "per_pod",
    "record_names",
    "recording_rules",
]

POD_LEVEL = "_".join(POD)
FLEET_LEVEL = "_".join(FLEET)
# Best first: the plugin's exact count, then preemptions x context, then proxy stalls. The
# order and the counter names are the exporter's own (figures.recompute, expose.publish), so a
# rule can never prefer another method than the gauge does.
METHOD_PREFERENCE: tuple[str, ...] = tuple(method for method, _ in METHODS)
RECOMPUTE_COUNTERS: dict[str, str] = dict(RECOMPUTED_COUNTERS)


@dataclass(frozen=True, slots=True)
class RecordingRule:
    """One recording rule; ``help`` says how to read it (for dashboards, not emitted)."""

    record: str
    expr: str
    help: str


def per_pod(metric: str, operation: str) -> str:
    """The per-pod record name, e.g. ``per_pod("kvtax_delivered_tokens", "rate5m")``."""
    return f"{POD_LEVEL}:{metric}:{operation}"


def fleet(metric: str, operation: str) -> str:
    """The fleet-wide per-model record name."""
    return f"{FLEET_LEVEL}:{metric}:{operation}"


def _by(labels: tuple[str, ...]) -> str:
    return ", ".join(labels)


def recording_rules(config: RulesConfig = DEFAULT) -> tuple[RecordingRule, ...]:
    """All recording rules in evaluation order (fleet rules read the per-pod ones)."""
    w = config.rate_window
    rate = f"rate{w}"
    ratio = f"ratio_rate{w}"
    pod = _by(config.pod_labels)
    model = _by(config.fleet_labels)
    k = config.kvtax_selector

    def kvtax_rate(counter: str, *matchers: str) -> str:
        return f"sum by ({pod}) (rate({config.selector(counter, k, *matchers)}[{w}]))"

    def named_method(method: str) -> str:
        # An empty source label matches the empty regex, so label_replace just adds the label.
        return (
            f'label_replace({kvtax_rate(RECOMPUTE_COUNTERS[method])}, "method", "{method}", "", "")'
        )

    def kvtax_gauge(agg: str, gauge: str) -> str:
        return f"{agg} by ({pod}) ({config.selector(gauge, k)})"

    rules: list[RecordingRule] = []

    def add(record: str, expr: str, help_text: str) -> None:
        rules.append(RecordingRule(record, expr, help_text))

    # -- per pod and model ---------------------------------------------------------------------
    counters = (
        ("kvtax_delivered_tokens", "Goodput: completion tokens per second that reached clients."),
        ("kvtax_slo_met_tokens", "SLO goodput: delivered tokens/s of requests meeting the SLOs."),
        ("kvtax_slo_met_requests", "SLO goodput: requests/s meeting both SLOs (DistServe)."),
        ("kvtax_engine_generation_tokens", "Engine throughput: generated tokens per second."),
        ("kvtax_engine_prompt_computed_tokens", "Engine prompt tokens computed per second."),
        ("kvtax_engine_preemptions", "Preemptions per second."),
        ("kvtax_undelivered_tokens", "Tokens/s generated for clients that had gone."),
        (
            "kvtax_join_delivered_tokens",
            "Goodput as of kvtax's scrapes of vLLM, in step with the engine's counters: the "
            "delivery yield's numerator.",
        ),
        (
            "kvtax_join_undelivered_tokens",
            "Undelivered tokens/s as of kvtax's scrapes of vLLM: the waste's U.",
        ),
    )
    for metric, help_text in counters:
        add(per_pod(metric, rate), kvtax_rate(f"{metric}_total"), help_text)

    # One method per pod: `or on(...)` adds a lesser method only where no better one exists.
    recomputed = f" or on ({pod}) ".join(named_method(m) for m in METHOD_PREFERENCE)
    add(
        per_pod("kvtax_recomputed_tokens", rate),
        recomputed,
        "Recompute: tokens/s prefilled again after preemption, by the best method present.",
    )
    gen, prompt = (
        per_pod("kvtax_engine_generation_tokens", rate),
        per_pod("kvtax_engine_prompt_computed_tokens", rate),
    )
    # Without any recompute series the work is still prompt + generation.
    recomputed_sum = (
        f"(sum without (method) ({per_pod('kvtax_recomputed_tokens', rate)}) or {gen} * 0)"
    )
    add(
        per_pod("kvtax_engine_work_tokens", rate),
        f"{prompt} + {gen} + {recomputed_sum}",
        "Engine token work per second: computed prompt + generated + recomputed.",
    )
    work = per_pod("kvtax_engine_work_tokens", rate)
    add(
        per_pod("kvtax_preemption_tax", ratio),
        f"{per_pod('kvtax_recomputed_tokens', rate)} / ignoring (method) group_left {work}",
        "Preemption tax: the share of engine token work that was recompute, 0-1.",
    )
    # Ledger tokens over engine tokens: the join counters, which kvtax publishes as of the same
    # scrape of vLLM as the engine's. The live delivered counter leads the engine's between
    # scrapes, and a short window starting on such a sample reads a yield below 1 for nothing.
    add(
        per_pod("kvtax_waste", ratio),
        f"({recomputed_sum} + {per_pod('kvtax_join_undelivered_tokens', rate)}) / {work}",
        "Waste: the share of engine token work no client received, 0-1.",
    )
    add(
        per_pod("kvtax_delivery_yield", ratio),
        f"{per_pod('kvtax_join_delivered_tokens', rate)} / {gen}",
        "Delivery yield: delivered / generated tokens, 0-1 while the join covers all traffic.",
    )
    usage = config.name_selector(CONCEPTS["kv_usage"].names, config.vllm_selector)
    # KV usage is a fraction per engine: take the fullest engine, never a sum.
    add(
        per_pod("vllm_kv_cache_usage", "max"),
        f"max by ({pod}) ({usage})",
        "KV-cache usage, 0-1, of the fullest engine (both vLLM metric names).",
    )
    for metric, agg, help_text in (
        ("kvtax_kv_capacity_tokens", "max", "KV capacity in tokens."),
        ("kvtax_recommended_max_num_seqs", "min", "Recommended max_num_seqs."),
        ("kvtax_configured_max_num_seqs", "max", "Configured max_num_seqs."),
    ):
        add(per_pod(metric, agg), kvtax_gauge(agg, metric), help_text)

    # -- fleet-wide per model: sums of the per-pod records -------------------------------------
    def fleet_sum(metric: str, operation: str, fleet_op: str | None = None) -> None:
        add(
            fleet(metric, fleet_op or operation),
            f"sum by ({model}) ({per_pod(metric, operation)})",
            f"Fleet-wide sum of {per_pod(metric, operation)}.",
        )

    for metric, _ in counters:
        fleet_sum(metric, rate)
    fleet_sum("kvtax_recomputed_tokens", rate)
    fleet_sum("kvtax_engine_work_tokens", rate)
    f_work = fleet("kvtax_engine_work_tokens", rate)
    f_recomputed = fleet("kvtax_recomputed_tokens", rate)
    add(
        fleet("kvtax_preemption_tax", ratio),
        f"{f_recomputed} / {f_work}",
        "Fleet preemption tax per model: recompute / engine token work, 0-1.",
    )
    add(
        fleet("kvtax_waste", ratio),
        f"({f_recomputed} + {fleet('kvtax_join_undelivered_tokens', rate)}) / {f_work}",
        "Fleet waste per model, 0-1.",
    )
    add(
        fleet("kvtax_delivery_yield", ratio),
        f"{fleet('kvtax_join_delivered_tokens', rate)} / "
        f"{fleet('kvtax_engine_generation_tokens', rate)}",
        "Fleet delivery yield per model, 0-1.",
    )
    pod_usage = per_pod("vllm_kv_cache_usage", "max")
    add(
        fleet("vllm_kv_cache_usage", "avg"),
        f"avg by ({model}) ({pod_usage})",
        "Mean KV-cache usage across the model's pods, 0-1.",
    )
    add(
        fleet("vllm_kv_cache_usage", "max"),
        f"max by ({model}) ({pod_usage})",
        "KV-cache usage of the model's fullest pod, 0-1.",
    )
    fleet_sum("kvtax_kv_capacity_tokens", "max", "sum")
    fleet_sum("kvtax_recommended_max_num_seqs", "min", "sum")
    fleet_sum("kvtax_configured_max_num_seqs", "max", "sum")

    # -- the objective on delivered work (kvtax.mixin.rules.slo): per model, from the rates ---
    made = frozenset(r.record for r in rules)
    rules += [RecordingRule(r.record, r.expr, r.help) for r in slo.recording_rules(config, made)]
    return tuple(rules)


def record_names(config: RulesConfig = DEFAULT) -> tuple[str, ...]:
    """Every recorded series name, in evaluation order."""
    return tuple(r.record for r in recording_rules(config))
