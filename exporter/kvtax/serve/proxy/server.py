"""The proxy's HTTP/1.1 server side: a client's connection, its flow control, and its exchanges.

:class:`Connection` is one client's connection, an asyncio Protocol. It feeds the client's bytes
to an httptools (llhttp) parser, makes an :class:`Exchange` of each request as soon as its head
is complete, queues the exchanges in arrival order, and hands the queue's head to the proxy
(:class:`Handler`) from one task per busy connection, so that pipelined requests are answered
in order. That is all it does with a request: uvicorn's protocol and request-response cycle are
the model, kept together in one module as uvicorn keeps them.

An :class:`Exchange` is made when a request's head is complete and lives until the last byte of
its answer went out. It never sees the connection: it gets the transport, the connection's
:class:`~kvtax.serve.proxy.flow.FlowControl` and one callback. Everything one request decides
is decided there:

- **its body**: held whole, within its limit, for an accounted request (:meth:`Exchange.
  whole_body`; past the limit it is ``too_large`` and the rest is never read), or streamed on
  to vLLM as it arrives for any other (:meth:`Exchange.stream_body`), with at most
  ``body_buffer`` bytes held before reading pauses;
- **the 100-continue wait**: the 100 goes out when the exchange first wants its body (never to
  an HTTP/1.0 client, never for a body that will be refused);
- **keep-alive**: whether the connection carries another request after this one, decided when
  the answer's head is written (:meth:`Exchange.response_head`, :meth:`Exchange.answer`): not
  when the client asked to close, nor during shutdown's drain, nor when the request's body was
  not read to its end;
- **"response complete"**: :meth:`Exchange.finish` after the last byte, :meth:`Exchange.
  break_off` for a body cut short, which closes the connection so that it can never look
  complete;
- **flow control**: what it relays from (:meth:`Exchange.relay_from`: vLLM's side of the
  exchange) is paused while the client's socket is full.

The connection's :class:`~kvtax.serve.proxy.flow.FlowControl` is its reading and writing state,
shared with its exchanges: reading pauses while any reason holds it (the pipeline bound, a
streamed body waiting for vLLM, vLLM's socket full of it, the drain, a refusal), and a client
whose socket is full pauses the source being relayed to it; one that leaves it full for
``send_timeout`` seconds (nginx's ``send_timeout``) has gone away.

The parser is fed in pieces that end where a message can end (after a blank line, or at a
Content-Length body's last byte), so the connection always knows where the next request line
starts. That gives three things llhttp alone does not:

- the request line is checked before the parser sees it (:func:`~kvtax.serve.proxy.head.
  request_line_problem`: one space between its parts, a version of 1.0 or 1.1);
- parsing stops at a message boundary once ``max_pipelined`` requests wait behind the one
  being answered: the bytes after it wait unparsed (at most one read of them, since reading
  pauses too), so a read carrying thousands of pipelined requests costs their bytes, not
  thousands of parsed requests;
- trailer fields of a chunked body are never taken for headers.

What one connection may hold is bounded: :data:`~kvtax.serve.proxy.wire.MAX_HEAD` of head,
``max_pipelined`` parsed requests waiting, ``body_buffer`` of a streamed body not yet sent on,
and the answer bytes the client has not read: the next request is not answered while the
client's socket is full, and vLLM's side of the one being answered is paused until it drains.

A request the parser refuses is answered 400 in its turn, its bytes never logged, and the
connection closes. A client's FIN, a half-close included, counts as the client leaving, as nginx
counts it (its 499): the exchange being answered is cancelled, which closes vLLM's side so that
vLLM aborts it. :meth:`Connection.shutdown` closes an idle connection at once and lets a busy
one finish its answer with ``Connection: close``.

Example::

    server = await loop.create_server(lambda: Connection(proxy), host, port)
    ...                                        # in the proxy's handle(exchange):
    body = await exchange.whole_body()         # None: over the limit (answer the 413)
    exchange.relay_from(upstream_connection)   # paused while the client is full
    exchange.write(exchange.response_head(200, b"OK", headers, "chunked") + payload)
    exchange.finish()
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, cast

import httptools

from kvtax.serve.proxy.answers import bad_request, internal_error
from kvtax.serve.proxy.flow import BodyWriter, FlowControl, Hold, Latch, Source, peer_of
from kvtax.serve.proxy.head import (
    RequestHead,
    asks_keep_alive,
    head_problem,
    request_line_problem,
)
from kvtax.serve.proxy.wire import (
    CONTINUE,
    MAX_HEAD,
    MAX_LINE,
    Answer,
    Framing,
    Headers,
    response_head,
)

__all__ = ["Connection", "Exchange", "Handler", "ServerSettings"]

log = logging.getLogger("kvtax.serve.proxy")

_END_OF_HEAD = b"\r\n\r\n"


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """What the server side waits for and holds, per connection."""

    # Seconds a connection may wait on its client (an idle keep-alive connection, a request
    # head or body arriving too slowly) before it is closed (aiohttp's default).
    keepalive: float = 75.0
    # Seconds a refused client's further bytes are read and dropped after its answer, before
    # the close (nginx's lingering_timeout): closing on unread bytes resets the connection, and
    # a reset can destroy the answer before the client read it.
    linger: float = 5.0
    # Seconds a client may leave its socket full before it counts as gone (nginx's
    # send_timeout).
    send_timeout: float = 60.0
    # Requests parsed and waiting behind the one being answered before parsing stops.
    max_pipelined: int = 8
    # Bytes of a streamed body held while nothing takes them yet (vLLM's connection is being
    # made, or the request waits its turn behind a pipelined one) before reading pauses.
    body_buffer: int = 256 * 1024


class Handler(Protocol):
    """What answers requests: the proxy."""

    @property
    def server_settings(self) -> ServerSettings: ...

    def body_limit(self, head: RequestHead) -> int | None:
        """The body a request may have held whole (None: streamed on, no limit of kvtax's)."""

    async def handle(self, exchange: Exchange) -> None: ...

    def connected(self, conn: Connection) -> None: ...

    def disconnected(self, conn: Connection) -> None: ...


class Exchange:
    """One request's exchange; see the module docstring. ``limit`` is the body the request may
    have held whole (None: streamed, no limit of kvtax's own). ``stop_reading`` is the
    connection's: read no more of the client (the body went past the limit)."""

    def __init__(
        self,
        head: RequestHead,
        transport: asyncio.Transport,
        flow: FlowControl,
        *,
        limit: int | None,
        body_buffer: int,
        draining: bool,
        stop_reading: Callable[[], None],
    ) -> None:
        self.head = head
        self.transport = transport
        self.flow = flow
        self.limit = limit
        self.body_buffer = body_buffer
        self.draining = draining  # kvtax is shutting down: this is the last answer on it
        # The connection was answering it, or reading its body, when the drain began: it is
        # carried to its end within the grace period, as any request in flight.
        self.carried = False
        self._stop_reading = stop_reading
        # Set when the request is refused whatever it says (a bad head): answered in its turn.
        self.refusal: Answer | None = None
        self.size = 0  # body bytes received
        self.body_complete = not head.has_body
        self.too_large = limit is not None and head.length is not None and head.length > limit
        self._parts: list[bytes] = []  # a streamed body's reads, not sent on yet
        # A body held whole, grown in place: never a list of reads and their join beside it.
        self._whole = bytearray()
        self._waiter: asyncio.Future[None] | None = None
        self._writer: BodyWriter | None = None
        self._asked = False
        self.head_sent = False
        self.complete = False
        self.keep_alive = head.keep_alive
        self.disconnected = False  # the client's connection is gone

    # -- the request's body -------------------------------------------------------------------
    @property
    def upstream_holder(self) -> Latch:
        """What vLLM's side of a streamed body pauses reading the client by, while its socket
        is full."""
        return self.flow.holder(Hold.UPSTREAM)

    def body_part(self, data: bytes) -> None:
        """Body bytes the parser read (the connection calls this)."""
        if self.too_large:
            return
        self.size += len(data)
        writer = self._writer
        if writer is not None:
            writer.send_body(data)
            return
        if self.limit is not None and self.size > self.limit:
            self._overflow()
            return
        if self.limit is None:
            self._parts.append(data)
        else:
            self._whole += data
        if self.size > self.body_buffer and (self.limit is None or not self._asked):
            # Until stream_body takes it, or, held whole, until its request's turn comes
            # (want_body): a pipelined request waiting behind a long answer holds no more than
            # this of its body, however large a body its limit allows.
            self.flow.hold(Hold.BODY)

    def body_done(self) -> None:
        """The body's last byte was read (the connection calls this)."""
        self.body_complete = True
        if self._writer is not None:
            self._writer.end_body()
        self._wake()

    def want_body(self) -> None:
        """The exchange is ready for its body: reading it resumes, and the client waiting on a
        100 gets it now."""
        if self._asked:
            return
        self._asked = True
        if self.limit is not None:
            self.flow.release(Hold.BODY)
        if self.body_complete or self.too_large:
            return
        if self.head.expect and self.size == 0 and not self.draining:
            self.write(CONTINUE)

    def fail_body(self, refusal: Answer) -> None:
        """The body's framing broke (a bad chunk): the request is refused, and a body being
        streamed to vLLM is cut off there, so vLLM never takes it for whole."""
        self.refusal = refusal
        self.keep_alive = False
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.abort_body()
        self._wake()

    async def whole_body(self) -> bytearray | None:
        """The whole body, once read (the buffer it was read into, handed over); None when it
        is over ``limit`` (``too_large``) or its framing broke (``refusal``)."""
        self.want_body()
        if not self.body_complete and not self.too_large and self.refusal is None:
            self._waiter = self.flow.loop.create_future()
            await self._waiter
        if self.too_large or self.refusal is not None:
            return None
        whole, self._whole = self._whole, bytearray()
        return whole

    def buffered(self) -> bytes:
        """What arrived of a streamed body and is not sent yet (taken: sent from here on)."""
        parts, self._parts = self._parts, []
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def stream_body(self, writer: BodyWriter) -> None:
        """Hand the rest of the body to ``writer`` as it arrives (what is buffered goes first:
        call :meth:`buffered` before, to send it with the head)."""
        self.want_body()
        rest = self.buffered()
        if rest:
            writer.send_body(rest)
        self.flow.release(Hold.BODY)
        if self.body_complete:
            writer.end_body()
        else:
            self._writer = writer

    def _overflow(self) -> None:
        self.too_large = True
        self._parts.clear()
        self._whole = bytearray()
        self._stop_reading()  # the rest of the body is never read
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # -- relaying vLLM's answer ---------------------------------------------------------------
    def relay_from(self, source: Source) -> None:
        """``source`` feeds the answer from here on: it is paused while the client is full."""
        self.flow.source = source
        if self.flow.write_paused:
            source.pause_reading()

    def relay_ended(self) -> None:
        """The answer's source is done. What the client still sends of a body vLLM answered
        before its end goes nowhere, and the connection cannot carry another request (the rest
        of the body is never read)."""
        self.flow.source = None
        self._writer = None
        if not self.body_complete:
            self.keep_alive = False

    # -- the answer ---------------------------------------------------------------------------
    @property
    def reusable(self) -> bool:
        """The connection may carry another request after this answer."""
        return (
            self.keep_alive
            and self.head.keep_alive
            and self.body_complete
            and not self.too_large
            and not self.draining
        )

    def response_head(
        self,
        status: int,
        reason: bytes,
        headers: Headers,
        framing: Framing,
        *,
        length: int | None = None,
    ) -> bytes:
        """The answer's head for this client; decides keep-alive (``Connection: close``)."""
        close = framing == "close" or not self.reusable
        self.keep_alive = not close
        self.head_sent = True
        return response_head(
            self.head.version, status, reason, headers, framing, close=close, length=length
        )

    def interim(self, status: int, reason: bytes, headers: Headers) -> None:
        """vLLM's 1xx (103 Early Hints, say), before the final answer; an HTTP/1.0 client must
        not get one (RFC 9110 15.2)."""
        if self.head.version == b"1.1" and not self.head_sent:
            self.write(response_head(b"1.1", status, reason, headers, "none", close=False))

    def answer(self, answer: Answer) -> None:
        """Write one of kvtax's own answers whole, and finish."""
        if answer.close:
            self.keep_alive = False
        close = not self.reusable
        self.keep_alive = not close
        self.head_sent = True
        # The answer to a HEAD has the head alone (RFC 9110 9.3.2), its length kept.
        head_only = self.head.method == b"HEAD"
        self.write(answer.encode(self.head.version, close=close, head_only=head_only))
        self.finish()

    def write(self, data: bytes) -> None:
        transport = self.transport
        # uvloop refuses a write to a transport that is closing; the bytes have nowhere to go.
        if not transport.is_closing():
            transport.write(data)

    def finish(self) -> None:
        """The answer's last byte was written."""
        self.complete = True

    def break_off(self) -> None:
        """End the answer mid-body: the connection closes, so it can never look complete."""
        self.complete = True
        self.keep_alive = False
        if not self.transport.is_closing():
            self.transport.close()


class Connection(asyncio.Protocol):
    """One client's connection: parse, queue, answer in order. See the module docstring."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.settings = handler.server_settings
        self.transport: asyncio.Transport | None = None
        self._loop: asyncio.AbstractEventLoop  # set as the connection is made
        self.flow: FlowControl | None = None
        self.parser = httptools.HttpRequestParser(self)
        # "5 \r\n": whitespace after a chunk's size, which nginx and h11 read (RFC 9112's
        # chunk-ext allows it before a ';'). The body is framed anew for vLLM, so no reading of
        # it by vLLM can differ from kvtax's.
        self.parser.set_dangerous_leniencies(lenient_spaces_after_chunk_size=True)
        # Exchanges in arrival order; the first is the one being answered.
        self.pipeline: deque[Exchange] = deque()
        self.closed = False
        self.draining = False
        self.task: asyncio.Task[None] | None = None
        # The message being parsed: its head as it comes, then the exchange reading its body.
        self._target = b""
        self._headers: Headers = []
        self._head_bytes = 0
        self._limit_hit: str | None = None
        self._receiving: Exchange | None = None
        self._in_body = False
        # Feeding the parser: whether the next byte starts a request line, the partial line,
        # bytes left unparsed at a boundary, a Content-Length body's bytes still to feed, the
        # last bytes fed (an end of head can straddle two reads), and a message just ended.
        self._at_line = True
        self._line = bytearray()
        self._unparsed = b""
        self._body_left: int | None = None
        self._tail = b""
        self._ended = False
        self._refused = False
        self._method = b""  # of the request being parsed, from its line
        self._lingering = False  # answered a refusal; reading only to drop, until the close
        self._idle: asyncio.TimerHandle | None = None

    @property
    def current(self) -> Exchange | None:
        return self.pipeline[0] if self.pipeline else None

    @property
    def read_paused(self) -> bool:
        """Reading the client is paused (some reason holds it)."""
        return self.flow is not None and self.flow.read_paused

    # -- transport events -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not registered as asyncio.Transport subclasses.
        self.transport = cast(asyncio.Transport, transport)
        self.flow = FlowControl(
            self.transport, send_timeout=self.settings.send_timeout, on_resume=self._resumed
        )
        self._loop = self.flow.loop
        self.handler.connected(self)
        self._arm_idle()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._unparsed:  # a read that came just as reading paused
            self._unparsed += data
            return
        self._feed(data)
        if self._receiving is not None:
            self._arm_idle()  # a body arriving: each read restarts the wait (client_body_timeout)
        elif self.pipeline:
            self._disarm_idle()  # answering: nothing is wanted of the client meanwhile
        elif self._idle is None:
            self._arm_idle()

    def eof_received(self) -> bool | None:
        return None  # a FIN is the client leaving: the transport closes (see module doc)

    def linger(self) -> None:
        """Close after a refusal without losing its answer: the write side ends now (the client
        gets the answer and a FIN), and whatever it still sends of what was refused is read and
        dropped for at most ``linger`` seconds, or until it closes too."""
        transport = self.transport
        if transport is None or self.flow is None or self.closed or transport.is_closing():
            return
        if not transport.can_write_eof():
            self.close()
            return
        transport.write_eof()
        self._lingering = True
        self._refused = True  # data_received drops everything from here on
        self.flow.release_all()
        if self._idle is not None:
            self._idle.cancel()
        self._idle = self._loop.call_later(self.settings.linger, self.close)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._idle is not None:
            self._idle.cancel()
        if self.flow is not None:
            self.flow.lost()
        for exchange in self.pipeline:
            exchange.disconnected = True
        current = self.current
        if self.task is not None and current is not None and not current.complete:
            self.task.cancel()
        self.handler.disconnected(self)

    def pause_writing(self) -> None:
        if self.flow is not None:
            self.flow.pause_writing()

    def resume_writing(self) -> None:
        if self.flow is not None:
            self.flow.resume_writing()

    # -- reading ----------------------------------------------------------------------------
    def _hold(self, reason: Hold) -> None:
        if self.flow is not None:
            self.flow.hold(reason)

    def _release(self, reason: Hold) -> None:
        if self.flow is not None:
            self.flow.release(reason)

    def _resumed(self) -> None:
        """Nothing holds reading any more: parse what waited at a message boundary."""
        if self._unparsed and self._at_line and not self._pipeline_full() and not self.draining:
            data, self._unparsed = self._unparsed, b""
            self._feed(data)

    def stop_reading(self) -> None:
        """Read no more of this client: what it sent last is refused or past a limit."""
        self._refused = True
        self._unparsed = b""
        self._hold(Hold.REFUSED)

    def _exchange(self, head: RequestHead) -> Exchange:
        assert self.transport is not None
        assert self.flow is not None
        return Exchange(
            head,
            self.transport,
            self.flow,
            limit=self.handler.body_limit(head),
            body_buffer=self.settings.body_buffer,
            draining=self.draining,
            stop_reading=self.stop_reading,
        )

    # -- feeding the parser -----------------------------------------------------------------
    def _pipeline_full(self) -> bool:
        return len(self.pipeline) > self.settings.max_pipelined

    def _feed(self, data: bytes) -> None:
        pos, size = 0, len(data)
        while pos < size and not self._refused:
            if self._at_line:
                if self._pipeline_full() or self.draining:
                    # Parse no further: the rest waits, unparsed, until the queue shortens.
                    self._unparsed = data[pos:]
                    self._hold(Hold.PIPELINE)
                    return
                pos = self._request_line(data, pos)
                continue
            end = self._segment_end(data, pos)
            piece = data[pos:end]
            self._tail = (self._tail + piece)[-3:]
            pos = end
            if not self._parse(piece):
                return
            if self._ended:
                self._ended = False
                self._at_line = True
                self._tail = b""

    def _request_line(self, data: bytes, pos: int) -> int:
        """Take a request line starting at ``pos``; where the parser goes on from."""
        newline = data.find(b"\n", pos)
        if newline < 0:
            self._line += data[pos:]
            if len(self._line) > MAX_LINE:
                self._refuse(bad_request(400, f"a request line exceeds {MAX_LINE} bytes"))
            return len(data)
        line = bytes(self._line) + data[pos:newline]
        self._line.clear()
        if line in (b"", b"\r"):
            return newline + 1  # an empty line before a request is ignored (RFC 9112 2.2)
        if len(line) > MAX_LINE:
            self._refuse(bad_request(400, f"a request line exceeds {MAX_LINE} bytes"))
            return len(data)
        problem = request_line_problem(line)
        # The method is known from here: a refused HEAD gets its answer's head alone.
        self._method = line.split(b" ", 1)[0]
        if problem is not None:
            self._refuse(problem, version=b"1.1")
            return len(data)
        self._at_line = False
        self._parse(line + b"\n")
        return newline + 1

    def _segment_end(self, data: bytes, pos: int) -> int:
        """Where the piece to parse from ``pos`` ends: a Content-Length body's last byte, or just
        after the next blank line (where a head, a bodiless request and a chunked body end)."""
        left = self._body_left
        if left is not None:
            end = min(len(data), pos + left)
            self._body_left = left - (end - pos) or None
            return end
        tail = self._tail
        if tail:
            joined = (tail + data[pos : pos + 3]).find(_END_OF_HEAD)
            if joined >= 0:
                return pos + joined + 4 - len(tail)
        found = data.find(_END_OF_HEAD, pos)
        return len(data) if found < 0 else found + 4

    def _parse(self, piece: bytes) -> bool:
        """Feed ``piece``; False when the parser refused it (answered in turn, reading over)."""
        try:
            self.parser.feed_data(piece)
        except httptools.HttpParserUpgrade:
            # The upgrading request carries its refusal (on_headers_complete); read no more.
            self._refuse(bad_request(400, "protocol upgrades are not relayed"))
            return False
        except httptools.HttpParserError:
            # The parser's message quotes the client's bytes (a header value, a token): it is
            # never logged.
            self._refuse(bad_request(400, self._limit_hit or "malformed HTTP request"))
            return False
        return not self._refused

    # -- parser callbacks -------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._target = b""
        self._headers = []
        self._head_bytes = 0
        self._in_body = False

    def on_url(self, url: bytes) -> None:
        self._target += url
        self._count_head(len(url), len(self._target), "request line")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4, len(name) + len(value) + 2, "header")
        if not self._in_body:  # a trailer field after a chunked body is dropped, never a header
            self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._in_body = True
        parser = self.parser
        version = parser.get_http_version().encode()
        problem = head_problem(version, self._headers)
        keep_alive = parser.should_keep_alive()
        if version == b"1.0":
            # llhttp also takes Proxy-Connection: keep-alive; HTTP/1.0 keeps alive only on
            # Connection: keep-alive (RFC 9112 9.3, 9.6).
            keep_alive = keep_alive and asks_keep_alive(self._headers)
        head = RequestHead.of(
            parser.get_method(), self._target, version, self._headers, keep_alive=keep_alive
        )
        if problem is None and head is None:
            problem = bad_request(400, "the request target is not a URL")
        if problem is None and parser.should_upgrade():
            problem = bad_request(400, "protocol upgrades are not relayed")
        if head is None or problem is not None:
            self._refuse(problem or bad_request(400, "malformed HTTP request"))
            raise httptools.HttpParserError("refused")  # stop parsing this message
        exchange = self._exchange(head)
        self._receiving = exchange
        self.pipeline.append(exchange)
        if head.length and not head.chunked:
            self._body_left = head.length
        if exchange.too_large:
            self.stop_reading()  # its body is never read: 413 in its turn, then close
        self._start()

    def on_body(self, body: bytes) -> None:
        exchange = self._receiving
        if exchange is not None:
            exchange.body_part(body)

    def on_message_complete(self) -> None:
        exchange, self._receiving = self._receiving, None
        self._ended = True
        self._body_left = None
        if exchange is not None:
            exchange.body_done()

    # -- closing ----------------------------------------------------------------------------
    def close(self) -> None:
        """Close once what was written is sent (asyncio flushes the buffer first)."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def shutdown(self) -> None:
        """kvtax is stopping: an idle connection closes now, a busy one after its answer (which
        says ``Connection: close``); no request after it is read or answered on it. The one it
        is answering is carried to its end: a body still arriving is read to its last byte
        (reading stops at the next request line instead)."""
        self.draining = True
        for exchange in self.pipeline:
            exchange.draining = True
        current = self.current
        if current is not None:
            current.carried = True
        if self._receiving is None:
            self._hold(Hold.DRAINING)
        if not self.pipeline:
            self.close()

    # -- the queue and its task -------------------------------------------------------------
    def _start(self) -> None:
        """Run the queue's task, unless it runs already."""
        self._disarm_idle()
        if self.task is None:
            self.task = self._loop.create_task(self._serve())

    async def _serve(self) -> None:
        """Answer the queued exchanges in order, one at a time."""
        try:
            while self.pipeline and not self.closed:
                exchange = self.pipeline[0]
                flow = self.flow
                if flow is not None and flow.write_paused:
                    # The last answer is not read yet: no new one on top.
                    await flow.writable.wait()
                    if self.closed:
                        return
                try:
                    await self.handler.handle(exchange)
                except Exception:
                    # The proxy port's one edge: a fault of kvtax's own answers 500 (or cuts an
                    # answer already under way) and closes; the next request is not served.
                    log.exception("the proxy failed answering a request; closing its connection")
                    if not exchange.head_sent:
                        exchange.answer(internal_error())
                    exchange.break_off()
                    return
                if not exchange.complete:  # the handler wrote nothing: never leave it hanging
                    exchange.break_off()
                self.pipeline.popleft()
                if self._refused and not self.pipeline and not self.draining:
                    self.linger()  # the client may still be sending what was refused
                    return
                if not exchange.keep_alive or self.draining:
                    self.close()
                    return
                if not self._pipeline_full():
                    self._release(Hold.PIPELINE)
        except asyncio.CancelledError:
            pass  # the client left: the handler settled what it had
        finally:
            self.task = None
            if not self.closed and not self.pipeline:
                self._arm_idle()

    def _refuse(self, answer: Answer, *, version: bytes | None = None) -> None:
        """The bytes are refused: answered in turn, after the requests before them; the
        connection is read no more and closes after the answer."""
        if self._refused:
            return
        # The parser's own message quotes the client's bytes; only the peer is logged.
        log.debug("bad request from %s: %s", peer_of(self.transport), answer.status)
        exchange, self._receiving = self._receiving, None
        if exchange is not None:
            exchange.fail_body(answer)  # its body broke off: the exchange answers the refusal
        else:
            head = RequestHead.refused(version or self._version(), self._method)
            exchange = self._exchange(head)
            exchange.refusal = answer
            self.pipeline.append(exchange)
        self.stop_reading()
        self._start()

    def _version(self) -> bytes:
        try:
            version = self.parser.get_http_version().encode()
        except Exception:
            return b"1.1"
        return version if version in (b"1.0", b"1.1") else b"1.1"

    def _count_head(self, nbytes: int, line: int, what: str) -> None:
        self._head_bytes += nbytes
        if line > MAX_LINE:
            self._limit_hit = f"a {what} exceeds {MAX_LINE} bytes"
        elif self._head_bytes > MAX_HEAD:
            self._limit_hit = f"the request head exceeds {MAX_HEAD} bytes"
        else:
            return
        raise httptools.HttpParserError(self._limit_hit)  # ends the parse; answered below

    def _arm_idle(self) -> None:
        """Wait on the client at most ``keepalive`` seconds from now. A request must be complete
        within that of the connection going idle (reads of its head do not restart the wait,
        so a head sent a byte at a time cannot hold the connection); a body's reads each do.
        While an answer is under way with its request read, nothing is wanted of the client."""
        if self._lingering:
            return  # the linger's own timer closes it
        self._disarm_idle()
        if self.closed or (self.pipeline and self._receiving is None):
            return
        self._idle = self._loop.call_later(self.settings.keepalive, self.close)

    def _disarm_idle(self) -> None:
        if self._idle is not None and not self._lingering:
            self._idle.cancel()
            self._idle = None
