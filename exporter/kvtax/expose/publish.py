"""Engine figures and sidecar health as :class:`~kvtax.expose.report.Sample` values.

Pure: it maps :class:`~kvtax.figures.derive.EngineFigures` onto catalog names. A figure that is
``None``
produces no sample, so a concept a vLLM version lacks is absent from kvtax's output, not zero.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from kvtax.expose.report import Sample
from kvtax.figures.derive import EngineFigures

__all__ = ["engine_samples"]

_COUNTERS = (
    ("kvtax_engine_generation_tokens_total", "generation_tokens"),
    ("kvtax_engine_prompt_computed_tokens_total", "prompt_computed"),
    ("kvtax_engine_preemptions_total", "preemptions"),
)
_RECOMPUTED = (("measured", "recomputed_measured"), ("estimated", "recomputed_estimated"))


def engine_samples(
    figures: Mapping[str, EngineFigures], configured_max_num_seqs: int | None
) -> Iterator[Sample]:
    for model, f in figures.items():
        m = (model,)
        for metric, key in _COUNTERS:
            if key in f.totals:
                yield Sample(metric, m, f.totals[key])
        for method, key in _RECOMPUTED:
            if key in f.totals:
                yield Sample("kvtax_recomputed_tokens_total", (model, method), f.totals[key])
        gauges = (
            ("kvtax_engine_generation_tokens_per_second", f.generation_rate),
            ("kvtax_engine_prompt_computed_tokens_per_second", f.prompt_computed_rate),
            ("kvtax_engine_preemptions_per_second", f.preemption_rate),
            ("kvtax_kv_cache_usage_ratio", f.kv_usage),
            ("kvtax_requests_running", f.running),
            ("kvtax_requests_waiting", f.waiting),
            ("kvtax_kv_capacity_tokens", f.kv_capacity_tokens),
            ("kvtax_request_length_p50_tokens", f.length_p50),
            ("kvtax_request_length_p95_tokens", f.length_p95),
            ("kvtax_recommended_max_num_seqs", f.recommended_max_num_seqs),
            ("kvtax_over_admission_ratio", f.over_admission_ratio),
            ("kvtax_thrash_state", f.thrash_state),
            ("kvtax_configured_max_num_seqs", configured_max_num_seqs),
        )
        for metric, value in gauges:
            if value is not None:
                yield Sample(metric, m, float(value))
        for method, value in f.recompute_rate.items():
            yield Sample("kvtax_recomputed_tokens_per_second", (model, method), value)
        for method, value in f.tax.items():
            yield Sample("kvtax_preemption_tax_ratio", (model, method), value)
