"""The OpenAI-compatible reverse proxy in front of vLLM: relays every byte, counts what arrived.

:class:`Proxy` is an aiohttp server with one shared upstream client (:mod:`kvtax.serve.upstream`).
``/v1/completions`` and ``/v1/chat/completions`` are relayed with accounting; every other path
passes through untouched. Responses are relayed as their bytes arrive, never held whole
(:mod:`kvtax.serve.relay`). The proxy asks vLLM for usage on every chunk and trims it back to
what the client asked for (:mod:`kvtax.delivery.sse`); a non-streamed body's usage is read as it
passes (:mod:`kvtax.delivery.usage`). Tokens count as delivered once the client's TCP stack
acknowledged the bytes carrying them (:mod:`kvtax.serve.acks`). A client that goes away cancels
its handler (aiohttp's handler cancellation), which closes the upstream connection at once, so
vLLM aborts the request and frees its KV. Requests go to vLLM through a
:class:`~kvtax.serve.sender.Sender`, which gives a stale pooled connection one more try and lets
shutdown end a request vLLM has not answered yet.

Each request gathers facts in an :class:`~kvtax.serve.exchange.Exchange` as it goes; when it
ends, however it ends, :func:`~kvtax.serve.exchange.outcome_of` decides its outcome from those
facts and the proxy's one shutdown state (:attr:`Proxy.state`), and the ledger settles one
record.

With an admission gate (:mod:`kvtax.serve.gate`, ``--admission.mode`` other than ``off``) an
accounted request passes the gate after its body is read and before vLLM sees it: it may wait
in the gate's queue, be shed with a 429 and ``Retry-After``, or be refused (400) or clamped by
the per-request token budget. Without one, nothing of this runs and the relay is unchanged.

Errors the proxy itself produces (vLLM unreachable, timed out, body too large, kvtax shutting
down) are OpenAI-style JSON (:mod:`kvtax.serve.errors`); vLLM's own statuses, headers and error
bodies pass through unchanged. Nothing of a prompt, a completion or a header value is ever
logged.

Example::

    proxy = Proxy(ProxySettings(upstream="http://127.0.0.1:8000"), ledger)
    await proxy.start("127.0.0.1", 8001)
    ...
    await proxy.stop()
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from kvtax.admission.footprint import check_budget, shape_of, with_max_tokens
from kvtax.delivery.ledger import DeliveryLedger
from kvtax.delivery.sse import HoldBudget, UsageWish
from kvtax.delivery.timing import SloTargets
from kvtax.serve.bodies import BodyTooLarge, read_bounded
from kvtax.serve.errors import over_budget, shed, shutting_down, too_large, upstream_failure
from kvtax.serve.exchange import Exchange, Phase, outcome_of, record_of
from kvtax.serve.gate import CLOSED, Gate, Ticket
from kvtax.serve.relay import Relay, pass_through
from kvtax.serve.sender import Sender
from kvtax.serve.upstream import (
    NO_AUTO,
    UPSTREAM_IDLE,
    Prepared,
    new_session,
    prepare,
    read_timeout,
    request_headers,
    response_headers,
)

__all__ = ["ACCOUNTED_PATHS", "UPSTREAM_IDLE", "Proxy", "ProxySettings"]

log = logging.getLogger("kvtax.serve.proxy")

ACCOUNTED_PATHS = ("/v1/completions", "/v1/chat/completions")


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
        # None: no admission gate, the plain relay.
        self.gate = gate
        self.ledger = ledger
        self.clock = clock
        self.in_flight = 0
        self.sender = Sender(lambda: self.session, settings.upstream, settings.timeout)
        self.held = HoldBudget(settings.max_held)
        # The one shutdown state: the relay and outcome_of read it, only stop() moves it.
        self.state: Phase = "serving"
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        # Accounted requests vLLM is answering, so that shutdown can end what its grace period
        # does not cover, and a scrape can credit running streams.
        self._open: dict[int, tuple[Exchange, aiohttp.ClientResponse]] = {}
        self.relay = Relay(
            held=self.held,
            clock=clock,
            stall=(settings.stall_factor, settings.stall_min),
            phase=lambda: self.state,
        )

    @property
    def upstream_retries(self) -> int:
        """Requests sent a second time after vLLM closed a stale connection unanswered."""
        return self.sender.retries

    @property
    def streams_open(self) -> int:
        return sum(1 for ex, _ in self._open.values() if ex.rewriter is not None)

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = new_session()
        return self._session

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.settings.max_body)
        for path in ACCOUNTED_PATHS:
            app.router.add_post(path, self._accounted)
        app.router.add_route("*", "/{tail:.*}", self._passthrough)
        return app

    def runner(self) -> web.AppRunner:
        """An AppRunner that cancels a handler when its client disconnects."""
        return web.AppRunner(self.app(), access_log=None, handler_cancellation=True)

    async def start(self, host: str, port: int) -> None:
        self._runner = self.runner()
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        log.info("proxy on %s:%d relays to %s", host, port, self.settings.upstream)

    async def stop(self, grace: float = 0.0) -> None:
        """Stop accepting, let requests in flight finish for ``grace`` seconds, end the rest.

        From the start nothing new goes to vLLM: a request queued in the admission gate or not
        yet sent gets the shutdown 503 at once. Every accounted request vLLM still has when the
        grace period ends, answering or not yet answered, has its upstream closed, so vLLM
        frees its KV, and settles with the outcome ``shutdown``. A stream gets an OpenAI-style
        error event and a clean end of stream; a non-streamed answer cut short breaks the
        client's connection, so it never looks complete; one not answered yet gets the 503.
        """
        runner, self._runner = self._runner, None
        if runner is not None:
            self.state = "draining"
            if self.gate is not None:
                self.gate.close()
            for site in list(runner.sites):
                await site.stop()  # no new connections from here on
            loop = asyncio.get_running_loop()
            deadline = loop.time() + grace
            while self.in_flight and loop.time() < deadline:
                await asyncio.sleep(0.05)
            if self.in_flight:
                log.info("grace period over: ending %d request(s) still in flight", self.in_flight)
            self._cut()
            await runner.cleanup()
        await self.close()

    def _cut(self) -> None:
        """The grace period is over: end what vLLM still has, whether it answered yet or not."""
        self.state = "cutting"
        self.sender.cut()
        for _, upstream in list(self._open.values()):
            upstream.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

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

    # -- helpers -----------------------------------------------------------------------------
    async def _read_body(self, request: web.Request) -> bytes:
        """The whole request body, however many writes it came in, within --proxy.max-body."""
        return await read_bounded(request.content, self.settings.max_body, request.content_length)

    async def _outgoing(self, request: web.Request) -> Any:
        """A pass-through body for vLLM: streamed when its length is known to be in bounds,
        read within the limit when it is chunked; :class:`BodyTooLarge` past the limit."""
        if not request.body_exists:
            return None
        length = request.content_length
        if length is None:
            return await self._read_body(request)
        if length > self.settings.max_body:
            raise BodyTooLarge(self.settings.max_body)
        return request.content

    # -- pass-through ------------------------------------------------------------------------
    async def _passthrough(self, request: web.Request) -> web.StreamResponse:
        try:
            data = await self._outgoing(request)
        except BodyTooLarge:
            return too_large(self.settings.max_body)
        try:
            upstream = await self.session.request(
                request.method,
                self.settings.upstream + request.rel_url.raw_path_qs,
                headers=request_headers(request.headers, identity=False),
                data=data,
                skip_auto_headers=NO_AUTO,
                allow_redirects=False,
                timeout=read_timeout(self.settings.timeout),
            )
        except (aiohttp.ClientError, TimeoutError) as exc:
            return upstream_failure(exc, self.settings.timeout)
        try:
            return await pass_through(request, upstream)
        finally:
            upstream.release()

    # -- accounted endpoints -----------------------------------------------------------------
    async def _accounted(self, request: web.Request) -> web.StreamResponse:
        ex = Exchange(started=self.clock())
        self.in_flight += 1
        try:
            return await self._handle(request, ex)
        except (asyncio.CancelledError, ConnectionResetError):
            # aiohttp cancels the handler when the client disconnects, and at shutdown.
            ex.client_gone = True
            raise
        finally:
            self.in_flight -= 1
            self._settle(ex)

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

    async def _handle(self, request: web.Request, ex: Exchange) -> web.StreamResponse:
        try:
            body = await self._read_body(request)
        except BodyTooLarge:
            ex.too_large = True
            return too_large(self.settings.max_body)
        prepared = prepare(body)
        ex.model, wish = prepared.model, prepared.wish
        if self.gate is None:
            return await self._forward(request, ex, wish, prepared.body)
        gate = self.gate
        entry = await self._admit(gate, request.path, prepared, ex)
        if isinstance(entry, web.StreamResponse):
            return entry
        ticket, body = entry
        try:
            return await self._forward(request, ex, wish, body)
        finally:
            gate.leave(ticket)

    async def _admit(
        self, gate: Gate, path: str, prepared: Prepared, ex: Exchange
    ) -> tuple[Ticket, bytes] | web.StreamResponse:
        """Pass ``gate``: the ticket and the body to send (its max_tokens perhaps clamped), or
        the gate's own answer (400 over the token budget, 429 shed). The gate reads the JSON
        :func:`prepare` read: the body is parsed once, and both see the same request."""
        shape = shape_of(prepared.payload, path, whole=len(prepared.body))
        # Only a text prompt teaches the estimator: vLLM's count of a prompt with images
        # includes theirs, which no byte of it shows.
        ex.prompt_bytes = 0 if shape.media else shape.prompt_bytes
        prompt = gate.estimator.estimate(shape.prompt_bytes)
        checked = self._budget(gate, prepared, shape.max_tokens, prompt)
        if isinstance(checked, str):
            ex.shed = "over_budget"
            gate.rejections["over_budget"] += 1
            return over_budget(checked)
        body, limit = checked
        ticket = gate.ticket(prompt, limit)
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
        gate: Gate, prepared: Prepared, max_tokens: int | None, prompt: int
    ) -> tuple[bytes, int | None] | str:
        """The body to send and its completion limit under the token budget, or why it is
        refused. A body that is not a JSON object has no limit to check or set: vLLM refuses
        it with its own 400."""
        payload = prepared.payload
        budget = gate.settings.token_budget if isinstance(payload, dict) else None
        verdict = check_budget(prompt, max_tokens, budget, gate.settings.over_budget)
        if verdict.action == "reject":
            return verdict.message
        if verdict.action == "ok" or verdict.max_tokens is None:
            return prepared.body, max_tokens
        clamped = prepared.rewritten(with_max_tokens(payload, verdict.max_tokens))
        if clamped is None:  # too deep to write back: refused as `reject` would
            return check_budget(prompt, max_tokens, budget, "reject").message
        return clamped, verdict.max_tokens

    async def _forward(
        self, request: web.Request, ex: Exchange, wish: UsageWish | None, body: bytes
    ) -> web.StreamResponse:
        """Send the request to vLLM and relay its answer."""
        if self.state != "serving":
            ex.turned_away = True  # shutdown began: nothing new goes to vLLM
            return shutting_down()
        try:
            upstream = await self.sender.post(request, body)
        except aiohttp.ClientConnectorError as exc:
            return upstream_failure(exc, self.settings.timeout)
        except (aiohttp.ClientError, TimeoutError) as exc:
            ex.sent = True  # vLLM had the request: its HTTP counter counts it
            return upstream_failure(exc, self.settings.timeout)
        if upstream is None:
            # The cut came before vLLM's status line; the POST's connection is closed, so vLLM,
            # which had the request, aborts it.
            ex.sent = ex.turned_away = True
            return shutting_down()
        ex.status = upstream.status
        self._open[id(ex)] = (ex, upstream)
        try:
            return await self._respond(request, upstream, ex, wish)
        finally:
            del self._open[id(ex)]
            if outcome_of(ex, self.state) == "completed" and ex.eof:
                upstream.release()
            else:
                # Closing (not releasing) drops the connection: vLLM sees the disconnect and
                # aborts the request, freeing its KV blocks.
                upstream.close()

    async def _respond(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        ex: Exchange,
        wish: UsageWish | None,
    ) -> web.StreamResponse:
        """vLLM's answer to the client: an SSE stream rewritten, anything else as a body."""
        response = web.StreamResponse(
            status=upstream.status,
            reason=upstream.reason,
            headers=response_headers(upstream.headers),
        )
        ok = upstream.status < 300
        try:
            if ok and ex.model is not None:
                self.ledger.names.learn(ex.model)
            if wish is not None and ok and upstream.content_type == "text/event-stream":
                await self.relay.stream(request, response, upstream, ex, wish)
            else:
                await self.relay.body(request, response, upstream, ex)
        except ConnectionResetError:
            ex.client_gone = True  # a write found the client gone
        return response
