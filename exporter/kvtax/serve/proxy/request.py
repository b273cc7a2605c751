"""One accounted request, owned from its head to its ledger entry: :class:`AccountedRequest`.

A request to a generation API (:mod:`kvtax.delivery.dialects`) is answered by one object that
owns everything about it: its facts (:class:`~kvtax.serve.proxy.outcome.Facts`), its connection
to vLLM and the sink its answer is relayed into. It runs the request's steps in order:

1. **prepare**: the body, read once within ``--proxy.max-body`` (:func:`~kvtax.serve.proxy.
   prepare.prepare`), rewritten to ask vLLM for what counts each event, as the request's
   dialect says;
2. **admit**: with the gate on, its one call (:meth:`~kvtax.serve.proxy.gatekeeper.Gate.admit`),
   which may queue, clamp, or refuse the request;
3. **forward**: the request sent to vLLM on a pooled connection;
4. **relay**: vLLM's answer, read by read, into a sink: a stream through its dialect's counter,
   with the client's acknowledgements and the stream's timing, or a body whose usage is read
   as it passes;
5. **settle**: when it ends, however it ends, the outcome is decided once
   (:func:`~kvtax.serve.proxy.outcome.outcome_of`), the connection to vLLM goes back to the pool
   only after a completed answer, the gate's slot is freed, and the ledger settles one record.

A client that leaves cancels the request; the owner notes it and settles as it would otherwise.
Nothing outside this module writes a request's facts or decides its outcome.

What every request shares (the ledger, vLLM's pool, the gate, the relay's settings, the open
streams a scrape credits) is one :class:`Shared`, made by the proxy.

Example::

    request = AccountedRequest(exchange, dialect, shared)
    await request.run()        # answers the client and settles the ledger, however it ends
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from kvtax.delivery.asks import Scheme, UsageWish, asked_everything
from kvtax.delivery.cost import RelayCost
from kvtax.delivery.dialects import Dialect
from kvtax.delivery.ledger import RequestRecord
from kvtax.delivery.timing import SloTargets, StreamTiming
from kvtax.serve.proxy.acks import AckTracker, acknowledged
from kvtax.serve.proxy.answers import (
    shutting_down,
    too_large,
    undecodable,
    upstream_failure,
    vllm_refused,
    vllm_unavailable,
)
from kvtax.serve.proxy.client import Cut, Unreachable, Upstream, UpstreamBroke, UpstreamConnection
from kvtax.serve.proxy.form import FormTap, Upload
from kvtax.serve.proxy.forward import (
    coding_of,
    interim_to,
    is_event_stream,
    relay,
    response_framing,
    upstream_head,
)
from kvtax.serve.proxy.gatekeeper import CLOSED, Gate, Refused
from kvtax.serve.proxy.outcome import Facts, outcome_of, record_of
from kvtax.serve.proxy.prepare import UNNAMED, Prepared, prepare, prepare_form
from kvtax.serve.proxy.relay import (
    INFLATABLE,
    BodySink,
    InflatingStreamSink,
    RelaySettings,
    StreamSink,
)
from kvtax.serve.proxy.server import Exchange
from kvtax.serve.proxy.wire import Framing, Headers

__all__ = ["AccountedRequest", "Books", "Schemes", "Shared"]

log = logging.getLogger("kvtax.serve.proxy")

# A body past this is read, prepared and sized in separate turns of the event loop: each step
# costs a scan of its bytes (tens of ms for tens of MiB), and no stream waits on all of them.
_LARGE_BODY = 1024 * 1024
# How long such a request gives way between its steps. A turn (sleep(0)) is not enough: the
# request's next step is queued ahead of the tasks that the other connections' reads wake, and
# would run before them; a millisecond lets those run first.
_GIVE_WAY = 0.001


async def _give_way() -> None:
    """Let every other connection of the loop go first (a large body's next step waits)."""
    await asyncio.sleep(_GIVE_WAY)


class Schemes:
    """How streams were counted, for ``/metrics``, and the vLLM version whose streams came
    without the ids asked for: its later streams are counted by continuous usage."""

    def __init__(self, version: Callable[[], str | None], cost: RelayCost) -> None:
        self.version = version  # vLLM's version as the scrape last read it
        self.cost = cost
        self._ids_missing_in: str | None = None

    def ids_missing(self, version: str | None) -> bool:
        """Streams of vLLM ``version`` came without the ids asked for."""
        return version is not None and version == self._ids_missing_in

    def counted(self, scheme: Scheme, ids_missing: int) -> None:
        """A stream counted by ``scheme`` ended; ``ids_missing`` of its events lacked ids."""
        if scheme == "token_ids" and ids_missing:
            self.cost.schemes["events"] += 1
            version = self.version()
            if version is not None and version != self._ids_missing_in:
                self._ids_missing_in = version
                log.warning(
                    "vLLM %s streamed events without the token ids asked for; its streams are "
                    "counted by continuous usage from now on",
                    version,
                )
        else:
            self.cost.schemes[scheme] += 1


class Books(Protocol):
    """Where accounted requests are counted: the :class:`~kvtax.delivery.ledger.DeliveryLedger`,
    or in a proxy worker the link that reports to its parent's
    (:class:`~kvtax.serve.workers.child.Reporter`)."""

    def settle(self, record: RequestRecord) -> None: ...

    def credit(self, model: str | None, tokens: int, api: str | None = None) -> None: ...

    def learn(self, model: str) -> None: ...


@dataclass(slots=True, eq=False)
class Shared:
    """What every accounted request shares, made once by the proxy. ``streams`` holds the
    requests vLLM is answering (a scrape credits what their clients have so far);
    ``relaying`` the connections to vLLM being relayed, on any path (what shutdown cuts)."""

    upstream: Upstream
    ledger: Books
    relay: RelaySettings
    schemes: Schemes
    gate: Gate | None
    max_body: int
    timeout: float
    slo: SloTargets
    streams: set[AccountedRequest] = field(default_factory=set)
    relaying: set[UpstreamConnection] = field(default_factory=set)
    # Streams vLLM answered in a coding kvtax cannot inflate (not gzip or deflate).
    encoded_streams: int = 0


class AccountedRequest:
    """One accounted request and everything about it; see the module docstring."""

    __slots__ = ("_release", "api", "conn", "dialect", "exchange", "facts", "shared", "sink")

    def __init__(self, exchange: Exchange, dialect: Dialect, shared: Shared) -> None:
        self.exchange = exchange
        # The route's dialect names the request's API; ``api`` is the one its body resolved
        # to (a route of several), which counts it.
        self.dialect = dialect
        self.api = dialect
        self.shared = shared
        self.facts = Facts(started=shared.relay.clock(), api=dialect.name)
        self.conn: UpstreamConnection | None = None
        self.sink: StreamSink | BodySink | None = None
        self._release: Callable[[], None] | None = None  # frees the gate's slot

    async def run(self) -> None:
        """Answer the request and settle it, however it ends."""
        try:
            await self._answer()
        except asyncio.CancelledError:
            self.facts.client_gone = True  # the client left (its connection cancels us)
            raise
        finally:
            self._settle()

    def credit(self) -> None:
        """Count the tokens this stream's client acknowledged so far (at each scrape)."""
        facts = self.facts
        if facts.acks is None or facts.counter is None:
            return
        delivered = facts.acks.refresh()
        if delivered > facts.credited:
            self.shared.ledger.credit(facts.model, delivered - facts.credited, facts.api)
            facts.credited = delivered

    # -- prepare, admit ----------------------------------------------------------------------
    async def _answer(self) -> None:
        exchange, facts, shared = self.exchange, self.facts, self.shared
        if exchange.too_large:
            facts.model, facts.too_large = UNNAMED, True  # vLLM never saw it: not its default
            exchange.answer(too_large(shared.max_body, self.dialect))
            return
        if not self._may_go_on():
            facts.model, facts.turned_away = UNNAMED, True
            exchange.answer(shutting_down(self.dialect))
            return
        if self.dialect.form:
            await self._answer_form()
            return
        body = await exchange.whole_body()
        if body is None:
            facts.model = UNNAMED
            if exchange.refusal is not None:  # its chunked framing broke: never vLLM's
                facts.turned_away = True
                exchange.answer(exchange.refusal)
            else:
                facts.too_large = True
                exchange.answer(too_large(shared.max_body, self.dialect))
            return
        facts.started = shared.relay.clock()  # the request is whole: vLLM's part starts now
        large = len(body) > _LARGE_BODY
        if large:
            await _give_way()
        began = time.perf_counter()  # kvtax's forwarding of it, for its cost
        version = shared.schemes.version()
        prepared = prepare(
            body, self.dialect, version=version, ids_missing=shared.schemes.ids_missing(version)
        )
        del body  # the request's bytes are the prepared request's from here on
        facts.model, facts.scheme = prepared.model, prepared.scheme
        self.api = prepared.dialect or self.dialect
        gate = shared.gate
        if gate is None:
            await self._forward(prepared, began=began)
            return
        admitting = time.perf_counter()
        if large:
            await _give_way()
        verdict = await gate.admit(
            prepared, self.dialect, carried=exchange.carried, headers=exchange.head.headers
        )
        began += time.perf_counter() - admitting  # the gate's queue is not the relay's cost
        if isinstance(verdict, Refused):
            if verdict.reason == CLOSED:
                facts.turned_away = True  # shutdown began while it waited in the queue
            else:
                facts.shed = verdict.reason
            exchange.answer(verdict.answer)
            return
        self._release = verdict.release
        facts.prompt_bytes = verdict.prompt_bytes
        await self._forward(verdict.prepared, began=began)

    def _may_go_on(self) -> bool:
        """The request may go on to vLLM: kvtax is serving, or draining and the request was in
        flight as the drain began (its body still arriving, say), until the grace runs out."""
        phase = self.shared.relay.phase()
        return phase == "serving" or (phase == "draining" and self.exchange.carried)

    async def _admit_form(self, gate: Gate, early: Prepared) -> dict[str, str] | None:
        """An upload through the gate, on the fields read before its file: the fields its clamp
        sets (empty: none), or None when it was refused (and answered)."""
        exchange = self.exchange
        verdict = await gate.admit(
            early, self.dialect, carried=exchange.carried, headers=exchange.head.headers
        )
        if isinstance(verdict, Refused):
            if verdict.reason == CLOSED:
                self.facts.turned_away = True
            else:
                self.facts.shed = verdict.reason
            self.exchange.answer(verdict.answer)
            return None
        self._release = verdict.release
        own = early.written or {}
        written = verdict.prepared.written or {}
        return {key: value.decode() for key, value in written.items() if key not in own}

    # -- forward, relay ----------------------------------------------------------------------
    async def _forward(self, prepared: Prepared, *, began: float) -> None:
        """Send the request to vLLM and relay its answer. ``began``: when kvtax's forwarding
        of it began (perf_counter), for its cost."""
        exchange, upstream = self.exchange, self.shared.upstream
        head = upstream_head(exchange, upstream, prepared.size, identity=True)
        conn = await self._send(
            lambda: upstream.send((head, *prepared.parts), interim=interim_to(exchange)),
            began=began,
        )
        if conn is not None:
            await self._relay(conn, prepared.wish)

    async def _send(
        self, send: Callable[[], Awaitable[UpstreamConnection]], *, began: float
    ) -> UpstreamConnection | None:
        """vLLM's connection once its answer's head is in (``send`` sends the request); None
        when the client was answered instead (shutdown, or vLLM failed)."""
        exchange, facts, shared = self.exchange, self.facts, self.shared
        dialect = self.dialect
        if not self._may_go_on():
            facts.turned_away = True  # shutdown began: nothing new goes to vLLM
            exchange.answer(shutting_down(dialect))
            return None
        try:
            conn = await send()
        except Unreachable:
            if shared.gate is not None and shared.gate.settings.on:
                # The gate speaks for the pool: no engine to take it is a 503, not the relay's
                # 502, so a load balancer sends it to another replica.
                exchange.answer(vllm_unavailable(dialect))
            else:
                exchange.answer(upstream_failure(False, shared.timeout, dialect=dialect))
            return None
        except TimeoutError:
            facts.sent = True  # vLLM had the request: its HTTP counter counts it
            exchange.answer(upstream_failure(True, shared.timeout, dialect=dialect))
            return None
        except UpstreamBroke as exc:
            facts.sent = True
            if exchange.refusal is not None:  # the upload's framing broke as it streamed
                exchange.answer(exchange.refusal)
            else:
                exchange.answer(upstream_failure(False, shared.timeout, str(exc), dialect))
            return None
        except Cut:
            # The cut came before vLLM's status line; the connection is closed, so vLLM, which
            # had the request, aborts it.
            facts.sent = facts.turned_away = True
            exchange.answer(shutting_down(dialect))
            return None
        shared.relay.cost.forward.observe(conn.sent_at - began - conn.connecting)
        facts.status = conn.status
        self.conn = conn
        return conn

    async def _relay(self, conn: UpstreamConnection, wish: UsageWish | None) -> None:
        """vLLM's answer to the client, through the sink its kind takes, then its end's
        acknowledgements."""
        sink = self.sink = self._sink(conn, wish)
        if sink is None:
            return  # the client was answered instead; the connection closes as we settle
        self.shared.streams.add(self)
        source = sink if isinstance(sink, InflatingStreamSink) else None
        await relay(self.exchange, conn, sink, relaying=self.shared.relaying, source=source)
        await self._acknowledged()

    # -- an upload ---------------------------------------------------------------------------
    async def _answer_form(self) -> None:
        """An upload (its API's request is a multipart form): its fields read as it passes on
        to vLLM (:mod:`~kvtax.serve.proxy.form`), never held whole. The gate decides once the
        fields before the first file are in (clients send them first); the fields kvtax sets,
        the usage options by the fields read at the body's end and the gate's clamp, are
        written before the form's closing delimiter."""
        exchange, facts, shared = self.exchange, self.facts, self.shared
        dialect = self.dialect
        version = shared.schemes.version()
        ids_missing = shared.schemes.ids_missing(version)
        tap = FormTap.of(exchange.head.headers, dialect.read_keys)
        clamped: dict[str, str] = {}
        ended: list[Prepared] = []

        def extra(tap: FormTap) -> dict[str, str]:
            read = prepare_form(tap.fields, dialect, version=version, ids_missing=ids_missing)
            ended.append(read)
            return {**{k: v.decode() for k, v in (read.written or {}).items()}, **clamped}

        upload = Upload(
            tap, holder=exchange.upstream_holder, limit=exchange.body_buffer, extra=extra
        )
        exchange.stream_body(upload)
        await upload.ready
        if exchange.refusal is not None:  # its chunked framing broke: never vLLM's
            facts.model, facts.turned_away = UNNAMED, True
            exchange.answer(exchange.refusal)
            return
        early = prepare_form(tap.fields, dialect, version=version, ids_missing=ids_missing)
        facts.model, facts.scheme = (UNNAMED if tap.broken else early.model), early.scheme
        began = time.perf_counter()
        if shared.gate is not None:
            admitting = time.perf_counter()
            admitted = await self._admit_form(shared.gate, early)
            began += time.perf_counter() - admitting
            if admitted is None:
                return
            clamped.update(admitted)
        head = upstream_head(exchange, shared.upstream, None, identity=True, chunked=True)
        conn = await self._send(
            lambda: shared.upstream.send(
                head,
                streamed=upload.attach,
                chunked=True,
                holder=exchange.upstream_holder,
                interim=interim_to(exchange),
            ),
            began=began,
        )
        if conn is None:
            return
        read = ended[-1] if ended else early  # vLLM read the whole form before answering
        if not tap.broken:
            facts.model = read.model
        facts.scheme = read.scheme
        # A stream is counted as asked for only when the fields were set (or none were needed).
        wish = read.wish if upload.set or not read.written else None
        await self._relay(conn, wish)

    async def _acknowledged(self) -> None:
        """The answer is written: wait for the client's acknowledgements of it
        (:func:`~kvtax.serve.proxy.acks.acknowledged`). A client that leaves meanwhile, or
        takes nothing for ``send_timeout`` (its connection is then aborted), is gone: what it
        did not acknowledge, it never had."""
        facts, exchange = self.facts, self.exchange
        facts.answered_at = self.shared.relay.clock()
        if facts.acks is None:
            return
        ending = await acknowledged(
            facts.acks,
            gone=lambda: exchange.disconnected or self.shared.relay.phase() == "cutting",
            patience=exchange.flow.send_timeout,
        )
        if ending == "stalled":
            exchange.flow.give_up()
        if ending != "acknowledged":
            facts.client_gone = True

    def _sink(
        self, conn: UpstreamConnection, wish: UsageWish | None
    ) -> StreamSink | BodySink | None:
        """Where vLLM's answer goes: a stream is counted and cut (inflated first if vLLM
        gzipped it though asked for identity), anything else is read as it passes. None when
        the client was answered instead: a stream in a coding kvtax cannot read would hand the
        client usage it did not ask for."""
        exchange, facts, shared = self.exchange, self.facts, self.shared
        ok = conn.status < 300
        if ok and facts.model is not None:
            shared.ledger.learn(facts.model)
        stream = wish is not None and ok and is_event_stream(conn)
        coding = coding_of(conn) if ok else None
        if stream and coding is not None and coding not in INFLATABLE:
            assert wish is not None
            shared.encoded_streams += 1
            if not asked_everything(wish, facts.scheme):
                exchange.answer(undecodable(coding.decode("latin-1"), self.dialect))
                return None
            stream = False  # the client asked for all kvtax did: it passes unread
        decoded = stream and coding is not None
        added: Headers = []
        if conn.status == 503 and shared.gate is not None and shared.gate.settings.on:
            added = vllm_refused(conn.headers)
            shared.gate.refused_by_vllm()
        framing, head = response_framing(
            exchange, conn, rewritten=stream, decoded=decoded, added=added
        )
        facts.acks = acks = AckTracker(exchange.transport, unsent=len(head))
        relaying = shared.relay
        if not stream:
            return BodySink(
                exchange,
                framing,
                head,
                acks=acks,
                scan=self.api.usage_of if ok else None,
                clock=relaying.clock,
                cost=relaying.cost,
            )
        assert wish is not None
        return self._stream_sink(conn, wish, framing, head, acks, inflate=decoded)

    def _stream_sink(
        self,
        conn: UpstreamConnection,
        wish: UsageWish,
        framing: Framing,
        head: bytes,
        acks: AckTracker,
        *,
        inflate: bool,
    ) -> StreamSink:
        """A stream's sink, counted by its dialect's counter and timed; ``inflate``: vLLM
        compressed it. It frees the gate's slot once its end went out, though vLLM's connection
        may not."""
        facts, relaying = self.facts, self.shared.relay
        facts.counter = counter = self.api.counter(
            wish, facts.scheme, budget=relaying.held, fingerprints=relaying.fingerprints
        )
        facts.timing = timing = StreamTiming(
            facts.started, relaying.stall_factor, relaying.stall_min
        )
        make: Callable[..., StreamSink] = (
            functools.partial(InflatingStreamSink, upstream=conn) if inflate else StreamSink
        )
        return make(
            self.exchange,
            framing,
            head,
            counter=counter,
            timing=timing,
            acks=acks,
            relay=relaying,
            dialect=self.api,
            on_done=self._release,
        )

    # -- settle ------------------------------------------------------------------------------
    def _settle(self) -> None:
        """The request is over: its outcome, decided once, settles everything it holds."""
        facts, shared = self.facts, self.shared
        shared.streams.discard(self)
        if self.sink is not None:
            noted(facts, self.sink)
        acks = facts.acks
        if acks is not None:
            # A last reading (the client may have acknowledged since), a write it took part
            # of counted by its share.
            acks.refresh(partial=True)
        outcome = outcome_of(facts, shared.relay.phase())
        conn = self.conn
        if conn is not None:
            if outcome == "completed" and facts.eof:
                # vLLM's end may still be on its way (a stream's answer ends for the client
                # with its last event): the pool takes it back once it comes.
                shared.upstream.release(conn)
            else:
                # Closing (not releasing) drops the connection: vLLM sees the disconnect and
                # aborts the request, freeing its KV blocks.
                conn.close()
        if self._release is not None:
            self._release()
        if acks is not None:
            acks.close()
        counter = facts.counter
        if counter is not None:
            shared.schemes.counted(facts.scheme, counter.ids_missing)
        ended = facts.answered_at if facts.answered_at is not None else shared.relay.clock()
        record = record_of(facts, outcome, ended=ended, slo=shared.slo)
        shared.ledger.settle(record)
        gate = shared.gate
        if gate is not None and facts.prompt_bytes and record.prompt_tokens:
            gate.learn(facts.prompt_bytes, record.prompt_tokens)


def noted(facts: Facts, sink: StreamSink | BodySink) -> None:
    """What the relay saw of the answer, into the request's facts (its owner does this once,
    as the request ends)."""
    facts.wrote_all = sink.wrote_all
    facts.eof = sink.eof
    facts.upstream_broke = sink.broke_off
    if isinstance(sink, BodySink):
        facts.usage = sink.usage
        facts.finished_at = sink.finished_at
