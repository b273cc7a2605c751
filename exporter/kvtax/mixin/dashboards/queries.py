"""PromQL building blocks for the dashboards, spelled only from kvtax's tables of names.

Every series a panel queries comes from one of three places: :data:`kvtax.expose.catalog.METRICS`
(kvtax's own metrics), :data:`kvtax.engine.vocabulary.CONCEPTS` (vLLM's names, every version at
once) or the recording rules. The helpers here refuse a name outside those tables at generation
time; :func:`kvtax_dev.promql.series_names` reads them back out of the finished JSON so a
test can prove the committed dashboards agree. Pure string work; no I/O.

Example::

    >>> rate(kvtax("kvtax_engine_preemptions_total"))
    'rate(kvtax_engine_preemptions_total{namespace=~"$namespace", pod=~"$pod", \
model_name=~"$model_name"}[$__rate_interval])'
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from kvtax.engine.vocabulary import CONCEPTS, Kind
from kvtax.expose.catalog import METRICS, PROCESS_METRICS
from kvtax.mixin.rules.config import DEFAULT as RULES
from kvtax.mixin.rules.config import RulesConfig
from kvtax.mixin.rules.recording import fleet, per_pod, record_names

__all__ = [
    "RATE_INTERVAL",
    "SELECTOR",
    "by",
    "expand",
    "histogram_quantile",
    "kvtax",
    "objective_record",
    "process_rate",
    "rate",
    "recorded",
    "vllm",
]

RATE_INTERVAL = "$__rate_interval"
# With "All" the variables expand to ".*", which also matches an absent label: the same
# queries work on a Kubernetes Prometheus (namespace and pod labels) and on a static scrape.
SELECTOR = 'namespace=~"$namespace", pod=~"$pod", model_name=~"$model_name"'
# A kvtax series without model_name (the proxy's and the gate's, one per pod) must not take the
# model variable: a chosen model's regex does not match an absent label, so the panel would empty.
POD_SELECTOR = 'namespace=~"$namespace", pod=~"$pod"'


def _matchers(extra: Iterable[tuple[str, str]], regex: Iterable[tuple[str, str]] = ()) -> str:
    exact = "".join(f', {label}="{value}"' for label, value in extra)
    return exact + "".join(f', {label}=~"{pattern}"' for label, pattern in regex)


def kvtax(
    name: str,
    *,
    part: str = "",
    where: Iterable[tuple[str, str]] = (),
    regex: Iterable[tuple[str, str]] = (),
) -> str:
    """A selector for one catalog metric (``part`` picks a histogram's _bucket/_sum/_count);
    ``where`` adds exact matchers, ``regex`` regular-expression ones."""
    spec = METRICS[name]
    if (spec.type == "histogram") != bool(part):
        raise ValueError(f"{name} is a {spec.type}: part {part!r} does not fit")
    selector = SELECTOR if "model_name" in spec.labels else POD_SELECTOR
    return f"{name}{part}{{{selector}{_matchers(where, regex)}}}"


def process_rate(name: str) -> str:
    """The rate of one of kvtax's process counters (``process_cpu_seconds_total``), kvtax's own
    only: vLLM's /metrics in the same pod publishes the same name, so the series is kept where
    its target (instance) also publishes ``kvtax_build_info``."""
    if name not in {n for n, kind, _ in PROCESS_METRICS if kind == "counter"}:
        raise ValueError(f"{name} is not one of kvtax's process counters")
    build = kvtax("kvtax_build_info")
    return f"({rate(f'{name}{{{POD_SELECTOR}}}')} and on (instance) {build})"


def vllm(concept: str, *, part: str = "", where: Iterable[tuple[str, str]] = ()) -> str:
    """A selector for one vLLM concept under every name it has had.

    A concept with several names (``itl`` was renamed in 0.15) becomes a ``__name__`` regex:
    while a version publishes both, quantiles and max() are unchanged by the duplicate.
    """
    c = CONCEPTS[concept]
    if (c.kind is Kind.HISTOGRAM) != bool(part):
        raise ValueError(f"{concept} is a {c.kind.value}: part {part!r} does not fit")
    where = (*c.select, *where)
    names = [n + part for n in c.names]
    if len(names) == 1:
        return f"{names[0]}{{{SELECTOR}{_matchers(where)}}}"
    return f'{{__name__=~"{"|".join(names)}", {SELECTOR}{_matchers(where)}}}'


def objective_record(rules: RulesConfig, name: str) -> str:
    """A selector for one of the objective's per-model records under ``rules``: only the model
    variable narrows it, as any fleet record."""
    if name not in record_names(rules):
        raise ValueError(f"no recording rule {name}")
    return f'{name}{{model_name=~"$model_name"}}'


def recorded(metric: str, operation: str, *, level: str = "pod", rules: RulesConfig = RULES) -> str:
    """A selector for a recording rule of :mod:`kvtax.mixin.rules.recording` (``level`` pod or
    fleet), as ``rules`` records it.

    ``operation`` may say ``{w}`` for the rules' rate window, e.g. ``"rate{w}"`` -> ``rate5m``.
    Fleet records carry only model_name, so only the model variable narrows them.
    """
    operation = operation.format(w=rules.rate_window)
    name = per_pod(metric, operation) if level == "pod" else fleet(metric, operation)
    if name not in record_names(rules):
        raise ValueError(f"no recording rule {name}")
    if level == "pod":
        return f"{name}{{{SELECTOR}}}"
    return f'{name}{{model_name=~"$model_name"}}'


def rate(selector: str) -> str:
    return f"rate({selector}[{RATE_INTERVAL}])"


def by(labels: str, fn: str, inner: str) -> str:
    """``fn by (labels) (inner)``, e.g. ``by("model_name", "sum", rate(...))``."""
    return f"{fn} by ({labels}) ({inner})"


def histogram_quantile(q: float, bucket_selector: str, labels: str = "model_name") -> str:
    return f"histogram_quantile({q}, {by('le, ' + labels, 'sum', rate(bucket_selector))})"


def expand(expr: str, *, rate_interval: str, values: dict[str, str] | None = None) -> str:
    """Fill in the template variables as Grafana would: ``$x`` and ``${x}`` forms.

    Unknown variables default to ``.*`` (what "All" means here).
    """
    values = values or {}

    def sub(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name == "__rate_interval":
            return rate_interval
        return values.get(name, ".*")

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", sub, expr)
