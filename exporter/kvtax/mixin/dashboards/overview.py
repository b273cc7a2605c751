"""The Overview dashboard: one deployment, narrowed by namespace, pod and model.

Top to bottom it answers: is the engine thrashing, what is it costing (one headline per number:
tax, waste, goodput, SLO goodput; then the tax by method), what resumed requests got back
without computing it (the prefix cache, a KV connector), where the KV pressure is, what
clients feel (TTFT, ITL, stalls), and how admission is sized (recommended against configured
max_num_seqs, rejections, coverage). Pure: no I/O.
"""

from __future__ import annotations

from kvtax.mixin.dashboards.common import (
    KV_THRESHOLDS,
    MODEL,
    PER_S,
    POD,
    SEQS,
    THRASH_MAPPINGS,
    THRASH_THRESHOLDS,
    sum_rate,
)
from kvtax.mixin.dashboards.costs import (
    GOODPUT_NOW,
    GOODPUT_VS_ENGINE,
    SLO_GOODPUT_NOW,
    TAX_BY_METHOD,
    TAX_NOW,
    TAX_OVER_TIME,
    WASTE_NOW,
)
from kvtax.mixin.dashboards.gate import GATE_ROW
from kvtax.mixin.dashboards.model import Board, Panel, Row, Target, Threshold
from kvtax.mixin.dashboards.queries import by, histogram_quantile, kvtax, rate, vllm
from kvtax.mixin.dashboards.resumes import RESUMES_ROW
from kvtax.mixin.rules.config import DEFAULT as RULES

__all__ = ["OVERVIEW"]


def _quantiles(title: str, concept: str, client_metric: str, what: str, runbook: str) -> Panel:
    return Panel(
        title,
        "timeseries",
        (
            Target(
                histogram_quantile(0.5, vllm(concept, part="_bucket")), "vLLM p50 {{model_name}}"
            ),
            Target(
                histogram_quantile(0.99, vllm(concept, part="_bucket")), "vLLM p99 {{model_name}}"
            ),
            Target(
                histogram_quantile(0.5, kvtax(client_metric, part="_bucket")),
                "client p50 {{model_name}}",
                dashed=True,
            ),
            Target(
                histogram_quantile(0.99, kvtax(client_metric, part="_bucket")),
                "client p99 {{model_name}}",
                dashed=True,
            ),
        ),
        "s",
        f"{what} p50 and p99, solid as vLLM measured it and dashed as clients saw it through the "
        "kvtax proxy. Under preemption p99 jumps while p50 barely moves; a client line far above "
        "vLLM's means time lost between engine and client (queueing in the proxy or network).",
        runbook,
        width=8,
        min=0,
    )


_thrash_state = Panel(
    "Thrash state",
    "stat",
    (Target(by(MODEL, "max", kvtax("kvtax_thrash_state")), "{{model_name}}"),),
    "none",
    "Is the engine thrashing? ok: no preemption signature. at risk: KV cache near full and "
    "preempting. thrashing: cache full, preempting, requests waiting and engine throughput "
    "falling as load rises. Worst pod per model.",
    "KvtaxThrashing",
    width=4,
    height=5,
    thresholds=THRASH_THRESHOLDS,
    mappings=THRASH_MAPPINGS,
)

_max_num_seqs_now = Panel(
    "max_num_seqs: recommended / configured",
    "stat",
    (
        Target(by(MODEL, "min", kvtax("kvtax_recommended_max_num_seqs")), "recommended"),
        Target(by(MODEL, "max", kvtax("kvtax_configured_max_num_seqs")), "configured"),
    ),
    SEQS,
    "What to set --max-num-seqs to: floor(KV capacity x target usage / p95 request length), "
    "next to the value vLLM runs with (kvtax serve --max-num-seqs). On vLLM 0.33+ set "
    "--max-num-active-seqs to it instead, with --max-num-seqs left at its default (>= it): it "
    "caps the running batch without shrinking CUDA-graph capacity. Configured well above "
    "recommended means the engine admits more sequences than its KV cache can finish.",
    "KvtaxOverAdmitted",
    width=4,
    height=5,
    base_color="blue",
)

_kv_usage = Panel(
    "KV cache usage",
    "timeseries",
    (Target(by(POD, "max", kvtax("kvtax_kv_cache_usage_ratio")), "{{model_name}} {{pod}}"),),
    "percentunit",
    "Share of KV blocks in use, per pod. Above the orange 0.85 line a burst of long generations "
    "runs the pool dry and vLLM starts preempting; pinned near 1 with a queue is thrashing.",
    "KvtaxKvCacheNearFull",
    width=8,
    min=0,
    max=1,
    thresholds=KV_THRESHOLDS,
    threshold_lines=True,
)

_preemption_rate = Panel(
    "Preemption rate",
    "timeseries",
    (Target(sum_rate("kvtax_engine_preemptions_total"), "{{model_name}}"),),
    PER_S,
    "Preemptions per second (reset-corrected from vLLM's counter). vLLM counts a preemption when "
    "the request next produces output, so bursts lag the cause. Any sustained rate is a cost.",
    "KvtaxVllmPreempting",
    width=8,
    min=0,
)

_running_waiting = Panel(
    "Running and waiting requests",
    "timeseries",
    (
        Target(by(MODEL, "sum", kvtax("kvtax_requests_running")), "running {{model_name}}"),
        Target(by(MODEL, "sum", kvtax("kvtax_requests_waiting")), "waiting {{model_name}}"),
        Target(
            by(MODEL, "sum", kvtax("kvtax_configured_max_num_seqs")),
            "configured max_num_seqs",
            color="purple",
            dashed=True,
        ),
    ),
    "short",
    "Requests in vLLM's batch and in its queue. Running pinned at max_num_seqs with a growing "
    "queue means the engine is full; running far below it with a queue means the KV cache, not "
    "max_num_seqs, is the limit.",
    "KvtaxQueueGrowing",
    width=8,
    min=0,
)

_stalls = Panel(
    "Stream stalls",
    "timeseries",
    (
        Target(
            by(MODEL, "sum", rate(kvtax("kvtax_stream_stall_seconds", part="_count"))),
            "stalls {{model_name}}",
        ),
        Target(
            sum_rate("kvtax_engine_preemptions_total"), "preemptions {{model_name}}", dashed=True
        ),
    ),
    PER_S,
    "Streams that went silent far longer than their usual inter-token gap, per second, next to "
    "the preemption rate (dashed). A preempted stream stalls while it waits to be prefilled "
    "again, so the two lines move together when preemption is what users feel.",
    "KvtaxStreamStalls",
    width=8,
    min=0,
)

_rejections = Panel(
    "Rejected requests",
    "timeseries",
    (
        Target(
            by("model_name, reason", "sum", rate(vllm("admission_rejections"))),
            "vLLM admission {{model_name}} ({{reason}})",
        ),
        Target(
            sum_rate("kvtax_requests_total", where=(("outcome", "upstream_4xx"),)),
            "vLLM 4xx {{model_name}}",
        ),
        Target(
            sum_rate("kvtax_requests_total", where=(("outcome", "too_large"),)),
            "too large (413) {{model_name}}",
            dashed=True,
        ),
    ),
    "reqps",
    "Requests refused per second. vLLM's admission rejections (0.32+, by reason: "
    "--max-num-queued-reqs or --max-num-queued-tokens full) are load shedding, answered 503: "
    "capacity is short, and the alert watches them. The proxy counts those 503s as "
    "outcome upstream_error, not upstream_4xx. vLLM 4xx answers (outcome upstream_4xx) are "
    "malformed or over-long requests, not load; too large (dashed) are bodies over kvtax's "
    "proxy limit, answered 413 by the proxy itself.",
    "KvtaxLoadShedding",
    width=8,
    min=0,
)

_coverage = Panel(
    "Join coverage",
    "timeseries",
    (Target(by(MODEL, "min", kvtax("kvtax_join_coverage_ratio")), "{{model_name}}"),),
    "percentunit",
    "Requests the delivery ledger saw / requests vLLM served. Below 1 some traffic bypasses the "
    "kvtax proxy, so goodput and waste are partial; trust them only near 1.",
    "KvtaxJoinCoverageLow",
    width=8,
    min=0,
    base_color="red",
    thresholds=(Threshold(RULES.join_coverage_min, "green"),),
    threshold_lines=True,
)

_recommended_vs_configured = Panel(
    "Recommended against configured max_num_seqs",
    "timeseries",
    (
        Target(
            by(MODEL, "min", kvtax("kvtax_recommended_max_num_seqs")), "recommended {{model_name}}"
        ),
        Target(
            by(MODEL, "max", kvtax("kvtax_configured_max_num_seqs")),
            "configured {{model_name}}",
            dashed=True,
        ),
        Target(by(MODEL, "max", kvtax("kvtax_requests_running")), "running {{model_name}}"),
    ),
    SEQS,
    "The recommendation moves with the request length mix; configured is a flat line. Running "
    "above recommended is where preemption starts. Cap it with --max-num-seqs, or on vLLM "
    "0.33+ with --max-num-active-seqs (--max-num-seqs left at its default).",
    "KvtaxOverAdmitted",
    width=8,
    min=0,
)

OVERVIEW = Board(
    "Overview",
    "Is the engine thrashing, what is it costing, and what should max_num_seqs be: one vLLM "
    "deployment per namespace, pod and model.",
    rows=(
        Row(
            "At a glance",
            (
                _thrash_state,
                TAX_NOW,
                WASTE_NOW,
                GOODPUT_NOW,
                SLO_GOODPUT_NOW,
                _max_num_seqs_now,
            ),
        ),
        Row("What it costs", (GOODPUT_VS_ENGINE, TAX_OVER_TIME, TAX_BY_METHOD)),
        RESUMES_ROW,
        Row("KV pressure", (_kv_usage, _preemption_rate, _running_waiting)),
        Row(
            "What clients feel",
            (
                _quantiles(
                    "Time to first token",
                    "ttft",
                    "kvtax_client_ttft_seconds",
                    "Time to first token",
                    "KvtaxTtftSloBreach",
                ),
                _quantiles(
                    "Inter-token latency",
                    "itl",
                    "kvtax_client_itl_seconds",
                    "Gap between tokens",
                    "KvtaxStreamStalls",
                ),
                _stalls,
            ),
        ),
        Row("Sizing and admission", (_recommended_vs_configured, _rejections, _coverage)),
        GATE_ROW,
    ),
    tags=("vllm", "overview"),
)
