"""What kvtax publishes at one instant: plain samples keyed by catalog names.

Every producer (engine figures, the delivery ledger, the join, the sidecar's own health) turns its
state into :class:`Sample` and :class:`HistogramSample` values; the exposition layer only renders
them. Label values are given in the catalog's label order.

Example:

    >>> Sample("kvtax_preemption_tax_ratio", ("tiny-llama", "measured"), 0.36).labels
    ('tiny-llama', 'measured')
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["HistogramSample", "Sample"]


@dataclass(frozen=True, slots=True)
class Sample:
    metric: str
    labels: tuple[str, ...]
    value: float


@dataclass(frozen=True, slots=True)
class HistogramSample:
    """Cumulative buckets ``(le, count)`` ending with ``+Inf``, and the sum of observations."""

    metric: str
    labels: tuple[str, ...]
    buckets: tuple[tuple[float, float], ...]
    sum: float
