"""The proxy's relay: vLLM's response to the client as its bytes arrive, facts noted on the way.

:class:`Relay` copies one response from vLLM to the client. Nothing is held whole: each write
waits for the client's socket to drain, and the upstream reader pauses when its buffer is full,
so a slow client slows vLLM's TCP stream instead of growing memory. An accounted stream goes
through a :class:`~kvtax.delivery.sse.StreamRewriter` that trims the usage the client did not
ask for, a non-streamed body past a :class:`~kvtax.delivery.usage.UsageScanner`; every write is
recorded with the client's acknowledgement tracker (:mod:`kvtax.serve.acks`). The relay only
notes facts on the :class:`~kvtax.serve.exchange.Exchange`; the proxy decides the outcome.

A stream vLLM does not finish (it broke off, timed out, or shutdown closed it) ends with an
OpenAI-style error event and a clean end of stream: its headers and 200 are long gone. A plain
body that breaks off breaks the client's connection, so it can never look complete.

Example::

    relay = Relay(held=HoldBudget(2**24), clock=time.monotonic, stall=(5.0, 0.05),
                  phase=lambda: "serving")
    await relay.stream(request, response, upstream, ex, wish)
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import aiohttp
from aiohttp import web

from kvtax.delivery.openai import sse_error_event
from kvtax.delivery.sse import HoldBudget, StreamRewriter, UsageWish
from kvtax.delivery.timing import StreamTiming
from kvtax.delivery.usage import UsageScanner
from kvtax.serve.acks import AckTracker
from kvtax.serve.errors import SHUTTING_DOWN
from kvtax.serve.exchange import Exchange, Phase
from kvtax.serve.upstream import response_headers

__all__ = ["Relay", "UpstreamFailed", "break_client", "pass_through", "upstream_chunks"]


def break_client(request: web.Request) -> None:
    """Close the client's connection so a body cut short can never look complete."""
    transport = request.transport
    if transport is not None:
        transport.close()


class UpstreamFailed(Exception):
    """vLLM's side of an exchange broke: its connection failed or its read timed out."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


async def upstream_chunks(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """vLLM's body as it arrives, with its failures raised as :class:`UpstreamFailed`.

    The server's own writes fail with ``aiohttp.ClientConnectionResetError`` when the client has
    left, and that is an ``aiohttp.ClientError`` too: a relay loop that caught ClientError
    around both its read and its write would take a client that hung up for a vLLM that broke
    off. Read failures come out of here as UpstreamFailed; a write's error stays the client's.
    """
    chunks = content.iter_any().__aiter__()
    while True:
        try:
            chunk = await chunks.__anext__()
        except StopAsyncIteration:
            return
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise UpstreamFailed(exc) from exc
        yield chunk


async def pass_through(
    request: web.Request, upstream: aiohttp.ClientResponse
) -> web.StreamResponse:
    """Relay an unaccounted response as it is; the caller releases ``upstream``."""
    try:
        response = web.StreamResponse(
            status=upstream.status,
            reason=upstream.reason,
            headers=response_headers(upstream.headers),
        )
        if upstream.content_length is not None:
            response.content_length = upstream.content_length
        await response.prepare(request)
        try:
            async for chunk in upstream_chunks(upstream.content):
                await response.write(chunk)
        except UpstreamFailed:
            break_client(request)
            upstream.close()
            return response
        await response.write_eof()
        return response
    except BaseException:
        # Client gone (cancelled), client reset: drop the connection rather than return a
        # half-read one to the pool.
        upstream.close()
        raise


class Relay:
    """Relays accounted responses; shared by all requests of one proxy."""

    def __init__(
        self,
        *,
        held: HoldBudget,
        clock: Callable[[], float],
        stall: tuple[float, float],
        phase: Callable[[], Phase],
    ) -> None:
        self.held = held
        self.clock = clock
        self.stall_factor, self.stall_min = stall
        self.phase = phase

    async def body(
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
            async for chunk in upstream_chunks(upstream.content):
                if scanner is not None:
                    scanner.feed(chunk)
                await response.write(chunk)
                acks.wrote(len(chunk), 0)
        except UpstreamFailed:
            ex.upstream_broke = True
            break_client(request)
            return
        ex.usage = scanner.tokens() if scanner is not None else None
        ex.wrote_all = True
        ex.finished_at = self.clock()
        await response.write_eof()
        ex.eof = True

    async def stream(
        self,
        request: web.Request,
        response: web.StreamResponse,
        upstream: aiohttp.ClientResponse,
        ex: Exchange,
        wish: UsageWish,
    ) -> None:
        """An SSE stream, rewritten to what the client asked for; ends cleanly whatever happens."""
        rewriter = ex.rewriter = StreamRewriter(wish, budget=self.held)
        ex.timing = StreamTiming(ex.started, self.stall_factor, self.stall_min)
        await response.prepare(request)
        ex.acks = AckTracker(request.transport)
        try:
            failure = await self._events(response, upstream_chunks(upstream.content), ex)
            # Shutdown closes vLLM's side, which can look like a clean end before [DONE].
            cut_short = self.phase() == "cutting" and not rewriter.done
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
            rewriter.close()

    def _stream_error(self, failure: BaseException | None, ex: Exchange) -> bytes:
        """The error event that ends a stream vLLM did not finish (headers are long gone)."""
        ex.upstream_broke = True
        if self.phase() == "cutting":
            return sse_error_event(503, SHUTTING_DOWN, "server_shutdown")
        reason = "timed out" if isinstance(failure, TimeoutError) else "broke off"
        return sse_error_event(502, f"vLLM's stream {reason}", "upstream_error")

    async def _events(
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
        except UpstreamFailed as failed:
            return failed.cause
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
