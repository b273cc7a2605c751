"""The delivery ledger: per model and source, what reached clients and how it felt to them.

Pure counting, no I/O. The proxy settles one :class:`RequestRecord` per request; the push
endpoint and a gateway's counter add :class:`DeliveryCounts` increments. Every counter only grows,
so :meth:`DeliveryLedger.counts` hands the exposition plain values to publish as Prometheus
counters and histograms, and the window reads :class:`LedgerTotals` at every scrape of vLLM.
Model labels go through :class:`ModelNames`: a request counts under the name vLLM's metrics use
for the model that served it (its default model when the request names none, the first served
name for an alias, the base model for an adapter); anything else is counted as ``other``, so a
client cannot create series by inventing model names.

Example::

    names = ModelNames()
    names.update(["tiny-llama"])
    ledger = DeliveryLedger(names)
    ledger.settle(RequestRecord("tiny-llama", "completed", delivered_tokens=12, prompt_tokens=5))
    ledger.totals()["tiny-llama"].delivered  # 12.0
    names.set_adapters({"sql-lora": "tiny-llama"})  # an adapter counts under its base model
    ledger.settle(RequestRecord("sql-lora", "completed", delivered_tokens=3))
    ledger.totals()["tiny-llama"].delivered  # 15.0
    ledger.adapter_counts()  # {("tiny-llama", "sql-lora"): 3.0}
    ledger.settle(RequestRecord("tiny-llama", "completed", delivered_tokens=4, api="messages"))
    ledger.api_counts()  # {("tiny-llama", "messages"): ApiCounts(delivered=4.0, ...)}

The proxy's requests are also counted by the generation API they came through (``api``: a
dialect's name, a small fixed set): a breakdown of the proxy's part of the model's counters,
like the adapters', never added to them.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "OTHER",
    "OUTCOMES",
    "SOURCES",
    "ApiCounts",
    "BookCounts",
    "DeliveryCounts",
    "DeliveryLedger",
    "HistogramAccumulator",
    "HistogramCounts",
    "LedgerTotals",
    "ModelNames",
    "RequestRecord",
]

OTHER = "other"
# "shutdown": still streaming when kvtax's shutdown grace period ran out.
OUTCOMES = (
    "completed",
    "client_disconnected",
    "upstream_error",
    "upstream_4xx",
    "too_large",
    "shutdown",
    "shed",
)
SOURCES = ("proxy", "push", "gateway")

# Bucket bounds in seconds. Client-visible gaps on a GPU are tens of ms; a preemption stall is
# hundreds of ms to seconds; TTFT under queueing can reach a minute.
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0)
STALL_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class ModelNames:
    """The bounded set of model labels: names vLLM reports, plus names vLLM answered with 2xx.

    A request is labelled with the name vLLM's metrics use for the model that served it, so
    that its tokens join the engine series that did the work:

    - a request that names no model (None) is served by vLLM's default model (:meth:`default`);
    - a ``--served-model-name`` alias is labelled with the first served name, the one vLLM's
      metrics carry (:meth:`set_served`, from ``/v1/models``);
    - a LoRA adapter (:meth:`set_adapters`) with its base model, whose engine series did the
      work (see :mod:`kvtax.delivery.adapters`), and :meth:`adapter` names it for the
      per-adapter counter;
    - anything else vLLM does not serve is ``other``.

    ``limit`` caps learned names so a misbehaving upstream still cannot grow cardinality.
    """

    def __init__(self, limit: int = 256) -> None:
        self._served: set[str] = set()
        self._limit = limit
        self._adapters: dict[str, str] = {}
        self._aliases: dict[str, str] = {}
        self._default: str | None = None  # from /v1/models
        self._scraped: frozenset[str] = frozenset()  # names on the last scrape of /metrics

    def update(self, served: Iterable[str]) -> None:
        """Names seen on vLLM's /metrics (the scrape's model_name values)."""
        scraped = frozenset(served)
        self._scraped = scraped
        for name in scraped:
            self.learn(name)

    def learn(self, name: str) -> None:
        """A name vLLM accepted (it answered 2xx for it), so vLLM serves it."""
        if name in self._adapters or name in self._aliases:
            return  # counted under the name vLLM's metrics use, never as a label of its own
        if name and name != OTHER and len(self._served) < self._limit:
            self._served.add(name)

    def set_adapters(self, adapters: Mapping[str, str]) -> None:
        """Replace the adapter -> base model map (from /v1/models and the config)."""
        self._adapters = dict(adapters)
        # A name learned before the map arrived is an adapter after all: no label of its own.
        self._served -= self._adapters.keys()

    def set_served(self, default: str | None, aliases: Mapping[str, str]) -> None:
        """vLLM's default model and its other served names -> that name (from /v1/models)."""
        self._aliases = {a: n for a, n in aliases.items() if a != n}
        # A name learned before the map arrived is an alias after all: no label of its own.
        self._served -= self._aliases.keys()
        self._default = self._aliases.get(default, default) if default else None
        if self._default is not None:
            self.learn(self._default)
        for name in set(self._aliases.values()):
            self.learn(name)

    @property
    def adapters(self) -> Mapping[str, str]:
        return dict(self._adapters)

    @property
    def aliases(self) -> Mapping[str, str]:
        return dict(self._aliases)

    @property
    def default(self) -> str | None:
        """The model serving a request that names none: vLLM's first served name, or the one
        model on its /metrics until /v1/models has answered; None when neither tells."""
        if self._default is not None:
            return self._default
        if len(self._scraped) == 1:
            return next(iter(self._scraped))
        return None

    def adapter(self, name: str | None) -> str | None:
        """The adapter ``name`` is, or None for a base model or an unknown name."""
        return name if name is not None and name in self._adapters else None

    def label(self, name: str | None) -> str:
        """The label of a request for ``name`` (None: the client named no model)."""
        if name is None:
            name = self.default
            if name is None:
                return OTHER
        name = self._adapters.get(name, name)
        name = self._aliases.get(name, name)
        return name if name in self._served else OTHER

    def __contains__(self, name: object) -> bool:
        return name in self._served


@dataclass(frozen=True, slots=True)
class HistogramCounts:
    """Cumulative buckets ``(le, count)`` ending with ``+Inf``, and the sum of observations."""

    buckets: tuple[tuple[float, float], ...]
    sum: float


class HistogramAccumulator:
    """A cumulative Prometheus histogram with fixed bounds (``+Inf`` is implied)."""

    __slots__ = ("_bounds", "_counts", "_sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self._counts = [0] * (len(bounds) + 1)
        self._sum = 0.0

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self._bounds, value)] += 1
        self._sum += value

    def add(self, other: HistogramAccumulator) -> None:
        """Count what ``other`` (of the same bounds) counted."""
        if other._bounds != self._bounds:
            raise ValueError("histograms of different bounds cannot be added")
        self._counts = [a + b for a, b in zip(self._counts, other._counts, strict=True)]
        self._sum += other._sum

    def raw(self) -> tuple[list[int], float]:
        """Its count per bucket (not cumulative; ``+Inf``'s last) and its sum, as
        :meth:`restored` takes them back: how a proxy worker reports one to its parent."""
        return list(self._counts), self._sum

    @classmethod
    def restored(
        cls, bounds: tuple[float, ...], counts: Sequence[int], total: float
    ) -> HistogramAccumulator:
        """The histogram :meth:`raw` described; ValueError if ``counts`` do not fit ``bounds``."""
        if len(counts) != len(bounds) + 1:
            raise ValueError(f"{len(counts)} bucket counts for {len(bounds) + 1} buckets")
        histogram = cls(bounds)
        histogram._counts = [int(n) for n in counts]
        histogram._sum = float(total)
        return histogram

    @classmethod
    def of(cls, bounds: tuple[float, ...], values: Iterable[float]) -> HistogramAccumulator:
        """A histogram of ``values``."""
        histogram = cls(bounds)
        for value in values:
            histogram.observe(value)
        return histogram

    @property
    def count(self) -> int:
        return sum(self._counts)

    @property
    def sum(self) -> float:
        return self._sum

    def counts(self) -> HistogramCounts:
        running = 0
        buckets: list[tuple[float, float]] = []
        for le, n in zip((*self._bounds, float("inf")), self._counts, strict=True):
            running += n
            buckets.append((le, float(running)))
        return HistogramCounts(tuple(buckets), self._sum)


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request through the proxy, settled once when it ends (however it ends).

    ``forwarded`` says the request reached vLLM (vLLM's HTTP counter will count it);
    ``itl`` counts the client-visible gaps between writes that carried tokens, in
    :data:`ITL_BUCKETS` (None: not a stream); ``stalls`` are
    ``(seconds, context tokens at the stall's start)``. ``credited_tokens`` of the delivered
    ones were already counted while the stream ran (:meth:`DeliveryLedger.credit`).
    """

    model: str | None
    outcome: str
    delivered_tokens: int = 0
    credited_tokens: int = 0
    prompt_tokens: int = 0
    undelivered_tokens: int = 0
    forwarded: bool = True
    duration: float | None = None
    ttft: float | None = None
    itl: HistogramAccumulator | None = None
    stalls: tuple[tuple[float, int], ...] = ()
    slo_met: bool = False
    # Completed, but vLLM sent no usage kvtax could read: its tokens are missing from delivered.
    usage_missing: bool = False
    # The generation API it came through (a dialect's name); None: not counted by API.
    api: str | None = None


@dataclass(frozen=True, slots=True)
class DeliveryCounts:
    """Increments reported by another source (push endpoint, gateway counter)."""

    delivered_tokens: float = 0.0
    prompt_tokens: float = 0.0
    undelivered_tokens: float = 0.0
    requests: Mapping[str, float] = field(default_factory=dict)
    slo_met_requests: float = 0.0
    slo_met_tokens: float = 0.0


@dataclass(frozen=True, slots=True)
class LedgerTotals:
    """One model's lifetime totals over every source, as the join reads them."""

    delivered: float = 0.0
    prompt: float = 0.0
    undelivered: float = 0.0
    joined_requests: float = 0.0
    slo_met_requests: float = 0.0
    slo_met_tokens: float = 0.0
    stalls: float = 0.0
    stall_context: float = 0.0


@dataclass(slots=True)
class ApiCounts:
    """One model's requests through one API: delivered and undelivered tokens, outcomes."""

    delivered: float = 0.0
    undelivered: float = 0.0
    outcomes: dict[str, float] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0.0))

    def copy(self) -> ApiCounts:
        return ApiCounts(self.delivered, self.undelivered, dict(self.outcomes))


@dataclass(frozen=True, slots=True)
class BookCounts:
    """One model label's counters, as values for the exposition (by source, by outcome)."""

    delivered: Mapping[str, float]
    prompt: Mapping[str, float]
    undelivered: Mapping[str, float]
    outcomes: Mapping[str, float]
    joined_requests: float
    usage_missing: float
    slo_met_requests: float
    slo_met_tokens: float
    stall_context: float
    ttft: HistogramCounts
    itl: HistogramCounts
    stall: HistogramCounts
    duration: HistogramCounts


class _ModelBook:
    """Mutable counters of one model label."""

    def __init__(self) -> None:
        self.delivered: dict[str, float] = {}
        self.prompt: dict[str, float] = {}
        self.undelivered: dict[str, float] = {}
        self.outcomes: dict[str, float] = dict.fromkeys(OUTCOMES, 0.0)
        self.joined_requests = 0.0
        self.usage_missing = 0.0
        self.slo_met_requests = 0.0
        self.slo_met_tokens = 0.0
        self.stall_context = 0.0
        self.ttft = HistogramAccumulator(TTFT_BUCKETS)
        self.itl = HistogramAccumulator(ITL_BUCKETS)
        self.stall = HistogramAccumulator(STALL_BUCKETS)
        self.duration = HistogramAccumulator(DURATION_BUCKETS)

    def add_tokens(self, source: str, delivered: float, prompt: float, undelivered: float) -> None:
        self.delivered[source] = self.delivered.get(source, 0.0) + delivered
        self.prompt[source] = self.prompt.get(source, 0.0) + prompt
        self.undelivered[source] = self.undelivered.get(source, 0.0) + undelivered

    def counts(self) -> BookCounts:
        return BookCounts(
            delivered=dict(self.delivered),
            prompt=dict(self.prompt),
            undelivered=dict(self.undelivered),
            outcomes=dict(self.outcomes),
            joined_requests=self.joined_requests,
            usage_missing=self.usage_missing,
            slo_met_requests=self.slo_met_requests,
            slo_met_tokens=self.slo_met_tokens,
            stall_context=self.stall_context,
            ttft=self.ttft.counts(),
            itl=self.itl.counts(),
            stall=self.stall.counts(),
            duration=self.duration.counts(),
        )

    def totals(self) -> LedgerTotals:
        return LedgerTotals(
            delivered=sum(self.delivered.values()),
            prompt=sum(self.prompt.values()),
            undelivered=sum(self.undelivered.values()),
            joined_requests=self.joined_requests,
            slo_met_requests=self.slo_met_requests,
            slo_met_tokens=self.slo_met_tokens,
            stalls=float(self.stall.count),
            stall_context=self.stall_context,
        )


class DeliveryLedger:
    """Counters of delivered work per model label and source. See the module docstring."""

    def __init__(self, names: ModelNames) -> None:
        self.names = names
        self._books: dict[str, _ModelBook] = {}
        # (base model label, adapter) -> delivered tokens, every source together.
        self._adapter_delivered: dict[tuple[str, str], float] = {}
        # (model label, API) -> the proxy's counts of that API's requests.
        self._apis: dict[tuple[str, str], ApiCounts] = {}

    def _book(self, model: str | None) -> _ModelBook:
        label = self.names.label(model)
        book = self._books.get(label)
        if book is None:
            book = self._books[label] = _ModelBook()
        return book

    def settle(self, record: RequestRecord) -> None:
        """Count one finished proxy request."""
        if record.outcome not in OUTCOMES:
            raise ValueError(f"unknown outcome {record.outcome!r}")
        book = self._book(record.model)
        book.outcomes[record.outcome] += 1
        # Prompt tokens count only when some output reached the client.
        prompt = record.prompt_tokens if record.delivered_tokens > 0 else 0
        remaining = max(0, record.delivered_tokens - record.credited_tokens)
        book.add_tokens("proxy", remaining, prompt, record.undelivered_tokens)
        self._credit_adapter(record.model, remaining)
        if record.api is not None:
            api = self._api(record.model, record.api)
            api.outcomes[record.outcome] += 1
            api.delivered += remaining
            api.undelivered += record.undelivered_tokens
        if record.forwarded:
            book.joined_requests += 1
        if record.usage_missing:
            book.usage_missing += 1
        if record.slo_met and record.outcome == "completed":
            book.slo_met_requests += 1
            book.slo_met_tokens += record.delivered_tokens
        if record.ttft is not None:
            book.ttft.observe(record.ttft)
        if record.itl is not None:
            book.itl.add(record.itl)
        for seconds, context in record.stalls:
            book.stall.observe(seconds)
            book.stall_context += context
        if record.duration is not None:
            book.duration.observe(record.duration)

    def learn(self, model: str) -> None:
        """vLLM answered 2xx for ``model``: it serves it (:meth:`ModelNames.learn`)."""
        self.names.learn(model)

    def credit(self, model: str | None, tokens: int, api: str | None = None) -> None:
        """Count tokens of a stream still running as delivered (the proxy, at each scrape).

        Crediting while the stream runs, not when it ends, keeps goodput over a window in step
        with the engine's generation counter: a minute-long stream would otherwise show all its
        tokens in the window it ended in.
        """
        self._book(model).add_tokens("proxy", tokens, 0, 0)
        self._credit_adapter(model, tokens)
        if api is not None:
            self._api(model, api).delivered += tokens

    def _api(self, model: str | None, api: str) -> ApiCounts:
        key = (self.names.label(model), api)
        counts = self._apis.get(key)
        if counts is None:
            counts = self._apis[key] = ApiCounts()
        return counts

    def add(self, model: str | None, counts: DeliveryCounts, source: str) -> None:
        """Add increments from another source (``push`` or ``gateway``)."""
        if source not in SOURCES:
            raise ValueError(f"unknown source {source!r}")
        book = self._book(model)
        book.add_tokens(
            source, counts.delivered_tokens, counts.prompt_tokens, counts.undelivered_tokens
        )
        self._credit_adapter(model, counts.delivered_tokens)
        for outcome, n in counts.requests.items():
            if outcome not in OUTCOMES:
                raise ValueError(f"unknown outcome {outcome!r}")
            book.outcomes[outcome] += n
            if outcome != "too_large":
                book.joined_requests += n
        book.slo_met_requests += counts.slo_met_requests
        book.slo_met_tokens += counts.slo_met_tokens

    def _credit_adapter(self, model: str | None, tokens: float) -> None:
        adapter = self.names.adapter(model)
        if adapter is None or tokens <= 0:
            return
        key = (self.names.label(adapter), adapter)
        self._adapter_delivered[key] = self._adapter_delivered.get(key, 0.0) + tokens

    def models(self) -> list[str]:
        return sorted(self._books)

    def adapter_counts(self) -> dict[tuple[str, str], float]:
        """Delivered tokens per (base model label, adapter), sorted; a subset of the base
        model's ``delivered``, which already holds them."""
        return dict(sorted(self._adapter_delivered.items()))

    def api_counts(self) -> dict[tuple[str, str], ApiCounts]:
        """The proxy's counts per (model label, API), sorted: a part of each model's, which
        already holds them."""
        return {key: self._apis[key].copy() for key in sorted(self._apis)}

    def outcomes(self) -> dict[str, float]:
        """Requests by outcome, over every model (for the shutdown log line)."""
        counts = dict.fromkeys(OUTCOMES, 0.0)
        for book in self._books.values():
            for outcome, n in book.outcomes.items():
                counts[outcome] += n
        return counts

    def totals(self) -> dict[str, LedgerTotals]:
        return {label: book.totals() for label, book in self._books.items()}

    def counts(self) -> dict[str, BookCounts]:
        """Every counter of every model label, sorted by label (what kvtax publishes)."""
        return {label: self._books[label].counts() for label in sorted(self._books)}
