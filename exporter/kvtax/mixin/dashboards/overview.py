"""The Overview dashboard: one deployment, narrowed by namespace, pod and model.

Top to bottom it answers: are clients getting what the objective promises (attainment, burn
rate, budget left), is the engine thrashing, what is it costing (one headline per number: tax,
waste, goodput, SLO goodput; then the tax by method), what resumed requests got back without
computing it (the prefix cache, a KV connector), where the KV pressure is (preemptions per
request included), what clients feel (TTFT, ITL, stalls, how requests finished, the proxy's
errors), which generation API the traffic and the waste come from, and how admission is sized
(recommended against configured max_num_seqs, rejections, coverage); then the gate. Pure: no
I/O.
"""

from __future__ import annotations

from dataclasses import replace

from kvtax.engine.vocabulary import CONCEPTS
from kvtax.mixin.dashboards.apis import API_ROW
from kvtax.mixin.dashboards.common import (
    KV_THRESHOLDS,
    MODEL,
    PER_S,
    POD,
    SEQS,
    THRASH_MAPPINGS,
    THRASH_THRESHOLDS,
    sum_rate,
    sum_rate_regex,
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
from kvtax.mixin.dashboards.objective import ATTAINMENT, BUDGET_LEFT, BURN_RATE
from kvtax.mixin.dashboards.queries import by, histogram_quantile, kvtax, rate, vllm
from kvtax.mixin.dashboards.resumes import RESUMES_ROW
from kvtax.mixin.dashboards.selfcost import SELF_COST_ROW
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

# vLLM's default buckets for preemptions per request start at 1, which holds the requests
# preempted once together with those never preempted; a bucket at 0.5 (counts are whole) holds
# only the latter. Both le values are matched as vLLM writes them.
_PREEMPTIONS = CONCEPTS["request_preemptions"].names[0]
_PREEMPTIONS_TUNED = (
    "--custom-histogram-buckets '{\"request_num_preemptions\": [0.5, 1, 2, 3, 4, 5, 10, 20]}'"
)


def _share_above(le: str) -> str:
    """The share of finished requests preempted more often than the bucket ``le`` holds."""
    bucket = by(
        MODEL, "sum", rate(vllm("request_preemptions", part="_bucket", where=(("le", le),)))
    )
    count = by(MODEL, "sum", rate(vllm("request_preemptions", part="_count")))
    return f"1 - {bucket} / {count}"


_preempted_requests = Panel(
    "Requests preempted",
    "timeseries",
    (
        Target(_share_above("0.5"), "at least once {{model_name}}"),
        Target(_share_above("1.0"), "twice or more {{model_name}}", dashed=True),
    ),
    "percentunit",
    "The share of the requests vLLM finished that were preempted at least once, and twice or "
    f"more (dashed), from its {_PREEMPTIONS} histogram (vLLM 0.30+). A request "
    "preempted once waited to be prefilled again and stalled its stream; twice or more is a "
    "batch far over what the KV cache holds. vLLM's default buckets start at 1, which lumps "
    "the requests preempted once with those never preempted, so the first line needs vLLM "
    f"started with {_PREEMPTIONS_TUNED} (checked on vLLM 0.32); without it only the dashed "
    "line shows.",
    "KvtaxVllmPreempting",
    width=12,
    min=0,
    max=1,
)

_preemptions_per_request = Panel(
    "Preemptions per request",
    "timeseries",
    (
        Target(
            histogram_quantile(0.99, vllm("request_preemptions", part="_bucket")),
            "p99 {{model_name}}",
        ),
        Target(
            f"{by(MODEL, 'sum', rate(vllm('request_preemptions', part='_sum')))} / "
            f"{by(MODEL, 'sum', rate(vllm('request_preemptions', part='_count')))}",
            "mean {{model_name}}",
            dashed=True,
        ),
    ),
    "short",
    "How many times a finished request was preempted: p99 and the mean (dashed), from vLLM's "
    f"{_PREEMPTIONS} histogram (0.30+). The p99 is interpolated inside a bucket "
    "(between 5 and 10, say), so read it as a range; the mean is exact. Each preemption threw "
    "the request's KV away and prefilled it again: the mean times the request rate is the "
    "preemption rate.",
    "KvtaxVllmPreempting",
    width=12,
    min=0,
)

_finished_by_reason = Panel(
    "Finished requests by reason",
    "timeseries",
    (
        Target(
            by("model_name, finished_reason", "sum", rate(vllm("request_success"))),
            "{{finished_reason}} {{model_name}}",
        ),
    ),
    "reqps",
    "Requests vLLM finished per second, by why they ended: stop (a stop token or string: the "
    "answer is whole), length (max_tokens or the model length reached: the answer was cut), "
    "abort (cancelled: vLLM 0.32 was seen not to count a client's disconnect here, only its "
    "HTTP counters do) and error (0.13+). A rise in length with no change in the requests "
    "means answers are being truncated.",
    "KvtaxLoadShedding",
    width=12,
    min=0,
)

_ERRORS_4XX = "upstream_4xx|too_large|shed"
_ERRORS_5XX = "upstream_error|shutdown"


def _outcome_share(outcomes: str) -> str:
    part = sum_rate_regex("kvtax_requests_total", (("outcome", outcomes),))
    return f"{part} / {sum_rate('kvtax_requests_total')}"


_proxy_errors = Panel(
    "Proxy 4xx and 5xx",
    "timeseries",
    (
        Target(_outcome_share(_ERRORS_4XX), "4xx {{model_name}}"),
        Target(_outcome_share(_ERRORS_5XX), "5xx {{model_name}}", color="red"),
    ),
    "percentunit",
    "The share of requests through the kvtax proxy that ended in an error, by the proxy's "
    "outcomes: 4xx is vLLM's 4xx answers (upstream_4xx: bad requests), kvtax's 413 for a body "
    "over its limit (too_large) and the gate's refusals (shed: it answered them itself, see "
    "the Gate row); 5xx is vLLM's 5xx or no answer, its admission 503s and streams that broke "
    "mid-answer included (upstream_error), and requests ended by kvtax's own shutdown "
    "(shutdown). 5xx spends the objective's error budget; of 4xx, only the gate's refusals do.",
    "KvtaxGateShedding",
    width=12,
    min=0,
    max=1,
)


OVERVIEW = Board(
    "Overview",
    "Is the engine thrashing, what is it costing, and what should max_num_seqs be: one vLLM "
    "deployment per namespace, pod and model.",
    rows=(
        Row(
            "At a glance",
            (
                # Are clients getting what they were promised: the objective, first.
                ATTAINMENT,
                BURN_RATE,
                BUDGET_LEFT,
                _thrash_state,
                TAX_NOW,
                WASTE_NOW,
                # The second line of stats: three to a line's width.
                replace(GOODPUT_NOW, width=8),
                replace(SLO_GOODPUT_NOW, width=8),
                replace(_max_num_seqs_now, width=8),
            ),
        ),
        Row("What it costs", (GOODPUT_VS_ENGINE, TAX_OVER_TIME, TAX_BY_METHOD)),
        RESUMES_ROW,
        Row(
            "KV pressure",
            (
                _kv_usage,
                _preemption_rate,
                _running_waiting,
                _preempted_requests,
                _preemptions_per_request,
            ),
        ),
        Row(
            "What clients feel",
            (
                _quantiles(
                    "Time to first token",
                    "ttft",
                    "kvtax_client_ttft_seconds",
                    "Time to first token",
                    "KvtaxErrorBudgetBurn",
                ),
                _quantiles(
                    "Inter-token latency",
                    "itl",
                    "kvtax_client_itl_seconds",
                    "Gap between tokens",
                    "KvtaxStreamStalls",
                ),
                _stalls,
                _finished_by_reason,
                _proxy_errors,
            ),
        ),
        API_ROW,
        Row("Sizing and admission", (_recommended_vs_configured, _rejections, _coverage)),
        SELF_COST_ROW,
        GATE_ROW,
    ),
    tags=("vllm", "overview"),
)
