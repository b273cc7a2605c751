"""One step's numbers, from what the client saw and what the engine's counters said.

Pure. The client side is a list of :class:`RequestRecord` (each stream's timing from
:class:`kvtax.delivery.timing.StreamTiming`, the proxy's own stall and SLO rules). The engine
side is the step's slice of :class:`kvtax.figures.window.Point` values, read by
:func:`kvtax.figures.derive.derive_model`: the tax, KV usage and thrash state of a step are the
ones the dashboards would show over the same span.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtax.figures.derive import EngineSettings, derive_model
from kvtax.figures.window import Point

__all__ = [
    "EngineStep",
    "RequestRecord",
    "StepResult",
    "engine_step",
    "measure_step",
    "quantile",
    "rank",
]


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What the client saw of one request."""

    started: float
    ended: float
    ok: bool
    completion_tokens: int
    prompt_tokens: int | None = None
    ttft: float | None = None
    gaps: tuple[float, ...] = ()
    stalls: int = 0
    slo_met: bool = False
    error: str | None = None


@dataclass(frozen=True, slots=True)
class EngineStep:
    """The engine's side of a span: increases of its counters and its derived figures."""

    scrapes: int
    generation_tokens: float | None = None
    prompt_tokens: float | None = None
    preemptions: float | None = None
    tax: float | None = None
    tax_method: str | None = None
    recomputed_tokens: float | None = None
    kv_usage_mean: float | None = None
    kv_usage_max: float | None = None
    running_max: float | None = None
    waiting_max: float | None = None
    thrash_state: str | None = None
    kv_capacity_tokens: float | None = None
    recommended_max_num_seqs: int | None = None


@dataclass(frozen=True, slots=True)
class StepResult:
    index: int
    level: float
    start: float
    end: float
    requests: int
    ok: int
    failed: int
    delivered_tokens: int
    slo_met_requests: int
    slo_tokens: int
    ttft_p50: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p99: float | None
    stalls: int
    engine: EngineStep
    errors: tuple[str, ...] = field(default_factory=tuple)

    @property
    def span(self) -> float:
        return self.end - self.start

    @property
    def throughput(self) -> float | None:
        """Tokens per second the engine generated (the counter), over the step's span."""
        gen = self.engine.generation_tokens
        return gen / self.span if gen is not None and self.span > 0 else None

    @property
    def goodput(self) -> float:
        """Tokens per second that reached the client in completed responses."""
        return self.delivered_tokens / self.span if self.span > 0 else 0.0

    @property
    def slo_goodput(self) -> float:
        """Tokens per second of responses that met both SLOs (TTFT and every gap)."""
        return self.slo_tokens / self.span if self.span > 0 else 0.0


def rank(n: int, q: float) -> int:
    """The index, in ``n`` sorted values, of their nearest-rank ``q`` quantile: the smallest
    value with at least ``q`` of them at or below it."""
    return min(n - 1, max(0, math.ceil(q * n) - 1))


def quantile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank quantile (:func:`rank`); None for no values. A value one of them had: a
    p99 TTFT is one a request waited, never a point between two. kvtax's benches (bench/)
    report theirs by this same function."""
    if not values:
        return None
    return sorted(values)[rank(len(values), q)]


def _increase(first: Point, last: Point, key: str) -> float | None:
    if key not in last.counters or key not in first.counters:
        return None
    return last.counters[key] - first.counters[key]


def engine_step(points: Sequence[Point], settings: EngineSettings) -> EngineStep:
    """The engine's figures over ``points`` (oldest first, one model)."""
    if len(points) < 2:
        return EngineStep(scrapes=len(points))
    first, last = points[0], points[-1]
    figures = derive_model(points, settings)
    usages = [p.gauges["kv_usage"] for p in points if "kv_usage" in p.gauges]
    running = [p.gauges["requests_running"] for p in points if "requests_running" in p.gauges]
    waiting = [p.gauges["requests_waiting"] for p in points if "requests_waiting" in p.gauges]
    recomputed = None
    if figures.tax is not None:
        recomputed = _increase(first, last, f"recomputed_{figures.tax.method}")
    return EngineStep(
        scrapes=len(points),
        generation_tokens=_increase(first, last, "generation_tokens"),
        prompt_tokens=_increase(first, last, "prompt_tokens"),
        preemptions=_increase(first, last, "preemptions"),
        tax=figures.tax.value if figures.tax else None,
        tax_method=figures.tax.method if figures.tax else None,
        recomputed_tokens=recomputed,
        kv_usage_mean=sum(usages) / len(usages) if usages else None,
        kv_usage_max=max(usages) if usages else None,
        running_max=max(running) if running else None,
        waiting_max=max(waiting) if waiting else None,
        thrash_state=figures.thrash_state.name.lower()
        if figures.thrash_state is not None
        else None,
        kv_capacity_tokens=figures.kv_capacity_tokens,
        recommended_max_num_seqs=figures.recommended_max_num_seqs,
    )


def measure_step(
    index: int,
    level: float,
    *,
    start: float,
    end: float,
    records: Sequence[RequestRecord],
    engine: EngineStep,
) -> StepResult:
    ok = [r for r in records if r.ok]
    met = [r for r in ok if r.slo_met]
    gaps = [g for r in ok for g in r.gaps]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    errors = sorted({r.error for r in records if r.error})
    return StepResult(
        index=index,
        level=level,
        start=start,
        end=end,
        requests=len(records),
        ok=len(ok),
        failed=len(records) - len(ok),
        delivered_tokens=sum(r.completion_tokens for r in ok),
        slo_met_requests=len(met),
        slo_tokens=sum(r.completion_tokens for r in met),
        ttft_p50=quantile(ttfts, 0.5),
        ttft_p99=quantile(ttfts, 0.99),
        itl_p50=quantile(gaps, 0.5),
        itl_p99=quantile(gaps, 0.99),
        stalls=sum(r.stalls for r in ok),
        engine=engine,
        errors=tuple(errors[:5]),
    )
