"""Which series a PromQL expression names, and whether kvtax knows every one of them.

A deliberately crude reader, not a parser: it takes metric names from ``__name__`` matchers,
drops strings, label matchers, ranges and label lists (``by (...)``, ``on (...)``), then keeps
every identifier that is not a keyword, a function call or part of a number or duration.
That is enough to catch the failure that matters: a rule or dashboard querying a name that
no longer exists (a renamed catalog entry, ``vllm:num_preemptions`` without ``_total``).
Known names come from kvtax's catalog, the vLLM vocabulary, the recording rules and the few
series Prometheus makes itself. Pure: no I/O.

Example::

    >>> sorted(series_names('sum by (pod) (rate(kvtax_engine_preemptions_total{a="b"}[5m]))'))
    ['kvtax_engine_preemptions_total']
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from kvtax.engine import vocabulary
from kvtax.expose import catalog

from .config import DEFAULT, RulesConfig
from .recording import record_names

__all__ = ["PROMETHEUS_SERIES", "known_series", "series_names", "unknown_series"]

# Series Prometheus writes about its own scrapes.
PROMETHEUS_SERIES: frozenset[str] = frozenset(
    {"up", "scrape_duration_seconds", "scrape_samples_scraped", "ALERTS", "ALERTS_FOR_STATE"}
)
_HISTOGRAM_PARTS = ("_bucket", "_sum", "_count")
_KEYWORDS = frozenset(
    {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right"}
    | {"offset", "bool", "inf", "nan", "atan2"}
)
_NAME_MATCHER = re.compile(r'__name__\s*=~?\s*"([^"]*)"')
_PLAIN_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACES = re.compile(r"\{[^}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_LABEL_LIST = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
# An identifier not glued to a digit or dot (so "15m" and "1e3" are not names) and not a call.
_IDENT = re.compile(r"(?<![\w.:])([a-zA-Z_:][a-zA-Z0-9_:]*)(?![\w:])(?!\s*\()")


def series_names(expr: str) -> set[str]:
    """Every metric name ``expr`` selects."""
    names: set[str] = set()
    for pattern in _NAME_MATCHER.findall(expr):
        # Alternatives of plain names count; a wildcard such as "vllm:.*" names nothing.
        names.update(part for part in pattern.split("|") if _PLAIN_NAME.fullmatch(part))
    text = _STRING.sub('""', expr)
    text = _BRACES.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _LABEL_LIST.sub(" ", text)
    names.update(t for t in _IDENT.findall(text) if t.lower() not in _KEYWORDS)
    return names


def _with_parts(name: str, histogram: bool) -> Iterable[str]:
    yield name
    if histogram:
        yield from (name + part for part in _HISTOGRAM_PARTS)


def known_series(config: RulesConfig = DEFAULT) -> set[str]:
    """kvtax's catalog, the vLLM vocabulary, the recording rules and Prometheus' own series."""
    known = set(PROMETHEUS_SERIES) | set(record_names(config))
    for metric in catalog.METRICS.values():
        known.update(_with_parts(metric.name, metric.type == "histogram"))
    for concept in vocabulary.CONCEPTS.values():
        histogram = concept.kind is vocabulary.Kind.HISTOGRAM
        for name in concept.names:
            known.update(_with_parts(name, histogram))
    return known


def unknown_series(exprs: Mapping[str, str], config: RulesConfig = DEFAULT) -> dict[str, set[str]]:
    """Rule name -> the series its expression names that kvtax does not know (empty if none)."""
    known = known_series(config)
    missing = {rule: series_names(expr) - known for rule, expr in exprs.items()}
    return {rule: names for rule, names in missing.items() if names}
