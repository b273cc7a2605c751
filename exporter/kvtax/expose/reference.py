"""The metrics reference page, ``docs/metrics.md``, generated from the catalog so it cannot drift.

Besides the catalog's tables, the page carries the "Changed in 0.2" table: every metric (or
label value) 0.2 removed or reshaped, what replaces it and the PromQL to read instead. The table
lives here, as data, so ``kvtax docs`` writes it and a test can check that no removed name
survives anywhere else in the repository's rules, dashboards and docs. Pure: no I/O.

Example::

    >>> "kvtax_admission_limit" in REMOVED_0_2
    True
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtax.engine.vocabulary import CONCEPTS
from kvtax.expose.catalog import METRIC_LIST, PROCESS_METRICS

__all__ = ["CHANGES_0_2", "CHANGES_HEADING", "REMOVED_0_2", "Change", "render_markdown"]

CHANGES_HEADING = "## Changed in 0.2"


@dataclass(frozen=True, slots=True)
class Change:
    """One row of the table: ``removed`` names the metrics that are gone (none if reshaped)."""

    old: str
    new: str
    instead: str
    removed: tuple[str, ...] = ()


def _rate(counter: str) -> str:
    return f"`sum by (model_name) (rate({counter}[5m]))`"


def _window_gauge(gauge: str, counter: str) -> Change:
    removed = "removed: the rate of a published counter"
    return Change(f"`{gauge}`", removed, _rate(counter), (gauge,))


_TAX_BY_METHOD = (
    "`R / (sum by (model_name) (rate(kvtax_engine_prompt_computed_tokens_total[5m])) + "
    "sum by (model_name) (rate(kvtax_engine_generation_tokens_total[5m])) + R)` with R = "
    "`sum by (model_name) (rate(kvtax_recomputed_tokens_estimated_total[5m]))` (or another "
    "method's counter)"
)
_VLLM_REJECTIONS = CONCEPTS["admission_rejections"].names[0]

CHANGES_0_2: tuple[Change, ...] = (
    Change(
        "`kvtax_recomputed_tokens_total{method}`",
        "one counter per method: `kvtax_recomputed_tokens_measured_total`, "
        "`kvtax_recomputed_tokens_estimated_total`, `kvtax_recomputed_tokens_stall_estimated_total`"
        ", each published only when its source exists",
        "the counter of the method you want; the best one per pod: "
        "`namespace_pod_model_name:kvtax_recomputed_tokens:rate5m` (its `method` label names it)",
        ("kvtax_recomputed_tokens_total",),
    ),
    Change(
        "`kvtax_preemption_tax_ratio{method}`, one series per method",
        "one series per model: the best method present (measured, then estimated, then "
        "stall_estimated), named in `method`; see [the one definition](tax.md#the-one-definition)",
        "per method: " + _TAX_BY_METHOD,
    ),
    Change(
        "`kvtax_waste_ratio{method}`, one series per method",
        "one series per model, R from the same method as the tax",
        "`namespace_pod_model_name:kvtax_waste:ratio_rate5m`",
    ),
    _window_gauge(
        "kvtax_engine_generation_tokens_per_second", "kvtax_engine_generation_tokens_total"
    ),
    _window_gauge(
        "kvtax_engine_prompt_computed_tokens_per_second",
        "kvtax_engine_prompt_computed_tokens_total",
    ),
    _window_gauge("kvtax_engine_preemptions_per_second", "kvtax_engine_preemptions_total"),
    Change(
        "`kvtax_recomputed_tokens_per_second`",
        "removed: the rate of a published counter",
        "`namespace_pod_model_name:kvtax_recomputed_tokens:rate5m`, or the rate of one method's "
        "counter",
        ("kvtax_recomputed_tokens_per_second",),
    ),
    _window_gauge("kvtax_slo_goodput_requests_per_second", "kvtax_slo_met_requests_total"),
    _window_gauge("kvtax_undelivered_tokens_per_second", "kvtax_undelivered_tokens_total"),
    Change(
        "`kvtax_delivery_yield_ratio`",
        "removed: a ratio of published counters",
        "`namespace_pod_model_name:kvtax_delivery_yield:ratio_rate5m` (delivered / generated)",
        ("kvtax_delivery_yield_ratio",),
    ),
    Change(
        "`kvtax_admission_in_flight`, `kvtax_admission_limit`, `kvtax_admission_queued`",
        "removed: nothing produced them",
        "the gate's own series, `kvtax_gate_*` ([gate.md](gate.md))",
        ("kvtax_admission_in_flight", "kvtax_admission_limit", "kvtax_admission_queued"),
    ),
    Change(
        '`kvtax_requests_total{outcome="rejected"}`',
        '`outcome="upstream_4xx"` (vLLM answered 4xx) and `outcome="too_large"` (kvtax\'s own 413)',
        f"vLLM's own admission rejections: `sum by (model_name, reason) "
        f"(rate({_VLLM_REJECTIONS}[5m]))`",
    ),
)

# Every metric name 0.2 removed, for the test that none survives outside this table.
REMOVED_0_2: frozenset[str] = frozenset(name for c in CHANGES_0_2 for name in c.removed)


def _changes() -> list[str]:
    lines = [
        CHANGES_HEADING,
        "",
        "| before 0.2 | in 0.2 | query instead |",
        "|---|---|---|",
    ]
    lines += [f"| {c.old} | {c.new} | {c.instead} |" for c in CHANGES_0_2]
    return lines


def render_markdown() -> str:
    """The whole page: kvtax's metrics, the process families, then the changes of 0.2."""
    lines = [
        "# kvtax metrics reference",
        "",
        "Generated from `exporter/kvtax/expose/catalog.py` by `kvtax docs`; do not edit by hand.",
        "The ratios follow [the one definition of the tax](tax.md#the-one-definition).",
        "The page is OpenMetrics when the scraper's `Accept` asks for it (Prometheus does by",
        "default) and text 0.0.4 otherwise, gzipped when its `Accept-Encoding` allows:",
        "prometheus-client's own negotiation.",
        "",
        "| name | type | labels | meaning |",
        "|---|---|---|---|",
    ]
    for m in METRIC_LIST:
        labels = ", ".join(f"`{label}`" for label in m.labels) or "-"
        lines.append(f"| `{m.name}` | {m.type} | {labels} | {m.help} |")
    lines += [
        "",
        "The process's own standard families (prometheus-client's process collector; the",
        "parse worker is a separate process and is not included):",
        "",
        "| name | type | meaning |",
        "|---|---|---|",
    ]
    lines += [f"| `{name}` | {kind} | {text} |" for name, kind, text in PROCESS_METRICS]
    return "\n".join([*lines, "", *_changes()]) + "\n"
