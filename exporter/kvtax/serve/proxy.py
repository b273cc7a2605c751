"""The OpenAI-compatible reverse proxy in front of vLLM: relays every byte, counts what arrived.

:class:`Proxy` is an aiohttp server with one shared upstream client. ``/v1/completions`` and
``/v1/chat/completions`` are relayed with accounting; every other path passes through untouched.
Responses are relayed as their bytes arrive, never held whole: each write waits for the client's
socket to drain, and the upstream reader pauses when its buffer is full, so a slow client slows
vLLM's TCP stream instead of growing memory. The proxy asks vLLM for usage on every chunk and
trims it back to what the client asked for (:mod:`kvtax.delivery.sse`); a non-streamed body's usage
is
read as it passes (:mod:`kvtax.delivery.usage`). Tokens count as delivered once the client's TCP
stack
acknowledged the bytes carrying them (:mod:`kvtax.serve.acks`). A client that goes away cancels its
handler (aiohttp's handler cancellation), which closes the upstream connection at once, so vLLM
aborts the request and frees its KV.

Each request gathers facts in an :class:`Exchange` as it goes (what vLLM answered, what was
written, whether the client or vLLM went away); when it ends, however it ends, :func:`outcome_of`
decides its outcome from those facts, in one place, and the ledger settles one record.

Errors the proxy itself produces (vLLM unreachable, timed out, body too large) are OpenAI-style
JSON; vLLM's own statuses, headers and error bodies pass through unchanged. Nothing of a prompt,
a completion or a header value is ever logged.

Example::

    proxy = Proxy(ProxySettings(upstream="http://127.0.0.1:8000"), ledger)
    await proxy.start("127.0.0.1", 8001)
    ...
    await proxy.stop()
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict

from kvtax.delivery.ledger import DeliveryLedger, RequestRecord
from kvtax.delivery.sse import HoldBudget, StreamRewriter, UsageWish, with_usage
from kvtax.delivery.timing import SloTargets, StreamTiming, meets_slo_unstreamed
from kvtax.delivery.usage import UsageScanner
from kvtax.serve.acks import AckTracker
from kvtax.serve.bodies import BodyTooLarge, read_bounded

__all__ = [
    "ACCOUNTED_PATHS",
    "UPSTREAM_IDLE",
    "Exchange",
    "Proxy",
    "ProxySettings",
    "openai_error",
    "outcome_of",
]

log = logging.getLogger("kvtax.serve.proxy")

ACCOUNTED_PATHS = ("/v1/completions", "/v1/chat/completions")
# RFC 9110 7.6.1 hop-by-hop headers, plus the ones aiohttp recomputes itself.
_HOP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "TE",
        "Trailer",
        "Trailers",
        "Transfer-Encoding",
        "Upgrade",
        "Host",
        "Content-Length",
    )
)
# Headers aiohttp's client would add on its own; the upstream must see only the client's.
_NO_AUTO = ("User-Agent", "Accept", "Accept-Encoding", "Content-Type")
_ONE_WRITE = 1024**2
# Seconds an idle upstream connection is kept; below vLLM's own 5 s keep-alive.
UPSTREAM_IDLE = 2.0

State = Literal["serving", "draining", "cutting"]


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


def openai_error(status: int, message: str, kind: str) -> web.Response:
    """An error in the shape OpenAI clients parse: ``{"error": {message, type, param, code}}``."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.json_response(body, status=status)


def _sse_error(message: str, kind: str, status: int) -> bytes:
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def _loads(body: bytes) -> Any:
    """A request body as JSON: orjson, or the standard parser for what orjson refuses but
    Python's accepts (integers past 64 bits, NaN), so such a body is still understood."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return json.loads(body)


def _request_headers(headers: Mapping[str, str], *, identity: bool) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        lower = name.lower()
        if lower in _HOP or (identity and lower == "accept-encoding"):
            continue
        out.add(name, value)
    return out


def _response_headers(headers: Mapping[str, str]) -> CIMultiDict[str]:
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in _HOP)


@dataclass(slots=True)
class Exchange:
    """The facts of one accounted request, gathered as it runs; :func:`outcome_of` reads them.

    ``status`` is vLLM's (None: it never answered). ``wrote_all`` means every byte of the
    response, ``[DONE]`` included, was handed to the client's socket; ``eof`` that the response
    was also ended cleanly. ``client_gone`` and ``upstream_broke`` say who left early.
    """

    started: float
    model: str | None = None
    too_large: bool = False
    status: int | None = None
    wrote_all: bool = False
    eof: bool = False
    client_gone: bool = False
    upstream_broke: bool = False
    cut: bool = False  # ended by shutdown after its grace period
    acks: AckTracker | None = None
    rewriter: StreamRewriter | None = None
    timing: StreamTiming | None = None
    usage: tuple[int, int] | None = None  # non-streamed: (completion, prompt)
    credited: int = 0  # delivered tokens the ledger already counted mid-stream
    finished_at: float | None = None
    sent: bool = False  # vLLM got the request even if it never answered

    @property
    def reached_client(self) -> bool:
        """Every byte reached the client: ended cleanly, or its acknowledgements cover it all."""
        if not self.wrote_all:
            return False
        if self.eof and not self.client_gone:
            return True
        return self.acks is None or self.acks.all_acknowledged


def outcome_of(ex: Exchange) -> str:
    """The one place a request's outcome is decided."""
    if ex.too_large:
        return "too_large"
    if ex.status is None:
        return "upstream_error"
    if ex.status >= 500:
        return "upstream_error"
    if ex.status >= 400:
        return "upstream_4xx"
    if ex.reached_client:
        return "completed"
    if ex.cut:
        return "shutdown"
    if ex.upstream_broke:
        return "upstream_error"
    return "client_disconnected"


class Proxy:
    """The relay. ``in_flight`` counts accounted requests not yet settled."""

    def __init__(
        self,
        settings: ProxySettings,
        ledger: DeliveryLedger,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.ledger = ledger
        self.clock = clock
        self.in_flight = 0
        self.held = HoldBudget(settings.max_held)
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        # Streams in flight, so that shutdown can end the ones its grace period does not cover.
        self._streams: dict[int, tuple[Exchange, aiohttp.ClientResponse]] = {}
        self.state: State = "serving"

    @property
    def streams_open(self) -> int:
        return len(self._streams)

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                # No pool limit: the pool must never queue a stream behind others. Idle
                # connections are dropped before vLLM drops them (uvicorn closes after 5 s):
                # reusing one vLLM is closing at that instant fails the request with a 502.
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=UPSTREAM_IDLE),
                # Relay encoded bodies as they are; never keep cookies between clients.
                auto_decompress=False,
                cookie_jar=aiohttp.DummyCookieJar(),
                timeout=aiohttp.ClientTimeout(total=None),
            )
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

        A stream still running when the grace period ends gets an OpenAI-style error event and
        a clean end of stream; its upstream is closed so vLLM frees its KV, and the ledger
        settles it with the outcome ``shutdown``.
        """
        runner, self._runner = self._runner, None
        if runner is not None:
            self.state = "draining"
            for site in list(runner.sites):
                await site.stop()  # no new connections from here on
            loop = asyncio.get_running_loop()
            deadline = loop.time() + grace
            while self.in_flight and loop.time() < deadline:
                await asyncio.sleep(0.05)
            if self.in_flight:
                log.info("grace period over: ending %d request(s) still in flight", self.in_flight)
            self.state = "cutting"
            for _, upstream in list(self._streams.values()):
                upstream.close()
            await runner.cleanup()
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def credit_in_flight(self) -> None:
        """Count the tokens running streams have delivered so far; called at each scrape.

        Crediting at scrape time rather than per chunk keeps the relay's hot path free of
        ledger work, and still keeps windowed goodput in step with the engine.
        """
        for ex, _ in self._streams.values():
            if ex.acks is None:
                continue
            delivered = ex.acks.refresh()
            if delivered > ex.credited:
                self.ledger.credit(ex.model, delivered - ex.credited)
                ex.credited = delivered

    # -- helpers -----------------------------------------------------------------------------
    def _timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(
            total=None, sock_connect=self.settings.timeout, sock_read=self.settings.timeout
        )

    async def _read_body(self, request: web.Request) -> bytes:
        """The whole request body, however many writes it came in, within --proxy.max-body."""
        return await read_bounded(request.content, self.settings.max_body, request.content_length)

    def _too_large(self) -> web.Response:
        response = openai_error(
            413,
            f"request body exceeds the proxy's limit of {self.settings.max_body} bytes "
            "(--proxy.max-body)",
            "invalid_request_error",
        )
        # The rest of the body was never read: the connection cannot carry another request.
        response.force_close()
        return response

    def _upstream_failure(self, exc: BaseException) -> web.Response:
        if isinstance(exc, TimeoutError):
            return openai_error(
                504,
                f"vLLM did not answer within {self.settings.timeout:g}s",
                "upstream_timeout",
            )
        return openai_error(502, "vLLM is unreachable", "upstream_unavailable")

    @staticmethod
    def _break(request: web.Request) -> None:
        """Close the client's connection so a body cut short can never look complete."""
        transport = request.transport
        if transport is not None:
            transport.close()

    # -- pass-through ------------------------------------------------------------------------
    async def _passthrough(self, request: web.Request) -> web.StreamResponse:
        data: Any = None
        if request.body_exists:
            if request.content_length is not None:
                if request.content_length > self.settings.max_body:
                    return self._too_large()
                data = request.content  # streamed; the length is already known to be in bounds
            else:
                try:  # chunked: no length to check up front, so read it within the limit
                    data = await self._read_body(request)
                except BodyTooLarge:
                    return self._too_large()
        try:
            upstream = await self.session.request(
                request.method,
                self.settings.upstream + request.rel_url.raw_path_qs,
                headers=_request_headers(request.headers, identity=False),
                data=data,
                skip_auto_headers=_NO_AUTO,
                allow_redirects=False,
                timeout=self._timeout(),
            )
        except (aiohttp.ClientError, TimeoutError) as exc:
            return self._upstream_failure(exc)
        try:
            response = web.StreamResponse(
                status=upstream.status,
                reason=upstream.reason,
                headers=_response_headers(upstream.headers),
            )
            if upstream.content_length is not None:
                response.content_length = upstream.content_length
            await response.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
            except (aiohttp.ClientError, TimeoutError):
                self._break(request)
                upstream.close()
                return response
            await response.write_eof()
            return response
        except BaseException:
            # Client gone (cancelled), client reset: drop the connection rather than return a
            # half-read one to the pool.
            upstream.close()
            raise
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
        outcome = outcome_of(ex)
        delivered, upstream_tokens, prompt = self._tokens(ex, outcome)
        timing = ex.timing
        completed = outcome == "completed"
        self.ledger.settle(
            RequestRecord(
                model=ex.model,
                outcome=outcome,
                delivered_tokens=delivered,
                credited_tokens=ex.credited,
                prompt_tokens=prompt,
                undelivered_tokens=max(0, upstream_tokens - delivered),
                forwarded=ex.status is not None or ex.sent,
                duration=self.clock() - ex.started,
                ttft=timing.ttft if timing else None,
                gaps=tuple(timing.gaps) if timing else (),
                stalls=tuple(timing.stalls) if timing else (),
                slo_met=completed and self._slo_met(ex, delivered),
                usage_missing=completed and self._usage_missing(ex),
            )
        )

    @staticmethod
    def _tokens(ex: Exchange, outcome: str) -> tuple[int, int, int]:
        """(delivered, sent by vLLM, prompt) tokens, by outcome."""
        rw = ex.rewriter
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

    def _slo_met(self, ex: Exchange, delivered: int) -> bool:
        if ex.timing is not None:
            return ex.timing.meets(self.settings.slo)
        if ex.status is not None and ex.status < 300 and ex.finished_at is not None:
            return meets_slo_unstreamed(ex.finished_at - ex.started, delivered, self.settings.slo)
        return False

    @staticmethod
    def _usage_missing(ex: Exchange) -> bool:
        if ex.status is None or ex.status >= 300:
            return False
        if ex.rewriter is not None:
            return ex.rewriter.usage_lines == 0
        return ex.usage is None

    async def _handle(self, request: web.Request, ex: Exchange) -> web.StreamResponse:
        try:
            body = await self._read_body(request)
        except BodyTooLarge:
            ex.too_large = True
            return self._too_large()
        wish, body = self._prepare(body, ex)
        try:
            upstream = await self.session.post(
                self.settings.upstream + request.rel_url.raw_path_qs,
                headers=_request_headers(request.headers, identity=True),
                # aiohttp writes a large bytes body in one go; a file-like one goes in pieces.
                data=body if len(body) <= _ONE_WRITE else io.BytesIO(body),
                skip_auto_headers=_NO_AUTO,
                allow_redirects=False,
                timeout=self._timeout(),
            )
        except aiohttp.ClientConnectorError as exc:
            return self._upstream_failure(exc)
        except (aiohttp.ClientError, TimeoutError) as exc:
            ex.sent = True  # vLLM had the request: its HTTP counter counts it
            return self._upstream_failure(exc)
        ex.status = upstream.status
        response = web.StreamResponse(
            status=upstream.status,
            reason=upstream.reason,
            headers=_response_headers(upstream.headers),
        )
        try:
            if upstream.status < 300 and ex.model is not None:
                self.ledger.names.learn(ex.model)
            if wish is not None and upstream.status < 300 and self._is_sse(upstream):
                await self._relay_stream(request, response, upstream, ex, wish)
            else:
                await self._relay_body(request, response, upstream, ex)
        except ConnectionResetError:
            ex.client_gone = True  # a write found the client gone
        finally:
            if outcome_of(ex) == "completed" and ex.eof:
                upstream.release()
            else:
                # Closing (not releasing) drops the connection: vLLM sees the disconnect and
                # aborts the request, freeing its KV blocks.
                upstream.close()
        return response

    @staticmethod
    def _is_sse(upstream: aiohttp.ClientResponse) -> bool:
        return upstream.content_type == "text/event-stream"

    @staticmethod
    def _prepare(body: bytes, ex: Exchange) -> tuple[UsageWish | None, bytes]:
        """Learn the model; for a stream, ask vLLM for usage. Other bodies go as they came."""
        try:
            payload = _loads(body)
        except ValueError:
            return None, body  # vLLM answers the 400 for a body that is not JSON
        if not isinstance(payload, dict):
            return None, body
        model = payload.get("model")
        ex.model = model if isinstance(model, str) else None
        if payload.get("stream") is not True:
            return None, body
        wish, upstream_payload = with_usage(payload)
        try:
            return wish, orjson.dumps(upstream_payload)
        except orjson.JSONEncodeError:  # integers past 64 bits: the standard encoder
            return wish, json.dumps(upstream_payload, ensure_ascii=False).encode()

    async def _relay_body(
        self,
        request: web.Request,
        response: web.StreamResponse,
        upstream: aiohttp.ClientResponse,
        ex: Exchange,
    ) -> None:
        """A whole (non-SSE) response: relayed as it arrives, its usage read on the way."""
        if upstream.content_length is not None:
            response.content_length = upstream.content_length
        scanner = UsageScanner() if upstream.status < 300 else None
        await response.prepare(request)
        acks = ex.acks = AckTracker(request.transport)
        try:
            async for chunk in upstream.content.iter_any():
                if scanner is not None:
                    scanner.feed(chunk)
                await response.write(chunk)
                acks.wrote(len(chunk), 0)
        except (aiohttp.ClientError, TimeoutError):
            ex.upstream_broke = True
            self._break(request)
            return
        ex.usage = scanner.tokens() if scanner is not None else None
        ex.wrote_all = True
        ex.finished_at = self.clock()
        await response.write_eof()
        ex.eof = True

    async def _relay_stream(
        self,
        request: web.Request,
        response: web.StreamResponse,
        upstream: aiohttp.ClientResponse,
        ex: Exchange,
        wish: UsageWish,
    ) -> None:
        rewriter = ex.rewriter = StreamRewriter(wish, budget=self.held)
        ex.timing = StreamTiming(ex.started, self.settings.stall_factor, self.settings.stall_min)
        await response.prepare(request)
        ex.acks = AckTracker(request.transport)
        self._streams[id(ex)] = (ex, upstream)
        try:
            failure = await self._relay_events(response, upstream.content.iter_any(), ex)
            # Shutdown closes vLLM's side, which can look like a clean end before [DONE].
            cut_short = self.state == "cutting" and not rewriter.done
            if failure is None and not cut_short:
                out = rewriter.finish()
                if out.payload:
                    await self._write(response, out.payload, out.completion_tokens, ex)
                ex.wrote_all = True
            elif not rewriter.done:
                await response.write(self._stream_error(failure, ex))
            await response.write_eof()
            ex.eof = True
        finally:
            del self._streams[id(ex)]
            rewriter.close()

    def _stream_error(self, failure: BaseException | None, ex: Exchange) -> bytes:
        """The error event that ends a stream vLLM did not finish (headers are long gone)."""
        ex.upstream_broke = True
        if self.state == "cutting":
            ex.cut = True
            return _sse_error("kvtax is shutting down; retry the request", "server_shutdown", 503)
        reason = "timed out" if isinstance(failure, TimeoutError) else "broke off"
        return _sse_error(f"vLLM's stream {reason}", "upstream_error", 502)

    async def _relay_events(
        self, response: web.StreamResponse, chunks: AsyncIterator[bytes], ex: Exchange
    ) -> BaseException | None:
        """Relay events until vLLM's stream ends; return what broke it, if anything did."""
        rewriter = ex.rewriter
        assert rewriter is not None
        try:
            async for data in chunks:
                out = rewriter.feed(data)
                if out.payload:
                    await self._write(response, out.payload, out.completion_tokens, ex)
                    if rewriter.done:
                        ex.wrote_all = True  # [DONE] is with the client's kernel
        except (aiohttp.ClientError, TimeoutError) as exc:
            return exc
        return None

    async def _write(
        self, response: web.StreamResponse, payload: bytes, tokens: int, ex: Exchange
    ) -> None:
        await response.write(payload)
        acks, timing, rewriter = ex.acks, ex.timing, ex.rewriter
        assert acks is not None
        assert timing is not None
        assert rewriter is not None
        before = acks.written_tokens
        if tokens > before:
            timing.tokens_written(self.clock(), rewriter.prompt_tokens + before)
        acks.wrote(len(payload), max(tokens, before))
