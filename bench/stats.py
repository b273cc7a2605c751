"""The benches' statistics: the quantile (kvtax's own nearest-rank one, which ``kvtax loadtest``
reports by too, as a float: NaN for no values), a spread, and a bootstrap interval of the median."""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence

from kvtax.tools.loadtest.measure import quantile as _nearest_rank

__all__ = ["median_ci", "quantile", "spread"]


def quantile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile of ``values`` (a value one of them had), NaN for none."""
    found = _nearest_rank(values, q)
    return math.nan if found is None else found


def spread(values: Sequence[float]) -> tuple[float, float, float]:
    """The least, the median and the most of ``values``."""
    return min(values), statistics.median(values), max(values)


def median_ci(values: Sequence[float], draws: int = 2000) -> tuple[float, float]:
    """A 95 % bootstrap interval of the median (seeded: the same data give the same interval)."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    return medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]
