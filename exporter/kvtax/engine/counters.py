"""Reset-corrected counters: vLLM restarts must never make a rate negative or spike.

:class:`CounterTracker` turns a raw counter that may fall back to zero into a monotonic total,
the way Prometheus' ``increase()`` does: when a raw value drops, the engine restarted and the new
raw value is all the increase since the last scrape. The first value ever seen is taken as the
starting total, so kvtax's counters mirror vLLM's until vLLM restarts and stay monotonic after.

A reading that is NaN, infinite or negative is no counter value at all: it is ignored, the total
keeps its last good value, and it is not taken for a restart. One NaN would otherwise make the
total, and every rate over it, NaN for good. (normalize already drops such samples and counts
them in ``VllmSnapshot.rejected``; this is the last guard.)

Example (a restart between the two reads):

    >>> t = CounterTracker()
    >>> t.update("g", 100.0)   # the first read counts as no increase
    0.0
    >>> t.update("g", 5.0)     # lower than before: vLLM restarted and counted 5 since
    5.0
    >>> t.total("g")
    105.0
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["CounterTracker"]


@dataclass(slots=True)
class _Track:
    last_raw: float
    total: float


class CounterTracker:
    """Monotonic totals per key from raw counter readings."""

    def __init__(self) -> None:
        self._tracks: dict[str, _Track] = {}
        self.resets = 0

    def update(self, key: str, raw: float) -> float:
        """Record a raw reading and return the increase since the previous one (never < 0)."""
        if not (math.isfinite(raw) and raw >= 0):
            return 0.0
        track = self._tracks.get(key)
        if track is None:
            self._tracks[key] = _Track(raw, raw)
            return 0.0
        if raw < track.last_raw:
            self.resets += 1
            increase = raw
        else:
            increase = raw - track.last_raw
        track.last_raw = raw
        track.total += increase
        return increase

    def add(self, key: str, amount: float) -> None:
        """Grow a total kvtax computes itself (no raw counter behind it)."""
        if not (math.isfinite(amount) and amount >= 0):
            return
        track = self._tracks.get(key)
        if track is None:
            self._tracks[key] = _Track(0.0, amount)
        else:
            track.total += amount

    def total(self, key: str) -> float | None:
        track = self._tracks.get(key)
        return track.total if track is not None else None

    def totals(self) -> dict[str, float]:
        return {k: t.total for k, t in self._tracks.items()}
