"""The Overview dashboard: one deployment, narrowed by namespace, pod and model.

Top to bottom it answers: is the engine thrashing, what is it costing (tax, waste, goodput
against engine throughput), where the KV pressure is, what clients feel (TTFT, ITL, stalls),
and how admission is sized (recommended against configured max_num_seqs, 429s, coverage).
Pure: no I/O.
"""

from __future__ import annotations

from kvtax.rules.config import DEFAULT as RULES

from .common import (
    KV_THRESHOLDS,
    MODEL,
    PER_S,
    POD,
    SEQS,
    TAX_THRESHOLDS,
    THRASH_MAPPINGS,
    THRASH_THRESHOLDS,
    TOK_S,
    gen_rate,
    goodput,
    sum_rate,
)
from .model import Board, Panel, Row, Target, Threshold
from .promql import by, histogram_quantile, kvtax, rate, vllm

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
    width=6,
    height=5,
    thresholds=THRASH_THRESHOLDS,
    mappings=THRASH_MAPPINGS,
)

_tax_now = Panel(
    "Preemption tax",
    "stat",
    (
        Target(
            by("model_name, method", "max", kvtax("kvtax_preemption_tax_ratio")),
            "{{model_name}} ({{method}})",
        ),
    ),
    "percentunit",
    "What preemption costs: the share of engine token work that was recompute over kvtax's "
    "window, R / (Pc + G + R). The method says where R comes from: measured (the stat-logger "
    "plugin) or estimated (preemptions x mean context, an upper bound). A token share, not time.",
    "KvtaxPreemptionTaxHigh",
    width=6,
    height=5,
    thresholds=TAX_THRESHOLDS,
)

_waste_now = Panel(
    "Waste",
    "stat",
    (
        Target(
            by("model_name, method", "max", kvtax("kvtax_waste_ratio")),
            "{{model_name}} ({{method}})",
        ),
    ),
    "percentunit",
    "Share of engine token work no client received: recompute plus tokens generated for clients "
    "that had gone, (R + U) / (Pc + G + R). Above the tax, the difference is abandoned requests.",
    "KvtaxGoodputDiverging",
    width=6,
    height=5,
    thresholds=TAX_THRESHOLDS,
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
    "next to the value vLLM runs with (kvtax serve --max-num-seqs). Configured well above "
    "recommended means the engine admits more sequences than its KV cache can finish.",
    "KvtaxOverAdmitted",
    width=6,
    height=5,
    base_color="blue",
)

_goodput_vs_engine = Panel(
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
    min=0,
)

_tax_over_time = Panel(
    "Preemption tax by method",
    "timeseries",
    (
        Target(
            by("model_name, method", "max", kvtax("kvtax_preemption_tax_ratio")),
            "tax {{model_name}} ({{method}})",
        ),
        Target(
            by("model_name, method", "max", kvtax("kvtax_waste_ratio")),
            "waste {{model_name}} ({{method}})",
            dashed=True,
        ),
    ),
    "percentunit",
    "The tax (recompute share of engine work) and the waste (recompute plus undelivered) over "
    "time, one line per method: measured when the plugin runs in vLLM, estimated otherwise. "
    "The orange and red lines are the warning and critical alert thresholds.",
    "KvtaxPreemptionTaxHigh",
    min=0,
    thresholds=TAX_THRESHOLDS,
    threshold_lines=True,
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

_shedding = Panel(
    "429s and rejections",
    "timeseries",
    (
        Target(
            f"{sum_rate('kvtax_requests_total', where=(('outcome', 'rejected'),))}"
            f" or {sum_rate('kvtax_requests_total')} * 0",
            "kvtax 429 {{model_name}}",
        ),
        Target(
            by("model_name, reason", "sum", rate(vllm("admission_rejections"))),
            "vLLM rejected {{model_name}} ({{reason}})",
        ),
    ),
    "reqps",
    "Requests turned away per second: by kvtax's admission gate (HTTP 429 with Retry-After) and "
    "by vLLM's own queue limits. Shedding protects latency but means capacity is short.",
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
    "above recommended is where preemption starts.",
    "KvtaxOverAdmitted",
    width=8,
    min=0,
)

OVERVIEW = Board(
    "Overview",
    "Is the engine thrashing, what is it costing, and what should max_num_seqs be: one vLLM "
    "deployment per namespace, pod and model.",
    rows=(
        Row("At a glance", (_thrash_state, _tax_now, _waste_now, _max_num_seqs_now)),
        Row("What it costs", (_goodput_vs_engine, _tax_over_time)),
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
        Row("Sizing and admission", (_recommended_vs_configured, _shedding, _coverage)),
    ),
    tags=("vllm", "overview"),
)
