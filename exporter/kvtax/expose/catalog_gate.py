"""The gate's metrics (docs/gate.md), a table of :mod:`kvtax.expose.catalog`.

With the gate off only ``kvtax_gate_advised_cap`` is published: the value to copy into vLLM's
``--max-num-seqs`` (``--max-num-active-seqs`` on 0.33+). Kept apart from the catalog's other
tables because it is the one feature that is opt-in.
"""

from __future__ import annotations

from kvtax.expose.spec import MetricSpec

__all__ = ["GATE_METRICS"]

_S = MetricSpec
GATE_METRICS: tuple[MetricSpec, ...] = (
    _S(
        "kvtax_gate_advised_cap",
        "gauge",
        "Requests in flight the auto mode would allow now: floor(capacity x target usage / p95 "
        "request length), bounded by --gate.floor and --gate.ceiling. Published with "
        "the gate off too, as a value for vLLM's --max-num-seqs (--max-num-active-seqs on "
        "0.33+, --max-num-seqs left at its default) or --max-num-queued-reqs.",
        (),
        "gate",
    ),
    _S(
        "kvtax_gate_cap",
        "gauge",
        "The gate's cap on requests in flight, by mode and by how it was chosen (source: "
        "static, floor, cold_start, formula, budget, cut, raise).",
        ("mode", "source"),
        "gate",
    ),
    _S(
        "kvtax_gate_budget_blocks",
        "gauge",
        "KV blocks the budget mode hands out: the whole pool's (capacity / block size).",
        (),
        "gate",
    ),
    _S(
        "kvtax_gate_blocks_in_flight",
        "gauge",
        "Worst-case KV blocks (prompt + max_tokens) of the requests the gate let through.",
        (),
        "gate",
    ),
    _S(
        "kvtax_gate_requests_in_flight",
        "gauge",
        "Requests the gate let through that have not ended.",
        (),
        "gate",
    ),
    _S(
        "kvtax_gate_queue_depth",
        "gauge",
        "Requests waiting in the gate's queue.",
        (),
        "gate",
    ),
    _S(
        "kvtax_gate_queue_wait_seconds",
        "histogram",
        "Time a request waited at the gate before it was let through (0 when it fit at once).",
        (),
        "gate",
    ),
    _S(
        "kvtax_gate_admitted_total",
        "counter",
        "Requests the gate let through to vLLM.",
        (),
        "gate",
    ),
    _S(
        "kvtax_gate_rejections_total",
        "counter",
        "Requests the gate answered itself, by reason: queue_full (429, over "
        "--gate.max-queue), wait_predicted (429 at arrival, its expected wait over "
        "--gate.max-wait), wait_expired (429, over --gate.max-wait), over_budget "
        "(400, over --gate.token-budget); and vllm_refused, vLLM's own 503 to a request the "
        "gate let through (its --max-num-queued-reqs or --max-num-queued-tokens).",
        ("reason",),
        "gate",
    ),
    _S(
        "kvtax_gate_cap_changes_total",
        "counter",
        "Changes of the gate's cap, by direction (up, down).",
        ("direction",),
        "gate",
    ),
)
