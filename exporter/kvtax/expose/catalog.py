"""The one catalog of kvtax's own metrics: names, types, labels and help text.

The exporter builds its families from this table, the rule and dashboard generators check
their queries against it, and the metrics reference in ``docs/metrics.md`` is generated from it
(by :mod:`kvtax.expose.reference`). Renaming a metric here is the only way to rename it
anywhere. The ratios follow docs/tax.md's one definition of the tax.

Example::

    >>> METRICS["kvtax_preemption_tax_ratio"].labels
    ('model_name', 'method')
"""

from __future__ import annotations

from kvtax.expose.catalog_gate import GATE_METRICS
from kvtax.expose.spec import M, MetricSpec, MetricType

__all__ = ["METRICS", "METRIC_LIST", "PROCESS_METRICS", "MetricSpec", "MetricType"]

_S = MetricSpec
METRIC_LIST: tuple[MetricSpec, ...] = (
    # -- the sidecar itself ------------------------------------------------------------------
    _S(
        "kvtax_build_info",
        "info",
        "kvtax build: version and Python version.",
        ("version", "python_version"),
        "sidecar",
    ),
    _S(
        "kvtax_vllm_up",
        "gauge",
        "1 if the last scrape of vLLM's /metrics succeeded, else 0.",
        (),
        "sidecar",
    ),
    _S(
        "kvtax_scrape_duration_seconds",
        "gauge",
        "Duration of the last scrape of vLLM.",
        (),
        "sidecar",
    ),
    _S("kvtax_scrapes_total", "counter", "Scrapes of vLLM attempted.", (), "sidecar"),
    _S(
        "kvtax_metrics_requests_total",
        "counter",
        "Answers of kvtax's own /metrics by format (openmetrics or text, as the scraper's Accept "
        "asked) and encoding (gzip or identity, as its Accept-Encoding asked).",
        ("format", "encoding"),
        "sidecar",
    ),
    _S(
        "kvtax_scrape_errors_total",
        "counter",
        "Failed scrapes of vLLM by reason: timeout (vLLM slow), refused (nothing listens: "
        "vLLM down), connect (other network errors), http_status (not 200; redirects are not "
        "followed), too_large (over --scrape.max-bytes), truncated (no final newline), "
        "too_many_series (over --scrape.max-series), parse, no_models.",
        ("reason",),
        "sidecar",
    ),
    _S(
        "kvtax_last_scrape_error",
        "gauge",
        "1 for the reason the last scrape of vLLM failed, 0 for the other reasons; all 0 "
        "after a good scrape. Reasons as in kvtax_scrape_errors_total.",
        ("reason",),
        "sidecar",
    ),
    _S(
        "kvtax_scrape_rejected_samples_total",
        "counter",
        "Samples of vLLM's page left out by reason: non_finite (NaN or Inf), negative (a "
        "counter or histogram below 0). The concept is skipped for that scrape; totals keep "
        "their last good value.",
        ("reason",),
        "sidecar",
    ),
    _S(
        "kvtax_scrape_dropped_models_total",
        "counter",
        "model_name values left out of a scrape because kvtax already tracks "
        "--scrape.max-models models, summed over scrapes.",
        (),
        "sidecar",
    ),
    _S(
        "kvtax_last_scrape_success_timestamp_seconds",
        "gauge",
        "Unix time of the last successful scrape of vLLM.",
        (),
        "sidecar",
    ),
    _S(
        "kvtax_vllm_restarts_total",
        "counter",
        "Counter resets seen in vLLM's metrics, i.e. engine restarts.",
        (),
        "sidecar",
    ),
    _S(
        "kvtax_vllm_info",
        "info",
        "What kvtax detected about the scraped vLLM: version (from /version), engine (v0/v1) "
        "and api_servers: the API-server processes behind its page (1; several, from "
        "--api-server-count, when a multiprocess collector serves it; or unknown).",
        ("version", "engine", "api_servers"),
        "sidecar",
    ),
    # -- engine work, from vLLM's counters (reset-corrected) ---------------------------------
    _S(
        "kvtax_event_loop_lag_seconds",
        "gauge",
        "Worst lateness of kvtax's event loop over the last few seconds (it wakes every 0.25 s): "
        "the latency kvtax itself adds to every relayed chunk and probe while busy.",
        (),
        "sidecar",
    ),
    _S(
        "kvtax_event_loop_tasks",
        "gauge",
        "asyncio tasks alive in kvtax; back to its idle level once traffic stops.",
        (),
        "sidecar",
    ),
    _S(
        "kvtax_proxy_requests_in_flight",
        "gauge",
        "Accounted requests the proxy is handling now.",
        (),
        "delivery",
    ),
    _S("kvtax_proxy_streams_open", "gauge", "Streams the proxy is relaying now.", (), "delivery"),
    _S(
        "kvtax_proxy_workers",
        "gauge",
        "Proxy worker processes running (--proxy.workers above 1); 0: kvtax's own process relays.",
        (),
        "delivery",
    ),
    _S(
        "kvtax_proxy_worker_cpu_seconds_total",
        "counter",
        "CPU time (user and system) of the proxy worker processes, the ended ones' included, as "
        "each last reported it; kvtax's whole CPU is this plus its process_cpu_seconds_total.",
        (),
        "delivery",
    ),
    _S(
        "kvtax_proxy_worker_restarts_total",
        "counter",
        "Proxy workers started again after one ended on its own; the requests it had in flight "
        "settle as outcome shutdown.",
        (),
        "delivery",
    ),
    _S(
        "kvtax_proxy_relay_seconds",
        "histogram",
        "kvtax's own time on the path of every event: from a read of vLLM's bytes arriving to "
        "their write to the client (the parse, the count and the cut, the write call).",
        (),
        "delivery",
    ),
    _S(
        "kvtax_proxy_forward_seconds",
        "histogram",
        "kvtax's own time per request: from the request being in kvtax whole to its write to "
        "vLLM, less any wait in the gate's queue or for a new connection to vLLM to open.",
        (),
        "delivery",
    ),
    _S(
        "kvtax_proxy_events_relayed_total",
        "counter",
        "SSE events relayed on accounted streams; rate(process_cpu_seconds_total) over its rate "
        "is kvtax's CPU seconds per event.",
        (),
        "delivery",
    ),
    _S(
        "kvtax_proxy_streams_counted_total",
        "counter",
        "Accounted streams by how their tokens were counted: token_ids (each event's ids, what "
        "costs vLLM least), usage (continuous usage, the fallback), final_usage (an API with "
        "no count per event: its final usage, one per content event before it), events (ids "
        "were asked for and did not come).",
        ("scheme",),
        "delivery",
    ),
    _S(
        "kvtax_proxy_upstream_retries_total",
        "counter",
        "Requests the proxy sent to vLLM a second time because vLLM closed the connection before "
        "answering (a pooled keep-alive connection closed as it was reused); one retry at most.",
        (),
        "delivery",
    ),
    _S(
        "kvtax_engine_generation_tokens_total",
        "counter",
        "Tokens generated by the engine (vLLM generation_tokens, reset-corrected).",
        (M,),
    ),
    _S(
        "kvtax_engine_prompt_computed_tokens_total",
        "counter",
        "Prompt tokens the engine computed, excluding prefix-cache hits (first prefill only).",
        (M,),
    ),
    _S(
        "kvtax_engine_preemptions_total",
        "counter",
        "Preemptions reported by vLLM (reset-corrected).",
        (M,),
    ),
    # -- cache and queue state ---------------------------------------------------------------
    _S("kvtax_kv_cache_usage_ratio", "gauge", "KV-cache usage, 0-1 (max across engines).", (M,)),
    _S("kvtax_requests_running", "gauge", "Requests in vLLM's running batch.", (M,)),
    _S("kvtax_requests_waiting", "gauge", "Requests waiting in vLLM's queue.", (M,)),
    _S(
        "kvtax_kv_capacity_tokens",
        "gauge",
        "Tokens the KV pool holds: num_gpu_blocks x block_size.",
        (M,),
    ),
    _S(
        "kvtax_request_length_p50_tokens",
        "gauge",
        "Median request length (prompt + generation) over the window.",
        (M,),
    ),
    _S(
        "kvtax_request_length_p95_tokens",
        "gauge",
        "p95 request length (prompt p95 + generation p95, an upper bound) over the window.",
        (M,),
    ),
    _S(
        "kvtax_recommended_max_num_seqs",
        "gauge",
        "floor(KV capacity x target usage / p95 request length): the value for vLLM's "
        "--max-num-seqs, or --max-num-active-seqs on 0.33+ (--max-num-seqs left at its default).",
        (M,),
    ),
    _S(
        "kvtax_configured_max_num_seqs",
        "gauge",
        "The --max-num-seqs the operator told kvtax vLLM runs with (its --max-num-active-seqs "
        "where set).",
        (M,),
    ),
    _S(
        "kvtax_over_admission_ratio",
        "gauge",
        "Configured max_num_seqs / recommended max_num_seqs; above 1 the engine can over-admit "
        "(lower --max-num-seqs, or --max-num-active-seqs on vLLM 0.33+).",
        (M,),
    ),
    _S("kvtax_thrash_state", "gauge", "0 ok, 1 at risk, 2 thrashing (see docs/tax.md).", (M,)),
    # -- recompute and the tax ---------------------------------------------------------------
    _S(
        "kvtax_recomputed_tokens_measured_total",
        "counter",
        "Tokens prefilled again after preemption, measured: kvtax's vLLM plugin, or V0's counters "
        "(absent when neither is there).",
        (M,),
    ),
    _S(
        "kvtax_recomputed_tokens_estimated_total",
        "counter",
        "Tokens prefilled again after preemption, estimated: new preemptions x mean context "
        "(mean prompt tokens computed + half the mean generation); an upper bound.",
        (M,),
    ),
    _S(
        "kvtax_recomputed_tokens_stall_estimated_total",
        "counter",
        "Tokens prefilled again after preemption, estimated from the proxy: new preemptions x "
        "mean context at the stream stalls it saw.",
        (M,),
    ),
    _S(
        "kvtax_recompute_avoided_tokens_total",
        "counter",
        "Tokens of resumed (preempted) requests that were not computed again, by source: "
        "prefix_cache (still in vLLM's own KV cache) or kv_connector (loaded back by a KV "
        "connector: CPU offloading, LMCache; present only where vLLM runs with one). Measured by "
        "kvtax's vLLM plugin; absent without it.",
        (M, "source"),
    ),
    _S(
        "kvtax_preemption_tax_ratio",
        "gauge",
        "Share of engine token work that was recompute over the window: R / (Pc + G + R), one "
        "series per model; method names the R used, the first available of measured, "
        "estimated, stall_estimated (docs/tax.md, the one definition).",
        (M, "method"),
    ),
    _S(
        "kvtax_waste_ratio",
        "gauge",
        "Share of engine token work no client received over the window: (R + U) / (Pc + G + R), "
        "one series per model, R as in kvtax_preemption_tax_ratio.",
        (M, "method"),
    ),
    # -- delivery ledger (proxy, push endpoint, gateway counter) -----------------------------
    _S(
        "kvtax_delivered_tokens_total",
        "counter",
        "Completion tokens written to a still-connected client.",
        (M, "source"),
        "delivery",
    ),
    _S(
        "kvtax_delivered_prompt_tokens_total",
        "counter",
        "Prompt tokens of requests whose output reached a client.",
        (M, "source"),
        "delivery",
    ),
    _S(
        "kvtax_undelivered_tokens_total",
        "counter",
        "Tokens the engine generated for clients that had gone (disconnect, error).",
        (M, "source"),
        "delivery",
    ),
    _S(
        "kvtax_requests_total",
        "counter",
        "Requests through kvtax by outcome: completed, client_disconnected, upstream_error "
        "(5xx or no answer, including vLLM's own admission rejections, a 503), upstream_4xx "
        "(vLLM answered 4xx: a bad request), too_large (kvtax's own 413), "
        "shutdown (ended by kvtax's shutdown: cut when the grace period ran out, or turned away "
        "with a 503), shed (the gate's "
        "429 or 400: never sent to vLLM).",
        (M, "outcome"),
        "delivery",
    ),
    _S(
        "kvtax_joined_requests_total",
        "counter",
        "Requests in the ledger that reached vLLM (all sources): join coverage's numerator.",
        (M,),
        "delivery",
    ),
    _S(
        "kvtax_requests_without_usage_total",
        "counter",
        "Requests relayed to the end whose token count could not be read: vLLM sent no usage "
        "kvtax could parse (stream_options ignored, unusual framing). Their tokens are missing "
        "from delivered; above 0, the delivered figures undercount.",
        (M,),
        "delivery",
    ),
    _S(
        "kvtax_slo_met_requests_total",
        "counter",
        "Completed requests that met both the TTFT and the ITL SLO.",
        (M,),
        "delivery",
    ),
    _S(
        "kvtax_slo_met_tokens_total",
        "counter",
        "Completion tokens of requests that met both SLOs.",
        (M,),
        "delivery",
    ),
    _S(
        "kvtax_client_ttft_seconds",
        "histogram",
        "Time to first token as the client saw it.",
        (M,),
        "delivery",
    ),
    _S(
        "kvtax_client_itl_seconds",
        "histogram",
        "Gaps between chunks written to the client.",
        (M,),
        "delivery",
    ),
    _S(
        "kvtax_stream_stall_seconds",
        "histogram",
        "Stream stalls: gaps far above the stream's running median (a preemption's face).",
        (M,),
        "delivery",
    ),
    _S(
        "kvtax_stall_context_tokens_total",
        "counter",
        "Context length (prompt + delivered) at the start of each stall.",
        (M,),
        "delivery",
    ),
    _S(
        "kvtax_request_duration_seconds",
        "histogram",
        "Request duration through the proxy.",
        (M,),
        "delivery",
    ),
    # -- the join ----------------------------------------------------------------------------
    _S(
        "kvtax_goodput_tokens_per_second",
        "gauge",
        "Delivered completion tokens per second over the window.",
        (M,),
        "join",
    ),
    _S(
        "kvtax_slo_goodput_tokens_per_second",
        "gauge",
        "Delivered tokens per second of requests that met the SLOs.",
        (M,),
        "join",
    ),
    _S(
        "kvtax_engine_api_requests_total",
        "counter",
        "Completion and chat requests vLLM's HTTP server answered, aborted ones included "
        "(reset-corrected; server-wide): join coverage's denominator.",
        (M,),
        "join",
    ),
    _S(
        "kvtax_join_delivered_tokens_total",
        "counter",
        "kvtax_delivered_tokens_total over every source, as of kvtax's last scrape of vLLM, "
        "like the kvtax_engine_* counters: the numerator of the delivery yield. The ledger is "
        "read as the fetch began and as the page arrived; between the two, the count grows by no "
        "more than vLLM generated since the last scrape. The source-labelled counter is live "
        "and leads the engine's counters between scrapes.",
        (M,),
        "join",
    ),
    _S(
        "kvtax_join_undelivered_tokens_total",
        "counter",
        "kvtax_undelivered_tokens_total over every source, as of kvtax's last scrape of vLLM, "
        "like the kvtax_engine_* counters: the U of the waste recording rules.",
        (M,),
        "join",
    ),
    _S(
        "kvtax_join_coverage_ratio",
        "gauge",
        "Requests the ledger saw / requests vLLM served; below 1 traffic bypasses kvtax.",
        (M,),
        "join",
    ),
    # -- vLLM answers, but publishes nothing kvtax can read -----------------------------------
    _S(
        "kvtax_vllm_metrics_missing",
        "gauge",
        "1 while vLLM answers /metrics with no vllm: series that carry model_name (stats "
        "logging off with --disable-log-stats, or metrics renamed by a newer vLLM), else 0. "
        "kvtax keeps serving and never fails readiness for it; the scrapes count as no_models.",
        (),
        "sidecar",
    ),
    # -- LoRA adapters: their tokens count under the base model, and here by adapter too -----
    _S(
        "kvtax_adapter_delivered_tokens_total",
        "counter",
        "Completion tokens of LoRA adapter requests written to a still-connected client, by "
        "adapter; model_name is the base model (from vLLM's /v1/models parent or "
        "--delivery.adapters), whose kvtax_delivered_tokens_total already includes them.",
        (M, "adapter"),
        "delivery",
    ),
    # -- the generation APIs: the proxy's counts by API, a part of the per-model ones -------
    _S(
        "kvtax_api_delivered_tokens_total",
        "counter",
        "Completion tokens the proxy delivered, by the generation API the request came through "
        "(kvtax.delivery.dialects: completions, chat, chat_batch, responses, messages, "
        "generate, invocations, transcription, translation); a part of "
        'kvtax_delivered_tokens_total{source="proxy"}.',
        (M, "api"),
        "delivery",
    ),
    _S(
        "kvtax_api_undelivered_tokens_total",
        "counter",
        "Completion tokens vLLM sent through the proxy that did not reach their client, by "
        'API; a part of kvtax_undelivered_tokens_total{source="proxy"}.',
        (M, "api"),
        "delivery",
    ),
    _S(
        "kvtax_api_requests_total",
        "counter",
        "Requests the proxy settled, by API and outcome; a part of kvtax_requests_total.",
        (M, "api", "outcome"),
        "delivery",
    ),
    # -- the gate (docs/gate.md): kvtax.expose.catalog_gate ----------------------------------
    *GATE_METRICS,
)

METRICS: dict[str, MetricSpec] = {m.name: m for m in METRIC_LIST}


# The process's own families, from prometheus-client's ProcessCollector (Linux): the standard
# names every exporter publishes, so they keep their standard names rather than a kvtax_ prefix.
PROCESS_METRICS: tuple[tuple[str, str, str], ...] = (
    ("process_resident_memory_bytes", "gauge", "Resident memory of the kvtax process."),
    ("process_virtual_memory_bytes", "gauge", "Virtual memory of the kvtax process."),
    ("process_open_fds", "gauge", "Open file descriptors of the kvtax process."),
    ("process_max_fds", "gauge", "The kvtax process's limit on open file descriptors."),
    ("process_cpu_seconds_total", "counter", "CPU time the kvtax process used."),
    ("process_start_time_seconds", "gauge", "When the kvtax process started, Unix time."),
)
