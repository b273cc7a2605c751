"""One accounted request through the proxy: its facts, its outcome, and its ledger record.

The request's owner (:class:`~kvtax.serve.proxy.request.AccountedRequest`) gathers facts in a
:class:`Facts` as the request runs: what vLLM answered, what was written to the client, who
went away early. When the request ends, however it ends, the owner asks :func:`outcome_of` once
for its outcome, from those facts and the proxy's shutdown :data:`Phase`. It is the one place an
outcome is decided; nothing else sets or guesses one.
:func:`record_of` then turns the exchange into the one :class:`RequestRecord` the ledger settles.
Both are pure: the caller takes the last reading of the client's acknowledgements first.

The outcomes (the ledger's ``OUTCOMES``): ``too_large`` is the proxy's own 413; ``shed`` is the
gate's 429 or 400 (the request never reached vLLM);
``upstream_4xx`` and ``upstream_error`` are vLLM's 4xx and 5xx, or a vLLM that never answered
or broke off; ``completed`` means every byte reached the client; ``shutdown`` that kvtax's
shutdown ended the request first (its grace period ran out, or kvtax answered its own 503);
``client_disconnected`` that the client left, whether vLLM had answered yet or not.

Example::

    ex = Facts(started=clock())
    ...  # the relay records facts on ex
    record = record_of(ex, outcome_of(ex, "serving"), ended=clock(), slo=SloTargets(2.0, 0.2))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvtax.delivery.asks import Scheme
from kvtax.delivery.dialects import StreamCounter
from kvtax.delivery.ledger import RequestRecord
from kvtax.delivery.timing import SloTargets, StreamTiming, meets_slo_unstreamed
from kvtax.serve.proxy.acks import AckTracker

__all__ = ["Facts", "Phase", "outcome_of", "record_of"]

# The proxy's one shutdown state, and it only moves forward: "draining" lets requests in flight
# finish; "cutting" is after the grace period, when what still runs is ended by kvtax.
Phase = Literal["serving", "draining", "cutting"]


@dataclass(slots=True)
class Facts:
    """The facts of one accounted request, gathered as it runs; :func:`outcome_of` reads them.

    ``status`` is vLLM's (None: it never answered). ``wrote_all`` means every byte of the
    response, a stream's end marker included, was handed to the client's socket; ``eof`` that
    the response was also ended cleanly. ``client_gone`` and ``upstream_broke`` say who left
    early. ``counter`` counted a stream's tokens (its dialect's), ``acks`` what the client's TCP
    stack acknowledged.
    """

    started: float
    model: str | None = None
    too_large: bool = False
    status: int | None = None
    wrote_all: bool = False
    eof: bool = False
    client_gone: bool = False
    upstream_broke: bool = False
    acks: AckTracker | None = None
    counter: StreamCounter | None = None
    timing: StreamTiming | None = None
    usage: tuple[int, int] | None = None  # non-streamed: (completion, prompt)
    credited: int = 0  # delivered tokens the ledger already counted mid-stream
    finished_at: float | None = None
    # When the answer's last byte was written (its duration ends there, not after the wait for
    # the client's acknowledgements of it).
    answered_at: float | None = None
    sent: bool = False  # vLLM got the request even if it never answered
    shed: str | None = None  # the gate answered instead of vLLM, and why
    turned_away: bool = False  # kvtax answered its shutdown 503 before vLLM answered
    prompt_bytes: int = 0  # the gate's measure of the prompt, corrected from vLLM's usage
    scheme: Scheme = "usage"  # how a stream's tokens are counted (kvtax.delivery.asks)
    api: str | None = None  # the generation API it came through (its dialect's name)

    @property
    def reached_client(self) -> bool:
        """Every byte reached the client: ended cleanly, or its acknowledgements cover it all."""
        if not self.wrote_all:
            return False
        if self.eof and not self.client_gone:
            return True
        return self.acks is None or self.acks.all_acknowledged


def outcome_of(ex: Facts, phase: Phase) -> str:
    """The one place a request's outcome is decided, from its facts and the proxy's phase."""
    if ex.too_large:
        return "too_large"
    if ex.shed is not None:
        return "shed"
    if ex.turned_away:
        return "shutdown"
    if ex.status is None:
        # No answer. Unless its client left first (cancelled while queued in the gate or while
        # vLLM generated), vLLM was unreachable, timed out or closed without answering.
        if not ex.client_gone:
            return "upstream_error"
    elif ex.status >= 500:
        return "upstream_error"
    elif ex.status >= 400:
        return "upstream_4xx"
    if ex.reached_client:
        return "completed"
    # Past the grace period the proxy closes vLLM's side and cancels what still runs, so a
    # broken stream or a cancelled handler is kvtax's doing, not vLLM's or the client's.
    if phase == "cutting":
        return "shutdown"
    if ex.upstream_broke:
        return "upstream_error"
    return "client_disconnected"


def record_of(ex: Facts, outcome: str, *, ended: float, slo: SloTargets) -> RequestRecord:
    """The ledger's record of a finished exchange whose outcome is ``outcome``."""
    delivered, upstream_tokens, prompt = _tokens(ex, outcome)
    timing = ex.timing
    completed = outcome == "completed"
    return RequestRecord(
        model=ex.model,
        outcome=outcome,
        delivered_tokens=delivered,
        credited_tokens=ex.credited,
        prompt_tokens=prompt,
        undelivered_tokens=max(0, upstream_tokens - delivered),
        forwarded=ex.status is not None or ex.sent,
        duration=ended - ex.started,
        ttft=timing.ttft if timing else None,
        itl=timing.itl if timing else None,
        stalls=tuple(timing.stalls) if timing else (),
        slo_met=completed and _slo_met(ex, delivered, slo),
        usage_missing=completed and _usage_missing(ex),
        api=ex.api,
    )


def _tokens(ex: Facts, outcome: str) -> tuple[int, int, int]:
    """(delivered, sent by vLLM, prompt) tokens, by outcome."""
    rw = ex.counter
    if rw is not None:
        upstream = rw.upstream_completion_tokens
        if outcome == "completed":
            # Every byte reached the client, so every token did.
            delivered = rw.final_completion_tokens or rw.completion_tokens
            return delivered, max(upstream, delivered), rw.prompt_tokens
        acks = ex.acks
        if acks is None:
            return 0, upstream, rw.prompt_tokens
        # Ended cleanly with the client still there (an error event, say): what was written
        # will reach it, as for a completed stream. A client that left has what it acked.
        reached = acks.written_tokens if ex.eof and not ex.client_gone else acks.confirmed
        return reached, upstream, rw.prompt_tokens
    if ex.usage is None or ex.status is None or ex.status >= 300:
        return 0, 0, 0
    completion, prompt = ex.usage
    # A non-streamed answer is useful only whole: all of it reached the client, or none.
    return (completion if outcome == "completed" else 0), completion, prompt


def _slo_met(ex: Facts, delivered: int, slo: SloTargets) -> bool:
    if ex.timing is not None:
        return ex.timing.meets(slo)
    if ex.status is not None and ex.status < 300 and ex.finished_at is not None:
        return meets_slo_unstreamed(ex.finished_at - ex.started, delivered, slo)
    return False


def _usage_missing(ex: Facts) -> bool:
    if ex.status is None or ex.status >= 300:
        return False
    if ex.counter is not None:
        return ex.counter.usage_lines == 0
    return ex.usage is None
