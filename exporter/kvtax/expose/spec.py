"""The shape of one published metric, shared by the catalog's tables."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["M", "MetricSpec", "MetricType"]

MetricType = Literal["counter", "gauge", "histogram", "info"]

M = "model_name"


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One published metric. ``name`` is the full exposed name (counters end in ``_total``)."""

    name: str
    type: MetricType
    help: str
    labels: tuple[str, ...] = ()
    group: str = "engine"

    @property
    def family_name(self) -> str:
        """The name prometheus-client families expect: counters without ``_total``."""
        if self.type == "counter":
            return self.name.removesuffix("_total")
        if self.type == "info":
            return self.name.removesuffix("_info")
        return self.name
