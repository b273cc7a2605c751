"""The soak's judgement: what the clients saw against what kvtax's ledger says. Pure, no I/O.

The load generator keeps one :class:`ClientRecord` per request: the outcome as the client saw
it and the completion tokens it received. :class:`LedgerView` is the part of kvtax's /metrics
that should agree with them, for one model label. :func:`compare` checks, per model and per
outcome in ``kvtax.delivery.ledger.OUTCOMES``, that kvtax counted as many requests as the clients
saw,
and that the delivered tokens equal what the clients received. Only a client that hung up
mid-stream has a range rather than a number: kvtax counts the tokens its TCP stack acknowledged,
which may be fewer than it read (the acknowledgement of the last write may not have been seen
yet) but never more, because the upstream sends nothing past what it read until the client is
gone. The soak sends those clients under a model name of their own, so that their range cannot
hide a few tokens missing from clients that read everything.

Example::

    records = [ClientRecord("stream", "completed", 200, tokens=12, model="m")]
    ledger = {"m": LedgerView({"completed": 1.0}, delivered=12.0)}
    all(check.ok for check in compare(records, ledger, ("completed", "client_disconnected")))
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from kvtax.expose.catalog import METRICS

__all__ = [
    "BOUNDED",
    "Check",
    "ClientRecord",
    "LedgerView",
    "compare",
    "compare_one",
    "gauge",
    "ledger_delta",
    "parse_ledger",
]

# The one client outcome whose tokens are a bound (at most what it read), not an exact count.
BOUNDED = "client_disconnected"
_REQUESTS = METRICS["kvtax_requests_total"]
_DELIVERED = METRICS["kvtax_delivered_tokens_total"]
_MODEL_LABEL, _OUTCOME_LABEL = _REQUESTS.labels
_SOURCE_LABEL = _DELIVERED.labels[-1]
# Optional: kvtax counts requests whose usage it could not read; the soak's upstream always sends
# it, so any is a parsing failure. None while the catalog has no such metric.
_NO_USAGE = METRICS.get("kvtax_requests_without_usage_total")


@dataclass(frozen=True, slots=True)
class ClientRecord:
    """What one client saw. ``tokens``: completion tokens received (for a client that hung up,
    the tokens it had read). ``problem`` is set when the answer was not the one the upstream
    sent (truncated body, missing tokens): the ledger may still agree with such a client."""

    kind: str
    outcome: str
    status: int
    tokens: int = 0
    problem: str = ""
    model: str = ""


@dataclass(frozen=True, slots=True)
class LedgerView:
    """kvtax's requests by outcome and its proxy-delivered tokens, over every model label."""

    outcomes: dict[str, float] = field(default_factory=dict)
    delivered: float = 0.0
    without_usage: float = 0.0

    def minus(self, before: LedgerView) -> LedgerView:
        """What happened between two scrapes of the same process (counters only grow)."""
        keys = self.outcomes.keys() | before.outcomes.keys()
        return LedgerView(
            {k: self.outcomes.get(k, 0.0) - before.outcomes.get(k, 0.0) for k in keys},
            self.delivered - before.delivered,
            self.without_usage - before.without_usage,
        )

    @property
    def requests(self) -> float:
        return sum(self.outcomes.values())


def parse_ledger(text: str) -> dict[str, LedgerView]:
    """The ledger on a kvtax /metrics page, by model label."""
    outcomes: dict[str, dict[str, float]] = {}
    delivered: dict[str, float] = {}
    no_usage: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            model = sample.labels.get(_MODEL_LABEL, "")
            if sample.name == _REQUESTS.name:
                by_outcome = outcomes.setdefault(model, {})
                outcome = sample.labels[_OUTCOME_LABEL]
                by_outcome[outcome] = by_outcome.get(outcome, 0.0) + sample.value
            elif sample.name == _DELIVERED.name and sample.labels[_SOURCE_LABEL] == "proxy":
                delivered[model] = delivered.get(model, 0.0) + sample.value
            elif _NO_USAGE is not None and sample.name == _NO_USAGE.name:
                no_usage[model] = no_usage.get(model, 0.0) + sample.value
    models = outcomes.keys() | delivered.keys() | no_usage.keys()
    return {
        m: LedgerView(outcomes.get(m, {}), delivered.get(m, 0.0), no_usage.get(m, 0.0))
        for m in models
    }


def ledger_delta(
    after: Mapping[str, LedgerView], before: Mapping[str, LedgerView]
) -> dict[str, LedgerView]:
    return {m: view.minus(before.get(m, LedgerView())) for m, view in after.items()}


def gauge(text: str, name: str) -> float | None:
    """The sum of an unlabelled or labelled gauge on a /metrics page; None when absent."""
    values = [
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    ]
    return sum(values) if values else None


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    clients: str
    kvtax: str
    ok: bool


def _outcome_checks(
    records: Sequence[ClientRecord], ledger: LedgerView, outcomes: Iterable[str]
) -> list[Check]:
    seen = Counter(r.outcome for r in records)
    known = list(outcomes)
    checks = []
    # An outcome a client saw that kvtax does not know is a mismatch too, never silently dropped.
    for outcome in known + sorted(set(seen) - set(known)):
        counted = ledger.outcomes.get(outcome, 0.0)
        name = outcome if outcome in known else f"{outcome} (not a kvtax outcome)"
        checks.append(Check(name, str(seen[outcome]), f"{counted:g}", counted == seen[outcome]))
    # A series kvtax publishes for an outcome this code did not ask about still has to be 0.
    for outcome in sorted(set(ledger.outcomes) - set(known) - set(seen)):
        counted = ledger.outcomes[outcome]
        checks.append(Check(f"{outcome} (unexpected)", "0", f"{counted:g}", counted == 0))
    return checks


def compare(
    records: Sequence[ClientRecord], ledger: Mapping[str, LedgerView], outcomes: Iterable[str]
) -> list[Check]:
    """Per model label a client used or kvtax counted: :func:`compare_one`."""
    known = tuple(outcomes)
    checks = []
    for model in sorted({r.model for r in records} | set(ledger)):
        group = [r for r in records if r.model == model]
        for check in compare_one(group, ledger.get(model, LedgerView()), known):
            checks.append(Check(f"{model}: {check.name}", check.clients, check.kvtax, check.ok))
    return checks


def compare_one(
    records: Sequence[ClientRecord], ledger: LedgerView, outcomes: Iterable[str]
) -> list[Check]:
    """Requests per outcome, then delivered tokens: exact, plus the disconnected clients' range."""
    checks = _outcome_checks(records, ledger, outcomes)
    exact = sum(r.tokens for r in records if r.outcome != BOUNDED)
    bound = sum(r.tokens for r in records if r.outcome == BOUNDED)
    if bound:
        expected = f"{exact:,} to {exact + bound:,}"
        ok = exact <= ledger.delivered <= exact + bound
    else:
        expected, ok = f"{exact:,}", ledger.delivered == exact
    checks.append(Check("delivered tokens (proxy)", expected, f"{ledger.delivered:,.0f}", ok))
    if _NO_USAGE is not None:
        missing = ledger.without_usage
        checks.append(Check("requests without usage", "0", f"{missing:g}", missing == 0))
    return checks
