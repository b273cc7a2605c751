"""A run's engine history as scrapes in time order, and the slice of it one step spans. Pure.

A *recording* is what ``kvtax annotate --record`` writes: JSON lines ``{"t": unix seconds,
"page": metrics text}``, each page cut to the series kvtax reads (:func:`keep_known`). A
:class:`Timeline` folds the scrapes into one :class:`~kvtax.figures.window.Window`, so a step's
tax, KV usage and thrash state come from :func:`kvtax.figures.derive.derive_model` like the
dashboards'.

A step from ``start`` to ``end`` spans the last scrape at or before ``start`` through the first
at or after ``end``: every counter increase inside the step is in that slice, and only the
increases of the scrape intervals that straddle its edges can be more.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvtax.engine.normalize import ParseError, normalize
from kvtax.engine.vocabulary import concept_for
from kvtax.errors import InputError
from kvtax.figures.window import Point, Window

__all__ = ["Scrape", "Timeline", "keep_known"]


@dataclass(frozen=True, slots=True)
class Scrape:
    t: float
    page: str


def keep_known(page: str) -> str:
    """The page without the series no vocabulary concept reads (comments kept): a recording
    of a vLLM page shrinks about tenfold and still normalizes to the same snapshot."""
    kept = []
    for line in page.splitlines():
        if not line or line.startswith("#"):
            if line.startswith(("# TYPE vllm", "# HELP vllm")):
                kept.append(line)
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if concept_for(name) is not None:
            kept.append(line)
    return "\n".join(kept) + "\n"


class Timeline:
    """Scrapes of one server in time order, folded into one window per model."""

    def __init__(self, scrapes: Iterable[Scrape], *, field: str) -> None:
        self.window = Window(window_seconds=float("inf"), max_points=10_000_000)
        count = 0
        last = float("-inf")
        for i, scrape in enumerate(sorted(scrapes, key=lambda s: s.t)):
            try:
                snap = normalize(scrape.page, timestamp=scrape.t)
            except ParseError as exc:
                raise InputError(f"{field}[{i}].page", f"not a metrics page: {exc}") from None
            self.window.observe(snap)
            count += 1
            last = scrape.t
        if count < 2:
            raise InputError(field, f"holds {count} scrape(s); at least 2 are needed")
        self.scrapes = count
        self.end = last

    def models(self) -> list[str]:
        return [m for m in self.window.models() if m]

    def span(self, model: str, start: float, end: float) -> Sequence[Point]:
        """The points from the last at or before ``start`` to the first at or after ``end``;
        empty when the timeline does not cover the whole span."""
        points = self.window.points(model)
        times = [p.t for p in points]
        lo = bisect.bisect_right(times, start) - 1
        hi = bisect.bisect_left(times, end)
        if lo < 0 or hi >= len(points):
            return ()
        return points[lo : hi + 1]
