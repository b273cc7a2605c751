"""The reverse proxy in front of vLLM: relays every byte, counts what arrived. Its lifecycle and
its dispatch.

:class:`Proxy` listens with asyncio Protocols (:mod:`~kvtax.serve.proxy.server`: each request an
:class:`~kvtax.serve.proxy.server.Exchange` from its head to its answer's last byte) and sends
to vLLM on a keep-alive pool (:mod:`~kvtax.serve.proxy.client`), both parsing HTTP/1.1 with
httptools (llhttp). Each request is dispatched by the path vLLM will route it by (whatever form
its target takes: :func:`~kvtax.serve.proxy.head.route_of`):

- a ``POST`` to a generation API (one of :data:`~kvtax.delivery.dialects.DIALECTS`) is an
  :class:`~kvtax.serve.proxy.request.AccountedRequest`, which owns it to its ledger entry:
  its body read once, the gate's verdict (``--gate.mode`` other than ``off``), vLLM's answer
  relayed and counted by its dialect, its outcome decided once;
- every other request passes through untouched (:func:`~kvtax.serve.proxy.forward.
  pass_through`), its body streamed to vLLM as it arrives.

Responses are relayed as their bytes arrive, one client write per read of vLLM's, never held
whole (:mod:`~kvtax.serve.proxy.relay`). A client that goes away cancels its request, which
closes the upstream connection at once, so vLLM aborts the request and frees its KV.

Errors the proxy itself produces (vLLM unreachable, timed out, body too large, kvtax shutting
down) are OpenAI-style JSON (:mod:`~kvtax.serve.proxy.answers`); vLLM's own
statuses, headers and error bodies pass through unchanged. Nothing of a prompt, a completion or
a header value is ever logged.

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

from kvtax.delivery.cost import RelayCost
from kvtax.delivery.dialects import Dialect, dialect_for
from kvtax.delivery.ledger import DeliveryLedger
from kvtax.delivery.sse import Fingerprint, HoldBudget
from kvtax.delivery.timing import SloTargets
from kvtax.serve.proxy.answers import shutting_down
from kvtax.serve.proxy.client import Upstream
from kvtax.serve.proxy.forward import pass_through
from kvtax.serve.proxy.gatekeeper import Gate
from kvtax.serve.proxy.head import RequestHead
from kvtax.serve.proxy.outcome import Phase
from kvtax.serve.proxy.relay import RelaySettings
from kvtax.serve.proxy.request import AccountedRequest, Books, Schemes, Shared
from kvtax.serve.proxy.server import Connection, Exchange, ServerSettings

__all__ = ["Proxy", "ProxySettings"]

log = logging.getLogger("kvtax.serve.proxy")

# Seconds the cut leaves handlers to write their last event before connections are closed.
_CUT_GRACE = 2.0


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
    # Seconds a client connection may wait on its client (ServerSettings.keepalive), and read a
    # refused client's bytes before the close (ServerSettings.linger).
    keepalive: float = 75.0
    linger: float = 5.0
    # Seconds an idle connection to vLLM is kept: below vLLM's own 5 s keep-alive.
    upstream_idle: float = 2.0
    # Seconds after sending within which vLLM closing the connection unanswered is a stale
    # pooled connection, worth one more try (kvtax.serve.proxy.client).
    stale_within: float = 0.5

    @property
    def slo(self) -> SloTargets:
        return SloTargets(self.slo_ttft, self.slo_itl)

    @property
    def server(self) -> ServerSettings:
        return ServerSettings(
            keepalive=self.keepalive, linger=self.linger, send_timeout=self.send_timeout
        )


class Proxy:
    """The relay. ``in_flight`` counts accounted requests not yet settled."""

    def __init__(
        self,
        settings: ProxySettings,
        ledger: Books,
        *,
        clock: Callable[[], float] = time.monotonic,
        gate: Gate | None = None,
        vllm_version: Callable[[], str | None] = lambda: None,
        on_accounted: Callable[[], None] | None = None,
    ) -> None:
        self.settings = settings
        # Called as each accounted request begins: a proxy worker tells its parent, which
        # settles the ones a dead worker never settled (kvtax.serve.workers).
        self._on_accounted = on_accounted
        self.server_settings = settings.server
        # None: no gate, the plain relay.
        self.gate = gate
        self.clock = clock
        self.in_flight = 0
        # Every exchange being answered, accounted or not: the drain waits for them all.
        self._busy = 0
        # What relaying costs kvtax itself, and streams by how their tokens were counted.
        self.cost = RelayCost()
        self.upstream = Upstream(
            settings.upstream,
            settings.timeout,
            idle=settings.upstream_idle,
            stale_within=settings.stale_within,
        )
        # The one shutdown state: requests and outcome_of read it, only stop() moves it.
        self.state: Phase = "serving"
        self._server: asyncio.Server | None = None
        self._clients: set[Connection] = set()
        self._settled = asyncio.Event()  # set when no exchange is being answered
        relay = RelaySettings(
            held=HoldBudget(settings.max_held),
            clock=clock,
            stall_factor=settings.stall_factor,
            stall_min=settings.stall_min,
            phase=lambda: self.state,
            cost=self.cost,
            fingerprints=Fingerprint(),
        )
        self.shared = Shared(
            upstream=self.upstream,
            ledger=ledger,
            relay=relay,
            # vLLM's version as the scrape last read it: how a stream can be counted depends
            # on it.
            schemes=Schemes(vllm_version, self.cost),
            gate=gate,
            max_body=settings.max_body,
            timeout=settings.timeout,
            slo=settings.slo,
        )

    @property
    def ledger(self) -> DeliveryLedger:
        """Where every accounted request settles, when this process keeps the ledger (a proxy
        worker reports to its parent's instead: TypeError)."""
        ledger = self.shared.ledger
        if not isinstance(ledger, DeliveryLedger):
            raise TypeError("this proxy reports to another process's ledger")
        return ledger

    @ledger.setter
    def ledger(self, ledger: DeliveryLedger) -> None:
        self.shared.ledger = ledger

    @property
    def upstream_retries(self) -> int:
        """Requests sent a second time after vLLM closed a stale connection unanswered."""
        return self.upstream.retries

    @property
    def streams_open(self) -> int:
        return sum(1 for request in self.shared.streams if request.facts.counter is not None)

    @property
    def encoded_streams(self) -> int:
        """Streams vLLM answered in a coding kvtax cannot inflate (not gzip or deflate)."""
        return self.shared.encoded_streams

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self, host: str, port: int = 0, *, reuse_port: bool = False) -> int:
        """Listen on ``host``:``port``; the port bound (the kernel's choice for port 0).
        ``reuse_port``: share the port with other processes that set it too (SO_REUSEPORT:
        the kernel spreads new connections across them; kvtax.serve.workers)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: Connection(self), host or None, port, backlog=4096, reuse_port=reuse_port
        )
        bound = int(self._server.sockets[0].getsockname()[1])
        log.info("proxy on %s:%d relays to %s", host, bound, self.settings.upstream)
        return bound

    async def stop(self, grace: float = 0.0) -> None:
        """Stop accepting, let requests in flight finish for ``grace`` seconds, end the rest.

        From the start nothing new goes to vLLM, on any path: an idle keep-alive connection is
        closed at once, a busy one carries no request after the one it is answering (that
        answer says ``Connection: close``), and a request queued in the gate or waiting its
        turn gets the shutdown 503. The request a connection is answering, or whose body it is
        reading, is in flight: its body is read to the end, and it goes to vLLM and is relayed
        (past a closed gate, within the token budget) like any other. Every accounted request
        vLLM still has when the grace period ends, answering or not yet answered, has its
        upstream closed, so vLLM frees its KV, and settles with the outcome ``shutdown``. A
        stream gets an error event in its API's shape and a clean end of stream; a non-streamed
        answer cut short breaks the client's connection, so it never looks complete; one not
        answered yet gets the 503.
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
        for conn in list(self.shared.relaying):
            conn.close()

    async def close(self) -> None:
        self.upstream.close()

    def connected(self, conn: Connection) -> None:
        self._clients.add(conn)
        if self.state != "serving":
            conn.shutdown()  # accepted just as the drain began: it carries nothing

    def disconnected(self, conn: Connection) -> None:
        self._clients.discard(conn)

    def credit_in_flight(self) -> None:
        """Count the tokens running streams have delivered so far; called at each scrape.

        Crediting at scrape time rather than per chunk keeps the relay's hot path free of
        ledger work, and still keeps windowed goodput in step with the engine.
        """
        for request in self.shared.streams:
            request.credit()

    # -- dispatch ----------------------------------------------------------------------------
    @staticmethod
    def _dialect(head: RequestHead) -> Dialect | None:
        """The generation API a request is accounted as; None: it passes through."""
        return dialect_for(head.route) if head.method == b"POST" else None

    def body_limit(self, head: RequestHead) -> int | None:
        """An accounted request's body is held whole within ``--proxy.max-body``; an upload (a
        form, read as it passes) and any other request's is streamed on, with no limit of
        kvtax's own."""
        dialect = self._dialect(head)
        return self.settings.max_body if dialect is not None and not dialect.form else None

    async def handle(self, exchange: Exchange) -> None:
        """Answer ``exchange``; the client connection calls this for each, in order."""
        self._busy += 1
        try:
            dialect = self._dialect(exchange.head)
            if exchange.refusal is not None:
                exchange.answer(exchange.refusal)
            elif dialect is not None:
                if self._on_accounted is not None:
                    self._on_accounted()
                self.in_flight += 1
                try:
                    await AccountedRequest(exchange, dialect, self.shared).run()
                finally:
                    self.in_flight -= 1
            elif self.state != "serving" and not (self.state == "draining" and exchange.carried):
                exchange.answer(shutting_down())  # nothing new goes to vLLM
            else:
                await pass_through(
                    exchange,
                    self.upstream,
                    cost=self.cost,
                    relaying=self.shared.relaying,
                    timeout=self.settings.timeout,
                )
        finally:
            self._busy -= 1
            if not self._busy:
                self._settled.set()
