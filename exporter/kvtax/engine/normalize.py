"""Parse vLLM's Prometheus text and fold every version's names into one vocabulary.

The parser is prometheus-client's own; this module only walks its samples once, keeps those of a
known concept, combines engines per the concept's :class:`~kvtax.engine.vocabulary.Aggregate`, and
picks
the newest name when a scrape carries two (0.10 exposes both KV-usage names). Series without a
``model_name`` that merely reuse the ``vllm:`` prefix (routers re-exporting them) are ignored.

The page is hostile input. A body that does not end in a newline was cut short (the text format
ends every line with one) and is refused, as is a page with more series than the caller allows.
A sample that is NaN or infinite, or a counter or histogram that is negative, is rejected: its
concept is left out of this scrape for that model (so a reset-corrected total keeps its last good
value and no restart is inferred) and the rejection is counted in ``VllmSnapshot.rejected``.

Example (a page of one counter; the captures in tests/fixtures/vllm/ are whole pages):

    >>> page = 'vllm:generation_tokens_total{model_name="tiny-llama",engine="0"} 120.0\\n'
    >>> snap = normalize(page, timestamp=0.0)
    >>> snap.models["tiny-llama"].values, snap.names["generation_tokens"]
    ({'generation_tokens': 120.0}, 'vllm:generation_tokens_total')
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field, replace

from prometheus_client.parser import text_string_to_metric_families

from kvtax.engine.apiservers import ApiServerSignals
from kvtax.engine.snapshot import Histogram, ModelMetrics, VllmSnapshot
from kvtax.engine.vocabulary import CONCEPTS, FINGERPRINTS, Aggregate, Concept, Kind, concept_for
from kvtax.errors import UpstreamError

__all__ = ["REJECT_REASONS", "ParseError", "normalize", "prefix_cache_counts_blocks"]

_SERVER = ""  # model key for server-level series (no model_name label)

# Why a sample of an otherwise good page was rejected; a fixed set, so labels stay bounded.
REJECT_REASONS = ("non_finite", "negative")


class ParseError(UpstreamError, ValueError):
    """The /metrics body is not acceptable; ``reason`` is parse, truncated or too_many_series."""

    def __init__(self, message: str, reason: str = "parse") -> None:
        super().__init__(message)
        self.reason = reason

    def __reduce__(self) -> tuple[type[ParseError], tuple[str, str]]:
        # Raised in the parse worker process: keep the reason across pickling.
        return (type(self), (str(self), self.reason))


@dataclass(slots=True)
class _Acc:
    """Mutable accumulator for one (model, concept, rank) during a single pass."""

    value: float | None = None
    split: dict[str, float] = field(default_factory=dict)
    buckets: dict[float, float] = field(default_factory=dict)
    hsum: float = 0.0
    hcount: float = 0.0
    info: dict[str, str] = field(default_factory=dict)
    invalid: bool = False


def _combine(concept: Concept, old: float | None, new: float) -> float:
    if old is None:
        return new
    if concept.aggregate is Aggregate.MAX:
        return max(old, new)
    if concept.aggregate is Aggregate.FIRST:
        return old
    return old + new


def prefix_cache_counts_blocks(
    version: str | None,
    marks: frozenset[str],
    names: dict[str, str],
    prompt_tokens: float | None,
    queries: float | None,
) -> bool:
    """Whether ``gpu_prefix_cache_*`` counts blocks (0.7.3-0.8.5) rather than tokens.

    The version from ``GET /version`` decides when known. Without it, a scrape with the new
    KV-usage name is 0.9.2+ (tokens); otherwise compare with prompt tokens: lookups are made for
    nearly every prompt token, so far fewer lookups than prompt tokens means blocks.
    """
    # The block-counting name is the oldest one in the vocabulary (gpu_prefix_cache_queries).
    if names.get("prefix_cache_queries") != CONCEPTS["prefix_cache_queries"].names[-1]:
        return False
    if version:
        try:
            major, minor = (int(p) for p in version.split(".")[:2])
        except ValueError:
            pass
        else:
            return (major, minor) < (0, 9)
    if "0.9.2+" in marks:
        return False
    if not prompt_tokens or queries is None:
        return False
    return queries * 4 < prompt_tokens


def _check_page(text: str, max_series: int | None) -> None:
    if text and not text.endswith("\n"):
        tail = text[-40:]
        raise ParseError(f"page does not end with a newline (cut short?): ...{tail!r}", "truncated")
    if max_series is not None:
        # Counted in C before any parsing: sample lines are all lines but comments (an upper
        # bound, as blank lines count too). Parsing costs ~50 us per series in pure Python.
        lines = text.count("\n")
        comments = text.count("\n#") + text.startswith("#")
        if lines - comments > max_series:
            raise ParseError(
                f"page has about {lines - comments} series, above --scrape.max-series={max_series}",
                "too_many_series",
            )


def normalize(
    text: str, *, timestamp: float, version: str | None = None, max_series: int | None = None
) -> VllmSnapshot:
    """Turn one /metrics body into a :class:`VllmSnapshot`. Raises :class:`ParseError`."""
    _check_page(text, max_series)
    accs: dict[tuple[str, str, int], _Acc] = {}
    marks: set[str] = set()
    rejected = dict.fromkeys(REJECT_REASONS, 0)
    servers = ApiServerSignals()
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                name = sample.name
                servers.see(name, sample.labels, sample.value)
                mark = FINGERPRINTS.get(name) or FINGERPRINTS.get(family.name)
                if mark:
                    marks.add(mark)
                hit = concept_for(name)
                if hit is None:
                    continue
                concept, rank, part = hit
                labels = sample.labels
                model = labels.get("model_name")
                if model is None:
                    if not concept.server_level:
                        continue
                    model = _SERVER
                if "engine" in labels:
                    marks.add("engine_label")
                if concept.select and any(labels.get(k) != v for k, v in concept.select):
                    continue
                key = (model, concept.name, rank)
                acc = accs.get(key)
                if acc is None:
                    acc = accs[key] = _Acc()
                why = _rejected(concept, sample.value)
                if why is not None:
                    rejected[why] += 1
                    acc.invalid = True
                    continue
                _accumulate(acc, concept, part, labels, sample.value)
    except ValueError as exc:  # prometheus-client raises ValueError on malformed text
        raise ParseError(str(exc)) from exc
    return replace(_finish(accs, marks, timestamp, version, rejected), api_servers=servers.report())


def _rejected(concept: Concept, value: float) -> str | None:
    """Why a sample cannot be used, or None. One bad engine spoils its model's sum."""
    if not math.isfinite(value):
        return "non_finite"
    if value < 0 and concept.kind in (Kind.COUNTER, Kind.HISTOGRAM):
        return "negative"
    return None


def _accumulate(
    acc: _Acc, concept: Concept, part: str, labels: dict[str, str], value: float
) -> None:
    kind = concept.kind
    if kind is Kind.HISTOGRAM:
        if part == "bucket":
            le = float(labels["le"])
            acc.buckets[le] = acc.buckets.get(le, 0.0) + value
        elif part == "sum":
            acc.hsum += value
        elif part == "count":
            acc.hcount += value
    elif kind is Kind.INFO:
        if not acc.info:
            acc.info = {k: v for k, v in labels.items() if k not in ("model_name", "engine")}
    elif concept.split_by is not None:
        split_value = labels.get(concept.split_by, "")
        acc.split[split_value] = _combine(concept, acc.split.get(split_value), value)
    else:
        acc.value = _combine(concept, acc.value, value)


def _finish(
    accs: dict[tuple[str, str, int], _Acc],
    marks: set[str],
    timestamp: float,
    version: str | None,
    rejected: dict[str, int],
) -> VllmSnapshot:
    # Keep, per (model, concept), only the newest name's data.
    best: dict[tuple[str, str], int] = {}
    for model, concept, rank in accs:
        key = (model, concept)
        if key not in best or rank < best[key]:
            best[key] = rank

    names: dict[str, str] = {}
    per_model: dict[str, dict[str, _Acc]] = defaultdict(dict)
    for (model, concept_name), rank in best.items():
        per_model[model][concept_name] = accs[(model, concept_name, rank)]
        names[concept_name] = CONCEPTS[concept_name].names[rank]

    server = per_model.pop(_SERVER, {})
    frozen_marks = frozenset(marks)
    models: dict[str, ModelMetrics] = {}
    for model, concepts in per_model.items():
        merged = {**server, **concepts}
        models[model] = _freeze(merged, frozen_marks, names, version)
    return VllmSnapshot(timestamp, models, frozen_marks, names, version, rejected)


def _freeze(
    concepts: dict[str, _Acc], marks: frozenset[str], names: dict[str, str], version: str | None
) -> ModelMetrics:
    values: dict[str, float] = {}
    split: dict[str, dict[str, float]] = {}
    histograms: dict[str, Histogram] = {}
    info: dict[str, str] = {}
    for name, acc in concepts.items():
        kind = CONCEPTS[name].kind
        if acc.invalid:
            continue  # absent this scrape, like a concept the version lacks
        if kind is Kind.HISTOGRAM:
            buckets = tuple(sorted(acc.buckets.items()))
            histograms[name] = Histogram(buckets, acc.hsum, acc.hcount)
        elif kind is Kind.INFO:
            info = acc.info
        elif CONCEPTS[name].split_by is not None:
            split[name] = acc.split
        elif acc.value is not None and math.isfinite(acc.value):
            # Finite samples can still sum past the largest float across engines.
            values[name] = acc.value

    if prefix_cache_counts_blocks(
        version, marks, names, values.get("prompt_tokens"), values.get("prefix_cache_queries")
    ):
        block_size = _float(info.get("block_size"))
        if block_size:
            for concept in ("prefix_cache_queries", "prefix_cache_hits"):
                if concept in values:
                    values[concept] *= block_size
    return ModelMetrics(values, split, histograms, info)


def _float(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None
