"""One scrape's :class:`~kvtax.gate.cap.Signals`, from the figures every model has.

A vLLM server usually serves one model; with several, the gate in front of it sees the pool as
one: the largest capacity, block size and KV usage, the longest p95 length, and the
preemptions and recompute of all models together. Counts are increases of reset-corrected
totals since the previous call, so the caller keeps the totals this returns and hands them
back next time.

Example::

    signals, totals = signals_of(
        sidecar.figures, previous_totals, queued=3, in_flight=8, footprint_p95=812.0
    )
"""

from __future__ import annotations

from collections.abc import Mapping

from kvtax.figures.derive import ModelFigures
from kvtax.gate.cap import Signals

__all__ = ["Total", "Totals", "signals_of"]

# (preemptions, recomputed tokens, e2e latency sum, e2e latency count, requests vLLM's queue
# caps refused) per model, as of the last call.
Total = tuple[float, float, float, float, float]
Totals = Mapping[str, Total]


def _recomputed(totals: Mapping[str, float]) -> float:
    """The largest recompute total of any method (a method the engine lacks is absent)."""
    values = [v for k, v in totals.items() if k.startswith("recomputed_")]
    return max(values, default=0.0)


def signals_of(
    figures: Mapping[str, ModelFigures],
    before: Totals,
    *,
    queued: int,
    in_flight: int,
    footprint_p95: float | None,
) -> tuple[Signals, dict[str, Total]]:
    """The signals of this scrape and the totals to pass to the next call."""
    engine = {m: f for m, f in figures.items() if f.engine}
    totals = {
        m: (
            f.totals.get("preemptions", 0.0),
            _recomputed(f.totals),
            f.totals.get("e2e_latency_sum", 0.0),
            f.totals.get("e2e_latency_count", 0.0),
            f.totals.get("admission_rejections", 0.0),
        )
        for m, f in engine.items()
    }
    preempted = recomputed = latency = finished = refused = 0.0
    first_latency = first_finished = 0.0
    for model, (p, r, s, n, q) in totals.items():
        p0, r0, s0, n0, q0 = before.get(model, (p, r, s, n, q))  # a model new here adds nothing
        preempted += max(0.0, p - p0)
        recomputed += max(0.0, r - r0)
        latency += max(0.0, s - s0)
        finished += max(0.0, n - n0)
        refused += max(0.0, q - q0)
        first_latency, first_finished = first_latency + s, first_finished + n
    capacities = [f.kv_capacity_tokens for f in engine.values() if f.kv_capacity_tokens]
    lengths = [f.length_p95 for f in engine.values() if f.length_p95]
    usages = [f.kv_usage for f in engine.values() if f.kv_usage is not None]
    # One server has one block size (cache_config_info is server-wide); max() only picks it.
    sizes = [f.kv_block_size for f in engine.values() if f.kv_block_size]
    signals = Signals(
        capacity_tokens=max(capacities, default=None),
        length_p95=max(lengths, default=None),
        footprint_p95=footprint_p95,
        kv_usage=max(usages, default=None),
        preemptions=preempted,
        recomputed=recomputed,
        refused=refused,
        queued=queued,
        in_flight=in_flight,
        block_size=max(sizes, default=None),
        service_time=_mean(latency, finished) if before else _mean(first_latency, first_finished),
    )
    return signals, totals


def _mean(total: float, count: float) -> float | None:
    """A histogram's mean over ``count`` observations; None with none (or a bad sum)."""
    if count < 1 or total < 0:
        return None
    return total / count
