"""The soak's judgement: what the clients saw against what kvtax's ledger says. Pure, no I/O.

The load generator keeps one :class:`ClientRecord` per request: the outcome as the client saw
it and the completion tokens it received. :class:`LedgerView` is the part of kvtax's /metrics
that should agree with them, summed over models. :func:`compare` checks, per outcome in
``kvtax.ledger.OUTCOMES``, that kvtax counted as many requests as the clients saw, and that the
delivered tokens equal what the clients received. Only a client that hung up mid-stream has a
range rather than a number: kvtax counts the tokens its TCP stack acknowledged, which may be
fewer than it read (the acknowledgement of the last write may not have been seen yet) but never
more, because the upstream sends nothing past what it read until the client is gone.

Example::

    records = [ClientRecord("stream", "completed", 200, tokens=12)]
    view = LedgerView({"completed": 1.0}, delivered=12.0)
    all(check.ok for check in compare(records, view, ("completed", "client_disconnected")))
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from kvtax.catalog import METRICS

__all__ = ["BOUNDED", "Check", "ClientRecord", "LedgerView", "compare", "gauge"]

# The one client outcome whose tokens are a bound (at most what it read), not an exact count.
BOUNDED = "client_disconnected"
_REQUESTS = METRICS["kvtax_requests_total"]
_DELIVERED = METRICS["kvtax_delivered_tokens_total"]
_OUTCOME_LABEL = _REQUESTS.labels[-1]
_SOURCE_LABEL = _DELIVERED.labels[-1]


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


@dataclass(frozen=True, slots=True)
class LedgerView:
    """kvtax's requests by outcome and its proxy-delivered tokens, over every model label."""

    outcomes: dict[str, float] = field(default_factory=dict)
    delivered: float = 0.0

    @classmethod
    def parse(cls, text: str) -> LedgerView:
        outcomes: dict[str, float] = {}
        delivered = 0.0
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == _REQUESTS.name:
                    outcome = sample.labels[_OUTCOME_LABEL]
                    outcomes[outcome] = outcomes.get(outcome, 0.0) + sample.value
                elif sample.name == _DELIVERED.name and sample.labels[_SOURCE_LABEL] == "proxy":
                    delivered += sample.value
        return cls(outcomes, delivered)

    def minus(self, before: LedgerView) -> LedgerView:
        """What happened between two scrapes of the same process (counters only grow)."""
        keys = self.outcomes.keys() | before.outcomes.keys()
        return LedgerView(
            {k: self.outcomes.get(k, 0.0) - before.outcomes.get(k, 0.0) for k in keys},
            self.delivered - before.delivered,
        )

    @property
    def requests(self) -> float:
        return sum(self.outcomes.values())


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
    return checks
