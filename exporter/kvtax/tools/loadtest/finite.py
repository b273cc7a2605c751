"""A load-test report's number, or nothing: the one reading every report reader shares.

guidellm, AIPerf and ``vllm bench serve`` all write JSON, where a measurement can come as NaN,
an infinity, an integer past a float's range, a bool or a string. None of those is a
measurement, and the readers treat them as absent rather than carry them into arithmetic.

Example::

    >>> finite(2.5), finite(float("nan")), finite(True), finite(10**400)
    (2.5, None, None, None)
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["finite"]


def finite(value: Any) -> float | None:
    """``value`` as a float when it is a finite JSON number, else None."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None
