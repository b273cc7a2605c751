"""Per-model history of scrapes: reset-corrected counters and a sliding window of points.

:class:`EngineHistory` is the only stateful piece between the scraper and the derived numbers.
Each :meth:`EngineHistory.observe` folds one :class:`~kvtax.engine.snapshot.VllmSnapshot` into
monotonic
totals (see :mod:`kvtax.engine.counters`) and appends a :class:`Point`; :mod:`kvtax.figures.derive`
then reads
the points as plain values. It does no I/O.

The ``model_name`` values come from vLLM's page, so they are bounded here: at most
``max_models`` models are tracked. Models already tracked keep their place; a new one takes a
free place, else the place of the model gone from the page longest, else it is dropped for this
scrape and counted in ``dropped_models``. A model gone from the page for longer than the window
is forgotten, so its series leave kvtax's output. :func:`candidates` applies the same rule
early, in the parse worker, so that a page of thousands of models never crosses to the sidecar.

Example::

    h = EngineHistory(window_seconds=300)
    h.observe(snapshot)
    points = h.points("tiny-llama")
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace

from kvtax.engine.counters import CounterTracker
from kvtax.engine.snapshot import Histogram, ModelMetrics, VllmSnapshot

__all__ = [
    "DEFAULT_MAX_MODELS",
    "WINDOW_HISTOGRAMS",
    "EngineHistory",
    "Point",
    "candidates",
    "computed_prompt_raw",
    "mean_context",
]

# A vLLM server serves one model name, or a handful; a page with more is hostile or broken.
DEFAULT_MAX_MODELS = 32

# Counter concepts whose reset-corrected totals kvtax keeps (and republishes).
TRACKED = (
    "generation_tokens",
    "prompt_tokens",
    "preemptions",
    "recomputed_tokens",
    "preempted_queried_tokens",
    "preempted_hit_tokens",
    "preempted_resumes",
)


# The histograms derive reads over a window: the request lengths behind the p50/p95.
WINDOW_HISTOGRAMS = ("request_prompt_tokens", "request_generation_tokens")


@dataclass(frozen=True, slots=True)
class Point:
    """One scrape of one model, as totals and gauges.

    ``counters`` holds reset-corrected totals: the tracked vLLM counters plus ``prompt_computed``,
    ``recomputed_estimated`` and (when measurable) ``recomputed_measured``. ``histograms`` holds
    only the ones derive reads over a window (:data:`WINDOW_HISTOGRAMS`); the snapshot has all.
    """

    t: float
    counters: Mapping[str, float]
    gauges: Mapping[str, float]
    histograms: Mapping[str, Histogram]
    info: Mapping[str, str]


def computed_prompt_raw(m: ModelMetrics, *, v0: bool) -> float | None:
    """Prompt tokens the engine computed, from the best source this version has."""
    if "prompt_tokens_local_compute" in m.values:
        return m.values["prompt_tokens_local_compute"]
    if "prefill_kv_computed" in m.histograms:
        return m.histograms["prefill_kv_computed"].sum
    if v0 and "request_prompt_tokens" in m.histograms:
        # V0's prompt_tokens_total also counts re-prefill; the per-request histogram does not.
        return m.histograms["request_prompt_tokens"].sum
    if "prompt_tokens" in m.values:
        return m.values["prompt_tokens"] - m.values.get("prefix_cache_hits", 0.0)
    return None


def mean_context(histograms: Mapping[str, Histogram]) -> float | None:
    """L-hat: the mean context at preemption, taken as mean prompt + half the mean generation.

    An upper bound: prefix-cache self-hits make the real re-prefill shorter.
    """
    prompt = histograms.get("request_prompt_tokens")
    gen = histograms.get("request_generation_tokens")
    p = prompt.mean() if prompt else None
    g = gen.mean() if gen else None
    if p is None or g is None:
        return None
    return p + g / 2


def candidates(snap: VllmSnapshot, tracked: Collection[str], limit: int) -> VllmSnapshot:
    """The page's models that :meth:`EngineHistory.observe` could track, the others left out.

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


class _ModelHistory:
    def __init__(self, maxlen: int, now: float) -> None:
        self.tracker = CounterTracker()
        self.points: deque[Point] = deque(maxlen=maxlen)
        self.pending_preemptions = 0.0
        self.last_seen = now


class EngineHistory:
    """Folds snapshots into per-model totals and keeps the points of the last window."""

    def __init__(
        self, window_seconds: float, max_points: int = 4096, max_models: int = DEFAULT_MAX_MODELS
    ) -> None:
        self.window_seconds = window_seconds
        self._max_points = max_points
        self._max_models = max_models
        self._models: dict[str, _ModelHistory] = {}
        self.restarts = 0
        # Models left out of scrapes for want of a place, summed over scrapes.
        self.dropped_models = 0

    def models(self) -> list[str]:
        return sorted(self._models)

    def points(self, model: str) -> tuple[Point, ...]:
        hist = self._models.get(model)
        return tuple(hist.points) if hist else ()

    def latest(self, model: str) -> Point | None:
        hist = self._models.get(model)
        return hist.points[-1] if hist and hist.points else None

    def observe(self, snap: VllmSnapshot) -> VllmSnapshot:
        """Fold one scrape; returns the snapshot restricted to the models tracked."""
        kept = self._admit(snap)
        restarted = False
        for model in kept:
            hist = self._models[model]
            hist.last_seen = snap.timestamp
            metrics = snap.models[model]
            resets_before = hist.tracker.resets
            self._fold(hist, metrics, snap)
            restarted |= hist.tracker.resets > resets_before
            self._trim(hist, snap.timestamp)
        if restarted:
            self.restarts += 1
        if len(kept) == len(snap.models):
            return snap
        return replace(snap, models={model: snap.models[model] for model in kept})

    def _admit(self, snap: VllmSnapshot) -> list[str]:
        """Forget models gone for a window, then find a place for the page's models."""
        now, page = snap.timestamp, snap.models
        for model in [m for m, h in self._models.items() if m not in page]:
            if now - self._models[model].last_seen > self.window_seconds:
                del self._models[model]
        kept = [model for model in page if model in self._models]
        for model in sorted(model for model in page if model not in self._models):
            if len(self._models) >= self._max_models and not self._evict_absent(page):
                break
            self._models[model] = _ModelHistory(self._max_points, now)
            kept.append(model)
        on_page = snap.models_on_page if snap.models_on_page is not None else len(page)
        self.dropped_models += on_page - len(kept)
        return kept

    @property
    def max_models(self) -> int:
        return self._max_models

    def _evict_absent(self, page: Mapping[str, ModelMetrics]) -> bool:
        """Free the place of the model gone from the page longest, if any is gone."""
        absent = [(h.last_seen, m) for m, h in self._models.items() if m not in page]
        if not absent:
            return False
        del self._models[min(absent)[1]]
        return True

    def _fold(self, hist: _ModelHistory, m: ModelMetrics, snap: VllmSnapshot) -> None:
        tracker = hist.tracker
        deltas: dict[str, float] = {}
        for concept in TRACKED:
            if concept in m.values:
                deltas[concept] = tracker.update(concept, m.values[concept])
        computed = computed_prompt_raw(m, v0=snap.is_v0)
        if computed is not None:
            tracker.update("prompt_computed", computed)

        if snap.is_v0 and "prompt_tokens" in m.values and "request_prompt_tokens" in m.histograms:
            # V0 counted re-prefill in prompt_tokens_total: the excess over the per-request
            # prompt histogram is exactly the recompute.
            sum_delta = tracker.update(
                "v0_request_prompt_sum", m.histograms["request_prompt_tokens"].sum
            )
            tracker.add(
                "recomputed_measured", max(0.0, deltas.get("prompt_tokens", 0.0) - sum_delta)
            )
        elif "recomputed_tokens" in m.values:
            # Mirror vLLM's lifetime from the first scrape, like the other totals, so the
            # measured total equals the plugin's counter rather than starting at zero.
            first_measured = tracker.total("recomputed_measured") is None
            tracker.add(
                "recomputed_measured",
                m.values["recomputed_tokens"]
                if first_measured
                else deltas.get("recomputed_tokens", 0.0),
            )

        if "preemptions" in m.values:
            first_seen = tracker.total("recomputed_estimated") is None
            # Like the other totals, the estimate mirrors vLLM's lifetime from the first scrape.
            hist.pending_preemptions += (
                m.values["preemptions"] if first_seen else deltas.get("preemptions", 0.0)
            )
            context = mean_context(m.histograms)
            if context is not None:
                tracker.add("recomputed_estimated", hist.pending_preemptions * context)
                hist.pending_preemptions = 0.0
            elif tracker.total("recomputed_estimated") is None:
                tracker.add("recomputed_estimated", 0.0)

        gauges = {
            name: m.values[name]
            for name in (
                "kv_usage",
                "requests_running",
                "requests_waiting",
                "v0_prompt_throughput",
                "v0_generation_throughput",
            )
            if name in m.values
        }
        # Points are kept for a whole window per model, so keep them lean: only the histograms
        # derive reads, and the previous point's objects when nothing changed (all of vLLM's
        # histograms made ~0.5 MB per scrape at 30 models, and the RSS target is 80 MB).
        prev = hist.points[-1] if hist.points else None
        histograms: dict[str, Histogram] = {}
        for name in WINDOW_HISTOGRAMS:
            h = m.histograms.get(name)
            if h is not None:
                old = prev.histograms.get(name) if prev is not None else None
                histograms[name] = old if old == h and old is not None else h
        info = prev.info if prev is not None and prev.info == m.info else dict(m.info)
        hist.points.append(Point(snap.timestamp, tracker.totals(), gauges, histograms, info))

    def _trim(self, hist: _ModelHistory, now: float) -> None:
        # Keep one point at or before the window's start so a full-window rate is possible.
        horizon = now - self.window_seconds
        while len(hist.points) >= 2 and hist.points[1].t <= horizon:
            hist.points.popleft()
