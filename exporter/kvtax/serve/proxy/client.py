"""The proxy's HTTP/1.1 client side: a keep-alive pool of connections to vLLM, asyncio Protocols
with httptools parsers.

:meth:`Upstream.send` writes one request on a pooled connection or a new one, and returns once
vLLM's status line and headers arrived. A request whose body is still arriving from the client
goes on a new connection, its body streamed on as it comes (``streamed``: the connection is the
body's :class:`~kvtax.serve.proxy.flow.BodyWriter`, and a full socket to vLLM pauses
reading the client through its :class:`Holder`). From then on the response's body goes, read
by read, to the :class:`Sink` the relay attaches: the parser's ``on_body`` pieces of one read
are handed over together, so one read of vLLM's makes one write to the client. Nothing is
awaited per read.

What the pool keeps from the aiohttp client it replaces:

- Idle connections are dropped after ``idle`` seconds, before vLLM drops them (uvicorn closes
  after 5 s): reusing one vLLM is closing at that instant fails the request. A pooled
  connection whose socket is readable is not reused either: vLLM closed it (or sent on it)
  and kvtax's loop, late under load, has not read that yet (:meth:`UpstreamConnection.dropped`).
- vLLM can still close a pooled connection just as it is reused (its event loop late under
  load); the request then fails before vLLM read it. nginx gives a cached connection's failure
  a second try for this reason, and so does :meth:`Upstream.send`, once, when the break came
  within ``stale_within`` seconds of sending and before any byte of an answer. Such a
  connection fails on the write or on the first read, at once; a break that comes later met a
  vLLM that had the request and ran it (for a non-streamed request the status line comes only
  when the generation ends), and sending it again would run it twice. A refused connect,
  a later break, a streamed body or any answer at all is never sent twice (``retries`` counts
  the second tries).
- ``timeout`` bounds connecting and vLLM's silence: the wait for its next byte while kvtax is
  reading it, and for it to take the next bytes of a body kvtax is sending. Time during which
  kvtax itself holds vLLM paused (its client's socket full) or waits for the client's own
  body bytes is not vLLM's silence, and does not count. A whole stream is unbounded.
- Shutdown's cut (:meth:`Upstream.cut`): vLLM sends a non-streamed answer's status line only
  when the generation ends, so every request still waiting for one when the grace period is
  over has its connection closed, which makes vLLM abort it; ``send`` raises :class:`Cut`.

And what a front door must not take from an upstream: a head over
:data:`~kvtax.serve.proxy.wire.MAX_HEAD` (502, and
the connection dropped unread), a ``101`` (no upgrades are relayed), and any byte after the
answer's end (a second, unrequested answer, leftovers): the answer already complete goes out
as it was, and the connection is closed, never pooled, so nothing of it reaches this client or
the next request.

Example::

    upstream = Upstream("http://127.0.0.1:8000", timeout=300.0, idle=2.0, stale_within=0.5)
    conn = await upstream.send(head + body)
    conn.attach(sink)       # sink.feed(...) per read, then sink.end() or sink.broke(exc)
    ...
    upstream.release(conn)  # back to the pool, or conn.close()
"""

from __future__ import annotations

import asyncio
import logging
import select
import ssl
import time
from collections.abc import Callable
from typing import Protocol, TypeAlias, cast
from urllib.parse import urlsplit

import httptools

from kvtax.errors import UpstreamError
from kvtax.serve.proxy.wire import MAX_HEAD, Headers, header

__all__ = [
    "Cut",
    "Holder",
    "Outgoing",
    "Sink",
    "Unreachable",
    "Upstream",
    "UpstreamBroke",
    "UpstreamConnection",
]

log = logging.getLogger("kvtax.serve.proxy")

# A request for vLLM: one buffer, or several written in turn (a head and a body's parts).
Outgoing: TypeAlias = bytes | tuple[bytes | bytearray | memoryview, ...]


class Unreachable(UpstreamError):
    """vLLM refused or could not be reached: it never had the request."""


class UpstreamBroke(UpstreamError):
    """vLLM's connection closed or broke before its answer was complete."""


class Cut(Exception):
    """Shutdown's cut came before vLLM's status line."""


class Sink(Protocol):
    """Where a response body goes, read by read: ``feed`` and ``end`` gather, ``flush`` writes
    what one read brought; ``broke`` ends the body and writes. ``arrived`` is when the read that
    brought ``data`` arrived (``time.perf_counter``), for the relay's own cost."""

    def feed(self, data: bytes, arrived: float) -> None: ...

    def end(self) -> None: ...

    def flush(self) -> None: ...

    def broke(self, cause: BaseException) -> None: ...


class Holder(Protocol):
    """The client's reading, paused while vLLM's socket is full of its body."""

    def hold(self) -> None: ...

    def release(self) -> None: ...


class UpstreamConnection(asyncio.Protocol):
    """One connection to vLLM, one exchange at a time. ``status``, ``reason`` and ``headers``
    are vLLM's once :meth:`Upstream.send` returned it; ``reusable`` once the body ended."""

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream
        self.clock = upstream.clock
        self.transport: asyncio.Transport | None = None
        self.loop: asyncio.AbstractEventLoop  # set as the connection is made
        self.parser = httptools.HttpResponseParser(self)
        # Whitespace after a chunk's size, as the client side reads it too.
        self.parser.set_dangerous_leniencies(lenient_spaces_after_chunk_size=True)
        self.status = 0
        self.reason = b""
        self.headers: Headers = []
        self.reusable = False
        self.complete = False
        self.answered = False  # a byte of vLLM's answer arrived
        self.head: asyncio.Future[None] | None = None
        self.sink: Sink | None = None
        self.no_body = False
        self.until_close = False
        self.last_read = 0.0
        self.arrived = 0.0  # when the last read arrived (perf_counter): the relay's own cost
        self.sent_at = 0.0  # when the request was written to vLLM (perf_counter)
        # Seconds this exchange waited for the connection to vLLM to open (0: from the pool):
        # vLLM's accept, not kvtax's work.
        self.connecting = 0.0
        self.closed = False
        # A request body still being sent (streamed), and how: chunked or as it comes.
        self.sending = False
        self.chunked = False
        self.holder: Holder | None = None
        # Where vLLM's interim answers (1xx) go while the final one is awaited.
        self.interim: Callable[[int, bytes, Headers], None] | None = None
        self.write_paused = False
        # kvtax paused reading (its client is full): vLLM's silence is not counted meanwhile.
        self.read_paused = False
        self._head_bytes = 0
        self._parts: list[bytes] = []
        self._failure: BaseException | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._idle: asyncio.TimerHandle | None = None

    # -- one exchange -----------------------------------------------------------------------
    def start(
        self, data: Outgoing, *, no_body: bool, streamed: bool = False, chunked: bool = False
    ) -> asyncio.Future[None]:
        """Send ``data`` (a whole request, or a head and the body so far when ``streamed``; in
        one buffer or several, written in turn); the future resolves when vLLM's head is in."""
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        self.status, self.reason, self.headers = 0, b"", []
        self.reusable = self.complete = self.answered = self.until_close = False
        self.no_body = no_body
        self.sending, self.chunked = streamed, chunked
        self.sink, self._parts, self._failure = None, [], None
        self._head_bytes = 0
        self.head = self.loop.create_future()
        self.last_read = self.clock()
        self._arm(self.upstream.timeout)
        assert self.transport is not None
        self.sent_at = time.perf_counter()  # the request's forwarding, for the relay's cost
        if isinstance(data, bytes):
            self.transport.write(data)
        else:
            # The buffers in one call, never joined: uvloop sends them with one writev (a small
            # request is one syscall and one segment, not one per buffer), and a large body is
            # not copied to be sent. (asyncio's own loop, off Linux, joins them.)
            self.transport.writelines(data)
        return self.head

    def attach(self, sink: Sink) -> None:
        """Hand the body to ``sink``: what already arrived at once, the rest read by read."""
        self.sink = sink
        if self._parts:
            self._flush(sink)
        if self.complete:
            self._ended(sink)
        elif self._failure is not None:
            sink.broke(self._failure)
        else:
            sink.flush()

    def dropped(self) -> bool:
        """vLLM closed this idle connection (or sent on it), and kvtax's loop has not read that
        yet: its socket is readable. A loop late under load reads a close late, and a request
        written on such a connection is refused by vLLM's kernel, unread. One poll per reuse,
        as urllib3's pool checks a connection before it reuses it."""
        if self.transport is None:
            return True
        sock = self.transport.get_extra_info("socket")
        if sock is None:
            return False
        poller = select.poll()
        # A close makes the socket readable (POLLIN, 0 bytes); Linux also says so apart.
        poller.register(sock.fileno(), select.POLLIN | getattr(select, "POLLRDHUP", 0))
        return bool(poller.poll(0))

    @property
    def failed(self) -> bool:
        """The exchange broke off (vLLM's side failed or timed out)."""
        return self._failure is not None

    def idle_for(self, seconds: float) -> None:
        """Back in the pool: closed after ``seconds`` unless reused first."""
        self._idle = self.loop.call_later(seconds, self.close)

    def close(self) -> None:
        """Drop the connection: vLLM sees the disconnect and aborts what it was running."""
        self.closed = True
        self._disarm()
        self._release_holder()
        if self.transport is not None:
            self.transport.close()

    # -- the request's body, streamed (BodyWriter) ---------------------------------------------
    def send_body(self, data: bytes) -> None:
        if self.closed or not self.sending or self.transport is None:
            return
        self.transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self.chunked else data)

    def end_body(self) -> None:
        if self.closed or not self.sending or self.transport is None:
            return
        if self.chunked:
            self.transport.write(b"0\r\n\r\n")
        self.sending = False
        self.last_read = self.clock()  # vLLM's silence counts from the body's end
        self._release_holder()

    def abort_body(self) -> None:
        """The client's body broke off: vLLM must not take what it got for a whole request."""
        if self.sending:
            self.close()

    # -- flow control ---------------------------------------------------------------------------
    def pause_writing(self) -> None:
        # vLLM's socket is full of the body: the client waits, and vLLM's silence counts.
        self.write_paused = True
        self.last_read = self.clock()
        if self.sending and self.holder is not None:
            self.holder.hold()

    def resume_writing(self) -> None:
        self.write_paused = False
        self.last_read = self.clock()
        self._release_holder()

    def pause_reading(self) -> None:
        """kvtax's client is full: stop reading vLLM, and stop counting its silence."""
        self.read_paused = True
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if not self.read_paused:
            return
        self.read_paused = False
        self.last_read = self.clock()
        if self.transport is not None and not self.closed and not self.transport.is_closing():
            self.transport.resume_reading()

    def _release_holder(self) -> None:
        if self.holder is not None:
            self.holder.release()

    # -- transport events -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not registered as asyncio.Transport subclasses.
        self.transport = cast(asyncio.Transport, transport)
        self.loop = asyncio.get_running_loop()  # looked up once (see FlowControl.loop)

    def data_received(self, data: bytes) -> None:
        if self.complete or self.head is None:
            # A byte after the answer's end, or on an idle pooled connection: nothing asked
            # for it. The connection is never reused, and nothing of it goes anywhere.
            self._unsolicited()
            return
        self.arrived = time.perf_counter()
        self.last_read = self.clock()
        self.answered = True
        try:
            self.parser.feed_data(data)
            if not self.status:
                # Still no final head: a header value grows inside the parser and reaches
                # on_header only whole, so the head is counted by the bytes that brought it.
                self._count(len(data))
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamBroke("vLLM answered with a protocol upgrade (101)"))
            self.close()
        except httptools.HttpParserError as exc:
            if self.complete:
                self._unsolicited()  # bytes after the end, in the same read as the end
            else:
                cause = next(
                    (e for e in (exc, exc.__context__) if isinstance(e, _HeadTooLarge)), None
                )
                what = str(cause) if cause else f"vLLM's answer is not HTTP: {type(exc).__name__}"
                self._fail(UpstreamBroke(what))
                self.close()
        sink = self.sink
        if sink is not None:
            parts = self._parts
            if parts:
                # _flush inlined: this runs once per read of every stream.
                self._parts = []
                sink.feed(parts[0] if len(parts) == 1 else b"".join(parts), self.arrived)
            if self.complete:
                self._ended(sink)  # writes what this read brought, and the body's end
            else:
                sink.flush()

    def eof_received(self) -> bool | None:
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._disarm()
        self._release_holder()
        self.upstream.forget(self)
        if not self.complete and self.until_close and exc is None and self.status:
            self.complete = True  # the close ends such a body; the connection is not reused
            sink = self.sink
            if sink is not None:
                self._ended(sink)
        elif not self.complete:
            self._fail(UpstreamBroke(str(exc) if exc else "vLLM closed the connection"))

    # -- parser callbacks -------------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self.complete:
            raise _Extra()  # a second answer: stop parsing (caught as a parser error)

    def on_status(self, reason: bytes) -> None:
        self._count(len(reason))
        self.reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        if not self.status:  # trailer fields of a chunked body are dropped, never headers
            self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200 and status != 101:  # an interim answer: the real one follows
            # A proxy forwards the 1xx it did not ask for (RFC 9110 15.2): 103 Early Hints,
            # say. kvtax never sends vLLM an Expect, so a 100 is nobody's and goes nowhere.
            if status != 100 and self.interim is not None:
                self.interim(status, self.reason, self.headers)
            self.reason, self.headers = b"", []
            return
        self.status = status
        coding = header(self.headers, b"transfer-encoding")
        if coding is not None and coding.strip().lower() != b"chunked":
            # Read to the close, the body would reach the client still in its transfer coding
            # (gzip, say), which kvtax does not undo: refused, as nginx does.
            self._fail(UpstreamBroke("vLLM answered with a transfer coding other than chunked"))
            raise _Refused()
        # A body with neither length nor chunks runs to the connection's close (HTTP/1.0 style).
        self.until_close = (
            status not in (204, 304)
            and not self.no_body
            and header(self.headers, b"content-length") is None
            and header(self.headers, b"transfer-encoding") is None
        )
        if self.no_body:
            # The answer to a HEAD has no body whatever its headers say; the parser cannot be
            # told so, so the connection is not reused.
            self.complete = True
        if status == 101:
            self._fail(UpstreamBroke("vLLM answered with a protocol upgrade (101)"))
            raise _Refused()  # nothing of it is parsed further, nor relayed
        head = self.head
        if head is not None and not head.done():
            head.set_result(None)

    def on_body(self, body: bytes) -> None:
        if not self.complete:
            self._parts.append(body)

    def on_message_complete(self) -> None:
        if self.status and not self.complete:  # not the end of an interim answer
            self.complete = True
            self.reusable = not self.sending and self.parser.should_keep_alive()

    # -- internals ----------------------------------------------------------------------------
    def _count(self, nbytes: int) -> None:
        self._head_bytes += nbytes
        if self._head_bytes > MAX_HEAD:
            raise _HeadTooLarge()

    def _unsolicited(self) -> None:
        self.reusable = False
        self.close()

    def _flush(self, sink: Sink) -> None:
        parts, self._parts = self._parts, []
        sink.feed(parts[0] if len(parts) == 1 else b"".join(parts), self.arrived)

    def _ended(self, sink: Sink) -> None:
        self._disarm()
        self.sink = None
        sink.end()

    def _fail(self, cause: BaseException) -> None:
        if self._failure is not None or self.complete:
            return
        self._failure = cause
        self._disarm()
        head = self.head
        if head is not None and not head.done():
            head.set_exception(cause)
        elif self.sink is not None:
            sink, self.sink = self.sink, None
            sink.broke(cause)

    def _arm(self, delay: float) -> None:
        self._disarm()
        self._timer = self.loop.call_later(delay, self._check)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        """The read timeout: re-armed for what is left of it, so a read costs no timer. While
        kvtax holds vLLM paused, or waits for its client's body, vLLM is not the one silent."""
        self._timer = None
        timeout = self.upstream.timeout
        now = self.clock()
        if self.read_paused or (self.sending and not self.write_paused):
            self.last_read = now
        quiet = now - self.last_read
        if quiet < timeout:
            self._arm(timeout - quiet)
            return
        self._fail(TimeoutError(f"no byte from vLLM in {timeout:g}s"))
        self.close()


class _Tail:
    """The sink of a connection whose client has its whole answer: vLLM's last bytes are
    dropped, and its end puts the connection back in the pool."""

    __slots__ = ("_conn", "_upstream")

    def __init__(self, upstream: Upstream, conn: UpstreamConnection) -> None:
        self._upstream, self._conn = upstream, conn

    def feed(self, data: bytes, arrived: float) -> None:
        pass

    def flush(self) -> None:
        pass

    def end(self) -> None:
        self._upstream.tail_ended(self._conn, clean=True)

    def broke(self, cause: BaseException) -> None:
        self._upstream.tail_ended(self._conn, clean=False)


class _HeadTooLarge(httptools.HttpParserError):
    def __init__(self) -> None:
        super().__init__(f"vLLM's answer head exceeds {MAX_HEAD} bytes")


class _Extra(httptools.HttpParserError):
    """A second answer after the first one's end."""


class _Refused(httptools.HttpParserError):
    """An answer that is not relayed (101): parsing stops."""


class Upstream:
    """The keep-alive pool to one vLLM; see the module docstring."""

    def __init__(
        self,
        url: str,
        timeout: float,
        *,
        idle: float,
        stale_within: float,
        clock: Callable[[], float] | None = None,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"vLLM URL must be http(s)://host[:port]: {url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.netloc = parts.netloc.rsplit("@", 1)[-1].encode()
        self.prefix = parts.path.rstrip("/").encode()
        self.timeout = timeout
        self.idle = idle
        self.stale_within = stale_within
        self.retries = 0
        self.clock = clock or time.monotonic
        self._free: list[UpstreamConnection] = []
        # Connections whose client has its whole answer, waiting for vLLM's end (release).
        self._tails: set[UpstreamConnection] = set()
        self._waiting: set[UpstreamConnection] = set()
        self._cut = False

    async def send(
        self,
        data: Outgoing,
        *,
        no_body: bool = False,
        streamed: Callable[[UpstreamConnection], None] | None = None,
        chunked: bool = False,
        holder: Holder | None = None,
        interim: Callable[[int, bytes, Headers], None] | None = None,
    ) -> UpstreamConnection:
        """Send a request; the connection once vLLM's head is in. ``streamed``: ``data`` is the
        head and the body so far, and ``streamed(conn)`` hands the connection the rest (sent
        ``chunked`` or as it comes; ``holder`` pauses reading while vLLM's socket is full).
        ``interim`` gets each 1xx answer (but 100) as it comes. Raises :class:`Unreachable`,
        :class:`UpstreamBroke`, :class:`TimeoutError` or :class:`Cut`."""
        if streamed is not None:
            # A body still arriving cannot be sent twice: a new connection, which is not stale.
            conn = await self._connect()
            conn.holder, conn.interim = holder, interim
            return await self._exchange(conn, data, no_body, streamed, chunked)
        conn = self._pooled() or await self._connect()
        conn.interim = interim
        began = time.monotonic()
        try:
            return await self._exchange(conn, data, no_body)
        except UpstreamBroke as exc:
            if self._cut or conn.answered or time.monotonic() - began > self.stale_within:
                raise
            self.retries += 1
            log.debug("vLLM closed the connection before answering (%s); one more try", exc)
        conn = await self._connect()
        conn.interim = interim
        return await self._exchange(conn, data, no_body)

    def release(self, conn: UpstreamConnection) -> None:
        """A connection whose exchange ended cleanly goes back to the pool. One whose answer
        ended for the client before vLLM's body did (a stream's last event ends it) goes back
        once vLLM's end comes: what vLLM sends until then is dropped, and a connection that
        breaks or stays silent past the read timeout closes instead."""
        if not (conn.complete or conn.closed or conn.failed or self._cut):
            self._tails.add(conn)
            conn.attach(_Tail(self, conn))
            return
        if conn.closed or not conn.reusable or self._cut:
            conn.close()
            return
        conn.sink = None
        conn.head = None
        conn.holder = conn.interim = None
        self._free.append(conn)
        conn.idle_for(self.idle)

    @property
    def pooled(self) -> int:
        """Idle connections in the pool."""
        return len(self._free)

    @property
    def ending(self) -> int:
        """Connections waiting for the end of an answer their client already has."""
        return len(self._tails)

    def tail_ended(self, conn: UpstreamConnection, *, clean: bool) -> None:
        """vLLM's end of an answer its client already had: pooled when it ended cleanly."""
        self._tails.discard(conn)
        if clean:
            self.release(conn)
        else:
            conn.close()

    def forget(self, conn: UpstreamConnection) -> None:
        if conn in self._free:
            self._free.remove(conn)

    def cut(self) -> None:
        """The grace period is over: end every request vLLM has not answered yet."""
        self._cut = True
        for conn in list(self._waiting):
            conn._fail(Cut())
            conn.close()

    def close(self) -> None:
        for conn in [*self._free, *self._tails]:
            conn.close()
        self._free.clear()
        self._tails.clear()

    async def _exchange(
        self,
        conn: UpstreamConnection,
        data: Outgoing,
        no_body: bool,
        streamed: Callable[[UpstreamConnection], None] | None = None,
        chunked: bool = False,
    ) -> UpstreamConnection:
        self._waiting.add(conn)
        try:
            head = conn.start(data, no_body=no_body, streamed=streamed is not None, chunked=chunked)
            if streamed is not None:
                streamed(conn)
            await head
        except BaseException:
            conn.close()
            raise
        finally:
            self._waiting.discard(conn)
        if self._cut:  # answered just before the cut, resumed after it
            conn.close()
            raise Cut()
        return conn

    def _pooled(self) -> UpstreamConnection | None:
        while self._free:
            conn = self._free.pop()
            if conn.closed:
                continue
            if conn.dropped():
                conn.close()
                continue
            conn.connecting = 0.0
            return conn
        return None

    async def _connect(self) -> UpstreamConnection:
        if self._cut:
            raise Cut()
        loop = asyncio.get_running_loop()
        began = time.perf_counter()
        try:
            async with asyncio.timeout(self.timeout):
                _, conn = await loop.create_connection(
                    lambda: UpstreamConnection(self),
                    self.host,
                    self.port,
                    ssl=self.ssl,
                    server_hostname=self.host if self.ssl else None,
                )
        except TimeoutError:
            raise
        except OSError as exc:
            raise Unreachable(str(exc)) from exc
        conn.connecting = time.perf_counter() - began
        return conn
