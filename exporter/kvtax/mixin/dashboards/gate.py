"""The Overview's "Gate" row: the proxy's cap, its queue and what it sheds.

The gate's series carry no ``model_name`` (one gate stands in front of every model of a pod),
so their selectors take the namespace and pod variables only, and the panels keep their data
whichever model is chosen. Pure: no I/O.
"""

from __future__ import annotations

from kvtax.mixin.dashboards.common import PER_S, SEQS
from kvtax.mixin.dashboards.model import Panel, Row, Target
from kvtax.mixin.dashboards.queries import by, histogram_quantile, kvtax, rate

__all__ = ["GATE_ROW"]

_GATE = "namespace, pod"
_SHED = (("reason", "queue_full|wait_predicted|wait_expired"),)

_cap = Panel(
    "Gate cap",
    "timeseries",
    (
        Target(by(f"{_GATE}, source", "max", kvtax("kvtax_gate_cap")), "cap {{pod}} ({{source}})"),
        Target(by(_GATE, "max", kvtax("kvtax_gate_advised_cap")), "advised {{pod}}", dashed=True),
        Target(by(_GATE, "max", kvtax("kvtax_gate_requests_in_flight")), "in flight {{pod}}"),
    ),
    SEQS,
    "The gate's cap on requests in flight and how it was chosen (source: static, floor, "
    "cold_start, formula, budget, cut, raise), the cap the auto mode advises (dashed; "
    "published with the gate off too, for vLLM's --max-num-seqs, or --max-num-active-seqs on "
    "0.33+), and the requests in flight.",
    "KvtaxGateShedding",
    width=8,
    min=0,
)

_queue = Panel(
    "Gate queue",
    "timeseries",
    (
        Target(by(_GATE, "max", kvtax("kvtax_gate_queue_depth")), "waiting {{pod}}"),
        Target(
            histogram_quantile(
                0.99, kvtax("kvtax_gate_queue_wait_seconds", part="_bucket"), labels="pod"
            ),
            "p99 wait (s) {{pod}}",
            dashed=True,
        ),
    ),
    "short",
    "Requests waiting at the gate, and the p99 of how long a request waited before it was let "
    "through (dashed, seconds). Waits count in the client's time to first token. Empty while "
    "the gate is off.",
    "KvtaxGateShedding",
    width=8,
    min=0,
    no_data="The gate is off (--gate.mode off)",
)

_shed = Panel(
    "Gate answers",
    "timeseries",
    (
        Target(
            by(f"{_GATE}, reason", "sum", rate(kvtax("kvtax_gate_rejections_total"))),
            "{{reason}} {{pod}}",
        ),
        Target(
            by(_GATE, "sum", rate(kvtax("kvtax_gate_admitted_total"))),
            "let through {{pod}}",
            dashed=True,
        ),
    ),
    PER_S,
    "Requests the gate answered itself, per second, by reason: queue_full, wait_predicted and "
    "wait_expired are 429s with Retry-After (shedding), over_budget is a 400 for the "
    "per-request token budget, vllm_refused is vLLM's own 503 behind the gate (its "
    "--max-num-queued-reqs or --max-num-queued-tokens). "
    "Let through (dashed) went on to vLLM. Empty while the gate is off.",
    "KvtaxGateShedding",
    width=8,
    min=0,
    no_data="The gate is off (--gate.mode off)",
)

GATE_ROW = Row("Gate", (_cap, _queue, _shed))
