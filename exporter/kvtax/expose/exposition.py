"""Render report samples as Prometheus families at scrape time.

:class:`ReportCollector` is a prometheus-client custom collector: on each scrape it asks a
callable for fresh samples and builds families from the catalog, so the exposed names, types and
help text can only come from :mod:`kvtax.expose.catalog`. Families with no samples are still
described
for counters with fixed label sets created up front (e.g. scrape errors by reason).

Example:

    >>> from prometheus_client import CollectorRegistry, generate_latest
    >>> registry = CollectorRegistry()
    >>> registry.register(ReportCollector(lambda: [Sample("kvtax_vllm_up", (), 1.0)]))
    >>> print(generate_latest(registry).decode().splitlines()[-1])
    kvtax_vllm_up 1.0
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
)
from prometheus_client.registry import Collector

from kvtax.expose.catalog import METRICS, MetricSpec
from kvtax.expose.samples import HistogramSample, Sample

__all__ = ["ReportCollector", "build_families"]

Producer = Callable[[], Iterable[Sample | HistogramSample]]


def _family(spec: MetricSpec) -> Any:
    labels = list(spec.labels)
    if spec.type == "counter":
        return CounterMetricFamily(spec.family_name, spec.help, labels=labels)
    if spec.type == "gauge":
        return GaugeMetricFamily(spec.family_name, spec.help, labels=labels)
    if spec.type == "histogram":
        return HistogramMetricFamily(spec.family_name, spec.help, labels=labels)
    return InfoMetricFamily(spec.family_name, spec.help, labels=[])


def build_families(samples: Iterable[Sample | HistogramSample]) -> list[Any]:
    """Group samples into families in catalog order. Unknown names are a programming error."""
    families: dict[str, Any] = {}
    for s in samples:
        spec = METRICS.get(s.metric)
        if spec is None:
            raise KeyError(f"{s.metric} is not in kvtax.expose.catalog")
        if len(s.labels) != len(spec.labels):
            raise ValueError(f"{s.metric} wants labels {spec.labels}, got {s.labels}")
        family = families.get(s.metric)
        if family is None:
            family = families[s.metric] = _family(spec)
        if isinstance(s, HistogramSample):
            buckets = [(_le(le), count) for le, count in s.buckets]
            family.add_metric(list(s.labels), buckets, s.sum)
        elif spec.type == "info":
            family.add_metric([], dict(zip(spec.labels, s.labels, strict=True)))
        else:
            family.add_metric(list(s.labels), s.value)
    order = {name: i for i, name in enumerate(METRICS)}
    return [families[name] for name in sorted(families, key=order.__getitem__)]


def _le(le: float) -> str:
    return "+Inf" if le == float("inf") else repr(float(le))


class ReportCollector(Collector):
    """Builds kvtax's families from a fresh report on every scrape."""

    def __init__(self, producer: Producer) -> None:
        self._producer = producer

    def collect(self) -> Iterator[Any]:
        yield from build_families(self._producer())
