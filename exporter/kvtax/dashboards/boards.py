"""The three kvtax dashboards (Overview, Capacity, Fleet), defined panel by panel.

Each board answers its questions in the order a person under pressure asks them: is the engine
thrashing, what is it costing, what should max_num_seqs be. Queries are composed from
:mod:`kvtax.dashboards.promql` (catalog, vocabulary and recording-rule names only); thresholds
come from the rules' config object so a dashboard line and the alert it mirrors cannot
disagree. Pure: no I/O.

Example::

    >>> [b.title for b in BOARDS]
    ['Overview', 'Capacity', 'Fleet']
"""

from __future__ import annotations

from ..derive import ThrashState
from ..rules.config import DEFAULT as RULES
from .model import Board, Panel, Row, Target, Threshold, ValueText
from .promql import by, histogram_quantile, kvtax, rate, recorded, vllm

__all__ = ["BOARDS", "CAPACITY", "FLEET", "OVERVIEW", "THRASH_MAPPINGS"]

POD = "namespace, pod, model_name"
MODEL = "model_name"

# Units: Grafana ids where one fits, "suffix:" custom units for kvtax's own quantities.
TOK_S = "suffix:tok/s"
TOKENS = "suffix:tok"
SEQS = "suffix:seqs"
PER_S = "suffix:/s"

THRASH_MAPPINGS = (
    ValueText(ThrashState.OK, "ok", "green"),
    ValueText(ThrashState.AT_RISK, "at risk", "orange"),
    ValueText(ThrashState.THRASHING, "thrashing", "red"),
)
_THRASH_THRESHOLDS = (
    Threshold(ThrashState.AT_RISK, "orange"),
    Threshold(ThrashState.THRASHING, "red"),
)
_TAX_THRESHOLDS = (Threshold(RULES.tax_warning, "orange"), Threshold(RULES.tax_critical, "red"))
_KV_THRESHOLDS = (
    Threshold(RULES.kv_near_full_usage, "orange"),
    Threshold(RULES.thrash_usage, "red"),
)


def _sum_rate(metric: str, labels: str = MODEL, where: tuple[tuple[str, str], ...] = ()) -> str:
    return by(labels, "sum", rate(kvtax(metric, where=where)))


def _gen_rate(labels: str = MODEL) -> str:
    return _sum_rate("kvtax_engine_generation_tokens_total", labels)


def _goodput(labels: str = MODEL) -> str:
    return _sum_rate("kvtax_delivered_tokens_total", labels)


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


# -- Overview ------------------------------------------------------------------------------------

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
    thresholds=_THRASH_THRESHOLDS,
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
    thresholds=_TAX_THRESHOLDS,
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
    thresholds=_TAX_THRESHOLDS,
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
        Target(_gen_rate(), "engine generated {{model_name}}", color="blue", dashed=True),
        Target(_goodput(), "delivered (goodput) {{model_name}}", color="green", stack=True),
        Target(
            f"{_sum_rate('kvtax_undelivered_tokens_total')} or {_goodput()} * 0",
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
    thresholds=_TAX_THRESHOLDS,
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
    thresholds=_KV_THRESHOLDS,
    threshold_lines=True,
)

_preemption_rate = Panel(
    "Preemption rate",
    "timeseries",
    (Target(_sum_rate("kvtax_engine_preemptions_total"), "{{model_name}}"),),
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
            _sum_rate("kvtax_engine_preemptions_total"), "preemptions {{model_name}}", dashed=True
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
            f"{_sum_rate('kvtax_requests_total', where=(('outcome', 'rejected'),))}"
            f" or {_sum_rate('kvtax_requests_total')} * 0",
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

# -- Capacity ------------------------------------------------------------------------------------

_capacity = kvtax("kvtax_kv_capacity_tokens")
_usage = kvtax("kvtax_kv_cache_usage_ratio")
_p50 = kvtax("kvtax_request_length_p50_tokens")
_p95 = kvtax("kvtax_request_length_p95_tokens")
_running = kvtax("kvtax_requests_running")
_waiting = kvtax("kvtax_requests_waiting")
_recommended = kvtax("kvtax_recommended_max_num_seqs")
# Typical requests that still fit in the free part of the pool right now.
_headroom_free = by(POD, "max", f"floor((1 - {_usage}) * {_capacity} / {_p50})")
# Sequences the recommendation still allows beyond those running (negative: over-admitted).
_headroom_seqs = by(POD, "max", f"{_recommended} - {_running}")

CAPACITY = Board(
    "Capacity",
    "How much the KV pool holds, how long requests are, and how many more fit: the numbers "
    "behind the recommended max_num_seqs.",
    rows=(
        Row(
            "Now",
            (
                Panel(
                    "KV capacity",
                    "stat",
                    (Target(by(POD, "max", _capacity), "{{model_name}} {{pod}}"),),
                    TOKENS,
                    "Tokens the KV pool holds (num_gpu_blocks x block_size, from vLLM's "
                    "cache_config_info). Fixed for the life of the engine.",
                    "KvtaxKvCacheNearFull",
                    width=6,
                    height=5,
                    base_color="blue",
                ),
                Panel(
                    "p95 request length",
                    "stat",
                    (Target(by(POD, "max", _p95), "{{model_name}} {{pod}}"),),
                    TOKENS,
                    "p95 prompt + p95 generation over kvtax's window: the size the "
                    "recommendation plans for (an upper bound on a real p95 request).",
                    "KvtaxOverAdmitted",
                    width=6,
                    height=5,
                    base_color="blue",
                ),
                Panel(
                    "Recommended max_num_seqs",
                    "stat",
                    (Target(by(POD, "min", _recommended), "{{model_name}} {{pod}}"),),
                    SEQS,
                    "floor(KV capacity x target usage / p95 request length): the most sequences "
                    "that can run to completion without preemption at today's lengths.",
                    "KvtaxOverAdmitted",
                    width=6,
                    height=5,
                    base_color="blue",
                ),
                Panel(
                    "Headroom",
                    "stat",
                    (Target(_headroom_free, "{{model_name}} {{pod}}"),),
                    "short",
                    "How many more typical (p50-length) requests fit in the free part of the KV "
                    "pool right now. Zero or less: new work preempts running work.",
                    "KvtaxKvCacheNearFull",
                    width=6,
                    height=5,
                    base_color="red",
                    thresholds=(Threshold(1, "orange"), Threshold(4, "green")),
                ),
            ),
        ),
        Row(
            "Over time",
            (
                Panel(
                    "KV capacity against use and demand",
                    "timeseries",
                    (
                        Target(by(POD, "max", _capacity), "capacity {{pod}}", dashed=True),
                        Target(by(POD, "max", f"{_usage} * {_capacity}"), "in use {{pod}}"),
                        Target(
                            by(POD, "max", f"({_running} + {_waiting}) * {_p95}"),
                            "demand at p95 {{pod}}",
                        ),
                    ),
                    TOKENS,
                    "Capacity (dashed) against tokens in use and against demand: running plus "
                    "waiting requests at p95 length. Demand above capacity means preemption.",
                    "KvtaxKvCacheNearFull",
                    min=0,
                ),
                Panel(
                    "Request length",
                    "timeseries",
                    (
                        Target(by(POD, "max", _p50), "p50 {{pod}}"),
                        Target(by(POD, "max", _p95), "p95 {{pod}}"),
                        Target(
                            histogram_quantile(0.95, vllm("request_prompt_tokens", part="_bucket")),
                            "prompt p95 (vLLM) {{model_name}}",
                            dashed=True,
                        ),
                        Target(
                            histogram_quantile(
                                0.95, vllm("request_generation_tokens", part="_bucket")
                            ),
                            "generation p95 (vLLM) {{model_name}}",
                            dashed=True,
                        ),
                    ),
                    TOKENS,
                    "Request length (prompt + generation) p50 and p95 over kvtax's window, with "
                    "vLLM's prompt and generation p95 (dashed) over the panel's interval. Longer "
                    "requests mean fewer fit: the recommendation falls as p95 rises.",
                    "KvtaxOverAdmitted",
                    min=0,
                ),
                Panel(
                    "Recommended max_num_seqs against running",
                    "timeseries",
                    (
                        Target(by(POD, "min", _recommended), "recommended {{pod}}"),
                        Target(
                            by(POD, "max", kvtax("kvtax_configured_max_num_seqs")),
                            "configured {{pod}}",
                            dashed=True,
                        ),
                        Target(by(POD, "max", _running), "running {{pod}}"),
                    ),
                    SEQS,
                    "Running sequences against the recommendation and the configured limit. "
                    "Running above recommended is where the pool runs out mid-decode.",
                    "KvtaxOverAdmitted",
                    min=0,
                ),
                Panel(
                    "Headroom over time",
                    "timeseries",
                    (
                        Target(_headroom_free, "typical requests that fit {{pod}}"),
                        Target(_headroom_seqs, "recommended - running {{pod}}", dashed=True),
                    ),
                    "short",
                    "Solid: p50-length requests that fit in the free KV now. Dashed: sequences "
                    "the recommendation still allows beyond those running; below zero the "
                    "engine runs more than it can finish without preemption.",
                    "KvtaxOverAdmitted",
                ),
            ),
        ),
    ),
    tags=("vllm", "capacity"),
)

# -- Fleet ---------------------------------------------------------------------------------------

_fleet_goodput = recorded("kvtax_delivered_tokens", "rate{w}", level="fleet")
_fleet_engine = recorded("kvtax_engine_generation_tokens", "rate{w}", level="fleet")
_fleet_tax = recorded("kvtax_preemption_tax", "ratio_rate{w}", level="fleet")
_fleet_waste = recorded("kvtax_waste", "ratio_rate{w}", level="fleet")
_fleet_capacity = recorded("kvtax_kv_capacity_tokens", "sum", level="fleet")
_pod_tax = recorded("kvtax_preemption_tax", "ratio_rate{w}")
_pod_waste = recorded("kvtax_waste", "ratio_rate{w}")
_pod_goodput = recorded("kvtax_delivered_tokens", "rate{w}")
_pod_usage = recorded("vllm_kv_cache_usage", "max")

FLEET = Board(
    "Fleet",
    "Every replica of a model side by side: which pods pay the most tax, fleet goodput, and the "
    "sum of KV capacity against demand. Built on kvtax's recording rules (5m windows).",
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
                        Target(by(MODEL, "max", _fleet_tax), "tax {{model_name}}"),
                        Target(by(MODEL, "max", _fleet_waste), "waste {{model_name}}", dashed=True),
                    ),
                    "percentunit",
                    "Recompute (tax) and recompute plus undelivered (waste) as shares of the "
                    "whole fleet's engine token work: ratios of sums, so busy pods weigh more.",
                    "KvtaxPreemptionTaxHigh",
                    width=8,
                    min=0,
                    thresholds=_TAX_THRESHOLDS,
                    threshold_lines=True,
                ),
                Panel(
                    "Fleet KV capacity against demand",
                    "timeseries",
                    (
                        Target(_fleet_capacity, "capacity {{model_name}}", dashed=True),
                        Target(
                            by(MODEL, "sum", f"{_usage} * {_capacity}"), "in use {{model_name}}"
                        ),
                        Target(
                            by(MODEL, "sum", f"({_running} + {_waiting}) * {_p95}"),
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
                            f"topk(5, {by('namespace, pod, model_name', 'max', _pod_tax)})",
                            "{{namespace}}/{{pod}} {{model_name}}",
                            instant=True,
                        ),
                    ),
                    "percentunit",
                    "The five replicas whose engines spend the largest share of token work on "
                    "recompute, now. One pod far above its peers: uneven routing or a "
                    "different configuration.",
                    "KvtaxPreemptionTaxHigh",
                    min=0,
                    max=1,
                    thresholds=_TAX_THRESHOLDS,
                ),
                Panel(
                    "Top pods by waste",
                    "bargauge",
                    (
                        Target(
                            f"topk(5, {by(POD, 'max', _pod_waste)})",
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
                    thresholds=_TAX_THRESHOLDS,
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
                    thresholds=_THRASH_THRESHOLDS,
                    mappings=THRASH_MAPPINGS,
                ),
                Panel(
                    "Goodput by pod",
                    "timeseries",
                    (Target(by(POD, "sum", _pod_goodput), "{{pod}} {{model_name}}"),),
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
                            by(f"{POD}, method", "max", _pod_tax),
                            "{{pod}} {{model_name}} ({{method}})",
                        ),
                    ),
                    "percentunit",
                    "Recompute share of engine work per replica, with the method used. Compare "
                    "replicas: the tax follows load and configuration, not the model.",
                    "KvtaxPreemptionTaxHigh",
                    width=8,
                    min=0,
                    thresholds=_TAX_THRESHOLDS,
                    threshold_lines=True,
                ),
                Panel(
                    "KV cache usage by pod",
                    "timeseries",
                    (Target(by(POD, "max", _pod_usage), "{{pod}} {{model_name}}"),),
                    "percentunit",
                    "KV usage of each replica's fullest engine, never summed (a sum of fractions "
                    "means nothing). Pods above the orange line are the ones about to preempt.",
                    "KvtaxKvCacheNearFull",
                    width=8,
                    min=0,
                    max=1,
                    thresholds=_KV_THRESHOLDS,
                    threshold_lines=True,
                ),
            ),
        ),
    ),
    tags=("vllm", "fleet"),
)

BOARDS: tuple[Board, ...] = (OVERVIEW, CAPACITY, FLEET)
