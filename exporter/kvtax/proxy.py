"""The OpenAI-compatible reverse proxy in front of vLLM: relays every byte, counts what arrived.

:class:`Proxy` is an aiohttp server with one shared upstream client. ``/v1/completions`` and
``/v1/chat/completions`` are relayed with accounting; every other path passes through untouched.
Streams are relayed chunk by chunk: each write waits for the client's socket to drain, and the
upstream reader pauses when its buffer is full, so a slow client slows vLLM's TCP stream instead
of growing memory. The proxy asks vLLM for usage on every chunk and trims it back to what the
client asked for (:mod:`kvtax.sse`); tokens count as delivered once the bytes carrying them were
written to the client and its TCP stack acknowledged them (bytes still queued in our socket when a
stalled client leaves never reached it). A client that goes away cancels its handler (aiohttp's
handler cancellation), which closes the upstream connection at once, so vLLM aborts the request
and frees its KV. Each request settles one :class:`~kvtax.ledger.RequestRecord` in a ``finally``.

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
import contextlib
import fcntl
import json
import logging
import struct
import termios
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from .ledger import DeliveryLedger, RequestRecord
from .sse import StreamRewriter, UsageWish, with_usage
from .timing import SloTargets, StreamTiming, meets_slo_unstreamed

__all__ = ["ACCOUNTED_PATHS", "Proxy", "ProxySettings", "openai_error"]

log = logging.getLogger("kvtax.proxy")

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
_MAX_RESPONSE = 256 * 1024**2  # a non-streamed answer larger than this is not a completion


@dataclass(frozen=True, slots=True)
class ProxySettings:
    upstream: str
    max_body: int = 32 * 1024**2
    timeout: float = 300.0
    stall_factor: float = 5.0
    stall_min: float = 0.05
    slo_ttft: float = 2.0
    slo_itl: float = 0.2

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


class _TooLarge(Exception):
    pass


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
class _Exchange:
    """Mutable facts about one accounted request, settled into the ledger at the end."""

    started: float
    model: str | None = None
    outcome: str = "upstream_error"
    forwarded: bool = False
    delivered: int = 0
    credited: int = 0  # of ``delivered``, what the ledger already counted mid-stream
    prompt: int = 0
    upstream_tokens: int = 0
    timing: StreamTiming | None = None
    slo_met: bool = False
    # Set when shutdown's grace period ran out while this request was still streaming.
    cut: bool = False
    # Every byte of the response was handed to the client (only the end-of-stream remained).
    relayed_all: bool = False


class Proxy:
    """The relay. ``in_flight`` counts accounted requests not yet settled (for tests)."""

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
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        # Streams in flight, so that shutdown can end the ones its grace period does not cover.
        self._streams: dict[int, tuple[_Exchange, aiohttp.ClientResponse]] = {}
        self._cutting = False

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                # No pool limit: the pool must never queue a stream behind others.
                connector=aiohttp.TCPConnector(limit=0),
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
            for site in list(runner.sites):
                await site.stop()  # no new connections from here on
            loop = asyncio.get_running_loop()
            deadline = loop.time() + grace
            while self.in_flight and loop.time() < deadline:
                await asyncio.sleep(0.05)
            if self.in_flight:
                log.info("grace period over: ending %d request(s) still in flight", self.in_flight)
            self._cutting = True
            for ex, upstream in list(self._streams.values()):
                ex.cut = True
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
            if ex.delivered > ex.credited:
                self.ledger.credit(ex.model, ex.delivered - ex.credited)
                ex.credited = ex.delivered

    # -- helpers -----------------------------------------------------------------------------
    def _timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(
            total=None, sock_connect=self.settings.timeout, sock_read=self.settings.timeout
        )

    async def _read_body(self, request: web.Request) -> bytes:
        limit = self.settings.max_body
        if request.content_length is not None and request.content_length > limit:
            raise _TooLarge
        parts: list[bytes] = []
        size = 0
        async for chunk in request.content.iter_any():
            size += len(chunk)
            if size > limit:
                raise _TooLarge
            parts.append(chunk)
        return b"".join(parts)

    def _too_large(self) -> web.Response:
        return openai_error(
            413,
            f"request body exceeds the proxy's limit of {self.settings.max_body} bytes",
            "invalid_request_error",
        )

    def _upstream_failure(self, exc: BaseException) -> web.Response:
        if isinstance(exc, TimeoutError):
            return openai_error(
                504,
                f"vLLM did not answer within {self.settings.timeout:g}s",
                "upstream_timeout",
            )
        return openai_error(502, "vLLM is unreachable", "upstream_unavailable")

    # -- pass-through ------------------------------------------------------------------------
    async def _passthrough(self, request: web.Request) -> web.StreamResponse:
        limit = self.settings.max_body
        if request.content_length is not None and request.content_length > limit:
            return self._too_large()
        data: Any = request.content if request.body_exists else None
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
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response
        except BaseException:
            # Client gone (cancelled), client reset, or upstream broke: drop the connection
            # rather than return a half-read one to the pool.
            upstream.close()
            raise
        finally:
            upstream.release()

    # -- accounted endpoints -----------------------------------------------------------------
    async def _accounted(self, request: web.Request) -> web.StreamResponse:
        ex = _Exchange(started=self.clock())
        self.in_flight += 1
        try:
            return await self._handle(request, ex)
        except asyncio.CancelledError:
            # aiohttp cancels the handler when the client disconnects, and at shutdown.
            if ex.outcome != "completed":
                ex.outcome = "shutdown" if self._cutting else "client_disconnected"
            raise
        finally:
            self.in_flight -= 1
            self._settle(ex)

    def _settle(self, ex: _Exchange) -> None:
        timing = ex.timing
        self.ledger.settle(
            RequestRecord(
                model=ex.model,
                outcome=ex.outcome,
                delivered_tokens=ex.delivered,
                credited_tokens=ex.credited,
                prompt_tokens=ex.prompt,
                undelivered_tokens=max(0, ex.upstream_tokens - ex.delivered),
                forwarded=ex.forwarded,
                duration=self.clock() - ex.started,
                ttft=timing.ttft if timing else None,
                gaps=tuple(timing.gaps) if timing else (),
                stalls=tuple(timing.stalls) if timing else (),
                slo_met=ex.slo_met,
            )
        )

    async def _handle(self, request: web.Request, ex: _Exchange) -> web.StreamResponse:
        try:
            body = await self._read_body(request)
        except _TooLarge:
            ex.outcome = "rejected"
            return self._too_large()
        payload: Any
        try:
            payload = json.loads(body)
        except ValueError:
            payload = None
        wish: UsageWish | None = None
        if isinstance(payload, dict):
            model = payload.get("model")
            ex.model = model if isinstance(model, str) else None
            if payload.get("stream") is True:
                wish, upstream_payload = with_usage(payload)
                body = json.dumps(upstream_payload, ensure_ascii=False).encode()
        # Anything that is not a JSON object goes to vLLM as it came; vLLM answers the 400.
        try:
            upstream = await self.session.post(
                self.settings.upstream + request.rel_url.raw_path_qs,
                headers=_request_headers(request.headers, identity=True),
                data=body,
                skip_auto_headers=_NO_AUTO,
                allow_redirects=False,
                timeout=self._timeout(),
            )
        except aiohttp.ClientConnectorError as exc:
            return self._upstream_failure(exc)
        except (aiohttp.ClientError, TimeoutError) as exc:
            ex.forwarded = True
            return self._upstream_failure(exc)
        ex.forwarded = True
        try:
            if upstream.status < 300 and ex.model is not None:
                self.ledger.names.learn(ex.model)
            if (
                wish is None
                or upstream.status >= 300
                or upstream.content_type != "text/event-stream"
            ):
                return await self._relay_whole(request, upstream, ex)
            return await self._relay_stream(request, upstream, ex, wish)
        except BaseException:
            if ex.outcome != "completed":
                ex.outcome = "shutdown" if self._cutting else "client_disconnected"
            raise
        finally:
            if ex.outcome == "completed":
                upstream.release()
            else:
                # Closing (not releasing) drops the connection: vLLM sees the disconnect and
                # aborts the request, freeing its KV blocks.
                upstream.close()

    async def _relay_whole(
        self, request: web.Request, upstream: aiohttp.ClientResponse, ex: _Exchange
    ) -> web.StreamResponse:
        try:
            body = await upstream.content.read(_MAX_RESPONSE)
        except (aiohttp.ClientError, TimeoutError) as exc:
            return self._upstream_failure(exc)
        status = upstream.status
        ex.outcome = "rejected" if 400 <= status < 500 else "upstream_error"
        usage = _usage_of(body) if status < 300 else None
        if usage is not None:
            ex.upstream_tokens, ex.prompt = usage
        response = web.StreamResponse(
            status=status, reason=upstream.reason, headers=_response_headers(upstream.headers)
        )
        response.content_length = len(body)
        try:
            await response.prepare(request)
            await response.write(body)
            await response.write_eof()
        except ConnectionResetError:
            ex.outcome = "client_disconnected"
            return response
        if status < 300:
            ex.outcome = "completed"
            ex.delivered = ex.upstream_tokens
            ex.slo_met = meets_slo_unstreamed(
                self.clock() - ex.started, ex.delivered, self.settings.slo
            )
        elif status < 400:
            ex.outcome = "completed"
        return response

    async def _relay_stream(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        ex: _Exchange,
        wish: UsageWish,
    ) -> web.StreamResponse:
        rewriter = StreamRewriter(wish)
        ex.timing = StreamTiming(ex.started, self.settings.stall_factor, self.settings.stall_min)
        response = web.StreamResponse(
            status=upstream.status,
            reason=upstream.reason,
            headers=_response_headers(upstream.headers),
        )
        await response.prepare(request)
        acks = _Acks(request.transport)
        self._streams[id(ex)] = (ex, upstream)
        try:
            return await self._relay_events(response, upstream, ex, rewriter, acks)
        finally:
            del self._streams[id(ex)]

    async def _relay_events(
        self,
        response: web.StreamResponse,
        upstream: aiohttp.ClientResponse,
        ex: _Exchange,
        rewriter: StreamRewriter,
        acks: _Acks,
    ) -> web.StreamResponse:
        timing = ex.timing
        assert timing is not None
        clock = self.clock
        written = 0
        try:
            try:
                async for data in upstream.content.iter_any():
                    out = rewriter.feed(data)
                    ex.upstream_tokens = rewriter.upstream_completion_tokens
                    if out.payload:
                        await response.write(out.payload)
                        if out.completion_tokens > written:
                            timing.tokens_written(clock(), rewriter.prompt_tokens + written)
                            written = out.completion_tokens
                            ex.prompt = rewriter.prompt_tokens
                        ex.delivered = acks.wrote(len(out.payload), written)
            except (aiohttp.ClientError, TimeoutError) as exc:
                if ex.cut:
                    return await self._end_cut(response, ex, rewriter, written)
                # The headers are gone; tell the client in the stream, the way vLLM does.
                reason = "timed out" if isinstance(exc, TimeoutError) else "broke off"
                ex.outcome = "upstream_error"
                ex.upstream_tokens = rewriter.upstream_completion_tokens
                await response.write(_sse_error(f"vLLM's stream {reason}", "upstream_error", 502))
                await response.write_eof()
                ex.delivered = written
                return response
            if ex.cut:
                return await self._end_cut(response, ex, rewriter, written)
            out = rewriter.finish()
            if out.payload:
                await response.write(out.payload)
                if out.completion_tokens > written:
                    timing.tokens_written(clock(), rewriter.prompt_tokens + written)
                    written = out.completion_tokens
                ex.delivered = acks.wrote(len(out.payload), written)
            ex.relayed_all = True
            await response.write_eof()
        except (ConnectionResetError, asyncio.CancelledError) as exc:
            if ex.relayed_all and ex.delivered >= written:
                # The client read the whole stream, [DONE] included, and hung up before our
                # end-of-stream: a completed request, not a disconnect.
                self._completed(ex, rewriter, written, timing)
                if isinstance(exc, asyncio.CancelledError):
                    raise
                return response
            ex.outcome = "shutdown" if ex.cut else "client_disconnected"
            # Whatever vLLM already sent us but the client never got is undelivered too.
            with contextlib.suppress(aiohttp.ClientError, RuntimeError):
                rewriter.feed(upstream.content.read_nowait())
            ex.upstream_tokens = rewriter.upstream_completion_tokens
            if isinstance(exc, asyncio.CancelledError):
                raise
            return response
        self._completed(ex, rewriter, written, timing)
        return response

    def _completed(
        self, ex: _Exchange, rewriter: StreamRewriter, written: int, timing: StreamTiming
    ) -> None:
        ex.outcome = "completed"
        ex.prompt = rewriter.prompt_tokens
        ex.delivered = written
        if rewriter.final_completion_tokens is not None:
            # Every byte reached the client, so every token did.
            ex.upstream_tokens = ex.delivered = rewriter.final_completion_tokens
        ex.slo_met = timing.meets(self.settings.slo)

    async def _end_cut(
        self,
        response: web.StreamResponse,
        ex: _Exchange,
        rewriter: StreamRewriter,
        written: int,
    ) -> web.StreamResponse:
        """End a stream that shutdown's grace period did not cover, as cleanly as vLLM would."""
        ex.outcome = "shutdown"
        ex.upstream_tokens = rewriter.upstream_completion_tokens
        ex.delivered = written
        await response.write(
            _sse_error("kvtax is shutting down; retry the request", "server_shutdown", 503)
        )
        await response.write_eof()
        return response


class _Acks:
    """Which written tokens the client's TCP stack has acknowledged.

    A write hands bytes to the kernel, not to the client: a client that stopped reading
    leaves them queued in our socket. After each write we ask the kernel how many bytes are
    still unacknowledged (Linux ``SIOCOUTQ``; plus what the transport still buffers) and confirm
    the tokens of every write whose bytes have all been acknowledged. Where the kernel cannot
    tell (not a TCP socket, not Linux), a write counts as soon as it returns.
    """

    __slots__ = ("_fd", "_pending", "_transport", "_written", "confirmed")

    def __init__(self, transport: asyncio.Transport | None) -> None:
        self._transport = transport
        sock = transport.get_extra_info("socket") if transport is not None else None
        self._fd: int = sock.fileno() if sock is not None else -1
        self._written = 0
        self._pending: deque[tuple[int, int]] = deque()
        self.confirmed = 0

    def wrote(self, nbytes: int, tokens: int) -> int:
        """Record a finished write that brought the client up to ``tokens``; return the
        tokens confirmed so far."""
        self._written += nbytes
        self._pending.append((self._written, tokens))
        unacked = self._unacked()
        acked = self._written - unacked if unacked is not None else self._written
        while self._pending and self._pending[0][0] <= acked:
            self.confirmed = self._pending.popleft()[1]
        return self.confirmed

    def _unacked(self) -> int | None:
        transport = self._transport
        # Never ask about a closed socket: its descriptor may already belong to another.
        if self._fd < 0 or transport is None or transport.is_closing():
            return None
        try:
            queued = fcntl.ioctl(self._fd, termios.TIOCOUTQ, b"\0\0\0\0")
        except OSError:
            self._fd = -1
            return None
        outq: int = struct.unpack("i", queued)[0]
        return outq + transport.get_write_buffer_size()


def _usage_of(body: bytes) -> tuple[int, int] | None:
    """(completion_tokens, prompt_tokens) from a non-streamed OpenAI response body."""
    try:
        usage = json.loads(body).get("usage")
        return int(usage.get("completion_tokens") or 0), int(usage.get("prompt_tokens") or 0)
    except (ValueError, AttributeError, TypeError):
        return None
