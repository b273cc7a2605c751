"""The gate at the I/O edge: a bounded, ordered queue in front of a cap on requests
(and, in budget mode, on KV blocks) in flight.

The decisions are pure functions of :mod:`kvtax.gate`; this module holds the state they
act on. :meth:`Gate.enter` admits a request at once when it fits and would head the queue,
else queues it, or sheds it at once with a reason: ``queue_full`` past ``--gate.max-queue``,
``wait_predicted`` when the requests' service time says it would wait past half of
``--gate.max-wait`` (:func:`~kvtax.gate.order.foretold_wait`,
:data:`~kvtax.gate.order.FORETOLD_SHARE`). A queued request is admitted in
:mod:`~kvtax.gate.order` as slots free, or shed as ``wait_expired`` once it did wait that
long: the backstop for a wait that ran longer than foretold, or that nothing could foretell.
A queued client that goes away (its handler is cancelled) leaves the queue at once.
:meth:`Gate.leave` frees the slot when the request ends (for a stream, once its ``[DONE]`` or
final usage event went to the client). :meth:`Gate.observe` steps the cap once a scrape: the
scrape hands each fold's figures to :meth:`Gate.on_figures` (a subscriber of the scrape job,
wired in :mod:`kvtax.serve.wiring`), which logs and outlives any error of one step. The
figures also carry vLLM's KV block size, which footprints are counted in unless
``--gate.block-size`` is given (a ticket keeps the blocks it was issued with).

The queue is a heap whose leavers are only marked (dropped when they reach its head, or when
half the heap is such): a client leaving, a wait expiring and shutdown's cancel-all cost O(1)
each (amortized O(log N)), not a rebuild of the queue each, which took O(N**2) for N leaving
at once.
When kvtax shuts down, :meth:`Gate.close` turns every queued request away at once
(:data:`CLOSED`) and admits nothing more.

With ``--gate.mode=off`` the proxy holds no gate; this object still steps the controller
so that ``/metrics`` publishes the cap ``auto`` would set (the advice).

The proxy asks the gate one thing per request, :meth:`Gate.admit`: the request's body as
:func:`~kvtax.serve.proxy.prepare.prepare` read it, and its API's dialect, which says what the
request states (its prompt's size, output limit and ``n``) and how to lower its limit. The
answer is :class:`Admitted` (the body to send, its ``max_tokens`` perhaps clamped by the token
budget, and the one :meth:`Admitted.release` that frees the slot, however often it is called)
or :class:`Refused` (the answer to give, and the reason, which is the request's outcome).

Example::

    gate = Gate(GateSettings(CapSettings(mode="adaptive")))
    verdict = await gate.admit(prepared, COMPLETIONS)
    if isinstance(verdict, Refused):
        exchange.answer(verdict.answer)
    else:
        ...  # send verdict.prepared to vLLM
        verdict.release()
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace

from kvtax.delivery.dialects import Dialect
from kvtax.delivery.ledger import HistogramAccumulator
from kvtax.expose.samples import HistogramSample, Sample
from kvtax.figures.derive import ModelFigures
from kvtax.gate.cap import CapSettings, CapState, block_size_of, initial, step
from kvtax.gate.fair import FairShares, Holdings
from kvtax.gate.footprint import (
    MAX_FOOTPRINT,
    OverBudget,
    TokenEstimator,
    blocks_of,
    check_budget,
    footprint_of,
)
from kvtax.gate.order import (
    FORETOLD_SHARE,
    CompletionRate,
    Order,
    ServiceTime,
    foretold_wait,
    queue_key,
    retry_after,
)
from kvtax.gate.signals import Totals, signals_of
from kvtax.serve.proxy.answers import over_budget, shed, shutting_down
from kvtax.serve.proxy.prepare import Prepared
from kvtax.serve.proxy.wire import Answer

# A waiting request's place: (-band, round, then --gate.order's key); smaller goes first.
QueueKey = tuple[int, int, tuple[int, int]]

__all__ = [
    "CLOSED",
    "REASONS",
    "WAIT_BUCKETS",
    "Admitted",
    "Gate",
    "GateSettings",
    "Refused",
    "Ticket",
]

# The logger keeps the name it had before this module was renamed: log filters name it.
log = logging.getLogger("kvtax.serve.proxy.gate")

# The gate's own refusals, then vLLM's 503s behind it (its own queue caps): counted beside them,
# as the answers a client of the gated pool got instead of a generation.
REASONS = ("queue_full", "wait_predicted", "wait_expired", "over_budget", "vllm_refused")
# What enter() says once close() ran: kvtax is shutting down (not a shed, not counted as one).
CLOSED = "shutdown"
WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
# The heap is rebuilt without its leavers once they are more than this share of it.
_COMPACT_AT = 0.5


@dataclass(frozen=True, slots=True)
class GateSettings:
    cap: CapSettings = field(default_factory=CapSettings)
    max_queue: int = 256
    max_wait: float = 30.0
    order: Order = "fifo"
    token_budget: int | None = None
    over_budget: OverBudget = "reject"
    # The completion length assumed for a request that states no max_tokens (the model's
    # max length); unset: the whole KV pool, the true worst case.
    max_model_len: int | None = None
    # Fair shares (kvtax.gate.fair): the headers (lower case) naming a request's key, served
    # round-robin with the other keys of its band, and its priority band, served strictly.
    fairness_header: bytes | None = None
    priority_header: bytes | None = None
    # With a fairness header: a slot kept free for each quiet key (kvtax.gate.fair).
    fair_reserve: bool = False

    @property
    def on(self) -> bool:
        return self.cap.mode != "off"


@dataclass(slots=True, eq=False)
class Ticket:
    """One request at the gate: its worst-case footprint and where it stands."""

    seq: int
    footprint: int  # prompt + max_tokens, tokens
    blocks: int
    arrived: float
    admitted: bool = False
    admitted_at: float = 0.0  # the gate's clock when it was let through
    waiter: asyncio.Future[None] | None = None
    queued: bool = False  # in the queue's heap and not gone (a leaver's entry stays, unmarked)
    band: int = 0  # its priority band (higher first); 0 without fair shares
    turn: int = 0  # its round within its band (kvtax.gate.fair); 0 without fair shares
    key: bytes = b""  # its fairness key; empty without fair shares


@dataclass(slots=True, eq=False)
class Admitted:
    """A request the gate let through: ``prepared`` goes to vLLM (clamped, if it was).
    ``prompt_bytes`` is the prompt's measure that vLLM's count of it corrects (0: it has media,
    which teach nothing)."""

    gate: Gate
    ticket: Ticket
    prepared: Prepared
    prompt_bytes: int

    def release(self) -> None:
        """The request is over for vLLM: its slot and blocks go to the next in line. Only the
        first call frees them."""
        self.gate.leave(self.ticket)


@dataclass(frozen=True, slots=True)
class Refused:
    """A request the gate answered itself: ``reason`` is a :data:`REASONS` entry, or
    :data:`CLOSED` (shutdown began while it waited)."""

    answer: Answer
    reason: str


class Gate:
    def __init__(self, settings: GateSettings, *, clock: Callable[[], float] = time.monotonic):
        self.settings = settings
        self.clock = clock
        self.state: CapState = initial(settings.cap)
        self.in_flight = 0
        self.blocks_in_flight = 0
        self.admitted = 0
        self.rejections = dict.fromkeys(REASONS, 0)
        self.waits = HistogramAccumulator(WAIT_BUCKETS)
        self.estimator = TokenEstimator()
        self.capacity_tokens: float | None = None
        # vLLM's KV block size as the last scrape that showed it said (see block_size).
        self.vllm_block_size: int | None = None
        # A heap of (key, ticket); the key holds the ticket's unique seq, so tickets are never
        # compared. Entries of tickets that left stay until they reach the head or compaction.
        self._queue: list[tuple[QueueKey, Ticket]] = []
        self.shares = FairShares()
        self._fair = settings.fairness_header is not None or settings.priority_header is not None
        self.holdings = Holdings()
        self._reserve = self._fair and settings.fair_reserve
        self._waiting = 0  # tickets in the heap still queued
        self.closed = False  # shutdown began: close() emptied the queue, enter() refuses
        self._seq = itertools.count()
        self._done = CompletionRate(clock())
        self._service = ServiceTime()
        self._flying: set[Ticket] = set()  # admitted and not yet left: their ages foretell waits
        self._footprints: deque[int] = deque(maxlen=256)
        self._totals: Totals = {}

    def refused_by_vllm(self) -> None:
        """vLLM answered a request the gate let through with its own 503: its queue caps
        (``--max-num-queued-reqs``/``-tokens``) refused it. Counted; the scrape's
        ``vllm:admission_rejections`` then steps the adaptive cap below vLLM's."""
        self.rejected("vllm_refused")

    def rejected(self, reason: str) -> None:
        """Count one refusal (a :data:`REASONS` entry) decided outside :meth:`enter`."""
        self.rejections[reason] += 1

    # -- the one call --------------------------------------------------------------------------
    async def admit(
        self,
        prepared: Prepared,
        dialect: Dialect,
        *,
        carried: bool = False,
        headers: Sequence[tuple[bytes, bytes]] = (),
    ) -> Admitted | Refused:
        """Let ``prepared`` (a request of ``dialect``'s API) through, perhaps after a wait in
        the queue, or refuse it: 400 over the token budget, 429 shed, 503 when shutdown began.
        ``carried``: the request was in flight when shutdown began (its body still arriving),
        and is let through the closed gate at once, within the budget. ``headers``: the
        request's, for its fair share (its key and band, when those headers are set).
        The gate reads the JSON :func:`~kvtax.serve.proxy.prepare.prepare` read: the body is
        parsed once, and both see the same request."""
        dialect = prepared.dialect or dialect  # the API a route of several resolved to
        shape = dialect.shape(prepared.payload, whole=prepared.size)
        prompt = self.estimator.estimate(shape.prompt_bytes)
        budgeted = self._budgeted(
            prepared, dialect, shape.max_tokens, prompt=prompt, prompts=shape.prompts, n=shape.n
        )
        if isinstance(budgeted, str):
            self.rejected("over_budget")
            return Refused(over_budget(budgeted, dialect), "over_budget")
        admitted, limit = budgeted
        ticket, reason = await self.let_in(
            prompt, limit, prompts=shape.prompts, n=shape.n, headers=headers, carried=carried
        )
        if reason == CLOSED:
            return Refused(shutting_down(dialect), CLOSED)
        if reason is not None:
            return Refused(shed(reason, self.retry_after(), dialect), reason)
        # Only a text prompt teaches the estimator: vLLM's count of a prompt with images
        # includes theirs, which no byte of it shows.
        return Admitted(self, ticket, admitted, 0 if shape.media else shape.prompt_bytes)

    def _budgeted(
        self,
        prepared: Prepared,
        dialect: Dialect,
        max_tokens: int | None,
        *,
        prompt: int,
        prompts: int,
        n: int,
    ) -> tuple[Prepared, int | None] | str:
        """The request to send and its completion limit under the token budget, or why it is
        refused. A body that is not a JSON object has no limit to check or set: vLLM refuses
        it with its own 400."""
        payload = prepared.payload
        budget = self.settings.token_budget if isinstance(payload, dict) else None
        over = self.settings.over_budget
        verdict = check_budget(prompt, max_tokens, budget, over, prompts=prompts, n=n)
        if verdict.action == "reject":
            return verdict.message
        if verdict.action == "ok" or verdict.max_tokens is None:
            return prepared, max_tokens
        clamped = prepared.with_fields(dialect.limit_fields(payload, verdict.max_tokens))
        if clamped is None:  # a value kvtax cannot write: refused as `reject` would
            return check_budget(prompt, max_tokens, budget, "reject", prompts=prompts, n=n).message
        return clamped, verdict.max_tokens

    async def let_in(
        self,
        prompt: int,
        limit: int | None,
        *,
        prompts: int,
        n: int,
        headers: Sequence[tuple[bytes, bytes]],
        carried: bool,
    ) -> tuple[Ticket, str | None]:
        """A request sized and budgeted, at the door: its ticket, and None (admitted) or why
        it was not (:meth:`enter`). A proxy worker's gate asks its parent's instead
        (:class:`~kvtax.serve.workers.gate.RemoteGate`)."""
        ticket = self.ticket(prompt, limit, prompts=prompts, n=n, headers=headers)
        return ticket, await self.enter(ticket, carried=carried)

    # -- sizing ------------------------------------------------------------------------------
    def ticket(
        self,
        prompt: int,
        max_tokens: int | None,
        *,
        prompts: int = 1,
        n: int = 1,
        headers: Sequence[tuple[bytes, bytes]] = (),
    ) -> Ticket:
        """A ticket for a request of about ``prompt`` tokens (the caller estimated them for the
        token budget already; all ``prompts`` of a prompt list together) whose completion
        limit is ``max_tokens``, for ``n`` sequences of each prompt
        (:func:`~kvtax.gate.footprint.footprint_of`)."""
        prompts, n = max(1, prompts), max(1, n)
        each = -(-prompt // prompts)  # a prompt's tokens, rounded up
        completion = max_tokens if max_tokens is not None else self._assumed_completion(each)
        footprint = footprint_of(prompt, completion, prompts=prompts, n=n)
        self._footprints.append(footprint)
        # Each sequence holds whole blocks of its own.
        sequence = footprint_of(each, completion)
        blocks = min(MAX_FOOTPRINT, blocks_of(sequence, self.block_size) * prompts * n)
        ticket = Ticket(
            seq=next(self._seq), footprint=footprint, blocks=blocks, arrived=self.clock()
        )
        if self._fair:  # its band and key from ``headers``, its round from its key's last
            settings = self.settings
            ticket.band, ticket.key = self.shares.classify(
                headers, fairness=settings.fairness_header, priority=settings.priority_header
            )
            ticket.turn = self.shares.turn(ticket.band, ticket.key)
            if self._reserve:
                self.holdings.seen((ticket.band, ticket.key), ticket.arrived)
        return ticket

    @property
    def block_size(self) -> int:
        """The KV block size tickets are counted in (:func:`~kvtax.gate.cap.block_size_of`):
        the flag's, else vLLM's own once a scrape showed it, else 16. A ticket issued before
        it changed keeps the blocks it was counted in, and gives back those same blocks when it
        leaves: until then, the blocks in flight mix the two sizes."""
        return block_size_of(self.settings.cap, self.vllm_block_size)

    def _assumed_completion(self, prompt: int) -> int:
        if self.settings.max_model_len is not None:
            return max(1, self.settings.max_model_len - prompt)
        if self.capacity_tokens is not None:
            return max(1, math.floor(self.capacity_tokens) - prompt)
        return 2048

    def learn(self, prompt_bytes: int, prompt_tokens: int) -> None:
        """Correct the prompt estimate from a prompt vLLM counted."""
        self.estimator = self.estimator.learned(prompt_bytes, prompt_tokens)

    @property
    def footprint_p95(self) -> float | None:
        if not self._footprints:
            return None
        ordered = sorted(self._footprints)
        return float(ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)])

    # -- the queue ---------------------------------------------------------------------------
    @property
    def queued(self) -> int:
        return self._waiting

    def fits(self, ticket: Ticket) -> bool:
        return self._room_for(ticket) and self._may_take_free_slot(ticket)

    def _may_take_free_slot(self, ticket: Ticket) -> bool:
        """Reserve (kvtax.gate.fair): in budget mode the slots are as many requests of
        ``ticket``'s size as the KV blocks hold, since its count cap is the ceiling."""
        if not self._reserve:
            return True
        return self.holdings.may_take(
            (ticket.band, ticket.key),
            cap=self._slots_for(ticket),
            in_flight=self.in_flight,
            now=self.clock(),
        )

    def _room_for(self, ticket: Ticket) -> bool:
        if self.in_flight >= self.state.cap:
            return False
        budget = self.state.budget_blocks
        # One request alone is always let through, however large: it could never fit otherwise.
        if budget is None or self.in_flight == 0:
            return True
        return self.blocks_in_flight + ticket.blocks <= budget

    async def enter(self, ticket: Ticket, *, carried: bool = False) -> str | None:
        """Admit ``ticket`` (None) or say why it is shed. Cancellation while queued (the client
        left) takes it out of the queue, or frees the slot it was just given. :data:`CLOSED`:
        shutdown began before it was admitted (unless ``carried``: in flight as it began, and
        admitted at once, the queue being closed)."""
        if self.closed:
            if not carried:
                return CLOSED
            self._admit(ticket)
            return None
        if self._goes_first(ticket) and self.fits(ticket):
            self._admit(ticket)
            return None
        if self._waiting >= self.settings.max_queue:
            self.rejections["queue_full"] += 1
            return "queue_full"
        if self._foretold_too_long(ticket):
            self.rejections["wait_predicted"] += 1
            return "wait_predicted"
        ticket.waiter = asyncio.get_running_loop().create_future()
        heapq.heappush(self._queue, (self._key(ticket), ticket))
        ticket.queued = True
        self._waiting += 1
        if self._reserve:  # the heads may be keys kept from the free slots; this one not
            self._pump()
        try:
            async with asyncio.timeout(self.settings.max_wait):
                await ticket.waiter
        except TimeoutError:
            if ticket.admitted:  # admitted just as the wait ran out
                return None
            self._drop(ticket)
            self.rejections["wait_expired"] += 1
            return "wait_expired"
        except asyncio.CancelledError:
            if ticket.admitted:
                self.leave(ticket)
            else:
                self._drop(ticket)
            raise
        return None if ticket.admitted else CLOSED  # close() woke it without a slot

    def _goes_first(self, ticket: Ticket) -> bool:
        """``ticket`` would head the queue: nobody waits, or (``shortest``) it is smaller than
        the head. Such a request that fits is admitted at once; queueing it would leave it
        waiting behind a head that does not fit until the next leave or scrape. FIFO never
        passes anyone: a newcomer's key is always the largest."""
        head = self._head()
        return head is None or self._key(ticket) < self._queue[0][0]

    def _foretold_too_long(self, ticket: Ticket) -> bool:
        """``ticket``, which must queue, would wait past :data:`FORETOLD_SHARE` of
        ``--gate.max-wait`` (a foretold wait is of means, and half the requests let in on one
        near the bound would wait it out): the requests ahead of it and itself, as the requests
        in flight leave by their age and the service time
        (:func:`~kvtax.gate.order.foretold_wait`). Refused now, its client can go elsewhere
        while waiting there still helps.

        The first request to queue is judged too: it queues because those in flight fill the
        cap, and they free it at the pace their service time says, whatever the traffic before.
        In ``shortest`` order only the requests it would follow count, and they are counted only
        when everyone queued would be too many. In budget mode a head too large for the blocks
        left can wait longer than foretold: ``wait_expired`` stays the backstop."""
        samples, service_time = self._service.reading()
        now, limit = self.clock(), self.settings.max_wait
        ages = [now - t.admitted_at for t in self._flying]
        durations = self._service.durations()

        def too_long(ahead: int) -> bool:
            wait = foretold_wait(
                ahead=ahead,
                ages=ages,
                cap=self._slots_for(ticket),
                samples=samples,
                durations=durations,
                mean=service_time,
            )
            return wait is not None and wait > limit * FORETOLD_SHARE

        everyone = too_long(self._waiting)
        if not everyone or (self.settings.order == "fifo" and not self._fair):
            return everyone
        return too_long(self._ahead(self._key(ticket)))

    def _slots_for(self, ticket: Ticket) -> int:
        """The requests let in at once, as the queue's wait counts them: the cap, or in budget
        mode as many requests of ``ticket``'s size as the KV blocks hold (the count cap there
        is the ceiling, which would foretell no wait at all)."""
        budget = self.state.budget_blocks
        if budget is None:
            return self.state.cap
        return max(1, min(self.state.cap, budget // max(1, ticket.blocks)))

    def _ahead(self, key: QueueKey) -> int:
        """Queued tickets whose key is below ``key``: those the queue serves first. The walk of
        the heap stops at each entry not below ``key`` (nothing beneath it in the heap is), so
        it costs the entries below ``key``, not the whole queue."""
        queue, count = self._queue, 0
        stack = [0] if queue else []
        while stack:
            i = stack.pop()
            entry, ticket = queue[i]
            if not entry < key:
                continue
            count += ticket.queued  # a leaver's entry stays in the heap; it is not ahead
            stack.extend(child for child in (2 * i + 1, 2 * i + 2) if child < len(queue))
        return count

    def _key(self, ticket: Ticket) -> QueueKey:
        order = queue_key(self.settings.order, seq=ticket.seq, footprint=ticket.footprint)
        return (-ticket.band, ticket.turn, order)

    def _admit(self, ticket: Ticket) -> None:
        if self._fair:
            self.shares.served(ticket.band, ticket.turn)
        if self._reserve:
            self.holdings.took((ticket.band, ticket.key))
        ticket.admitted = True
        ticket.admitted_at = now = self.clock()
        self._flying.add(ticket)
        self.in_flight += 1
        self.blocks_in_flight += ticket.blocks
        self.admitted += 1
        self.waits.observe(now - ticket.arrived)
        if ticket.waiter is not None and not ticket.waiter.done():
            ticket.waiter.set_result(None)

    def _drop(self, ticket: Ticket) -> None:
        """``ticket`` leaves the queue: marked, its entry left for :meth:`_head` or
        :meth:`_compact` to remove, so that N leaving at once is O(N), not N rebuilds."""
        if not ticket.queued:
            return
        ticket.queued = False
        self._waiting -= 1
        if len(self._queue) > 64 and self._waiting < _COMPACT_AT * len(self._queue):
            self._compact()
        self._pump()  # a large head leaving can let smaller ones in

    def _compact(self) -> None:
        """Rebuild the heap of the tickets still queued: O(N), once per N/2 leavers at least."""
        self._queue = [entry for entry in self._queue if entry[1].queued]
        heapq.heapify(self._queue)

    def _head(self) -> Ticket | None:
        """The first ticket still queued; the entries of leavers before it are dropped."""
        queue = self._queue
        while queue and not queue[0][1].queued:
            heapq.heappop(queue)
        return queue[0][1] if queue else None

    def _pump(self) -> None:
        """Admit from the head while there is room. A head whose key may not take the slots
        kept free for quiet keys (--gate.fair-reserve) is set aside for this pass, so the keys
        behind it get their turn."""
        aside: list[tuple[QueueKey, Ticket]] = []
        while (head := self._head()) is not None and self._room_for(head):
            entry = heapq.heappop(self._queue)
            if not self._may_take_free_slot(head):
                aside.append(entry)
                continue
            head.queued = False
            self._waiting -= 1
            self._admit(head)
        for entry in aside:
            heapq.heappush(self._queue, entry)

    def leave(self, ticket: Ticket) -> None:
        """The request ended: its slot and blocks go to the next in line."""
        if not ticket.admitted:
            return
        ticket.admitted = False
        self._flying.discard(ticket)
        if self._reserve:
            self.holdings.gave((ticket.band, ticket.key))
        self.in_flight -= 1
        self.blocks_in_flight -= ticket.blocks
        now = self.clock()
        self._done.add(now)
        self._service.add(now - ticket.admitted_at)
        self._pump()

    def close(self) -> None:
        """kvtax is shutting down: turn every queued request away now, not at max-wait.

        Nothing is admitted afterwards, as the queue stays empty: a slot freed by a request
        that ends would otherwise send vLLM new work while the proxy is stopping.
        """
        self.closed = True
        queued, self._queue, self._waiting = self._queue, [], 0
        for _, ticket in queued:
            if not ticket.queued:
                continue
            ticket.queued = False
            if ticket.waiter is not None and not ticket.waiter.done():
                ticket.waiter.set_result(None)

    def retry_after(self) -> int:
        """Seconds a shed client should wait, from the current completion rate (Retry-After;
        :class:`~kvtax.gate.order.CompletionRate`)."""
        completions, span = self._done.reading(self.clock())
        return retry_after(
            ahead=self._waiting, completions=completions, span=span, limit=self.settings.max_wait
        )

    # -- the controller ----------------------------------------------------------------------
    def observe(self, figures: Mapping[str, ModelFigures]) -> None:
        """Step the cap from one scrape's figures, then admit what now fits."""
        signals, self._totals = signals_of(
            figures,
            self._totals,
            queued=self._waiting,
            in_flight=self.in_flight,
            footprint_p95=self.footprint_p95,
        )
        if signals.capacity_tokens is not None:
            self.capacity_tokens = signals.capacity_tokens
        if signals.service_time is not None:
            self._service.seed(signals.service_time)
        self._learn_block_size(signals.block_size)
        # A scrape that lacks it (vLLM down) keeps the last one seen, as the tickets do.
        signals = replace(signals, block_size=self.vllm_block_size)
        before = self.state
        self.state = step(before, signals, self.settings.cap)
        if self.state.cap != before.cap and self.settings.on:
            log.info("gate cap %d -> %d (%s)", before.cap, self.state.cap, self.state.source)
        self._pump()

    def _learn_block_size(self, seen: int | None) -> None:
        if seen is None or seen == self.vllm_block_size:
            return
        self.vllm_block_size = seen
        if self.settings.cap.block_size is None:
            log.info("gate: vLLM's KV blocks hold %d tokens; footprints count in those", seen)

    def on_figures(self, figures: Mapping[str, ModelFigures]) -> None:
        """The scrape's new figures (the scrape job calls this after each fold): step the cap. An
        error of one step is logged here, with the cap it leaves, and the next scrape is stepped
        as usual: an error must never hold the cap where it was for good, silently."""
        try:
            self.observe(figures)
        except Exception:
            log.exception(
                "gate: stepping the cap failed; it stays at %d until the next scrape",
                self.state.cap,
            )

    def samples(self) -> Iterator[Sample | HistogramSample]:
        """The gate's metrics (see kvtax.expose.catalog_gate)."""
        state = self.state
        if state.advice is not None:
            yield Sample("kvtax_gate_advised_cap", (), float(state.advice))
        if not self.settings.on:
            return
        yield Sample("kvtax_gate_cap", (self.settings.cap.mode, state.source), float(state.cap))
        if state.budget_blocks is not None:
            yield Sample("kvtax_gate_budget_blocks", (), float(state.budget_blocks))
        yield Sample("kvtax_gate_blocks_in_flight", (), float(self.blocks_in_flight))
        yield Sample("kvtax_gate_requests_in_flight", (), float(self.in_flight))
        yield Sample("kvtax_gate_queue_depth", (), float(self._waiting))
        yield Sample("kvtax_gate_admitted_total", (), float(self.admitted))
        for reason, n in self.rejections.items():
            yield Sample("kvtax_gate_rejections_total", (reason,), float(n))
        yield Sample("kvtax_gate_cap_changes_total", ("up",), float(state.raises))
        yield Sample("kvtax_gate_cap_changes_total", ("down",), float(state.cuts))
        counts = self.waits.counts()
        yield HistogramSample("kvtax_gate_queue_wait_seconds", (), counts.buckets, counts.sum)
