"""One request and its answer on a client connection: the object that owns the exchange.

An :class:`Exchange` is made when a request's head is complete (uvicorn's request-response
cycle is the model) and lives until the last byte of its answer went out. The connection only
parses bytes into exchanges and queues them; everything one request decides is decided here:

- **its body**: held whole, within its limit, for an accounted request (:meth:`whole_body`;
  past the limit it is ``too_large`` and the rest is never read), or streamed on to vLLM as it
  arrives for any other (:meth:`stream_body`), with at most :data:`BODY_BUFFER` bytes held
  before reading pauses;
- **the 100-continue wait**: the 100 goes out when the exchange first wants its body (never to
  an HTTP/1.0 client, never for a body that will be refused);
- **keep-alive**: whether the connection carries another request after this one, decided when
  the answer's head is written (:meth:`response_head`, :meth:`answer`): not when the client
  asked to close, nor during shutdown's drain, nor when the request's body was not read to its
  end;
- **"response complete"**: :meth:`finish` after the last byte, :meth:`break_off` for a body cut
  short, which closes the connection so that it can never look complete;
- **flow control**: :attr:`source` is what is paused while the client's socket is full (vLLM's
  side of the exchange being relayed).

An accounted request also carries its :class:`~kvtax.serve.proxy.outcome.Facts`, from which
its outcome is decided when it ends.

Example::

    body = await exchange.whole_body()         # None: over the limit (answer the 413)
    exchange.source = upstream_connection      # paused while the client is full
    head = exchange.response_head(200, b"OK", headers, "chunked")
    exchange.write(head + payload)
    exchange.finish()
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Protocol

from kvtax.serve.proxy.head import RequestHead
from kvtax.serve.proxy.outcome import Facts
from kvtax.serve.proxy.wire import CONTINUE, Answer, Framing, Headers, response_head

if TYPE_CHECKING:
    from kvtax.serve.proxy.client import ClientConnection

__all__ = ["BODY_BUFFER", "BodyWriter", "Exchange", "Source"]

# Bytes of a streamed body held while nothing takes them yet (vLLM's connection is being
# made, or the request waits its turn behind a pipelined one) before reading pauses.
BODY_BUFFER = 256 * 1024


class BodyWriter(Protocol):
    """Where a streamed request body goes: vLLM's connection."""

    def send_body(self, data: bytes) -> None: ...

    def end_body(self) -> None: ...

    def abort_body(self) -> None: ...


class Source(Protocol):
    """What the exchange pauses while its client's socket is full."""

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


class Exchange:
    """One request's exchange; see the module docstring. ``limit`` is the body an accounted
    request may have held whole (None: streamed, no limit of kvtax's own)."""

    def __init__(
        self,
        conn: ClientConnection,
        head: RequestHead,
        *,
        accounted: bool,
        limit: int | None,
    ) -> None:
        self.conn = conn
        self.head = head
        self.accounted = accounted
        self.limit = limit
        # Set when the request is refused whatever it says (a bad head): answered in its turn.
        self.refusal: Answer | None = None
        self.size = 0  # body bytes received
        self.body_complete = not head.has_body
        self.too_large = limit is not None and head.length is not None and head.length > limit
        self._parts: list[bytes] = []
        self._waiter: asyncio.Future[None] | None = None
        self._writer: BodyWriter | None = None
        self._asked = False
        self.head_sent = False
        self.complete = False
        self.keep_alive = head.keep_alive
        self.source: Source | None = None
        self.facts: Facts | None = None

    # -- the request's body -------------------------------------------------------------------
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
        self._parts.append(data)
        if self.limit is None and self.size > BODY_BUFFER:
            self.conn.hold("body")  # until stream_body takes it

    def body_done(self) -> None:
        """The body's last byte was read (the connection calls this)."""
        self.body_complete = True
        if self._writer is not None:
            self._writer.end_body()
        self._wake()

    def want_body(self) -> None:
        """The exchange is ready for its body: the client waiting on a 100 gets it now."""
        if self._asked or self.body_complete or self.too_large:
            return
        self._asked = True
        if self.head.expect and self.size == 0 and not self.conn.draining:
            self.conn.write(CONTINUE)

    def fail_body(self, refusal: Answer) -> None:
        """The body's framing broke (a bad chunk): the request is refused, and a body being
        streamed to vLLM is cut off there, so vLLM never takes it for whole."""
        self.refusal = refusal
        self.keep_alive = False
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.abort_body()
        self._wake()

    async def whole_body(self) -> bytes | None:
        """The whole body, once read; None when it is over ``limit`` (``too_large``) or its
        framing broke (``refusal``)."""
        self.want_body()
        if not self.body_complete and not self.too_large and self.refusal is None:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        if self.too_large or self.refusal is not None:
            return None
        parts, self._parts = self._parts, []
        return parts[0] if len(parts) == 1 else b"".join(parts)

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
        self.conn.release("body")
        if self.body_complete:
            writer.end_body()
        else:
            self._writer = writer

    def detach_body(self) -> None:
        """vLLM answered before the body's end: what the client still sends goes nowhere, and
        the connection cannot carry another request (the rest of the body is never read)."""
        self._writer = None
        if not self.body_complete:
            self.keep_alive = False

    def _overflow(self) -> None:
        self.too_large = True
        self._parts.clear()
        self.conn.stop_reading()  # the rest of the body is never read
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # -- the answer ---------------------------------------------------------------------------
    @property
    def reusable(self) -> bool:
        """The connection may carry another request after this answer."""
        return (
            self.keep_alive
            and self.head.keep_alive
            and self.body_complete
            and not self.too_large
            and not self.conn.draining
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
            self.conn.write(response_head(b"1.1", status, reason, headers, "none", close=False))

    def answer(self, answer: Answer) -> None:
        """Write one of kvtax's own answers whole, and finish."""
        if answer.close:
            self.keep_alive = False
        close = not self.reusable
        self.keep_alive = not close
        self.head_sent = True
        # The answer to a HEAD has the head alone (RFC 9110 9.3.2), its length kept.
        head_only = self.head.method == b"HEAD"
        self.conn.write(answer.encode(self.head.version, close=close, head_only=head_only))
        self.finish()

    def write(self, data: bytes) -> None:
        self.conn.write(data)

    def finish(self) -> None:
        """The answer's last byte was written."""
        self.complete = True

    def break_off(self) -> None:
        """End the answer mid-body: the connection closes, so it can never look complete."""
        self.complete = True
        self.keep_alive = False
        self.conn.close()
