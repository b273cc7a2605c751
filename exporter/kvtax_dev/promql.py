"""Which series a PromQL expression names, and whether kvtax knows every one of them.

The expression is parsed with ``promql-parser`` (the Rust port of Prometheus' own parser), and
the names are read off its vector selectors: the metric name, or the plain alternatives of a
``__name__`` matcher (a wildcard such as ``"vllm:.*"`` names nothing). Parsing also refuses
PromQL that Prometheus would refuse, which a text scan never could. Grafana's template variables
(``$__rate_interval``, ``$model_name``) are filled with placeholders first, so dashboard queries
read as they are committed. That catches the failure that matters: a rule or dashboard querying
a name that no longer exists (a renamed catalog entry, ``vllm:num_preemptions`` without
``_total``). Known names come from kvtax's catalog, the vLLM vocabulary, the recording rules
and the few series Prometheus makes itself. Pure: no I/O.

``promql-parser`` is a development dependency (the lint and the tests use this reader; the pod
never does), imported when a query is first read.

Example::

    >>> sorted(series_names('sum by (pod) (rate(kvtax_engine_preemptions_total{a="b"}[5m]))'))
    ['kvtax_engine_preemptions_total']
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from kvtax.engine import vocabulary
from kvtax.expose import catalog
from kvtax.mixin.rules.config import DEFAULT, RulesConfig
from kvtax.mixin.rules.recording import record_names

__all__ = ["PROMETHEUS_SERIES", "known_series", "series_names", "unknown_series"]

# Series Prometheus writes about its own scrapes.
PROMETHEUS_SERIES: frozenset[str] = frozenset(
    {"up", "scrape_duration_seconds", "scrape_samples_scraped", "ALERTS", "ALERTS_FOR_STATE"}
)
_HISTOGRAM_PARTS = ("_bucket", "_sum", "_count")
_PLAIN_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
# A Grafana variable: $name or ${name}. In a range it must become a duration to parse.
_RANGE_VARIABLE = re.compile(r"\[\$\{?\w+\}?")
_VARIABLE = re.compile(r"\$\{?(\w+)\}?")


def _without_variables(expr: str) -> str:
    """``expr`` with Grafana's variables replaced by text that parses the same way."""
    return _VARIABLE.sub(r"\1", _RANGE_VARIABLE.sub("[1m", expr))


def series_names(expr: str) -> set[str]:
    """Every metric name ``expr`` selects; ValueError when it is not valid PromQL."""
    import promql_parser as pp  # a development dependency: see the module docstring

    names: set[str] = set()

    def visit(node: object) -> None:
        if not isinstance(node, pp.VectorSelector):
            return
        if node.name:
            names.add(node.name)
        for matcher in node.matchers.matchers:
            if matcher.name != "__name__":
                continue
            if matcher.op == pp.MatchOp.Equal:
                names.add(matcher.value)
            elif matcher.op == pp.MatchOp.Re:
                # Alternatives of plain names count; a wildcard names nothing.
                names.update(p for p in matcher.value.split("|") if _PLAIN_NAME.fullmatch(p))

    pp.walk(pp.parse(_without_variables(expr)), visit)
    return names


def _with_parts(name: str, histogram: bool) -> Iterable[str]:
    yield name
    if histogram:
        yield from (name + part for part in _HISTOGRAM_PARTS)


def known_series(config: RulesConfig = DEFAULT) -> set[str]:
    """kvtax's catalog (its process families included), the vLLM vocabulary, the recording
    rules and Prometheus' own series."""
    known = set(PROMETHEUS_SERIES) | set(record_names(config))
    known.update(name for name, _, _ in catalog.PROCESS_METRICS)
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
