"""One client connection to the proxy: an asyncio Protocol that parses bytes into exchanges.

:class:`ClientConnection` feeds the client's bytes to an httptools (llhttp) parser and makes an
:class:`~kvtax.serve.proxy.exchange.Exchange` of each request as soon as its head is complete;
the exchange owns the rest (its body, the 100-continue wait, keep-alive, the answer). Exchanges
queue in arrival order, and one task per busy connection hands the queue's head to the proxy
(:class:`Handler`), so that pipelined requests are answered in order.

The parser is fed in pieces that end where a message can end (after a blank line, or at a
Content-Length body's last byte), so the connection always knows where the next request line
starts. That gives three things llhttp alone does not:

- the request line is checked before the parser sees it (:func:`~kvtax.serve.proxy.head.
  request_line_problem`: one space between its parts, a version of 1.0 or 1.1);
- parsing stops at a message boundary once :data:`MAX_PIPELINED` requests wait behind the one
  being answered: the bytes after it wait unparsed (at most one read of them, since reading
  pauses too), so a read carrying thousands of pipelined requests costs their bytes, not
  thousands of parsed requests;
- trailer fields of a chunked body are never taken for headers.

What one connection may hold is bounded: :data:`MAX_HEAD` of head, :data:`MAX_PIPELINED`
parsed requests waiting, :data:`~kvtax.serve.proxy.exchange.BODY_BUFFER` of a streamed body
not yet sent on, and the answer bytes the client has not read: the next request is not
answered while the client's socket is full (``pause_writing``), and vLLM's side of the one
being answered is paused until it drains. A client that leaves its socket full for
``send_timeout`` seconds (nginx's ``send_timeout``) has gone away.

Reading pauses while any reason holds it (:meth:`hold`, :meth:`release`): the pipeline bound, a
streamed body waiting for vLLM, vLLM's socket full. A request the parser refuses is answered 400
in its turn, its bytes never logged, and the connection closes. A client's FIN, a half-close
included, counts as the client leaving, as nginx counts it (its 499): the exchange being
answered is cancelled, which closes vLLM's side so that vLLM aborts it. :meth:`shutdown` closes
an idle connection at once and lets a busy one finish its answer with ``Connection: close``.

Example::

    server = await loop.create_server(lambda: ClientConnection(proxy), host, port)
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Protocol, cast

import httptools

from kvtax.serve.proxy.answers import bad_request, internal_error
from kvtax.serve.proxy.exchange import Exchange
from kvtax.serve.proxy.head import (
    RequestHead,
    asks_keep_alive,
    head_problem,
    request_line_problem,
)
from kvtax.serve.proxy.wire import Answer, Headers

__all__ = ["KEEPALIVE", "LINGER", "MAX_HEAD", "MAX_PIPELINED", "ClientConnection", "Handler"]

log = logging.getLogger("kvtax.serve.proxy")

# Bytes of request line and headers one request may have, and of one line of them (aiohttp's
# and nginx's 8 KiB buffers).
MAX_HEAD = 64 * 1024
MAX_LINE = 8190
# Requests parsed and waiting behind the one being answered before parsing stops.
MAX_PIPELINED = 8
# Seconds a connection may wait on its client (an idle keep-alive connection, a request head or
# body arriving too slowly) before it is closed (aiohttp's default).
KEEPALIVE = 75.0
# Seconds a refused client's further bytes are read and dropped after its answer, before the
# close (nginx's lingering_timeout): closing on unread bytes resets the connection, and a reset
# can destroy the answer before the client read it.
LINGER = 5.0
_END_OF_HEAD = b"\r\n\r\n"


class Handler(Protocol):
    """What answers a request: the proxy."""

    def exchange_for(self, conn: ClientConnection, head: RequestHead) -> Exchange: ...

    async def handle(self, exchange: Exchange) -> None: ...

    def connected(self, conn: ClientConnection) -> None: ...

    def disconnected(self, conn: ClientConnection) -> None: ...

    @property
    def send_timeout(self) -> float: ...


class ClientConnection(asyncio.Protocol):
    """One client's connection: parse, queue, answer in order. See the module docstring."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        # "5 \r\n": whitespace after a chunk's size, which nginx and h11 read (RFC 9112's
        # chunk-ext allows it before a ';'). The body is framed anew for vLLM, so no reading of
        # it by vLLM can differ from kvtax's.
        self.parser.set_dangerous_leniencies(lenient_spaces_after_chunk_size=True)
        # Exchanges in arrival order; the first is the one being answered.
        self.pipeline: deque[Exchange] = deque()
        self.closed = False
        self.draining = False
        self.write_paused = False
        self.task: asyncio.Task[None] | None = None
        self._holds: set[str] = set()
        self._writable = asyncio.Event()
        self._writable.set()
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
        self._stalled: asyncio.TimerHandle | None = None

    @property
    def current(self) -> Exchange | None:
        return self.pipeline[0] if self.pipeline else None

    @property
    def read_paused(self) -> bool:
        """Reading the client is paused (some reason holds it)."""
        return bool(self._holds)

    # -- transport events -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not registered as asyncio.Transport subclasses.
        self.transport = cast(asyncio.Transport, transport)
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
        dropped for at most :data:`LINGER` seconds, or until it closes too."""
        transport = self.transport
        if transport is None or self.closed or transport.is_closing():
            return
        if not transport.can_write_eof():
            self.close()
            return
        transport.write_eof()
        self._lingering = True
        self._refused = True  # data_received drops everything from here on
        self._holds.clear()
        transport.resume_reading()
        if self._idle is not None:
            self._idle.cancel()
        self._idle = asyncio.get_running_loop().call_later(LINGER, self.close)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        for timer in (self._idle, self._stalled):
            if timer is not None:
                timer.cancel()
        self._writable.set()
        current = self.current
        if self.task is not None and current is not None and not current.complete:
            self.task.cancel()
        self.handler.disconnected(self)

    def pause_writing(self) -> None:
        self.write_paused = True
        self._writable.clear()
        current = self.current
        if current is not None and current.source is not None:
            current.source.pause_reading()
        if self._stalled is None:
            timeout = self.handler.send_timeout
            self._stalled = asyncio.get_running_loop().call_later(timeout, self._stall)

    def resume_writing(self) -> None:
        if not self.write_paused:
            return
        self.write_paused = False
        self._writable.set()
        if self._stalled is not None:
            self._stalled.cancel()
            self._stalled = None
        current = self.current
        if current is not None and current.source is not None:
            current.source.resume_reading()

    # -- reading: holds ---------------------------------------------------------------------
    def hold(self, reason: str) -> None:
        """Pause reading the client while ``reason`` holds."""
        if not self._holds and self.transport is not None and not self.closed:
            self.transport.pause_reading()
        self._holds.add(reason)

    def release(self, reason: str) -> None:
        """``reason`` no longer holds; reading resumes when nothing else does."""
        if reason not in self._holds:
            return
        self._holds.discard(reason)
        if not self._holds and not self._refused:
            if self.transport is not None and not self.closed:
                self.transport.resume_reading()
            if self._unparsed and self._at_line and not self._pipeline_full() and not self.draining:
                data, self._unparsed = self._unparsed, b""
                self._feed(data)

    def stop_reading(self) -> None:
        """Read no more of this client: what it sent last is refused or past a limit."""
        self._refused = True
        self._unparsed = b""
        self.hold("refused")

    # -- feeding the parser -----------------------------------------------------------------
    def _pipeline_full(self) -> bool:
        return len(self.pipeline) > MAX_PIPELINED

    def _feed(self, data: bytes) -> None:
        pos, size = 0, len(data)
        while pos < size and not self._refused:
            if self._at_line:
                if self._pipeline_full() or self.draining:
                    # Parse no further: the rest waits, unparsed, until the queue shortens.
                    self._unparsed = data[pos:]
                    self.hold("pipeline")
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
        exchange = self.handler.exchange_for(self, head)
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

    # -- writing ----------------------------------------------------------------------------
    def write(self, data: bytes) -> None:
        transport = self.transport
        # uvloop refuses a write to a transport that is closing; the bytes have nowhere to go.
        if transport is not None and not transport.is_closing():
            transport.write(data)

    def close(self) -> None:
        """Close once what was written is sent (asyncio flushes the buffer first)."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def shutdown(self) -> None:
        """kvtax is stopping: an idle connection closes now, a busy one after its answer (which
        says ``Connection: close``); nothing more is read or answered on it."""
        self.draining = True
        self.hold("draining")
        if not self.pipeline:
            self.close()

    # -- the queue and its task -------------------------------------------------------------
    def _start(self) -> None:
        """Run the queue's task, unless it runs already."""
        self._disarm_idle()
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        """Answer the queued exchanges in order, one at a time."""
        try:
            while self.pipeline and not self.closed:
                exchange = self.pipeline[0]
                if self.write_paused:  # the last answer is not read yet: no new one on top
                    await self._writable.wait()
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
                    self.release("pipeline")
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
        log.debug("bad request from %s: %s", self._peer(), answer.status)
        exchange, self._receiving = self._receiving, None
        if exchange is not None:
            exchange.fail_body(answer)  # its body broke off: the exchange answers the refusal
        else:
            head = RequestHead.refused(version or self._version(), self._method)
            exchange = self.handler.exchange_for(self, head)
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

    def _peer(self) -> str:
        peer = self.transport.get_extra_info("peername") if self.transport else None
        return str(peer[0]) if isinstance(peer, tuple) and peer else "an unknown peer"

    def _arm_idle(self) -> None:
        """Wait on the client at most KEEPALIVE seconds from now. A request must be complete
        within that of the connection going idle (reads of its head do not restart the wait,
        so a head sent a byte at a time cannot hold the connection); a body's reads each do.
        While an answer is under way with its request read, nothing is wanted of the client."""
        if self._lingering:
            return  # the linger's own timer closes it
        self._disarm_idle()
        if self.closed or (self.pipeline and self._receiving is None):
            return
        self._idle = asyncio.get_running_loop().call_later(KEEPALIVE, self.close)

    def _disarm_idle(self) -> None:
        if self._idle is not None and not self._lingering:
            self._idle.cancel()
            self._idle = None

    def _stall(self) -> None:
        """The client left its socket full for send_timeout: it has gone away."""
        self._stalled = None
        log.debug(
            "client %s read nothing for %gs; closing", self._peer(), self.handler.send_timeout
        )
        if self.transport is not None:
            self.transport.abort()
