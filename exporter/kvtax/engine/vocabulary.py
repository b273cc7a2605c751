"""The one table of every metric name vLLM has exposed since 0.6, mapped to kvtax's concepts.

Nothing else in kvtax spells a ``vllm:`` name. The normalizer reads this table to turn any
version's scrape into one canonical vocabulary; rules, dashboards and tests read it to check that
what they query exists. Each concept lists the exposed series names newest first: when a scrape
carries several (0.10 publishes both KV-usage names), the first one present wins.

Example::

    >>> CONCEPTS["kv_usage"].names
    ('vllm:kv_cache_usage_perc', 'vllm:gpu_cache_usage_perc')
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = [
    "BY_SERIES",
    "CONCEPTS",
    "FINGERPRINTS",
    "NOT_READ",
    "Aggregate",
    "Concept",
    "Kind",
    "accounted_for",
    "concept_for",
    "render_markdown",
]


class Kind(Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"
    INFO = "info"


class Aggregate(Enum):
    """How series of one model from several engines (data parallel) combine into one value."""

    SUM = "sum"
    # KV usage is a fraction per engine: summing two 0.9s gives a nonsense 1.8.
    MAX = "max"
    FIRST = "first"


@dataclass(frozen=True, slots=True)
class Concept:
    """One thing vLLM measures, under every name it has had.

    ``names`` are series names as exposed (counters with ``_total``; histograms by base name).
    ``split_by`` names a label whose values are kept apart (e.g. ``finished_reason``).
    ``select`` keeps only series whose labels match (e.g. ``source="local_compute"``).
    """

    name: str
    kind: Kind
    names: tuple[str, ...]
    help: str
    aggregate: Aggregate = Aggregate.SUM
    split_by: str | None = None
    select: tuple[tuple[str, str], ...] = ()
    since: str = "0.6"
    # Series of a server-wide concept carry no model_name (http_requests_total, and
    # cache_config_info); they are kept per server and shared by every model it serves.
    server_level: bool = False


_C = Concept
_K = Kind
CONCEPT_LIST: tuple[Concept, ...] = (
    # -- cache and queue state -------------------------------------------------------------
    _C(
        "kv_usage",
        _K.GAUGE,
        ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        "KV-cache blocks in use, 0-1 (a fraction despite 'perc'; new name from 0.9.2)",
        aggregate=Aggregate.MAX,
    ),
    _C("requests_running", _K.GAUGE, ("vllm:num_requests_running",), "requests in the batch"),
    _C("requests_waiting", _K.GAUGE, ("vllm:num_requests_waiting",), "requests queued"),
    _C(
        "requests_waiting_by_reason",
        _K.GAUGE,
        ("vllm:num_requests_waiting_by_reason",),
        "queued requests by reason",
        split_by="reason",
        since="0.20",
    ),
    _C("requests_swapped", _K.GAUGE, ("vllm:num_requests_swapped",), "V0 swapped requests"),
    # -- work counters ---------------------------------------------------------------------
    _C(
        "preemptions",
        _K.COUNTER,
        ("vllm:num_preemptions_total",),
        "preemptions (counted when the preempted request next produces output)",
    ),
    _C(
        "prompt_tokens",
        _K.COUNTER,
        ("vllm:prompt_tokens_total",),
        "prompt tokens, each prompt once (V1); V0 also counts re-prefill",
    ),
    _C(
        "generation_tokens",
        _K.COUNTER,
        ("vllm:generation_tokens_total",),
        "generated tokens, never double-counted in V1",
    ),
    _C(
        "prompt_tokens_local_compute",
        _K.COUNTER,
        ("vllm:prompt_tokens_by_source_total",),
        "prompt tokens computed locally (not cached)",
        select=(("source", "local_compute"),),
        since="0.16",
    ),
    _C(
        "prefill_kv_computed",
        _K.HISTOGRAM,
        ("vllm:request_prefill_kv_computed_tokens",),
        "per-request prefill tokens computed",
        since="0.13",
    ),
    _C(
        "prefix_cache_queries",
        _K.COUNTER,
        ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
        "prefix-cache lookups (gpu_* counts blocks in 0.7.3-0.8.5)",
    ),
    _C(
        "prefix_cache_hits",
        _K.COUNTER,
        ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
        "prefix-cache hits (gpu_* counts blocks in 0.7.3-0.8.5)",
    ),
    _C(
        "prefix_cache_hit_rate",
        _K.GAUGE,
        ("vllm:gpu_prefix_cache_hit_rate",),
        "V0 prefix-cache hit rate gauge",
        aggregate=Aggregate.MAX,
    ),
    _C(
        "request_success",
        _K.COUNTER,
        ("vllm:request_success_total",),
        "finished requests by reason (aborts are not always counted)",
        split_by="finished_reason",
    ),
    _C(
        "admission_rejections",
        _K.COUNTER,
        ("vllm:admission_rejections_total",),
        "requests the engine refused",
        split_by="reason",
        since="0.32",
    ),
    _C(
        "http_requests",
        _K.COUNTER,
        ("http_requests_total",),
        "HTTP requests by handler (counts aborted requests too)",
        split_by="handler",
        server_level=True,
    ),
    # -- V0 throughput gauges --------------------------------------------------------------
    _C(
        "v0_prompt_throughput",
        _K.GAUGE,
        ("vllm:avg_prompt_throughput_toks_per_s",),
        "V0 prompt throughput gauge (<=0.6.6)",
    ),
    _C(
        "v0_generation_throughput",
        _K.GAUGE,
        ("vllm:avg_generation_throughput_toks_per_s",),
        "V0 generation throughput gauge (<=0.6.6)",
    ),
    # -- histograms ------------------------------------------------------------------------
    _C("ttft", _K.HISTOGRAM, ("vllm:time_to_first_token_seconds",), "time to first token"),
    _C(
        "itl",
        _K.HISTOGRAM,
        ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
        "inter-token latency (old name removed in 0.15)",
    ),
    _C(
        "request_tpot",
        _K.HISTOGRAM,
        ("vllm:request_time_per_output_token_seconds",),
        "per-request time per output token",
        since="0.11",
    ),
    _C("e2e_latency", _K.HISTOGRAM, ("vllm:e2e_request_latency_seconds",), "request latency"),
    _C("queue_time", _K.HISTOGRAM, ("vllm:request_queue_time_seconds",), "time queued"),
    _C(
        "request_prompt_tokens",
        _K.HISTOGRAM,
        ("vllm:request_prompt_tokens",),
        "prompt length per request",
    ),
    _C(
        "request_generation_tokens",
        _K.HISTOGRAM,
        ("vllm:request_generation_tokens",),
        "generation length per request",
    ),
    _C(
        "request_preemptions",
        _K.HISTOGRAM,
        ("vllm:request_num_preemptions",),
        "preemptions per finished request",
        since="0.30",
    ),
    # -- config ----------------------------------------------------------------------------
    _C(
        "cache_config",
        _K.INFO,
        ("vllm:cache_config_info",),
        "cache configuration labels",
        aggregate=Aggregate.FIRST,
        server_level=True,
    ),
    # -- exact recompute: upstream's proposed name first, then kvtax's stat-logger plugin ----
    _C(
        "recomputed_tokens",
        _K.COUNTER,
        ("vllm:recomputed_token_executions_total", "kvtax_plugin_recomputed_tokens_total"),
        "tokens prefilled again after preemption (measured)",
    ),
    _C(
        "preempted_queried_tokens",
        _K.COUNTER,
        ("kvtax_plugin_preempted_queried_tokens_total",),
        "tokens of resumed requests looked up in the prefix cache",
    ),
    _C(
        "preempted_hit_tokens",
        _K.COUNTER,
        ("kvtax_plugin_preempted_hit_tokens_total",),
        "of those, tokens found in the prefix cache",
    ),
    _C(
        "preempted_connector_hit_tokens",
        _K.COUNTER,
        ("kvtax_plugin_preempted_connector_hit_tokens_total",),
        "of the hits, tokens a KV connector loaded back (only with a connector)",
    ),
    _C(
        "preempted_resumes",
        _K.COUNTER,
        ("kvtax_plugin_preempted_resumes_total",),
        "preempted requests resumed",
    ),
)

CONCEPTS: dict[str, Concept] = {c.name: c for c in CONCEPT_LIST}

# Series name -> (concept, rank); rank 0 is the newest name. Histograms are keyed by base name.
BY_SERIES: dict[str, tuple[Concept, int]] = {
    series: (c, rank) for c in CONCEPT_LIST for rank, series in enumerate(c.names)
}

# Series whose mere presence dates a scrape (see vllm-facts.md, "Fingerprints").
FINGERPRINTS: dict[str, str] = {
    "vllm:num_requests_swapped": "v0",
    "vllm:gpu_prefix_cache_hit_rate": "v0",
    "vllm:prompt_tokens_by_source_total": "0.16+",
    "vllm:request_num_preemptions": "0.30+",
    "vllm:kv_cache_usage_perc": "0.9.2+",
}

_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def concept_for(series: str) -> tuple[Concept, int, str] | None:
    """Map an exposed sample name to (concept, rank, histogram part or "")."""
    hit = BY_SERIES.get(series)
    if hit is not None and hit[0].kind is not Kind.HISTOGRAM:
        return hit[0], hit[1], ""
    for suffix in _HISTOGRAM_SUFFIXES:
        if series.endswith(suffix):
            base = BY_SERIES.get(series[: -len(suffix)])
            if base is not None and base[0].kind is Kind.HISTOGRAM:
                return base[0], base[1], suffix[1:]
    return None


# Names vLLM defines that kvtax knows of and deliberately does not read, each with why: family
# as exposed (counters with _total, histograms by base name) -> reason. With BY_SERIES this
# accounts for every `vllm:` family of the last vLLM checked (tests/fixtures/vllm/
# 0.33-definitions.txt, from the wheel): a name a newer vLLM adds fails tests/unit/
# test_vocabulary.py until it is read by a concept or listed here.
NOT_READ: dict[str, str] = {
    # -- prompt and cache accounting that kvtax takes from another series ----------------------
    "vllm:prompt_tokens_cached_total": (
        "local + external cached prompt tokens; the computed share comes from "
        "prompt_tokens_by_source{source=local_compute}"
    ),
    "vllm:prompt_tokens_cached_by_source_total": (
        "cache hit tokens by tier (device, host, disk, p2p); the computed share comes from "
        "prompt_tokens_by_source{source=local_compute}"
    ),
    "vllm:external_prefix_cache_queries_total": (
        "new requests' lookups in a KV connector's cache (LMCache, offload); vLLM leaves resumed "
        "requests out, and kvtax's plugin counts theirs (preempted_connector_hit_tokens)"
    ),
    "vllm:external_prefix_cache_hits_total": "hits in a KV connector's cache (see above)",
    "vllm:mm_cache_queries_total": "multimodal processor cache, not the KV cache",
    "vllm:mm_cache_hits_total": "multimodal processor cache, not the KV cache",
    # -- scheduler and KV-pool detail ------------------------------------------------------------
    "vllm:iteration_tokens_total": (
        "histogram of tokens per engine step; throughput comes from the token counters"
    ),
    "vllm:num_requests_kv_fetch_by_stage": (
        "waiting requests by async KV-load stage; only on a KV consumer (disaggregated prefill)"
    ),
    "vllm:kv_block_lifetime_seconds": "sampled block residency, only with --kv-cache-metrics",
    "vllm:kv_block_idle_before_evict_seconds": (
        "sampled block idle time before eviction, only with --kv-cache-metrics"
    ),
    "vllm:kv_block_reuse_gap_seconds": (
        "sampled gap between block reuses, only with --kv-cache-metrics"
    ),
    # -- request phases and parameters -----------------------------------------------------------
    "vllm:request_prefill_time_seconds": "phase timing; kvtax reads TTFT, ITL, queue time and E2E",
    "vllm:request_decode_time_seconds": "phase timing; kvtax reads TTFT, ITL, queue time and E2E",
    "vllm:request_inference_time_seconds": (
        "phase timing; kvtax reads TTFT, ITL, queue time and E2E"
    ),
    "vllm:request_max_num_generation_tokens": "a request parameter (n, best_of), not a load signal",
    "vllm:request_params_max_tokens": "a request parameter, not a load signal",
    "vllm:request_params_n": "a request parameter, not a load signal",
    # -- features outside the KV tax ---------------------------------------------------------
    "vllm:estimated_flops_per_gpu_total": "MFU estimate; stays 0 without --enable-mfu-metrics",
    "vllm:estimated_read_bytes_per_gpu_total": (
        "MFU estimate; stays 0 without --enable-mfu-metrics"
    ),
    "vllm:estimated_write_bytes_per_gpu_total": (
        "MFU estimate; stays 0 without --enable-mfu-metrics"
    ),
    "vllm:lora_requests_info": (
        "adapters running and waiting, without model_name; kvtax attributes by served model"
    ),
    "vllm:engine_sleep_state": "sleep-mode state (awake, weights_offloaded, discard_all)",
    "vllm:watermark_requests_total": (
        "finished requests by watermark status; only with a watermark config"
    ),
    "vllm:corrupted_requests_total": (
        "requests with NaN logits; only with VLLM_COMPUTE_NANS_IN_LOGITS"
    ),
    "vllm:spec_decode_num_drafts_total": "speculative-decoding acceptance; not a KV signal",
    "vllm:spec_decode_num_draft_tokens_total": "speculative-decoding acceptance; not a KV signal",
    "vllm:spec_decode_num_accepted_tokens_total": (
        "speculative-decoding acceptance; not a KV signal"
    ),
    "vllm:spec_decode_num_accepted_tokens_per_pos_total": (
        "speculative-decoding acceptance per draft position; not a KV signal"
    ),
    "vllm:diffusion_num_denoising_steps_total": "diffusion-LLM decoding counter",
    "vllm:diffusion_num_canvas_positions_total": "diffusion-LLM decoding counter",
    "vllm:diffusion_num_committed_tokens_total": "diffusion-LLM decoding counter",
}

_CREATED = "_created"


def accounted_for(family: str) -> bool:
    """A ``vllm:`` family (as a ``# TYPE`` line or the definitions list names it) is either read
    by a concept or listed in NOT_READ. prometheus_client's ``X_created`` companion of a counter
    ``X_total`` or a histogram ``X`` is accounted for when its parent is."""
    if family in BY_SERIES or family in NOT_READ:
        return True
    if family.endswith(_CREATED):
        parent = family.removesuffix(_CREATED)
        return any(accounted_for(p) for p in (parent + "_total", parent) if p != family)
    return False


# How each version was tested; docs/compatibility.md is generated from this and CONCEPT_LIST.
TESTED_VERSIONS: tuple[tuple[str, str, str], ...] = (
    (
        "0.33.0 (V1)",
        "wheel definitions, not run",
        "every `vllm:` family the wheel defines (tests/fixtures/vllm/0.33-definitions.txt) is "
        "read or listed below; the names, kinds and labels equal the 0.32 CPU build's, and "
        "tests/fixtures/vllm/0.33-definitions.prom (a 0.32 capture plus the families it "
        "lacks) is normalized like the 0.32 capture",
    ),
    (
        "0.32.0 (V1, CPU build)",
        "real engine",
        "end-to-end tests start a real engine; captures in tests/fixtures/vllm/0.32-*.prom",
    ),
    (
        "0.10.x (V1)",
        "hand-built fixture",
        "both KV-usage names, both prefix-cache name sets, two engines",
    ),
    ("0.8.x (V1)", "hand-built fixture", "prefix-cache counters in blocks, engine label"),
    (
        "0.6.x (V0)",
        "hand-built fixture",
        "gpu_cache_usage_perc, time_per_output_token_seconds, swapped, throughput gauges",
    ),
)


def render_markdown() -> str:
    """The compatibility page (docs/compatibility.md), generated from this module."""
    lines = [
        "# vLLM compatibility",
        "",
        "Generated from `exporter/kvtax/engine/vocabulary.py` by `kvtax docs`; "
        "do not edit by hand.",
        "",
        "## Versions tested",
        "",
        "| vLLM | how | what it covers |",
        "|---|---|---|",
        *(f"| {v} | {how} | {what} |" for v, how, what in TESTED_VERSIONS),
        "",
        "Any version from 0.6 on is read the same way: kvtax keeps, per concept, the newest name",
        "the scrape carries, combines engines (`engine` label, from 0.8.3) per model, and leaves",
        "out a concept the version lacks instead of publishing a zero.",
        "",
        "## Names read, per concept (newest first)",
        "",
        "| concept | kind | exposed names | since | notes |",
        "|---|---|---|---|---|",
    ]
    for c in CONCEPT_LIST:
        names = "<br>".join(f"`{n}`" for n in c.names)
        lines.append(f"| `{c.name}` | {c.kind.value} | {names} | {c.since} | {c.help} |")
    lines += [
        "",
        "## Names known and not read",
        "",
        "vLLM defines these too; kvtax leaves them out on purpose. Every `vllm:` family of the",
        "newest vLLM checked is either read above or listed here, and a test fails when a new",
        "version adds one that is neither.",
        "",
        "| exposed name | why kvtax does not read it |",
        "|---|---|",
        *(f"| `{name}` | {why} |" for name, why in NOT_READ.items()),
    ]
    return "\n".join(lines) + "\n"
