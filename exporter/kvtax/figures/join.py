"""The join: vLLM's engine counters against the delivery ledger, per model, over a window.

At every scrape of vLLM the sidecar hands :meth:`JoinHistory.observe` the engine totals it just
folded, vLLM's count of completion and chat requests served (``http_requests_total``; the only
vLLM series that counts aborted requests too), and the ledger's totals. Pairing them at the same
instant keeps the window's numerator and denominator aligned. :func:`derive_join` then gives
goodput, SLO goodput, undelivered tokens, delivery yield, join coverage, the waste ratio per
recompute method, and the stall-based recompute estimate (method ``stall_estimated``): the
preemptions vLLM counted times the mean context at the stalls the proxy saw. Pure: no I/O.

Example::

    join = JoinHistory(window_seconds=300)
    join.observe(t, {"m": engine_totals}, served_requests=1042.0, ledger=ledger.totals())
    figures = join.figures()["m"]
    figures.goodput, figures.coverage
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from kvtax.delivery.ledger import OTHER, LedgerTotals
from kvtax.engine.counters import CounterTracker
from kvtax.expose.report import Sample
from kvtax.figures.derive import tax_ratio

__all__ = ["SERVED_HANDLERS", "JoinFigures", "JoinHistory", "JoinPoint", "join_samples"]

# The vLLM handlers the proxy accounts for; vLLM's http_requests_total is split by handler.
SERVED_HANDLERS = ("/v1/completions", "/v1/chat/completions")
# Coverage at or above this counts as "the ledger saw everything": then U = G - D exactly.
FULL_COVERAGE = 0.999
_METHODS = (("measured", "recomputed_measured"), ("estimated", "recomputed_estimated"))


@dataclass(frozen=True, slots=True)
class JoinPoint:
    """One model at one scrape: engine totals, ledger totals, and server-wide request counts."""

    t: float
    engine: Mapping[str, float]
    ledger: LedgerTotals
    served_requests: float | None
    joined_requests: float
    stall_recomputed: float | None


@dataclass(frozen=True, slots=True)
class JoinFigures:
    """One model's joined numbers over the window. ``None`` means not knowable (yet)."""

    window_seconds: float = 0.0
    goodput: float | None = None
    slo_goodput_tokens: float | None = None
    slo_goodput_requests: float | None = None
    undelivered_rate: float | None = None
    delivery_yield: float | None = None
    coverage: float | None = None
    waste: Mapping[str, float] = field(default_factory=dict)
    stall_tax: float | None = None
    stall_recompute_rate: float | None = None
    stall_recomputed_total: float | None = None
    served_requests_total: float | None = None


class _ModelJoin:
    def __init__(self, maxlen: int) -> None:
        self.points: deque[JoinPoint] = deque(maxlen=maxlen)
        self.stall_total: float | None = None
        self.pending_preemptions = 0.0
        self.last_preemptions: float | None = None


class JoinHistory:
    """Aligned points per model over the window; see the module docstring."""

    def __init__(self, window_seconds: float, max_points: int = 4096, max_models: int = 64) -> None:
        self.window_seconds = window_seconds
        self._max_points = max_points
        # Models present in a scrape are never dropped (the engine history and the ledger bound
        # them); this caps how many absent ones are kept for the rest of their window.
        self._max_models = max_models
        self._models: dict[str, _ModelJoin] = {}
        self._served = CounterTracker()

    def observe(
        self,
        t: float,
        engine: Mapping[str, Mapping[str, float]],
        served_requests: float | None,
        ledger: Mapping[str, LedgerTotals],
    ) -> None:
        """Fold one scrape. ``served_requests`` is vLLM's raw (not reset-corrected) count."""
        served: float | None = None
        if served_requests is not None:
            self._served.update("served", served_requests)
            served = self._served.total("served")
        # Coverage is server-wide: vLLM's HTTP counter has no model label. Requests the ledger
        # could not attribute (label "other") still reached vLLM and count here.
        joined = sum(totals.joined_requests for totals in ledger.values())
        for model in sorted(set(engine) | (set(ledger) - {OTHER})):
            state = self._models.get(model)
            if state is None:
                state = self._models[model] = _ModelJoin(self._max_points)
            totals = engine.get(model, {})
            ledger_totals = ledger.get(model, LedgerTotals())
            self._fold_stalls(state, totals, ledger_totals)
            state.points.append(
                JoinPoint(t, dict(totals), ledger_totals, served, joined, state.stall_total)
            )
            horizon = t - self.window_seconds
            while len(state.points) >= 2 and state.points[1].t <= horizon:
                state.points.popleft()
        self._forget_absent(t)

    def _forget_absent(self, t: float) -> None:
        """Drop models absent from this scrape (engine and ledger) for a window, or, oldest
        first, beyond ``max_models``: rotating model names must not pile up here."""
        absent = sorted((s.points[-1].t, m) for m, s in self._models.items() if s.points[-1].t < t)
        for last, model in absent:
            if t - last > self.window_seconds or len(self._models) > self._max_models:
                del self._models[model]

    @staticmethod
    def _fold_stalls(state: _ModelJoin, engine: Mapping[str, float], ledger: LedgerTotals) -> None:
        """Grow the stall-based recompute estimate: new preemptions x mean stall context."""
        preemptions = engine.get("preemptions")
        if preemptions is None:
            return
        if state.last_preemptions is None:
            # The ledger starts at zero with kvtax; preemptions before it saw anything are not
            # attributable to stalls it measured.
            state.last_preemptions = preemptions
            state.stall_total = 0.0
            return
        state.pending_preemptions += max(0.0, preemptions - state.last_preemptions)
        state.last_preemptions = preemptions
        if ledger.stalls > 0:
            mean_context = ledger.stall_context / ledger.stalls
            state.stall_total = (
                state.stall_total or 0.0
            ) + state.pending_preemptions * mean_context
            state.pending_preemptions = 0.0

    def models(self) -> list[str]:
        return sorted(self._models)

    def figures(self) -> dict[str, JoinFigures]:
        return {model: derive_join(tuple(s.points)) for model, s in self._models.items()}


def _inc(first: Mapping[str, float], last: Mapping[str, float], key: str) -> float | None:
    if key not in last:
        return None
    return last[key] - first.get(key, last[key])


def derive_join(points: tuple[JoinPoint, ...]) -> JoinFigures:
    """Window figures from aligned points (oldest first)."""
    if not points:
        return JoinFigures()
    first, last = points[0], points[-1]
    span = last.t - first.t
    delivered = last.ledger.delivered - first.ledger.delivered
    generated = _inc(first.engine, last.engine, "generation_tokens")
    computed = _inc(first.engine, last.engine, "prompt_computed") or 0.0

    coverage: float | None = None
    if first.served_requests is not None and last.served_requests is not None:
        served = last.served_requests - first.served_requests
        joined = last.joined_requests - first.joined_requests
        if served > 0:
            # The ledger settles a request when its response ends, vLLM's counter a moment
            # earlier or later; a small excess is timing skew, not more traffic than vLLM saw.
            coverage = min(1.0, joined / served)

    if generated is not None and coverage is not None and coverage >= FULL_COVERAGE:
        undelivered = max(0.0, generated - delivered)
    else:
        # The join does not cover all traffic: only the ledger's own count is known.
        undelivered = last.ledger.undelivered - first.ledger.undelivered

    recomputed: dict[str, float] = {}
    for method, key in _METHODS:
        inc = _inc(first.engine, last.engine, key)
        if inc is not None:
            recomputed[method] = inc
    stall_inc: float | None = None
    if first.stall_recomputed is not None and last.stall_recomputed is not None:
        stall_inc = last.stall_recomputed - first.stall_recomputed
        recomputed["stall_estimated"] = stall_inc

    waste: dict[str, float] = {}
    if generated is not None:
        for method, r in recomputed.items():
            work = computed + generated + r
            waste[method] = (r + undelivered) / work if work > 0 else 0.0

    def per_second(value: float) -> float | None:
        return value / span if span > 0 else None

    return JoinFigures(
        window_seconds=span,
        goodput=per_second(delivered),
        slo_goodput_tokens=per_second(last.ledger.slo_met_tokens - first.ledger.slo_met_tokens),
        slo_goodput_requests=per_second(
            last.ledger.slo_met_requests - first.ledger.slo_met_requests
        ),
        undelivered_rate=per_second(undelivered),
        delivery_yield=delivered / generated if generated else None,
        coverage=coverage,
        waste=waste,
        stall_tax=(
            tax_ratio(stall_inc, computed, generated or 0.0) if stall_inc is not None else None
        ),
        stall_recompute_rate=per_second(stall_inc) if stall_inc is not None else None,
        stall_recomputed_total=last.stall_recomputed,
        served_requests_total=last.served_requests,
    )


def join_samples(figures: Mapping[str, JoinFigures]) -> Iterator[Sample]:
    """The join's figures as catalog samples; unknown figures produce no sample."""
    for model, f in sorted(figures.items()):
        m = (model,)
        gauges = (
            ("kvtax_goodput_tokens_per_second", f.goodput),
            ("kvtax_slo_goodput_tokens_per_second", f.slo_goodput_tokens),
            ("kvtax_slo_goodput_requests_per_second", f.slo_goodput_requests),
            ("kvtax_undelivered_tokens_per_second", f.undelivered_rate),
            ("kvtax_delivery_yield_ratio", f.delivery_yield),
            ("kvtax_join_coverage_ratio", f.coverage),
            ("kvtax_engine_api_requests_total", f.served_requests_total),
        )
        for metric, value in gauges:
            if value is not None:
                yield Sample(metric, m, value)
        for method, value in sorted(f.waste.items()):
            yield Sample("kvtax_waste_ratio", (model, method), value)
        if f.stall_recomputed_total is not None:
            yield Sample(
                "kvtax_recomputed_tokens_total",
                (model, "stall_estimated"),
                f.stall_recomputed_total,
            )
        if f.stall_recompute_rate is not None:
            yield Sample(
                "kvtax_recomputed_tokens_per_second",
                (model, "stall_estimated"),
                f.stall_recompute_rate,
            )
        if f.stall_tax is not None:
            yield Sample("kvtax_preemption_tax_ratio", (model, "stall_estimated"), f.stall_tax)
