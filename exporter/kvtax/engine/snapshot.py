"""Value types for one normalized scrape of vLLM: what every later stage reads.

A :class:`VllmSnapshot` holds, per ``model_name``, the canonical concepts of
:mod:`kvtax.engine.vocabulary` with engines already combined. It is immutable and carries no I/O, so
the join and derive code can be tested on captured text alone.

Example (a snapshot, as :func:`kvtax.engine.normalize.normalize` makes one from a page):

    >>> from kvtax.engine.normalize import normalize
    >>> text = 'vllm:num_preemptions_total{model_name="tiny-llama"} 4.0\\n'
    >>> snap = normalize(text, timestamp=0.0)
    >>> snap.models["tiny-llama"].values["preemptions"]
    4.0
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvtax.engine.apiservers import ApiServerReport

__all__ = ["Histogram", "ModelMetrics", "VllmSnapshot"]


@dataclass(frozen=True, slots=True)
class Histogram:
    """Cumulative buckets ``(le, count)`` sorted by ``le``, the last one ``+Inf``."""

    buckets: tuple[tuple[float, float], ...]
    sum: float
    count: float

    def minus(self, earlier: Histogram) -> Histogram:
        """The increase since ``earlier``; a reset (any count falling) yields ``self``."""
        if earlier.count > self.count or len(earlier.buckets) != len(self.buckets):
            return self
        return Histogram(
            tuple(
                (le, c - e) for (le, c), (_, e) in zip(self.buckets, earlier.buckets, strict=True)
            ),
            self.sum - earlier.sum,
            self.count - earlier.count,
        )

    def quantile(self, q: float) -> float | None:
        """Prometheus' ``histogram_quantile``: linear interpolation inside the bucket."""
        if self.count <= 0 or not self.buckets:
            return None
        rank = q * self.count
        lower_le, lower_count = 0.0, 0.0
        for le, count in self.buckets:
            if count >= rank:
                if math.isinf(le):
                    # Prometheus returns the highest finite bound when the rank lands in +Inf.
                    return lower_le
                if count == lower_count:
                    return le
                return lower_le + (le - lower_le) * (rank - lower_count) / (count - lower_count)
            lower_le, lower_count = le, count
        return lower_le

    def mean(self) -> float | None:
        return self.sum / self.count if self.count > 0 else None


@dataclass(frozen=True, slots=True)
class ModelMetrics:
    """One model's concepts. Concepts the scraped version lacks are absent, never zero."""

    values: Mapping[str, float] = field(default_factory=dict)
    split: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    histograms: Mapping[str, Histogram] = field(default_factory=dict)
    info: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class VllmSnapshot:
    """A normalized scrape.

    ``marks`` are version fingerprints seen (``"v0"``, ``"0.16+"``, ``"engine_label"``, ...);
    ``names`` records which exposed name fed each concept, for the docs and for debugging.
    ``rejected`` counts samples left out by reason (``non_finite``, ``negative``).
    ``models_on_page`` is set when models that could not be tracked were already left out
    (see :func:`kvtax.figures.window.candidates`): how many the page had.
    """

    timestamp: float
    models: Mapping[str, ModelMetrics]
    marks: frozenset[str] = frozenset()
    names: Mapping[str, str] = field(default_factory=dict)
    version: str | None = None
    rejected: Mapping[str, int] = field(default_factory=dict)
    models_on_page: int | None = None
    # How many API-server processes serve the page, as far as it tells (several: vLLM's
    # multiprocess collector, see kvtax.engine.apiservers); None when not read from a page.
    api_servers: ApiServerReport | None = None

    @property
    def is_v0(self) -> bool:
        return "v0" in self.marks
