"""Derived engine numbers per model, as pure functions of a window of :class:`Point` values.

Everything here is arithmetic on values: rates over the window, KV capacity, request-length
quantiles, the recommended ``max_num_seqs``, the thrash state and the preemption tax. The exact
meaning of each number is in ``docs/tax.md``; the formulas live only here.

Example::

    figures = derive_engine(history.points("tiny-llama"), EngineSettings())
    figures.recommended_max_num_seqs
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum

from kvtax.engine.snapshot import Histogram
from kvtax.figures.history import Point

__all__ = [
    "EngineFigures",
    "EngineSettings",
    "ThrashState",
    "derive_engine",
    "kv_capacity_tokens",
    "recommended_max_num_seqs",
    "tax_ratio",
]


class ThrashState(IntEnum):
    OK = 0
    AT_RISK = 1
    THRASHING = 2


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """Knobs of the derivation; defaults match docs/configuration.md."""

    target_usage: float = 0.9
    configured_max_num_seqs: int | None = None
    near_full: float = 0.9
    at_risk_usage: float = 0.85


@dataclass(frozen=True, slots=True)
class EngineFigures:
    """One model's derived numbers. ``None`` means "cannot be known yet", never zero."""

    totals: Mapping[str, float] = field(default_factory=dict)
    generation_rate: float | None = None
    prompt_computed_rate: float | None = None
    preemption_rate: float | None = None
    kv_usage: float | None = None
    running: float | None = None
    waiting: float | None = None
    kv_capacity_tokens: float | None = None
    length_p50: float | None = None
    length_p95: float | None = None
    recommended_max_num_seqs: int | None = None
    over_admission_ratio: float | None = None
    thrash_state: ThrashState | None = None
    # method -> value; a method is present only if its source exists.
    recompute_rate: Mapping[str, float] = field(default_factory=dict)
    tax: Mapping[str, float] = field(default_factory=dict)
    # The window actually covered, and every total's increase over it (G, Pc, R by method).
    window_seconds: float = 0.0
    window_increase: Mapping[str, float] = field(default_factory=dict)


def kv_capacity_tokens(info: Mapping[str, str]) -> float | None:
    """Tokens the KV pool holds, from ``vllm:cache_config_info`` labels."""
    direct = _num(info.get("kv_cache_size_tokens"))
    if direct:
        return direct
    blocks = _num(info.get("num_gpu_blocks"))
    block_size = _num(info.get("block_size"))
    if blocks and block_size:
        return blocks * block_size
    return None


def recommended_max_num_seqs(capacity: float, target_usage: float, p95_length: float) -> int:
    """floor(capacity x target usage / p95 request length), and never below 1."""
    if p95_length <= 0:
        raise ValueError(f"p95 request length must be positive, got {p95_length}")
    return max(1, math.floor(capacity * target_usage / p95_length))


def tax_ratio(recomputed: float, prompt_computed: float, generated: float) -> float:
    """R / (Pc + G + R); 0 when the engine did no work at all."""
    work = prompt_computed + generated + recomputed
    return recomputed / work if work > 0 else 0.0


def _num(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) and value > 0 else None


def _increase(first: Point, last: Point, key: str) -> float | None:
    if key not in last.counters:
        return None
    return last.counters[key] - first.counters.get(key, last.counters[key])


def _window_histogram(first: Point, last: Point, concept: str) -> Histogram | None:
    """The window's increase of a histogram, or its lifetime when the window saw nothing."""
    now = last.histograms.get(concept)
    if now is None:
        return None
    before = first.histograms.get(concept)
    delta = now.minus(before) if before is not None and first is not last else now
    return delta if delta.count > 0 else now


def _length_quantile(first: Point, last: Point, q: float) -> float | None:
    prompt = _window_histogram(first, last, "request_prompt_tokens")
    gen = _window_histogram(first, last, "request_generation_tokens")
    if prompt is None or gen is None:
        return None
    pq, gq = prompt.quantile(q), gen.quantile(q)
    if pq is None or gq is None:
        return None
    # Quantiles of the two histograms add up to an upper bound of the total's quantile: vLLM
    # exposes no joint histogram, and over-estimating the length errs on the safe side.
    return pq + gq


def derive_engine(points: Sequence[Point], settings: EngineSettings) -> EngineFigures:
    """All derived engine numbers for one model from its window of points (oldest first)."""
    if not points:
        return EngineFigures()
    first, last = points[0], points[-1]
    span = last.t - first.t

    def rate(key: str) -> float | None:
        inc = _increase(first, last, key)
        if inc is None or span <= 0:
            return None
        return inc / span

    increases = {
        key: inc for key in last.counters if (inc := _increase(first, last, key)) is not None
    }
    capacity = kv_capacity_tokens(last.info)
    p50 = _length_quantile(first, last, 0.5)
    p95 = _length_quantile(first, last, 0.95)
    recommended = (
        recommended_max_num_seqs(capacity, settings.target_usage, p95)
        if capacity is not None and p95 is not None and p95 > 0
        else None
    )
    over = (
        settings.configured_max_num_seqs / recommended
        if settings.configured_max_num_seqs is not None and recommended
        else None
    )

    recompute_rate: dict[str, float] = {}
    tax: dict[str, float] = {}
    generated = increases.get("generation_tokens", 0.0)
    computed = increases.get("prompt_computed", 0.0)
    for method, key in (("measured", "recomputed_measured"), ("estimated", "recomputed_estimated")):
        # A window of one scrape spans no time: its tax would be 0/0, not "no tax".
        if key not in increases or span <= 0:
            continue
        recomputed = increases[key]
        recompute_rate[method] = recomputed / span
        tax[method] = tax_ratio(recomputed, computed, generated)

    return EngineFigures(
        totals=dict(last.counters),
        generation_rate=rate("generation_tokens"),
        prompt_computed_rate=rate("prompt_computed"),
        preemption_rate=rate("preemptions"),
        kv_usage=last.gauges.get("kv_usage"),
        running=last.gauges.get("requests_running"),
        waiting=last.gauges.get("requests_waiting"),
        kv_capacity_tokens=capacity,
        length_p50=p50,
        length_p95=p95,
        recommended_max_num_seqs=recommended,
        over_admission_ratio=over,
        thrash_state=thrash_state(points, settings),
        recompute_rate=recompute_rate,
        tax=tax,
        window_seconds=span,
        window_increase=increases,
    )


def thrash_state(points: Sequence[Point], settings: EngineSettings) -> ThrashState | None:
    """The thrash signature over the window.

    Thrashing: the cache was near full, preemptions rose, and requests waited or engine
    throughput fell while demand rose. At risk: preemptions rose, or the cache averaged above
    the at-risk usage. A window without KV usage or preemption data gives ``None``.
    """
    usages = [p.gauges["kv_usage"] for p in points if "kv_usage" in p.gauges]
    if not usages or "preemptions" not in points[-1].counters:
        return None
    preempting = (_increase(points[0], points[-1], "preemptions") or 0.0) > 0
    near_full = max(usages) >= settings.near_full
    waited = any(p.gauges.get("requests_waiting", 0.0) > 0 for p in points)
    if preempting and near_full and (waited or _throughput_falling(points)):
        return ThrashState.THRASHING
    if preempting or sum(usages) / len(usages) >= settings.at_risk_usage:
        return ThrashState.AT_RISK
    return ThrashState.OK


def _throughput_falling(points: Sequence[Point]) -> bool:
    """Generation rate fell between the window's halves while running + waiting rose."""
    if len(points) < 5:
        return False
    mid = len(points) // 2
    halves = (points[: mid + 1], points[mid:])

    def gen_rate(seg: Sequence[Point]) -> float:
        span = seg[-1].t - seg[0].t
        inc = _increase(seg[0], seg[-1], "generation_tokens") or 0.0
        return inc / span if span > 0 else 0.0

    def demand(seg: Sequence[Point]) -> float:
        return sum(
            p.gauges.get("requests_running", 0.0) + p.gauges.get("requests_waiting", 0.0)
            for p in seg
        ) / len(seg)

    return gen_rate(halves[1]) < 0.9 * gen_rate(halves[0]) and demand(halves[1]) > demand(halves[0])
