"""Every derived number, per model, as pure functions of a window of :class:`Point` values.

This module owns the formulas: KV capacity, request-length quantiles, the recommended
``max_num_seqs``, the thrash state, goodput and SLO goodput, undelivered tokens, join coverage,
and the preemption tax and waste ratio with the best recompute method. The recompute totals
themselves grow in :mod:`kvtax.figures.window` by the formulas of
:mod:`kvtax.figures.recompute`. The exact meaning of each number is in ``docs/tax.md``.

Example::

    figures = derive_model(window.points("tiny-llama"), EngineSettings())
    figures.tax  # MethodValue("measured", 0.24)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum

from kvtax.engine.snapshot import Histogram
from kvtax.figures.recompute import METHODS, recompute_avoided
from kvtax.figures.window import Point, Window

__all__ = [
    "FULL_COVERAGE",
    "EngineSettings",
    "MethodValue",
    "ModelFigures",
    "ThrashState",
    "best_method",
    "coverage",
    "derive_all",
    "derive_model",
    "kv_block_size",
    "kv_capacity_tokens",
    "recommended_max_num_seqs",
    "tax_ratio",
    "thrash_state",
    "undelivered",
    "waste_ratio",
]

# Coverage at or above this counts as "the ledger saw everything": then U = G - D exactly.
FULL_COVERAGE = 0.999


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
class MethodValue:
    """A ratio computed with one recompute method, and that method's name."""

    method: str
    value: float


@dataclass(frozen=True, slots=True)
class ModelFigures:
    """One model's derived numbers. ``None`` means "cannot be known yet", never zero."""

    # Whether the window's last point has engine data (the page had the model lately).
    engine: bool = False
    totals: Mapping[str, float] = field(default_factory=dict)
    kv_usage: float | None = None
    running: float | None = None
    waiting: float | None = None
    kv_capacity_tokens: float | None = None
    kv_block_size: int | None = None  # tokens a KV block holds; None: the page does not say
    length_p50: float | None = None
    length_p95: float | None = None
    recommended_max_num_seqs: int | None = None
    over_admission_ratio: float | None = None
    thrash_state: ThrashState | None = None
    goodput: float | None = None
    slo_goodput_tokens: float | None = None
    coverage: float | None = None
    served_requests_total: float | None = None
    # The ledger's lifetime totals at the last point, as of the same scrape as ``totals``;
    # None while the ledger has not counted the model.
    delivered_total: float | None = None
    undelivered_total: float | None = None
    # With the best recompute method of the window (see best_method).
    tax: MethodValue | None = None
    waste: MethodValue | None = None
    # Lifetime tokens of resumed requests not computed again, by source (recompute_avoided).
    recompute_avoided: Mapping[str, float] = field(default_factory=dict)


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


def kv_block_size(info: Mapping[str, str]) -> int | None:
    """Tokens a KV block holds, from the ``block_size`` label of ``vllm:cache_config_info``;
    None when the label is absent or no whole positive number (``"None"`` included)."""
    size = _num(info.get("block_size"))
    return int(size) if size is not None and size.is_integer() else None


def recommended_max_num_seqs(capacity: float, target_usage: float, p95_length: float) -> int:
    """floor(capacity x target usage / p95 request length), and never below 1."""
    if p95_length <= 0:
        raise ValueError(f"p95 request length must be positive, got {p95_length}")
    return max(1, math.floor(capacity * target_usage / p95_length))


def tax_ratio(recomputed: float, prompt_computed: float, generated: float) -> float:
    """R / (Pc + G + R): the share of engine token work that was recompute; 0 with no work."""
    work = prompt_computed + generated + recomputed
    return recomputed / work if work > 0 else 0.0


def waste_ratio(
    recomputed: float, undelivered_tokens: float, prompt_computed: float, generated: float
) -> float:
    """(R + U) / (Pc + G + R): everything the engine did that no client received."""
    work = prompt_computed + generated + recomputed
    return (recomputed + undelivered_tokens) / work if work > 0 else 0.0


def best_method(increases: Mapping[str, float]) -> tuple[str, float] | None:
    """The first recompute method available, in the fixed order of METHODS, and its increase."""
    for method, key in METHODS:
        if key in increases:
            return method, increases[key]
    return None


def coverage(first: Point, last: Point) -> float | None:
    """Requests the ledger saw / requests vLLM served over the window (server-wide).

    The ledger cannot be read at the instant vLLM wrote its page, so each point brackets it: a
    count read before the page was fetched, and one read after it was parsed (seconds later on
    a starved machine, while requests kept settling). The window's joined requests run from
    the first point's earlier count to the last point's later one, so a request that settled
    while a page was in flight counts in the window whichever side of vLLM's count it fell: the
    skew can only raise the ratio, and an excess over 1 is skew, not more traffic than vLLM saw.
    """
    if first.served_requests is None or last.served_requests is None:
        return None
    served = last.served_requests - first.served_requests
    if served <= 0:
        return None
    base = first.joined_requests if first.joined_before is None else first.joined_before
    joined = last.joined_requests - base
    return min(1.0, joined / served)


def undelivered(first: Point, last: Point, generated: float | None, covered: float | None) -> float:
    """U over the window: G - D when the join covers all traffic, else the ledger's own count."""
    delivered = last.delivered_paired - first.delivered_paired
    if generated is not None and covered is not None and covered >= FULL_COVERAGE:
        return max(0.0, generated - delivered)
    return last.ledger.undelivered - first.ledger.undelivered


def derive_all(window: Window, settings: EngineSettings) -> dict[str, ModelFigures]:
    """Every tracked model's figures over the window."""
    return {model: derive_model(window.points(model), settings) for model in window.models()}


def derive_model(points: Sequence[Point], settings: EngineSettings) -> ModelFigures:
    """All derived numbers for one model from its window of points (oldest first)."""
    if not points:
        return ModelFigures()
    first, last = points[0], points[-1]
    span = last.t - first.t
    capacity = kv_capacity_tokens(last.info)
    p95 = _length_quantile(first, last, 0.95)
    recommended = (
        recommended_max_num_seqs(capacity, settings.target_usage, p95)
        if capacity is not None and p95 is not None and p95 > 0
        else None
    )
    configured = settings.configured_max_num_seqs
    tax, waste = _tax_and_waste(first, last)

    def per_second(value: float) -> float | None:
        return value / span if span > 0 else None

    return ModelFigures(
        engine=bool(last.counters or last.gauges or last.histograms or last.info),
        totals=dict(last.counters),
        kv_usage=last.gauges.get("kv_usage"),
        running=last.gauges.get("requests_running"),
        waiting=last.gauges.get("requests_waiting"),
        kv_capacity_tokens=capacity,
        kv_block_size=kv_block_size(last.info),
        length_p50=_length_quantile(first, last, 0.5),
        length_p95=p95,
        recommended_max_num_seqs=recommended,
        over_admission_ratio=(
            configured / recommended if configured is not None and recommended else None
        ),
        thrash_state=thrash_state(points, settings),
        goodput=per_second(last.ledger.delivered - first.ledger.delivered),
        slo_goodput_tokens=per_second(last.ledger.slo_met_tokens - first.ledger.slo_met_tokens),
        coverage=coverage(first, last),
        served_requests_total=last.served_requests,
        delivered_total=last.delivered_paired if last.booked else None,
        undelivered_total=last.ledger.undelivered if last.booked else None,
        tax=tax,
        waste=waste,
        recompute_avoided=recompute_avoided(last.counters),
    )


def _tax_and_waste(first: Point, last: Point) -> tuple[MethodValue | None, MethodValue | None]:
    """The tax and the waste over the window, both with R from the best method available."""
    increases = {
        key: inc for key in last.counters if (inc := _increase(first, last, key)) is not None
    }
    best = best_method(increases)
    # A window of one scrape spans no time: its tax would be 0/0, not "no tax".
    if best is None or last.t - first.t <= 0:
        return None, None
    method, recomputed = best
    generated = increases.get("generation_tokens")
    computed = increases.get("prompt_computed", 0.0)
    tax = MethodValue(method, tax_ratio(recomputed, computed, generated or 0.0))
    if generated is None:
        return tax, None
    u = undelivered(first, last, generated, coverage(first, last))
    return tax, MethodValue(method, waste_ratio(recomputed, u, computed, generated))


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
