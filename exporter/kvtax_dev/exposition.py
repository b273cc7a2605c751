"""The harness's one reader of a ``/metrics`` page: Prometheus text into plain dicts.

Tests, the testbed and benchmarks read vLLM's and kvtax's pages to assert on values, never on
formatting, so one reader serves them all. It uses prometheus-client's parser (the format's
reference reader) and keeps every sample, ``_bucket``/``_count``/``_sum``/``_created``
included. Two shapes: :func:`read_samples` groups by sample name with label sets as keys (for
"this name, exactly these labels"), and :func:`read_series` keys each sample by one
``name{a="1"}`` string (:func:`series_key`), handy for diffs and messages. :func:`total` sums
one sample name over all its label sets.

Example::

    page = read_samples(engine.metrics_text())
    preempted = total(page, "vllm:num_preemptions_total")
    info = labels_of(page, "vllm:cache_config_info")[0]
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

__all__ = [
    "Labels",
    "Samples",
    "labels_of",
    "read_samples",
    "read_series",
    "series_key",
    "total",
]

Labels = frozenset[tuple[str, str]]
Samples = dict[str, dict[Labels, float]]


def read_samples(text: str) -> Samples:
    """Sample name -> {label set: value} for every sample on the page."""
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, {})[frozenset(s.labels.items())] = s.value
    return samples


def series_key(name: str, labels: dict[str, str] | None = None) -> str:
    """``name{a="1",b="2"}`` with labels sorted; the key :func:`read_series` uses."""
    if not labels:
        return name
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


def read_series(text: str) -> dict[str, float]:
    """Every sample on the page, keyed by :func:`series_key`."""
    return {
        series_key(name, dict(labels)): value
        for name, by_labels in read_samples(text).items()
        for labels, value in by_labels.items()
    }


def total(samples: Samples, name: str) -> float:
    """The sum of ``name`` over all its label sets (engines, models); 0 when absent."""
    return sum(samples.get(name, {}).values())


def labels_of(samples: Samples, name: str) -> list[dict[str, str]]:
    """The label sets ``name`` appears with, e.g. an ``_info`` metric's fields."""
    return [dict(labels) for labels in samples.get(name, {})]
