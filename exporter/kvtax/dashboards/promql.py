"""PromQL building blocks for the dashboards, spelled only from kvtax's tables of names.

Every series a panel queries comes from one of three places: :data:`kvtax.catalog.METRICS`
(kvtax's own metrics), :data:`kvtax.vocabulary.CONCEPTS` (vLLM's names, every version at once)
or the recording rules. The helpers here refuse a name outside those tables at generation
time, and :func:`series_names` reads the names back out of a finished expression so a test
can prove the committed JSON agrees. Pure string work; no I/O.

Example::

    >>> rate(kvtax("kvtax_engine_preemptions_total"))
    'rate(kvtax_engine_preemptions_total{namespace=~"$namespace", pod=~"$pod", \
model_name=~"$model"}[$__rate_interval])'
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from ..catalog import METRICS
from ..rules.config import DEFAULT as RULES
from ..rules.recording import fleet, per_pod, record_names
from ..vocabulary import CONCEPTS, Kind, concept_for

__all__ = [
    "HISTOGRAM_PARTS",
    "RATE_INTERVAL",
    "SELECTOR",
    "by",
    "expand",
    "histogram_quantile",
    "is_known_series",
    "kvtax",
    "rate",
    "recorded",
    "series_names",
    "vllm",
]

RATE_INTERVAL = "$__rate_interval"
# With "All" the variables expand to ".*", which also matches an absent label: the same
# queries work on a Kubernetes Prometheus (namespace and pod labels) and on a static scrape.
SELECTOR = 'namespace=~"$namespace", pod=~"$pod", model_name=~"$model"'
HISTOGRAM_PARTS = ("_bucket", "_sum", "_count")


def _matchers(extra: Iterable[tuple[str, str]]) -> str:
    return "".join(f', {label}="{value}"' for label, value in extra)


def kvtax(name: str, *, part: str = "", where: Iterable[tuple[str, str]] = ()) -> str:
    """A selector for one catalog metric (``part`` picks a histogram's _bucket/_sum/_count)."""
    spec = METRICS[name]
    if (spec.type == "histogram") != bool(part):
        raise ValueError(f"{name} is a {spec.type}: part {part!r} does not fit")
    return f"{name}{part}{{{SELECTOR}{_matchers(where)}}}"


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


def recorded(metric: str, operation: str, *, level: str = "pod") -> str:
    """A selector for a recording rule of :mod:`kvtax.rules.recording` (``level`` pod or fleet).

    ``operation`` may say ``{w}`` for the rules' rate window, e.g. ``"rate{w}"`` -> ``rate5m``.
    Fleet records carry only model_name, so only the model variable narrows them.
    """
    operation = operation.format(w=RULES.rate_window)
    name = per_pod(metric, operation) if level == "pod" else fleet(metric, operation)
    if name not in record_names(RULES):
        raise ValueError(f"no recording rule {name}")
    if level == "pod":
        return f"{name}{{{SELECTOR}}}"
    return f'{name}{{model_name=~"$model"}}'


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


# -- reading names back out of an expression ------------------------------------------------

_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "inf",
    "nan",
}
_NAME_REGEX = re.compile(r'__name__\s*=~?\s*"([^"]*)"')
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def series_names(expr: str) -> set[str]:
    """Every metric name an expression selects, including ``__name__`` matchers.

    Label names, label values, functions, keywords and durations are not series and are
    dropped: strings first, then ``by (...)``-style label lists, then ``{...}`` matchers and
    ``[...]`` ranges, then anything called like a function.
    """
    names: set[str] = set()
    for pattern in _NAME_REGEX.findall(expr):
        names.update(p for p in pattern.split("|") if p)
    text = _STRING.sub('""', expr)
    text = _LABEL_LIST.sub(" ", text)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    for match in _IDENT.finditer(text):
        word = match.group(0)
        rest = text[match.end() :].lstrip()
        if rest.startswith("(") or word.lower() in _KEYWORDS:
            continue
        # A digit run like 1e3 never reaches here (idents cannot start with a digit), but
        # an exponent tail such as "e3" in "1e3" can: skip words glued to a preceding digit.
        if match.start() > 0 and text[match.start() - 1].isdigit():
            continue
        names.add(word)
    return names


def is_known_series(name: str, recorded: Iterable[str] = ()) -> bool:
    """True if ``name`` is a catalog metric (or histogram part), a vLLM name, or recorded."""
    if name in set(recorded) or concept_for(name) is not None:
        return True
    spec = METRICS.get(name)
    if spec is not None:
        return spec.type != "histogram"
    for part in HISTOGRAM_PARTS:
        base = METRICS.get(name.removesuffix(part))
        if name.endswith(part) and base is not None and base.type == "histogram":
            return True
    return False
