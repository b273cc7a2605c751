"""One client connection to the proxy: an asyncio Protocol with an httptools (llhttp) parser.

:class:`ClientConnection` parses requests as their bytes arrive; its parser callbacks fill one
small :class:`Incoming` per request, whose body is held within ``--proxy.max-body``. A complete
request joins the connection's queue, and one task per busy connection hands the queue's head
to the proxy (:class:`Handler`), so that pipelined requests are answered in order. Responses
are written straight to the transport; nothing is awaited per write.

Flow control runs both ways without an await. When the client's socket is full
(``pause_writing``) the connection pauses reading vLLM's side of the exchange it is relaying
(:attr:`ClientConnection.source`), and resumes it on ``resume_writing``. Pipelined requests past
:data:`MAX_PIPELINED` pause reading from the client until the queue shortens.

The HTTP behaviours: HTTP/1.0 and keep-alive (``should_keep_alive``); ``Expect: 100-continue``
answered once the request is next in line and its declared body fits; a body declared or grown
past the limit answered 413 at once and the connection closed; a head over :data:`MAX_HEAD`
answered 431; a request the parser refuses answered 400, its bytes never logged. A client's
FIN, a half-close included, counts as the client leaving, as nginx counts it (its 499): the
request it was waiting for is cancelled, which closes vLLM's side so that vLLM aborts it.

Example::

    server = await loop.create_server(lambda: ClientConnection(proxy, max_body), host, port)
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Protocol, cast

import httptools

from kvtax.serve.proxy.answers import bad_request
from kvtax.serve.proxy.wire import CONTINUE, Answer, Headers, content_length, header

__all__ = ["KEEPALIVE", "MAX_HEAD", "MAX_PIPELINED", "ClientConnection", "Handler", "Incoming"]

log = logging.getLogger("kvtax.serve.proxy")

# Bytes of request line and headers one request may have, and of one line of them (aiohttp's
# and nginx's 8 KiB buffers).
MAX_HEAD = 64 * 1024
MAX_LINE = 8190
# Complete requests queued behind the one being answered before reading pauses.
MAX_PIPELINED = 8
# Seconds a connection may sit without a complete request before it is closed: an idle
# keep-alive connection, or a client sending its request too slowly (aiohttp's default).
KEEPALIVE = 75.0


class Incoming:
    """One request as the parser saw it. ``body`` is complete once the request is queued."""

    __slots__ = (
        "body",
        "expect",
        "headers",
        "keep_alive",
        "method",
        "path",
        "refusal",
        "size",
        "target",
        "too_large",
        "version",
    )

    def __init__(self) -> None:
        self.target = b""
        self.path = b""
        self.method = b""
        self.version = b"1.1"
        self.headers: Headers = []
        self.body: list[bytes] = []
        self.size = 0
        self.keep_alive = True
        self.expect = False
        self.too_large = False
        # The parser refused this request: answered with this in its turn, then the connection
        # closes.
        self.refusal: Answer | None = None

    def body_bytes(self) -> bytes:
        return self.body[0] if len(self.body) == 1 else b"".join(self.body)


class Handler(Protocol):
    """What answers a request: the proxy."""

    max_body: int

    async def handle(self, conn: ClientConnection, request: Incoming) -> None: ...

    def connected(self, conn: ClientConnection) -> None: ...

    def disconnected(self, conn: ClientConnection) -> None: ...


class ClientConnection(asyncio.Protocol):
    """One client's connection: parse, queue, answer in order. See the module docstring."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.queue: deque[Incoming] = deque()
        self.current: Incoming | None = None
        self.head_bytes = 0
        self.limit_hit: str | None = None
        self.task: asyncio.Task[None] | None = None
        self.closed = False
        # The exchange being answered wrote its last byte: a FIN now costs it nothing.
        self.answered = False
        # vLLM's side of the exchange being relayed: paused while this client is full.
        self.source: asyncio.Transport | None = None
        self.write_paused = False
        self.read_paused = False
        self._idle: asyncio.TimerHandle | None = None

    # -- transport events -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not registered as asyncio.Transport subclasses.
        self.transport = cast(asyncio.Transport, transport)
        self.handler.connected(self)
        self._arm_idle()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # The upgrading request carries its refusal (on_headers_complete); read no more.
            self._refuse(bad_request(400, "protocol upgrades are not relayed"))
        except httptools.HttpParserError:
            # The parser's message quotes the client's bytes (a header value, a token): it is
            # never logged.
            self._refuse(bad_request(400, "malformed HTTP request"))

    def eof_received(self) -> bool | None:
        return None  # a FIN is the client leaving: the transport closes (see module doc)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._idle is not None:
            self._idle.cancel()
        self.resume_writing()
        task = self.task
        if task is not None and not self.answered:
            task.cancel()
        self.handler.disconnected(self)

    def pause_writing(self) -> None:
        self.write_paused = True
        if self.source is not None:
            self.source.pause_reading()

    def resume_writing(self) -> None:
        if self.write_paused:
            self.write_paused = False
            if self.source is not None and not self.source.is_closing():
                self.source.resume_reading()

    # -- parser callbacks -------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self.current = Incoming()
        self.head_bytes = 0

    def on_url(self, url: bytes) -> None:
        current = self.current
        assert current is not None
        current.target += url
        self._count_head(len(url), len(current.target), "request line")

    def on_header(self, name: bytes, value: bytes) -> None:
        current = self.current
        assert current is not None
        current.headers.append((name, value))
        self._count_head(len(name) + len(value) + 4, len(name) + len(value) + 2, "header")

    def on_headers_complete(self) -> None:
        request = self.current
        assert request is not None
        parser = self.parser
        request.method = parser.get_method()
        request.version = parser.get_http_version().encode()
        request.keep_alive = parser.should_keep_alive()
        request.path = request.target.split(b"?", 1)[0]
        if parser.should_upgrade():
            request.refusal = bad_request(400, "protocol upgrades are not relayed")
        declared = content_length(request.headers)
        expect = header(request.headers, b"expect")
        request.expect = expect is not None and expect.lower() == b"100-continue"
        if declared is not None and declared > self.handler.max_body:
            self._too_large(request)
        elif request.expect and not self.queue and self.task is None:
            self.write(CONTINUE)  # next in line: ask for the body now
            request.expect = False

    def on_body(self, body: bytes) -> None:
        request = self.current
        if request is None or request.too_large:
            return
        request.size += len(body)
        if request.size > self.handler.max_body:
            request.body.clear()
            self._too_large(request)
        else:
            request.body.append(body)

    def on_message_complete(self) -> None:
        request, self.current = self.current, None
        if request is not None and not request.too_large:
            self._enqueue(request)

    # -- writing ----------------------------------------------------------------------------
    def write(self, data: bytes) -> None:
        transport = self.transport
        # uvloop refuses a write to a transport that is closing; the bytes have nowhere to go.
        if transport is not None and not transport.is_closing():
            transport.write(data)

    def answer(self, answer: Answer, request: Incoming) -> None:
        """Write one of kvtax's own responses; close the connection after it if it must."""
        close = answer.close or not request.keep_alive
        self.write(answer.encode(request.version, close=close))
        if close:
            self.close()

    def close(self) -> None:
        """Close once what was written is sent (asyncio flushes the buffer first)."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    # -- the queue and its task -------------------------------------------------------------
    def _enqueue(self, request: Incoming) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        self.queue.append(request)
        if len(self.queue) > MAX_PIPELINED and not self.read_paused:
            self.read_paused = True
            assert self.transport is not None
            self.transport.pause_reading()
        self._start()

    def _start(self) -> None:
        """Run the queue's task, unless it runs already."""
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        """Answer the queued requests in order, one at a time."""
        try:
            while self.queue and not self.closed:
                request = self.queue[0]
                self.answered = False
                if request.expect:  # a pipelined request that waited its turn
                    self.write(CONTINUE)
                await self.handler.handle(self, request)
                if request.too_large:
                    return  # answered 413 and closed: the rest of its body is never read
                self.queue.popleft()
                if self.read_paused and len(self.queue) <= MAX_PIPELINED // 2:
                    self.read_paused = False
                    if self.transport is not None:
                        self.transport.resume_reading()
                if not request.keep_alive:
                    self.close()
                    return
        except asyncio.CancelledError:
            pass  # the client left: the handler settled what it had
        finally:
            self.task = None
            self.answered = False
            if not self.closed and not self.queue:
                self._arm_idle()

    def _too_large(self, request: Incoming) -> None:
        """A body past the limit: answered at once (in turn), the rest of it never read."""
        request.too_large = True
        request.keep_alive = False
        request.expect = False  # refused: its body is not wanted
        if self.current is request:
            self.current = None
        self.queue.append(request)
        self._start()
        self._stop_reading()

    def _count_head(self, nbytes: int, line: int, what: str) -> None:
        self.head_bytes += nbytes
        if line > MAX_LINE:
            self.limit_hit = f"a {what} exceeds {MAX_LINE} bytes"
        elif self.head_bytes > MAX_HEAD:
            self.limit_hit = f"the request head exceeds {MAX_HEAD} bytes"
        else:
            return
        raise httptools.HttpParserError(self.limit_hit)  # ends the parse; answered below

    def _refuse(self, answer: Answer) -> None:
        """The parser refused the bytes: answered in turn, after the requests before them; the
        connection is read no more and closes after the answer."""
        if self.limit_hit is not None:
            answer = bad_request(400, self.limit_hit)
        # The parser's own message quotes the client's bytes; only the peer is logged.
        log.debug("bad request from %s: %s", self._peer(), answer.status)
        request, self.current = self.current or Incoming(), None
        if request.refusal is None:
            request.refusal = answer
        request.keep_alive = False
        if request not in self.queue:
            self.queue.append(request)
        self._stop_reading()
        self._start()

    def _stop_reading(self) -> None:
        if self.transport is not None and not self.read_paused:
            self.read_paused = True
            self.transport.pause_reading()

    def _peer(self) -> str:
        peer = self.transport.get_extra_info("peername") if self.transport else None
        return str(peer[0]) if isinstance(peer, tuple) and peer else "an unknown peer"

    def _arm_idle(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
        self._idle = asyncio.get_running_loop().call_later(KEEPALIVE, self.close)
