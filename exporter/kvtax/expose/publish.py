"""What kvtax publishes, as :class:`~kvtax.expose.samples.Sample` values: the one mapping onto
catalog names of the derived figures, the ledger's counters and the proxy's gauges.

Pure. A figure that is ``None`` produces no sample, so a concept a vLLM version lacks is absent
from kvtax's output, not zero. Reading never changes what is read: the figures are computed at
the scrape of vLLM, and the ledger's running streams are credited there too.

The ledger's tokens appear twice. ``kvtax_delivered_tokens_total`` and
``kvtax_undelivered_tokens_total`` (:func:`ledger_samples`) are live: goodput keeps counting
while vLLM's /metrics is down or slow. ``kvtax_join_delivered_tokens_total`` and
``kvtax_join_undelivered_tokens_total`` (:func:`model_samples`) are the ledger's totals in the
window's last point, as of the same scrape of vLLM as the ``kvtax_engine_*`` counters (the
delivered one kept to the page's count by :func:`kvtax.figures.window.delivered_at_page`): a rule
that divides ledger tokens by engine tokens reads these, or the live ones would lead the engine's
by whatever streams delivered since that scrape.

Example::

    from kvtax.figures.derive import derive_all
    list(model_samples(derive_all(window, settings), configured_max_num_seqs=None))
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from kvtax.delivery.cost import RelayCost
from kvtax.delivery.ledger import ApiCounts, BookCounts, HistogramCounts
from kvtax.expose.samples import HistogramSample, Sample
from kvtax.figures.derive import ModelFigures
from kvtax.figures.recompute import METHODS

__all__ = [
    "RECOMPUTED_COUNTERS",
    "adapter_samples",
    "api_samples",
    "ledger_samples",
    "model_samples",
    "proxy_samples",
    "worker_samples",
]

_COUNTERS = (
    ("kvtax_engine_generation_tokens_total", "generation_tokens"),
    ("kvtax_engine_prompt_computed_tokens_total", "prompt_computed"),
    ("kvtax_engine_preemptions_total", "preemptions"),
)
# One counter per recompute method, so that a sum() over any of them means something.
# Named from recompute.METHODS, the one list of methods and their order; the catalog test
# checks each name is a catalog counter.
RECOMPUTED_COUNTERS = {method: f"kvtax_recomputed_tokens_{method}_total" for method, _ in METHODS}


def model_samples(
    figures: Mapping[str, ModelFigures], configured_max_num_seqs: int | None
) -> Iterator[Sample]:
    """Each model's totals and window figures; the tax and waste once, with their method."""
    for model, f in sorted(figures.items()):
        m = (model,)
        for metric, key in _COUNTERS:
            if key in f.totals:
                yield Sample(metric, m, f.totals[key])
        for method, key in METHODS:
            if key in f.totals:
                yield Sample(RECOMPUTED_COUNTERS[method], m, f.totals[key])
        for source, tokens in f.recompute_avoided.items():
            yield Sample("kvtax_recompute_avoided_tokens_total", (model, source), tokens)
        # The ledger's side of the join, as of the same scrape as the engine's counters above.
        for metric, value in (
            ("kvtax_join_delivered_tokens_total", f.delivered_total),
            ("kvtax_join_undelivered_tokens_total", f.undelivered_total),
        ):
            if value is not None:
                yield Sample(metric, m, value)
        gauges = (
            ("kvtax_kv_cache_usage_ratio", f.kv_usage),
            ("kvtax_requests_running", f.running),
            ("kvtax_requests_waiting", f.waiting),
            ("kvtax_kv_capacity_tokens", f.kv_capacity_tokens),
            ("kvtax_request_length_p50_tokens", f.length_p50),
            ("kvtax_request_length_p95_tokens", f.length_p95),
            ("kvtax_recommended_max_num_seqs", f.recommended_max_num_seqs),
            ("kvtax_over_admission_ratio", f.over_admission_ratio),
            ("kvtax_thrash_state", f.thrash_state),
            ("kvtax_goodput_tokens_per_second", f.goodput),
            ("kvtax_slo_goodput_tokens_per_second", f.slo_goodput_tokens),
            ("kvtax_join_coverage_ratio", f.coverage),
            ("kvtax_engine_api_requests_total", f.served_requests_total),
        )
        for metric, value in gauges:
            if value is not None:
                yield Sample(metric, m, float(value))
        if f.engine and configured_max_num_seqs is not None:
            yield Sample("kvtax_configured_max_num_seqs", m, float(configured_max_num_seqs))
        if f.tax is not None:
            yield Sample("kvtax_preemption_tax_ratio", (model, f.tax.method), f.tax.value)
        if f.waste is not None:
            yield Sample("kvtax_waste_ratio", (model, f.waste.method), f.waste.value)


def ledger_samples(books: Mapping[str, BookCounts]) -> Iterator[Sample | HistogramSample]:
    """The ledger's counters and histograms per model label (from ``DeliveryLedger.counts()``)."""
    for label, book in sorted(books.items()):
        m = (label,)
        for metric, by_source in (
            ("kvtax_delivered_tokens_total", book.delivered),
            ("kvtax_delivered_prompt_tokens_total", book.prompt),
            ("kvtax_undelivered_tokens_total", book.undelivered),
        ):
            for source, value in sorted(by_source.items()):
                yield Sample(metric, (label, source), value)
        for outcome, n in book.outcomes.items():
            yield Sample("kvtax_requests_total", (label, outcome), n)
        yield Sample("kvtax_joined_requests_total", m, book.joined_requests)
        yield Sample("kvtax_requests_without_usage_total", m, book.usage_missing)
        yield Sample("kvtax_slo_met_requests_total", m, book.slo_met_requests)
        yield Sample("kvtax_slo_met_tokens_total", m, book.slo_met_tokens)
        yield Sample("kvtax_stall_context_tokens_total", m, book.stall_context)
        yield _histogram("kvtax_client_ttft_seconds", m, book.ttft)
        yield _histogram("kvtax_client_itl_seconds", m, book.itl)
        yield _histogram("kvtax_stream_stall_seconds", m, book.stall)
        yield _histogram("kvtax_request_duration_seconds", m, book.duration)


def adapter_samples(delivered: Mapping[tuple[str, str], float]) -> Iterator[Sample]:
    """Delivered tokens per (base model, adapter) (from ``DeliveryLedger.adapter_counts()``)."""
    for labels, value in sorted(delivered.items()):
        yield Sample("kvtax_adapter_delivered_tokens_total", labels, value)


def api_samples(counts: Mapping[tuple[str, str], ApiCounts]) -> Iterator[Sample]:
    """The proxy's counts per (model, API) (from ``DeliveryLedger.api_counts()``)."""
    for (label, api), by_api in sorted(counts.items()):
        yield Sample("kvtax_api_delivered_tokens_total", (label, api), by_api.delivered)
        yield Sample("kvtax_api_undelivered_tokens_total", (label, api), by_api.undelivered)
        for outcome, n in by_api.outcomes.items():
            yield Sample("kvtax_api_requests_total", (label, api, outcome), n)


def proxy_samples(
    in_flight: int, streams_open: int, upstream_retries: int, cost: RelayCost
) -> Iterator[Sample | HistogramSample]:
    yield Sample("kvtax_proxy_requests_in_flight", (), float(in_flight))
    yield Sample("kvtax_proxy_streams_open", (), float(streams_open))
    yield Sample("kvtax_proxy_upstream_retries_total", (), float(upstream_retries))
    yield _histogram("kvtax_proxy_relay_seconds", (), cost.relay.counts())
    yield _histogram("kvtax_proxy_forward_seconds", (), cost.forward.counts())
    yield Sample("kvtax_proxy_events_relayed_total", (), float(cost.events))
    for scheme, streams in cost.schemes.items():
        yield Sample("kvtax_proxy_streams_counted_total", (scheme,), float(streams))


def worker_samples(workers: int, cpu: float, restarts: int) -> Iterator[Sample]:
    """The proxy workers' own (``--proxy.workers``; all 0 when kvtax's own process relays)."""
    yield Sample("kvtax_proxy_workers", (), float(workers))
    yield Sample("kvtax_proxy_worker_cpu_seconds_total", (), cpu)
    yield Sample("kvtax_proxy_worker_restarts_total", (), float(restarts))


def _histogram(metric: str, labels: tuple[str, ...], h: HistogramCounts) -> HistogramSample:
    return HistogramSample(metric, labels, h.buckets, h.sum)
