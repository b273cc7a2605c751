"""The OpenAI-compatible reverse proxy in front of vLLM: relays every byte, counts what arrived.

:class:`Proxy` listens with asyncio Protocols (:mod:`~kvtax.serve.proxy.client`), each request
an :class:`~kvtax.serve.proxy.exchange.Exchange` from its head to its answer's last byte, and
sends to vLLM on a keep-alive pool (:mod:`~kvtax.serve.proxy.upstream`), both parsing HTTP/1.1
with httptools (llhttp). A ``POST`` that vLLM will route to ``/v1/completions`` or
``/v1/chat/completions`` (whatever form its target takes: :func:`~kvtax.serve.proxy.head.
route_of`) is relayed with accounting; every other request passes through untouched, its body
streamed to vLLM as it arrives. Responses are relayed as their bytes arrive, one client write
per read of vLLM's, never held whole (:mod:`~kvtax.serve.proxy.relay`). The proxy asks vLLM for
what counts each event's tokens (:mod:`kvtax.delivery.asks`: token ids, or continuous usage
where ids are missing) and trims it back to what the client asked for
(:mod:`kvtax.delivery.sse`); a non-streamed body's usage is read as it passes
(:mod:`kvtax.delivery.usage`). Tokens count as delivered once the client's TCP stack
acknowledged the bytes carrying them (:mod:`~kvtax.serve.proxy.acks`). A client that goes away
cancels its request, which closes the upstream connection at once, so vLLM aborts the request
and frees its KV.

Each accounted request gathers facts in a :class:`~kvtax.serve.proxy.outcome.Facts` as it
goes; when it ends, however it ends, :func:`~kvtax.serve.proxy.outcome.outcome_of` decides its
outcome from those facts and the proxy's one shutdown state (:attr:`Proxy.state`), and the
ledger settles one record.

With the gate (:mod:`kvtax.serve.proxy.gate`, ``--gate.mode`` other than ``off``) an
accounted request passes the gate's one call, :meth:`~kvtax.serve.proxy.gate.Gate.admit`, after
its body is read and before vLLM sees it: it may wait in the gate's queue, be shed with a 429
and ``Retry-After``, or be refused (400) or clamped by the per-request token budget. Without
one, nothing of this runs.

Errors the proxy itself produces (vLLM unreachable, timed out, body too large, kvtax shutting
down) are OpenAI-style JSON (:mod:`~kvtax.serve.proxy.answers`); vLLM's own statuses, headers
and error bodies pass through unchanged. Nothing of a prompt, a completion or a header value is
ever logged.

Example::

    proxy = Proxy(ProxySettings(upstream="http://127.0.0.1:8000"), ledger)
    port = await proxy.start("127.0.0.1", 8001)   # 0: any free port, the one bound returned
    ...
    await proxy.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvtax.delivery.asks import UsageWish, asked_everything
from kvtax.delivery.cost import RelayCost
from kvtax.delivery.ledger import DeliveryLedger
from kvtax.delivery.sse import Fingerprint, HoldBudget
from kvtax.delivery.timing import SloTargets
from kvtax.gate.footprint import CHAT_PATH
from kvtax.serve.proxy.answers import (
    shutting_down,
    too_large,
    undecodable,
    upstream_failure,
)
from kvtax.serve.proxy.client import ClientConnection
from kvtax.serve.proxy.exchange import Exchange
from kvtax.serve.proxy.gate import CLOSED, Gate, Refused
from kvtax.serve.proxy.head import RequestHead
from kvtax.serve.proxy.outcome import Facts, Phase, outcome_of, record_of
from kvtax.serve.proxy.prepare import UNNAMED, prepare
from kvtax.serve.proxy.relay import (
    INFLATABLE,
    BodySink,
    InflatingStreamSink,
    PlainSink,
    RelaySettings,
    StreamSink,
)
from kvtax.serve.proxy.upstream import (
    UPSTREAM_IDLE,
    Cut,
    Unreachable,
    Upstream,
    UpstreamBroke,
    UpstreamConnection,
)
from kvtax.serve.proxy.wire import (
    Framing,
    Headers,
    content_length,
    forwarded,
    header,
    request_head,
)

__all__ = ["ACCOUNTED_PATHS", "UPSTREAM_IDLE", "Proxy", "ProxySettings"]

log = logging.getLogger("kvtax.serve.proxy")

ACCOUNTED_PATHS = ("/v1/completions", "/v1/chat/completions")
_ACCOUNTED = frozenset(ACCOUNTED_PATHS)
# Seconds the cut leaves handlers to write their last event before connections are closed.
_CUT_GRACE = 2.0
_STATUS_WITHOUT_LENGTH = frozenset({204}) | frozenset(range(100, 200))


@dataclass(frozen=True, slots=True)
class ProxySettings:
    upstream: str
    # The largest body of an accounted request, held whole to read it (images in base64 are
    # tens of MiB); other paths' bodies are streamed to vLLM with no limit of kvtax's own.
    max_body: int = 64 * 1024**2
    timeout: float = 300.0
    # Seconds a client may leave its socket full before it counts as gone (nginx's
    # send_timeout).
    send_timeout: float = 60.0
    stall_factor: float = 5.0
    stall_min: float = 0.05
    slo_ttft: float = 2.0
    slo_itl: float = 0.2
    # Partial SSE lines all streams together may hold while waiting for their end.
    max_held: int = 16 * 1024**2

    @property
    def slo(self) -> SloTargets:
        return SloTargets(self.slo_ttft, self.slo_itl)


class Proxy:
    """The relay. ``in_flight`` counts accounted requests not yet settled."""

    def __init__(
        self,
        settings: ProxySettings,
        ledger: DeliveryLedger,
        *,
        clock: Callable[[], float] = time.monotonic,
        gate: Gate | None = None,
        vllm_version: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.settings = settings
        # vLLM's version as the scrape last read it: how a stream can be counted depends on it.
        self.vllm_version = vllm_version
        # The version whose streams came without the ids asked for: counted by usage from then.
        self._ids_missing_in: str | None = None
        # What relaying costs kvtax itself, and streams by how their tokens were counted.
        self.cost = RelayCost()
        # None: no gate, the plain relay.
        self.gate = gate
        self.ledger = ledger
        self.clock = clock
        self.in_flight = 0
        # Every exchange being answered, accounted or not: the drain waits for them all.
        self._busy = 0
        # Streams vLLM answered in a coding kvtax cannot inflate (not gzip or deflate).
        self.encoded_streams = 0
        self.upstream = Upstream(settings.upstream, settings.timeout)
        self.held = HoldBudget(settings.max_held)
        # The one shutdown state: the relay and outcome_of read it, only stop() moves it.
        self.state: Phase = "serving"
        self._server: asyncio.Server | None = None
        self._clients: set[ClientConnection] = set()
        self._settled = asyncio.Event()  # set when no exchange is being answered
        # Accounted requests vLLM is answering, so that a scrape can credit running streams.
        self._open: dict[int, tuple[Facts, UpstreamConnection]] = {}
        # vLLM's connections being relayed, on any path: what shutdown's cut ends.
        self._relaying: set[UpstreamConnection] = set()
        self.relay = RelaySettings(
            held=self.held,
            clock=clock,
            stall_factor=settings.stall_factor,
            stall_min=settings.stall_min,
            phase=lambda: self.state,
            cost=self.cost,
            fingerprints=Fingerprint(),
        )

    @property
    def upstream_retries(self) -> int:
        """Requests sent a second time after vLLM closed a stale connection unanswered."""
        return self.upstream.retries

    @property
    def streams_open(self) -> int:
        return sum(1 for facts, _ in self._open.values() if facts.rewriter is not None)

    @property
    def send_timeout(self) -> float:
        return self.settings.send_timeout

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self, host: str, port: int = 0) -> int:
        """Listen on ``host``:``port``; the port bound (the kernel's choice for port 0)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: ClientConnection(self), host or None, port, backlog=4096
        )
        bound = int(self._server.sockets[0].getsockname()[1])
        log.info("proxy on %s:%d relays to %s", host, bound, self.settings.upstream)
        return bound

    async def stop(self, grace: float = 0.0) -> None:
        """Stop accepting, let requests in flight finish for ``grace`` seconds, end the rest.

        From the start nothing new goes to vLLM, on any path: an idle keep-alive connection is
        closed at once, a busy one carries no request after the one it is answering (that
        answer says ``Connection: close``), and a request queued in the gate or not yet sent
        gets the shutdown 503. Every accounted request vLLM still has when the grace period
        ends, answering or not yet answered, has its upstream closed, so vLLM frees its KV, and
        settles with the outcome ``shutdown``. A stream gets an OpenAI-style error event and a
        clean end of stream; a non-streamed answer cut short breaks the client's connection, so
        it never looks complete; one not answered yet gets the 503.
        """
        server, self._server = self._server, None
        if server is not None:
            self.state = "draining"
            if self.gate is not None:
                self.gate.close()
            server.close()  # no new connections from here on
            for conn in list(self._clients):
                conn.shutdown()
            await self._until_settled(grace)
            if self._busy:
                log.info("grace period over: ending %d request(s) still in flight", self._busy)
            self._cut()
            await self._until_settled(_CUT_GRACE)
            for conn in list(self._clients):
                conn.close()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_CUT_GRACE):
                    await server.wait_closed()
        await self.close()

    async def _until_settled(self, seconds: float) -> None:
        if not self._busy:
            return
        self._settled.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._settled.wait()

    def _cut(self) -> None:
        """The grace period is over: end what vLLM still has, whether it answered yet or not."""
        self.state = "cutting"
        self.upstream.cut()
        for conn in list(self._relaying):
            conn.close()

    async def close(self) -> None:
        self.upstream.close()

    def connected(self, conn: ClientConnection) -> None:
        self._clients.add(conn)
        if self.state != "serving":
            conn.shutdown()  # accepted just as the drain began: it carries nothing

    def disconnected(self, conn: ClientConnection) -> None:
        self._clients.discard(conn)

    def credit_in_flight(self) -> None:
        """Count the tokens running streams have delivered so far; called at each scrape.

        Crediting at scrape time rather than per chunk keeps the relay's hot path free of
        ledger work, and still keeps windowed goodput in step with the engine.
        """
        for facts, _ in self._open.values():
            if facts.acks is None or facts.rewriter is None:
                continue
            delivered = facts.acks.refresh()
            if delivered > facts.credited:
                self.ledger.credit(facts.model, delivered - facts.credited)
                facts.credited = delivered

    # -- one request -------------------------------------------------------------------------
    def exchange_for(self, conn: ClientConnection, head: RequestHead) -> Exchange:
        """The exchange of a request whose head just arrived: accounted or passed through."""
        accounted = head.method == b"POST" and head.route in _ACCOUNTED
        limit = self.settings.max_body if accounted else None
        return Exchange(conn, head, accounted=accounted, limit=limit)

    async def handle(self, exchange: Exchange) -> None:
        """Answer ``exchange``; the client connection calls this for each, in order."""
        self._busy += 1
        try:
            if exchange.refusal is not None:
                exchange.answer(exchange.refusal)
            elif exchange.accounted:
                await self._accounted(exchange)
            elif self.state != "serving":
                exchange.answer(shutting_down())  # nothing new goes to vLLM
            else:
                await self._passthrough(exchange)
        finally:
            self._busy -= 1
            if not self._busy:
                self._settled.set()

    async def _passthrough(self, exchange: Exchange) -> None:
        request = exchange.head
        no_body = request.method == b"HEAD"
        began = time.perf_counter()
        try:
            if exchange.body_complete:
                body = exchange.buffered()
                has_body = bool(body) or request.method in (b"POST", b"PUT", b"PATCH")
                head = self._head(exchange, len(body) if has_body else None, identity=False)
                conn = await self.upstream.send(
                    head + body, no_body=no_body, interim=self._interim(exchange)
                )
            else:
                # Sent on as it arrives, framed as it came: its length, or chunks.
                chunked = request.chunked
                length = None if chunked else request.length
                head = self._head(exchange, length, identity=False, chunked=chunked)
                conn = await self.upstream.send(
                    head + self._body_start(exchange),
                    no_body=no_body,
                    streamed=exchange.stream_body,
                    chunked=chunked,
                    holder=exchange.conn,
                    interim=self._interim(exchange),
                )
        except (Unreachable, UpstreamBroke, TimeoutError) as exc:
            self._failed(exchange, exc)
            return
        except Cut:
            exchange.answer(shutting_down())
            return
        self.cost.forward.observe(conn.sent_at - began - conn.connecting)
        framing, head = self._respond_head(exchange, conn, rewritten=False)
        await self._relay(exchange, conn, PlainSink(exchange, framing, head, self.cost))

    @staticmethod
    def _interim(exchange: Exchange) -> Callable[[int, bytes, Headers], None]:
        """vLLM's 1xx go to the client, its hop-by-hop headers dropped."""
        return lambda status, reason, headers: exchange.interim(status, reason, forwarded(headers))

    @staticmethod
    def _body_start(exchange: Exchange) -> bytes:
        """What arrived of a streamed body, framed as it goes to vLLM."""
        first = exchange.buffered()
        if not first:
            return b""
        return b"%x\r\n%b\r\n" % (len(first), first) if exchange.head.chunked else first

    def _failed(self, exchange: Exchange, exc: BaseException) -> None:
        """vLLM could not be reached or did not answer: 502 or 504, or the refusal of a body
        that broke off while it was being streamed (its framing was bad)."""
        if exchange.refusal is not None:
            exchange.answer(exchange.refusal)
            return
        timed_out = isinstance(exc, TimeoutError)
        broke = str(exc) if isinstance(exc, UpstreamBroke) else None
        exchange.answer(upstream_failure(timed_out, self.settings.timeout, broke=broke))

    async def _accounted(self, exchange: Exchange) -> None:
        facts = exchange.facts = Facts(started=self.clock())
        self.in_flight += 1
        try:
            await self._handle(exchange, facts)
        except asyncio.CancelledError:
            facts.client_gone = True  # the client left (its connection cancels the request)
            raise
        finally:
            self.in_flight -= 1
            self._settle(facts)

    def _settle(self, facts: Facts) -> None:
        acks = facts.acks
        if acks is not None:
            acks.refresh()  # a last reading: the client may have acknowledged since
            acks.close()
        rewriter = facts.rewriter
        if rewriter is not None:
            self._count_scheme(facts.scheme, rewriter.ids_missing)
        outcome = outcome_of(facts, self.state)
        record = record_of(facts, outcome, ended=self.clock(), slo=self.settings.slo)
        self.ledger.settle(record)
        if self.gate is not None and facts.prompt_bytes and record.prompt_tokens:
            self.gate.learn(facts.prompt_bytes, record.prompt_tokens)

    def _count_scheme(self, scheme: str, ids_missing: int) -> None:
        if scheme == "token_ids" and ids_missing:
            self.cost.schemes["events"] += 1
            version = self.vllm_version()
            if version is not None and version != self._ids_missing_in:
                self._ids_missing_in = version
                log.warning(
                    "vLLM %s streamed events without the token ids asked for; its streams are "
                    "counted by continuous usage from now on",
                    version,
                )
        else:
            self.cost.schemes[scheme] += 1

    async def _handle(self, exchange: Exchange, facts: Facts) -> None:
        if exchange.too_large:
            facts.model, facts.too_large = UNNAMED, True  # vLLM never saw it: not its default
            exchange.answer(too_large(self.settings.max_body))
            return
        if self.state != "serving":
            facts.model, facts.turned_away = UNNAMED, True
            exchange.answer(shutting_down())
            return
        body = await exchange.whole_body()
        if body is None:
            facts.model = UNNAMED
            if exchange.refusal is not None:  # its chunked framing broke: never vLLM's
                facts.turned_away = True
                exchange.answer(exchange.refusal)
            else:
                facts.too_large = True
                exchange.answer(too_large(self.settings.max_body))
            return
        facts.started = self.clock()  # the request is whole: vLLM's part starts now
        began = time.perf_counter()  # ... and kvtax's forwarding of it
        version = self.vllm_version()
        prepared = prepare(
            body,
            chat=exchange.head.route == CHAT_PATH,
            version=version,
            ids_missing=version is not None and version == self._ids_missing_in,
        )
        facts.model, wish = prepared.model, prepared.wish
        facts.scheme = prepared.scheme
        gate = self.gate
        if gate is None:
            await self._forward(exchange, facts, wish, prepared.body, began=began)
            return
        admitting = time.perf_counter()
        verdict = await gate.admit(prepared, exchange.head.route)
        began += time.perf_counter() - admitting  # the gate's queue is not the relay's cost
        if isinstance(verdict, Refused):
            if verdict.reason == CLOSED:
                facts.turned_away = True  # shutdown began while it waited in the queue
            else:
                facts.shed = verdict.reason
            exchange.answer(verdict.answer)
            return
        facts.prompt_bytes = verdict.prompt_bytes
        try:
            # A stream frees its slot once its end went out, though vLLM's connection may not.
            await self._forward(
                exchange, facts, wish, verdict.body, began=began, release=verdict.release
            )
        finally:
            verdict.release()

    async def _forward(
        self,
        exchange: Exchange,
        facts: Facts,
        wish: UsageWish | None,
        body: bytes,
        *,
        began: float,
        release: Callable[[], None] | None = None,
    ) -> None:
        """Send the request to vLLM and relay its answer; ``release`` is called once a stream's
        end (``[DONE]`` or the final usage event) went to the client. ``began``: when kvtax's
        forwarding of it began (perf_counter), for its cost."""
        if self.state != "serving":
            facts.turned_away = True  # shutdown began: nothing new goes to vLLM
            exchange.answer(shutting_down())
            return
        head = self._head(exchange, len(body), identity=True)
        try:
            conn = await self.upstream.send(head + body, interim=self._interim(exchange))
        except Unreachable:
            exchange.answer(upstream_failure(False, self.settings.timeout))
            return
        except TimeoutError:
            facts.sent = True  # vLLM had the request: its HTTP counter counts it
            exchange.answer(upstream_failure(True, self.settings.timeout))
            return
        except UpstreamBroke as exc:
            facts.sent = True
            exchange.answer(upstream_failure(False, self.settings.timeout, broke=str(exc)))
            return
        except Cut:
            # The cut came before vLLM's status line; the connection is closed, so vLLM, which
            # had the request, aborts it.
            facts.sent = facts.turned_away = True
            exchange.answer(shutting_down())
            return
        self.cost.forward.observe(conn.sent_at - began - conn.connecting)
        facts.status = conn.status
        sink = self._sink(exchange, conn, facts, wish, release=release)
        if sink is None:
            conn.close()  # vLLM sees the disconnect and aborts the request
            return
        self._open[id(facts)] = (facts, conn)
        try:
            await self._relay(exchange, conn, sink, settle=False)
        finally:
            del self._open[id(facts)]
            if outcome_of(facts, self.state) == "completed" and facts.eof:
                self.upstream.release(conn)
            else:
                # Closing (not releasing) drops the connection: vLLM sees the disconnect and
                # aborts the request, freeing its KV blocks.
                conn.close()

    def _sink(
        self,
        exchange: Exchange,
        conn: UpstreamConnection,
        facts: Facts,
        wish: UsageWish | None,
        *,
        release: Callable[[], None] | None,
    ) -> StreamSink | BodySink | None:
        """Where vLLM's answer goes: an accounted stream is rewritten (inflated first if vLLM
        gzipped it though asked for identity), anything else is read as it passes. None when
        the client was answered instead: a stream in a coding kvtax cannot read would hand the
        client usage it did not ask for."""
        ok = conn.status < 300
        if ok and facts.model is not None:
            self.ledger.names.learn(facts.model)
        stream = wish is not None and ok and _is_sse(conn)
        coding = _coding(conn) if ok else None
        if stream and coding is not None and coding not in INFLATABLE:
            assert wish is not None
            self.encoded_streams += 1
            if not asked_everything(wish, facts.scheme):
                exchange.answer(undecodable(coding.decode("latin-1")))
                return None
            stream = False  # the client asked for all kvtax did: it passes unread
        decoded = stream and coding is not None
        framing, head = self._respond_head(exchange, conn, rewritten=stream, decoded=decoded)
        if not stream:
            return BodySink(exchange, framing, head, self.clock, self.cost)
        assert wish is not None
        if decoded:
            sink = InflatingStreamSink(
                exchange, framing, head, wish=wish, relay=self.relay, upstream=conn, on_done=release
            )
            exchange.source = sink  # a full client stops the inflating, not only vLLM
            return sink
        return StreamSink(exchange, framing, head, wish=wish, relay=self.relay, on_done=release)

    async def _relay(
        self,
        exchange: Exchange,
        conn: UpstreamConnection,
        sink: PlainSink | BodySink | StreamSink,
        *,
        settle: bool = True,
    ) -> None:
        """Relay ``conn``'s body into ``sink`` until it ends, pausing vLLM while the client is
        full; ``settle`` gives the connection back (pass-through) when the body ended."""
        if exchange.source is None:
            exchange.source = conn
        if exchange.conn.write_paused:
            exchange.source.pause_reading()
        self._relaying.add(conn)
        try:
            conn.attach(sink)
            await sink.done
        finally:
            self._relaying.discard(conn)
            exchange.source = None
            exchange.detach_body()
            if not conn.closed:
                conn.resume_reading()
            if settle:
                if conn.complete and not exchange.conn.closed:
                    self.upstream.release(conn)
                else:
                    conn.close()

    def _head(
        self, exchange: Exchange, length: int | None, *, identity: bool, chunked: bool = False
    ) -> bytes:
        upstream = self.upstream
        request = exchange.head
        headers = forwarded(request.headers, identity=identity)
        if chunked:
            headers.append((b"Transfer-Encoding", b"chunked"))
        return request_head(
            request.method, upstream.prefix + request.origin, upstream.netloc, headers, length
        )

    @staticmethod
    def _respond_head(
        exchange: Exchange, conn: UpstreamConnection, *, rewritten: bool, decoded: bool = False
    ) -> tuple[Framing, bytes]:
        """The body's framing for the client, and vLLM's status and headers for it (written
        with the first bytes of the body that are in by then)."""
        request = exchange.head
        status = conn.status
        length = None if rewritten else _length(conn)
        framing: Framing
        if request.method == b"HEAD" or status in (204, 304):
            framing = "none"
        elif length is not None:
            framing = "length"
        elif request.version == b"1.0":
            framing = "close"
        else:
            framing = "chunked"
        headers = forwarded(conn.headers)
        if decoded:  # inflated for the client: it gets the stream plain
            headers = [(k, v) for k, v in headers if k.lower() != b"content-encoding"]
        if framing == "none" and status not in _STATUS_WITHOUT_LENGTH:
            # Keep the length vLLM gave (the body a GET would have); there is no body to frame.
            # A 204 never has one (RFC 9110 8.6).
            given = header(conn.headers, b"content-length")
            if given is not None:
                headers.append((b"Content-Length", given))
        head = exchange.response_head(status, conn.reason, headers, framing, length=length)
        return framing, head


def _length(conn: UpstreamConnection) -> int | None:
    """vLLM's Content-Length, unless chunks delimit the body."""
    if header(conn.headers, b"transfer-encoding") is not None:
        return None
    return content_length(conn.headers)


def _coding(conn: UpstreamConnection) -> bytes | None:
    """vLLM's Content-Encoding, lower case, when it is one (gzip, say) other than identity."""
    value = header(conn.headers, b"content-encoding")
    coding = value.strip().lower() if value is not None else b""
    return None if coding in (b"", b"identity") else coding


def _is_sse(conn: UpstreamConnection) -> bool:
    value = header(conn.headers, b"content-type")
    return value is not None and value.split(b";", 1)[0].strip().lower() == b"text/event-stream"
