"""The benches' quantile: kvtax's own nearest-rank one (``kvtax loadtest`` reports by it too),
as a float, NaN for no values, for figures that are formatted or subtracted at once."""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvtax.tools.loadtest.measure import quantile as _nearest_rank

__all__ = ["quantile"]


def quantile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile of ``values`` (a value one of them had), NaN for none."""
    found = _nearest_rank(values, q)
    return math.nan if found is None else found
