"""The window: per model, one history of points pairing the engine's totals with the ledger's.

:class:`Window` is the only state between a scrape and the derived numbers. Each
:meth:`Window.observe` takes one normalized scrape of vLLM and the delivery ledger's totals read
as the page arrived, and appends to every model's deque one :class:`Point` that carries both: the
engine's reset-corrected totals, gauges, histograms and cache info, the ledger's totals, vLLM's
server-wide count of requests served, the ledger's joined requests read on either side of the
page, and the recompute totals (the formulas are in :mod:`kvtax.figures.recompute`). Pairing
them at one scrape keeps a window's numerator and denominator aligned, and kvtax publishes the
ledger's half of the last point beside the engine's (``kvtax_join_*_tokens_total``) so that
Prometheus can pair them too. :mod:`kvtax.figures.derive` reads the points as plain values. No I/O.

Models come from vLLM's page, so they are bounded here: at most ``max_models`` are tracked.
Models already tracked keep their place; a new one takes a free place, else the place of the
model gone from the page longest, else it is dropped for this scrape and counted in
``dropped_models``. A model the ledger counts but the page lacks (a served alias) takes a free
place only. A model gone from the page and the ledger for longer than the window is forgotten,
so its series leave kvtax's output; one gone from the page only keeps its ledger figures and, a
window later, loses its engine ones. :func:`candidates` applies the same rule early, in the
parse worker, so that a page of thousands of models never crosses to the sidecar.

Example::

    window = Window(window_seconds=300)
    window.observe(snapshot, ledger.totals())
    points = window.points("tiny-llama")
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace

from kvtax.delivery.dialects import HANDLERS
from kvtax.delivery.ledger import OTHER, LedgerTotals
from kvtax.engine.counters import CounterTracker
from kvtax.engine.snapshot import Histogram, ModelMetrics, VllmSnapshot
from kvtax.figures import recompute

__all__ = [
    "DEFAULT_MAX_MODELS",
    "SERVED_HANDLERS",
    "WINDOW_HISTOGRAMS",
    "Point",
    "Window",
    "candidates",
    "delivered_at_page",
    "served_requests",
]

# A vLLM server serves one model name, or a handful; a page with more is hostile or broken.
DEFAULT_MAX_MODELS = 32
# Counter concepts whose reset-corrected totals kvtax keeps (and republishes). The plugin's hits
# of resumed requests, and the part a KV connector loaded, are the recompute avoided.
TRACKED = (
    "generation_tokens",
    "prompt_tokens",
    "preemptions",
    "recomputed_tokens",
    "preempted_hit_tokens",
    "preempted_connector_hit_tokens",
)
# The histograms derive reads over a window: the request lengths behind the p50/p95.
WINDOW_HISTOGRAMS = ("request_prompt_tokens", "request_generation_tokens")
_GAUGES = (
    "kv_usage",
    "requests_running",
    "requests_waiting",
    "v0_prompt_throughput",
    "v0_generation_throughput",
)
# The vLLM handlers the proxy accounts for, every generation API's routes (its dialects');
# vLLM's http_requests_total is split by handler.
SERVED_HANDLERS = HANDLERS


@dataclass(frozen=True, slots=True)
class Point:
    """One model at one scrape: engine totals and gauges, ledger totals, server-wide counts.

    ``counters`` holds reset-corrected totals: the tracked vLLM counters plus ``prompt_computed``
    and the ``recomputed_*`` total of each method whose source exists (see
    :data:`kvtax.figures.recompute.METHODS`). The engine fields are empty when the page lacks
    the model. ``ledger`` is the model's ledger totals (``booked``: the ledger has counted the
    model), read as close after vLLM's page as the scrape could. ``served_requests`` (vLLM) and
    the two ledger counts of joined requests are server-wide, as vLLM's HTTP counter has no model
    label. The ledger cannot be read at the instant vLLM wrote its page, so it is read on both
    sides of it: ``joined_before`` just before the page was fetched, ``joined_requests`` after
    it was parsed. A request settled between the two can sit on either side of vLLM's count.
    """

    t: float
    counters: Mapping[str, float] = field(default_factory=dict)
    gauges: Mapping[str, float] = field(default_factory=dict)
    histograms: Mapping[str, Histogram] = field(default_factory=dict)
    info: Mapping[str, str] = field(default_factory=dict)
    ledger: LedgerTotals = field(default_factory=LedgerTotals)
    booked: bool = False
    served_requests: float | None = None
    joined_requests: float = 0.0
    # None: read at the same instant as joined_requests.
    joined_before: float | None = None
    # The ledger's delivered tokens as of vLLM's page (delivered_at_page): what kvtax publishes
    # beside the engine's counters. None: ledger.delivered, read as the page arrived.
    delivered_at_page: float | None = None

    @property
    def delivered_paired(self) -> float:
        """Delivered tokens to divide by the engine's: as of the page where known."""
        return self.ledger.delivered if self.delivered_at_page is None else self.delivered_at_page


def delivered_at_page(
    previous: float | None, generated: float | None, before: float | None, arrived: float
) -> float:
    """The ledger's delivered tokens as of vLLM's page, from its reads on either side of it.

    The count at the page's render lies between ``before`` (read as the fetch began) and
    ``arrived`` (read once the page was in). A starved sidecar, woken after vLLM rendered the
    page, relays the tokens vLLM generated meanwhile before it gets to read the ledger, so
    ``arrived`` can lead the page by seconds of tokens; a short window whose base point carries
    that lead reads a yield below 1 for nothing (the calm pod of the fleet test, at a load's
    end). A token is generated before it is delivered, so the count can have grown since the
    last point (``previous``) by about what vLLM generated in between (``generated``, the
    reset-corrected increase): the estimate is that, kept inside the bracket. Tokens still in
    flight at the last page are the "about": the floor ``before`` takes them in at the next
    scrape. A real shortfall (clients gone, traffic around the proxy) is never hidden: the
    estimate never exceeds ``arrived``. Without a previous point or the engine's increase it is
    ``arrived``.

    >>> delivered_at_page(100.0, 50.0, before=120.0, arrived=190.0)  # 40 tokens led the page
    150.0
    >>> delivered_at_page(100.0, 50.0, before=110.0, arrived=130.0)  # 20 never delivered
    130.0
    """
    if previous is None or generated is None:
        return arrived
    floor = arrived if before is None else min(before, arrived)
    return min(arrived, max(floor, previous + generated))


def served_requests(snap: VllmSnapshot) -> float:
    """vLLM's count of completion and chat requests, from its server-wide HTTP counter.

    A server that has answered nothing yet exposes the family without samples: that is 0.
    """
    for metrics in snap.models.values():
        by_handler = metrics.split.get("http_requests")
        if by_handler is not None:
            return sum(by_handler.get(h, 0.0) for h in SERVED_HANDLERS)
    return 0.0


def candidates(snap: VllmSnapshot, tracked: Collection[str], limit: int) -> VllmSnapshot:
    """The page's models that :meth:`Window.observe` could track, the others left out.

    Those are the tracked models on the page, and the first new names in sorted order for the
    places left: the same choice ``observe`` makes. ``models_on_page`` keeps the drop count
    right. Pure, so the parse worker can apply it to a page of any size.
    """
    page = snap.models
    present = [model for model in page if model in tracked]
    room = max(0, limit - len(present))
    new = sorted(model for model in page if model not in tracked)[:room]
    if len(present) + len(new) == len(page):
        return snap
    kept = {model: page[model] for model in (*present, *new)}
    return replace(snap, models=kept, models_on_page=len(page))


class _ModelState:
    """One model's deque, its totals, and the preemptions not yet turned into recompute."""

    def __init__(self, maxlen: int, now: float, *, on_page: bool) -> None:
        self.tracker = CounterTracker()
        self.points: deque[Point] = deque(maxlen=maxlen)
        self.pending_estimated = 0.0
        self.pending_stall = 0.0
        self.last_on_page = now if on_page else float("-inf")
        self.last_present = now


class Window:
    """Per-model points of the last window; see the module docstring."""

    def __init__(
        self, window_seconds: float, max_points: int = 4096, max_models: int = DEFAULT_MAX_MODELS
    ) -> None:
        self.window_seconds = window_seconds
        self._max_points = max_points
        self._max_models = max_models
        self._models: dict[str, _ModelState] = {}
        self._served = CounterTracker()
        self.restarts = 0
        # Models left out of scrapes for want of a place, summed over scrapes.
        self.dropped_models = 0

    @property
    def max_models(self) -> int:
        return self._max_models

    def models(self) -> list[str]:
        return sorted(self._models)

    def points(self, model: str) -> tuple[Point, ...]:
        state = self._models.get(model)
        return tuple(state.points) if state else ()

    def observe(
        self,
        snap: VllmSnapshot,
        ledger: Mapping[str, LedgerTotals] | None = None,
        *,
        joined_before: float | None = None,
        joined_after: float | None = None,
        before: Mapping[str, LedgerTotals] | None = None,
    ) -> VllmSnapshot:
        """Fold one scrape and the ledger's totals; returns the snapshot cut to tracked models.

        ``joined_before`` and ``joined_after`` are the ledger's joined requests, every label
        together, read just before vLLM's page was fetched and after it was parsed (see
        :class:`Point`); each defaults to the count in ``ledger``. ``before`` is the ledger's
        totals read just before the fetch, the floor of :func:`delivered_at_page`.
        """
        books = {label: t for label, t in (ledger or {}).items() if label != OTHER}
        self._served.update("served", served_requests(snap))
        served = self._served.total("served")
        # Requests the ledger could not attribute (label "other") still reached vLLM.
        read = sum(t.joined_requests for t in (ledger or {}).values())
        after = read if joined_after is None else max(read, joined_after)
        joined = read if joined_before is None else min(read, joined_before)
        kept = self._admit(snap, books)
        restarted = False
        for model, state in self._models.items():
            metrics = snap.models.get(model) if model in kept else None
            if metrics is None and model not in books:
                continue
            state.last_present = snap.timestamp
            booked = model in books
            book = books[model] if booked else LedgerTotals()
            previous = state.points[-1] if state.points else None
            resets_before = state.tracker.resets
            engine = self._engine_part(state, metrics, snap, book)
            restarted |= state.tracker.resets > resets_before
            point = replace(
                engine,
                ledger=book,
                booked=booked,
                served_requests=served,
                joined_requests=after,
                joined_before=joined,
                delivered_at_page=_paired(
                    previous, engine if metrics is not None else None, before, model, book
                ),
            )
            state.points.append(point)
            horizon = snap.timestamp - self.window_seconds
            # Keep one point at or before the window's start so a full-window rate is possible.
            while len(state.points) >= 2 and state.points[1].t <= horizon:
                state.points.popleft()
        if restarted:
            self.restarts += 1
        if len(kept) == len(snap.models):
            return snap
        return replace(snap, models={model: snap.models[model] for model in kept})

    def _admit(self, snap: VllmSnapshot, books: Mapping[str, LedgerTotals]) -> list[str]:
        """Forget models gone for a window, then find a place for the page's models."""
        now, page = snap.timestamp, snap.models
        for model, state in list(self._models.items()):
            gone = model not in page and model not in books
            if gone and now - state.last_present > self.window_seconds:
                del self._models[model]
        kept = [model for model in page if model in self._models]
        for model in sorted(model for model in page if model not in self._models):
            if len(self._models) >= self._max_models and not self._evict_absent(page):
                break
            self._models[model] = _ModelState(self._max_points, now, on_page=True)
            kept.append(model)
        on_page = snap.models_on_page if snap.models_on_page is not None else len(page)
        self.dropped_models += on_page - len(kept)
        for model in sorted(model for model in books if model not in self._models):
            if len(self._models) >= self._max_models:
                break
            self._models[model] = _ModelState(self._max_points, now, on_page=False)
        return kept

    def _evict_absent(self, page: Mapping[str, ModelMetrics]) -> bool:
        """Free the place of the model gone from the page longest, if any is gone."""
        absent = [(s.last_on_page, m) for m, s in self._models.items() if m not in page]
        if not absent:
            return False
        del self._models[min(absent)[1]]
        return True

    def _engine_part(
        self, state: _ModelState, m: ModelMetrics | None, snap: VllmSnapshot, ledger: LedgerTotals
    ) -> Point:
        """The engine half of this scrape's point (the ledger half is added by the caller)."""
        prev = state.points[-1] if state.points else None
        if m is None:
            # Off the page: the last engine values stand for a window, then the model's engine
            # series leave the output while its ledger figures go on.
            recent = snap.timestamp - state.last_on_page <= self.window_seconds
            if prev is None or not recent:
                return Point(snap.timestamp)
            return replace(prev, t=snap.timestamp)
        state.last_on_page = snap.timestamp
        deltas = _fold_counters(state, m, snap.is_v0)
        _fold_recompute(state, m, snap.is_v0, deltas, ledger)
        # Points are kept for a whole window per model, so keep them lean: only the histograms
        # derive reads, and the previous point's objects when nothing changed (all of vLLM's
        # histograms made ~0.5 MB per scrape at 30 models, and the RSS target is 80 MB).
        histograms: dict[str, Histogram] = {}
        for name in WINDOW_HISTOGRAMS:
            h = m.histograms.get(name)
            if h is not None:
                old = prev.histograms.get(name) if prev is not None else None
                histograms[name] = old if old is not None and old == h else h
        info = prev.info if prev is not None and prev.info == m.info else dict(m.info)
        gauges = {name: m.values[name] for name in _GAUGES if name in m.values}
        return Point(snap.timestamp, state.tracker.totals(), gauges, histograms, info)


def _paired(
    previous: Point | None,
    engine: Point | None,
    before: Mapping[str, LedgerTotals] | None,
    model: str,
    arrived: LedgerTotals,
) -> float:
    """:func:`delivered_at_page` for one model's new point: ``engine`` is its engine half (None
    when the page lacked the model), ``before`` and ``arrived`` the ledger's reads on either
    side of the page (``before`` None when there was no read before the fetch)."""
    generated = None
    if previous is not None and engine is not None:
        old = previous.counters.get("generation_tokens")
        new = engine.counters.get("generation_tokens")
        if old is not None and new is not None:
            generated = max(0.0, new - old)  # reset-corrected totals
    floor = (before or {}).get(model)
    return delivered_at_page(
        None if previous is None else previous.delivered_paired,
        generated,
        None if floor is None else floor.delivered,
        arrived.delivered,
    )


def _fold_counters(state: _ModelState, m: ModelMetrics, v0: bool) -> dict[str, float]:
    """Grow the tracked totals; returns each one's increase at this scrape."""
    deltas = {c: state.tracker.update(c, m.values[c]) for c in TRACKED if c in m.values}
    latency = m.histograms.get("e2e_latency")
    if latency is not None:
        # vLLM's request latency, sum and count: the gate's service time before it has its own
        # (kvtax.gate.signals).
        state.tracker.update("e2e_latency_sum", latency.sum)
        state.tracker.update("e2e_latency_count", latency.count)
    refused = m.split.get("admission_rejections")
    if refused is not None:
        # Requests vLLM's own queue caps refused (0.32+): the gate keeps its cap below them.
        state.tracker.update("admission_rejections", sum(refused.values()))
    computed = recompute.computed_prompt_raw(m, v0=v0)
    if computed is not None:
        state.tracker.update("prompt_computed", computed)
    return deltas


def _fold_recompute(
    state: _ModelState,
    m: ModelMetrics,
    v0: bool,
    deltas: Mapping[str, float],
    ledger: LedgerTotals,
) -> None:
    """Grow the recompute total of each method whose source this scrape has."""
    tracker = state.tracker
    if v0 and "prompt_tokens" in m.values and "request_prompt_tokens" in m.histograms:
        request_sum = m.histograms["request_prompt_tokens"].sum
        sum_delta = tracker.update("v0_request_prompt_sum", request_sum)
        excess = recompute.v0_recompute(deltas.get("prompt_tokens", 0.0), sum_delta)
        tracker.add("recomputed_measured", excess)
    elif "recomputed_tokens" in m.values:
        # Mirror vLLM's lifetime from the first scrape, like the other totals, so the measured
        # total equals the plugin's counter rather than starting at zero.
        first = tracker.total("recomputed_measured") is None
        tracker.add(
            "recomputed_measured",
            m.values["recomputed_tokens"] if first else deltas.get("recomputed_tokens", 0.0),
        )
    if "preemptions" not in m.values:
        return
    if tracker.total("recomputed_estimated") is None:
        # The estimate mirrors vLLM's lifetime from the first scrape too. The stall estimate
        # cannot: the ledger starts at zero with kvtax, so earlier preemptions are not
        # attributable to stalls it measured.
        state.pending_estimated += m.values["preemptions"]
        tracker.add("recomputed_estimated", 0.0)
        tracker.add("recomputed_stall_estimated", 0.0)
    else:
        state.pending_estimated += deltas.get("preemptions", 0.0)
        state.pending_stall += deltas.get("preemptions", 0.0)
    # Preemptions wait while a context is unknown, then count at the first one known.
    estimated = recompute.estimated_recompute(
        state.pending_estimated, recompute.mean_context(m.histograms)
    )
    if estimated is not None:
        tracker.add("recomputed_estimated", estimated)
        state.pending_estimated = 0.0
    stall = recompute.estimated_recompute(state.pending_stall, recompute.stall_mean_context(ledger))
    if stall is not None:
        tracker.add("recomputed_stall_estimated", stall)
        state.pending_stall = 0.0
