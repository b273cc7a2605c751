"""The OpenAI-compatible reverse proxy in front of vLLM: relays every byte, counts what arrived.

:class:`Proxy` listens with asyncio Protocols (:mod:`~kvtax.serve.proxy.client`) and sends to
vLLM on a keep-alive pool (:mod:`~kvtax.serve.proxy.upstream`), both parsing HTTP/1.1 with
httptools (llhttp). ``/v1/completions`` and ``/v1/chat/completions`` are relayed with
accounting; every other path passes through untouched. Responses are relayed as their bytes
arrive, one client write per read of vLLM's, never held whole (:mod:`~kvtax.serve.proxy.relay`).
The proxy asks vLLM for usage on every chunk and trims it back to what the client asked for
(:mod:`kvtax.delivery.sse`); a non-streamed body's usage is read as it passes
(:mod:`kvtax.delivery.usage`). Tokens count as delivered once the client's TCP stack
acknowledged the bytes carrying them (:mod:`~kvtax.serve.proxy.acks`). A client that goes away
cancels its request, which closes the upstream connection at once, so vLLM aborts the request
and frees its KV.

Each request gathers facts in an :class:`~kvtax.serve.proxy.exchange.Exchange` as it goes; when
it ends, however it ends, :func:`~kvtax.serve.proxy.exchange.outcome_of` decides its outcome
from those facts and the proxy's one shutdown state (:attr:`Proxy.state`), and the ledger
settles one record.

With the gate (:mod:`kvtax.serve.proxy.gate`, ``--gate.mode`` other than ``off``) an
accounted request passes the gate after its body is read and before vLLM sees it: it may wait
in the gate's queue, be shed with a 429 and ``Retry-After``, or be refused (400) or clamped by
the per-request token budget. Without one, nothing of this runs.

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

from kvtax.delivery.ledger import DeliveryLedger
from kvtax.delivery.sse import HoldBudget, UsageWish
from kvtax.delivery.timing import SloTargets
from kvtax.gate.footprint import Shape, check_budget, shape_of, with_max_tokens
from kvtax.serve.proxy.answers import (
    over_budget,
    shed,
    shutting_down,
    too_large,
    undecodable,
    upstream_failure,
)
from kvtax.serve.proxy.client import ClientConnection, Incoming
from kvtax.serve.proxy.exchange import Exchange, Phase, outcome_of, record_of
from kvtax.serve.proxy.gate import CLOSED, Gate, Ticket
from kvtax.serve.proxy.prepare import UNNAMED, Prepared, prepare
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
    Answer,
    Framing,
    content_length,
    forwarded,
    header,
    request_head,
    response_head,
)

__all__ = ["ACCOUNTED_PATHS", "UPSTREAM_IDLE", "Proxy", "ProxySettings"]

log = logging.getLogger("kvtax.serve.proxy")

ACCOUNTED_PATHS = ("/v1/completions", "/v1/chat/completions")
_ACCOUNTED = frozenset(p.encode() for p in ACCOUNTED_PATHS)
# Seconds the cut leaves handlers to write their last event before connections are closed.
_CUT_GRACE = 2.0


@dataclass(frozen=True, slots=True)
class ProxySettings:
    upstream: str
    max_body: int = 4 * 1024**2
    timeout: float = 300.0
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
    ) -> None:
        self.settings = settings
        self.max_body = settings.max_body
        # None: no gate, the plain relay.
        self.gate = gate
        self.ledger = ledger
        self.clock = clock
        self.in_flight = 0
        # Streams vLLM answered in a coding kvtax cannot inflate (not gzip or deflate).
        self.encoded_streams = 0
        self.upstream = Upstream(settings.upstream, settings.timeout)
        self.held = HoldBudget(settings.max_held)
        # The one shutdown state: the relay and outcome_of read it, only stop() moves it.
        self.state: Phase = "serving"
        self._server: asyncio.Server | None = None
        self._clients: set[ClientConnection] = set()
        self._settled = asyncio.Event()  # set when in_flight falls to 0
        # Accounted requests vLLM is answering, so that shutdown can end what its grace period
        # does not cover, and a scrape can credit running streams.
        self._open: dict[int, tuple[Exchange, UpstreamConnection]] = {}
        self.relay = RelaySettings(
            held=self.held,
            clock=clock,
            stall_factor=settings.stall_factor,
            stall_min=settings.stall_min,
            phase=lambda: self.state,
        )

    @property
    def upstream_retries(self) -> int:
        """Requests sent a second time after vLLM closed a stale connection unanswered."""
        return self.upstream.retries

    @property
    def streams_open(self) -> int:
        return sum(1 for ex, _ in self._open.values() if ex.rewriter is not None)

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

        From the start nothing new goes to vLLM: a request queued in the gate or not
        yet sent gets the shutdown 503 at once. Every accounted request vLLM still has when the
        grace period ends, answering or not yet answered, has its upstream closed, so vLLM
        frees its KV, and settles with the outcome ``shutdown``. A stream gets an OpenAI-style
        error event and a clean end of stream; a non-streamed answer cut short breaks the
        client's connection, so it never looks complete; one not answered yet gets the 503.
        """
        server, self._server = self._server, None
        if server is not None:
            self.state = "draining"
            if self.gate is not None:
                self.gate.close()
            server.close()  # no new connections from here on
            await self._until_settled(grace)
            if self.in_flight:
                log.info("grace period over: ending %d request(s) still in flight", self.in_flight)
            self._cut()
            await self._until_settled(_CUT_GRACE)
            for conn in list(self._clients):
                conn.close()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_CUT_GRACE):
                    await server.wait_closed()
        await self.close()

    async def _until_settled(self, seconds: float) -> None:
        if not self.in_flight:
            return
        self._settled.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._settled.wait()

    def _cut(self) -> None:
        """The grace period is over: end what vLLM still has, whether it answered yet or not."""
        self.state = "cutting"
        self.upstream.cut()
        for _, conn in list(self._open.values()):
            conn.close()

    async def close(self) -> None:
        self.upstream.close()

    def connected(self, conn: ClientConnection) -> None:
        self._clients.add(conn)

    def disconnected(self, conn: ClientConnection) -> None:
        self._clients.discard(conn)

    def credit_in_flight(self) -> None:
        """Count the tokens running streams have delivered so far; called at each scrape.

        Crediting at scrape time rather than per chunk keeps the relay's hot path free of
        ledger work, and still keeps windowed goodput in step with the engine.
        """
        for ex, _ in self._open.values():
            if ex.acks is None or ex.rewriter is None:
                continue
            delivered = ex.acks.refresh()
            if delivered > ex.credited:
                self.ledger.credit(ex.model, delivered - ex.credited)
                ex.credited = delivered

    # -- one request -------------------------------------------------------------------------
    async def handle(self, client: ClientConnection, request: Incoming) -> None:
        """Answer ``request``; the client connection calls this for each, in order."""
        if request.refusal is not None:
            client.answer(request.refusal, request)
        elif request.too_large:
            if request.method == b"POST" and request.path in _ACCOUNTED:
                # Settled unread: its model is unknown (not vLLM's default: vLLM never saw it).
                ex = Exchange(started=self.clock(), model=UNNAMED, too_large=True)
                self.ledger.settle(
                    record_of(
                        ex, outcome_of(ex, self.state), ended=ex.started, slo=self.settings.slo
                    )
                )
            client.answer(too_large(self.max_body), request)
        elif request.method == b"POST" and request.path in _ACCOUNTED:
            await self._accounted(client, request)
        else:
            await self._passthrough(client, request)

    async def _passthrough(self, client: ClientConnection, request: Incoming) -> None:
        body = request.body_bytes()
        has_body = bool(body) or request.method in (b"POST", b"PUT", b"PATCH")
        head = self._head(request, len(body) if has_body else None, identity=False)
        try:
            conn = await self.upstream.send(head + body, no_body=request.method == b"HEAD")
        except (Unreachable, UpstreamBroke, TimeoutError) as exc:
            client.answer(
                upstream_failure(isinstance(exc, TimeoutError), self.settings.timeout), request
            )
            return
        except Cut:
            client.answer(shutting_down(), request)
            return
        framing, head = self._respond_head(request, conn, rewritten=False)
        sink = PlainSink(client, framing, head)
        await self._relay(client, conn, sink)

    async def _accounted(self, client: ClientConnection, request: Incoming) -> None:
        ex = Exchange(started=self.clock())
        self.in_flight += 1
        try:
            await self._handle(client, request, ex)
        except asyncio.CancelledError:
            ex.client_gone = True  # the client left (its connection cancels the request)
            raise
        finally:
            self.in_flight -= 1
            self._settle(ex)
            if not self.in_flight:
                self._settled.set()

    def _settle(self, ex: Exchange) -> None:
        acks = ex.acks
        if acks is not None:
            acks.refresh()  # a last reading: the client may have acknowledged since
            acks.close()
        outcome = outcome_of(ex, self.state)
        record = record_of(ex, outcome, ended=self.clock(), slo=self.settings.slo)
        self.ledger.settle(record)
        if self.gate is not None and ex.prompt_bytes and record.prompt_tokens:
            self.gate.learn(ex.prompt_bytes, record.prompt_tokens)

    async def _handle(self, client: ClientConnection, request: Incoming, ex: Exchange) -> None:
        prepared = prepare(request.body_bytes())
        ex.model, wish = prepared.model, prepared.wish
        if self.gate is None:
            await self._forward(client, request, ex, wish, prepared.body)
            return
        gate = self.gate
        entry = await self._admit(gate, request.path.decode("latin-1"), prepared, ex)
        if isinstance(entry, Answer):
            client.answer(entry, request)
            return
        ticket, body = entry
        try:
            # A stream frees its slot once its end went out, though vLLM's connection may not.
            await self._forward(client, request, ex, wish, body, release=lambda: gate.leave(ticket))
        finally:
            gate.leave(ticket)

    async def _admit(
        self, gate: Gate, path: str, prepared: Prepared, ex: Exchange
    ) -> tuple[Ticket, bytes] | Answer:
        """Pass ``gate``: the ticket and the body to send (its max_tokens perhaps clamped), or
        the gate's own answer (400 over the token budget, 429 shed). The gate reads the JSON
        :func:`prepare` read: the body is parsed once, and both see the same request."""
        shape = shape_of(prepared.payload, path, whole=len(prepared.body))
        # Only a text prompt teaches the estimator: vLLM's count of a prompt with images
        # includes theirs, which no byte of it shows.
        ex.prompt_bytes = 0 if shape.media else shape.prompt_bytes
        prompt = gate.estimator.estimate(shape.prompt_bytes)
        checked = self._budget(gate, prepared, shape, prompt)
        if isinstance(checked, str):
            ex.shed = "over_budget"
            gate.rejections["over_budget"] += 1
            return over_budget(checked)
        body, limit = checked
        ticket = gate.ticket(prompt, limit, prompts=shape.prompts, n=shape.n)
        reason = await gate.enter(ticket)
        if reason == CLOSED:
            ex.turned_away = True  # shutdown began while it waited in the queue
            return shutting_down()
        if reason is not None:
            ex.shed = reason
            return shed(reason, gate.retry_after())
        return ticket, body

    @staticmethod
    def _budget(
        gate: Gate, prepared: Prepared, shape: Shape, prompt: int
    ) -> tuple[bytes, int | None] | str:
        """The body to send and its completion limit under the token budget, or why it is
        refused. A body that is not a JSON object has no limit to check or set: vLLM refuses
        it with its own 400."""
        payload = prepared.payload
        budget = gate.settings.token_budget if isinstance(payload, dict) else None
        max_tokens, copies = shape.max_tokens, {"prompts": shape.prompts, "n": shape.n}
        verdict = check_budget(prompt, max_tokens, budget, gate.settings.over_budget, **copies)
        if verdict.action == "reject":
            return verdict.message
        if verdict.action == "ok" or verdict.max_tokens is None:
            return prepared.body, max_tokens
        clamped = prepared.rewritten(with_max_tokens(payload, verdict.max_tokens))
        if clamped is None:  # too deep to write back: refused as `reject` would
            return check_budget(prompt, max_tokens, budget, "reject", **copies).message
        return clamped, verdict.max_tokens

    async def _forward(
        self,
        client: ClientConnection,
        request: Incoming,
        ex: Exchange,
        wish: UsageWish | None,
        body: bytes,
        *,
        release: Callable[[], None] | None = None,
    ) -> None:
        """Send the request to vLLM and relay its answer; ``release`` is called once a stream's
        end (``[DONE]`` or the final usage event) went to the client."""
        if self.state != "serving":
            ex.turned_away = True  # shutdown began: nothing new goes to vLLM
            client.answer(shutting_down(), request)
            return
        head = self._head(request, len(body), identity=True)
        try:
            conn = await self.upstream.send(head + body)
        except Unreachable:
            client.answer(upstream_failure(False, self.settings.timeout), request)
            return
        except (UpstreamBroke, TimeoutError) as exc:
            ex.sent = True  # vLLM had the request: its HTTP counter counts it
            timed_out = isinstance(exc, TimeoutError)
            client.answer(upstream_failure(timed_out, self.settings.timeout), request)
            return
        except Cut:
            # The cut came before vLLM's status line; the connection is closed, so vLLM, which
            # had the request, aborts it.
            ex.sent = ex.turned_away = True
            client.answer(shutting_down(), request)
            return
        ex.status = conn.status
        sink = self._sink(client, request, conn, ex, wish, release=release)
        if sink is None:
            conn.close()  # vLLM sees the disconnect and aborts the request
            return
        self._open[id(ex)] = (ex, conn)
        try:
            await self._relay(client, conn, sink, settle=False)
        finally:
            del self._open[id(ex)]
            if outcome_of(ex, self.state) == "completed" and ex.eof:
                self.upstream.release(conn)
            else:
                # Closing (not releasing) drops the connection: vLLM sees the disconnect and
                # aborts the request, freeing its KV blocks.
                conn.close()

    def _sink(
        self,
        client: ClientConnection,
        request: Incoming,
        conn: UpstreamConnection,
        ex: Exchange,
        wish: UsageWish | None,
        *,
        release: Callable[[], None] | None,
    ) -> StreamSink | BodySink | None:
        """Where vLLM's answer goes: an accounted stream is rewritten (inflated first if vLLM
        gzipped it though asked for identity), anything else is read as it passes. None when
        the client was answered instead: a stream in a coding kvtax cannot read would hand the
        client usage it did not ask for."""
        ok = conn.status < 300
        if ok and ex.model is not None:
            self.ledger.names.learn(ex.model)
        stream = wish is not None and ok and _is_sse(conn)
        coding = _coding(conn) if ok else None
        if stream and coding is not None and coding not in INFLATABLE:
            assert wish is not None
            self.encoded_streams += 1
            if not (wish.include_usage and wish.continuous):
                client.answer(undecodable(coding.decode("latin-1")), request)
                return None
            stream = False  # the client asked for all kvtax did: it passes unread
        decoded = stream and coding is not None
        framing, head = self._respond_head(request, conn, rewritten=stream, decoded=decoded)
        if not stream:
            return BodySink(client, framing, head, ex, self.clock)
        assert wish is not None
        kind = InflatingStreamSink if decoded else StreamSink
        return kind(client, framing, head, ex, wish=wish, relay=self.relay, on_done=release)

    async def _relay(
        self,
        client: ClientConnection,
        conn: UpstreamConnection,
        sink: PlainSink | BodySink | StreamSink,
        *,
        settle: bool = True,
    ) -> None:
        """Relay ``conn``'s body into ``sink`` until it ends, pausing vLLM while the client is
        full; ``settle`` gives the connection back (pass-through) when the body ended."""
        client.source = conn.transport
        if client.write_paused and conn.transport is not None:
            conn.transport.pause_reading()
        try:
            conn.attach(sink)
            await sink.done
        finally:
            client.source = None
            if conn.transport is not None and not conn.closed:
                conn.transport.resume_reading()
            if settle:
                if conn.complete and not client.closed:
                    self.upstream.release(conn)
                else:
                    conn.close()

    def _head(self, request: Incoming, length: int | None, *, identity: bool) -> bytes:
        upstream = self.upstream
        return request_head(
            request.method,
            upstream.prefix + request.target,
            upstream.netloc,
            forwarded(request.headers, identity=identity),
            length,
        )

    @staticmethod
    def _respond_head(
        request: Incoming, conn: UpstreamConnection, *, rewritten: bool, decoded: bool = False
    ) -> tuple[Framing, bytes]:
        """The body's framing for the client, and vLLM's status and headers for it (written
        with the first bytes of the body that are in by then)."""
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
        close = framing == "close" or not request.keep_alive
        if close:
            request.keep_alive = False
        headers = forwarded(conn.headers)
        if decoded:  # inflated for the client: it gets the stream plain
            headers = [(k, v) for k, v in headers if k.lower() != b"content-encoding"]
        if framing == "none":
            # Keep the length vLLM gave (the body a GET would have); there is no body to frame.
            given = header(conn.headers, b"content-length")
            if given is not None:
                headers.append((b"Content-Length", given))
        head = response_head(
            request.version, status, conn.reason, headers, framing, close=close, length=length
        )
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
