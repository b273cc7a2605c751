"""vLLM's response body to the client, read by read: the sinks an upstream connection feeds.

Each sink takes what one read of vLLM's socket brought (:meth:`feed`), writes it to the client in
one ``transport.write`` and returns; nothing is awaited per event. :meth:`end` and :meth:`broke`
close the body and resolve :attr:`done`, which the request's owner awaits.

- :class:`StreamSink`: an accounted stream, through its dialect's counter
  (:class:`~kvtax.delivery.dialects.base.StreamCounter`), which counts each event and cuts the
  usage the client did not ask for. Every write is recorded with the client's acknowledgement
  tracker (:mod:`~kvtax.serve.proxy.acks`) and the stream's timing. A stream vLLM does not
  finish (it broke off, timed out, or shutdown cut it) ends with an error event in its API's
  shape and a clean end: its headers and 200 are long gone. Once its end marker or final usage
  went out (vLLM has finished the request), ``on_done`` is called, once: the gate frees the
  request's slot there, not when vLLM's connection ends, which an upstream that keeps it open
  would put off for good. When the counter says its last event went out whole (``ended``:
  OpenAI's ``[DONE]``), the client's body ends in that same write, and what vLLM sends after
  it is dropped: a client that closes as it reads ``[DONE]`` has nothing left unread.
- :class:`InflatingStreamSink`: the same for a stream vLLM gzipped although kvtax asked for
  identity; inflated as it comes, so the usage the client did not ask for is still cut, and the
  client gets it plain. It inflates one piece of at most 256 KiB per turn of the event loop,
  holds vLLM paused while a read's bytes are still being inflated, and stops while the client
  is full, so a bomb of a few KiB that inflates to gigabytes costs one piece of memory at a
  time, and never holds the loop for more than a piece.
- :class:`BodySink`: an accounted answer that is not a stream, its usage read as it passes
  (:class:`~kvtax.delivery.usage.UsageScanner`).
- :class:`PlainSink`: any other path's answer, as it is.

A body that breaks off and is not a stream breaks the client's connection, so it can never look
complete. The sinks write through the request's :class:`~kvtax.serve.proxy.server.Exchange`
(which decides keep-alive and when the answer is complete). They decide nothing about the
request: an accounted sink keeps what it saw (``wrote_all``, ``eof``, ``broke_off``; a body's
``usage``), and the request's owner (:mod:`~kvtax.serve.proxy.request`) reads it when the
request ends.

Example::

    sink = StreamSink(exchange, "chunked", head, counter=counter, timing=timing, acks=acks,
                      relay=settings, dialect=dialect)
    conn.attach(sink)           # feed() and end() per read, each read's bytes in one flush()
    await sink.done
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

from kvtax.delivery.cost import RelayCost
from kvtax.delivery.dialects import Dialect, StreamCounter
from kvtax.delivery.sse import Fingerprint, HoldBudget
from kvtax.delivery.timing import StreamTiming
from kvtax.delivery.usage import UsageReader, UsageScanner
from kvtax.serve.proxy.acks import AckTracker
from kvtax.serve.proxy.answers import SHUTTING_DOWN
from kvtax.serve.proxy.flow import Source
from kvtax.serve.proxy.outcome import Phase
from kvtax.serve.proxy.server import Exchange
from kvtax.serve.proxy.wire import LAST_CHUNK, Framing, chunk

__all__ = [
    "INFLATABLE",
    "BodySink",
    "InflatingStreamSink",
    "PlainSink",
    "RelaySettings",
    "StreamSink",
]

# Codings an InflatingStreamSink reads: zlib's gzip and (zlib-wrapped) deflate.
INFLATABLE = frozenset({b"gzip", b"x-gzip", b"deflate"})
# Inflated in pieces of at most this, each rewritten before the next is inflated.
_INFLATE_PIECE = 256 * 1024


@dataclass(frozen=True, slots=True)
class RelaySettings:
    """What every accounted stream shares: the hold budget, the clock, the stall rule, the
    proxy's shutdown phase and vLLM's fingerprint."""

    held: HoldBudget
    clock: Callable[[], float]
    stall_factor: float
    stall_min: float
    phase: Callable[[], Phase]
    # What relaying costs kvtax itself (kvtax.delivery.cost), for /metrics.
    cost: RelayCost
    # vLLM's system_fingerprint, learnt from its answers, for streams whose client asked for no
    # usage (StreamRewriter).
    fingerprints: Fingerprint


class _Sink:
    """Framing, batching and the end of a body, shared by the sinks.

    What one read of vLLM's brings (the response head first, then the body's bytes, and its end
    when the read ends it) is gathered and written in one ``transport.write`` by :meth:`flush`,
    which the upstream connection calls once per read.
    """

    def __init__(self, exchange: Exchange, framing: Framing, head: bytes, cost: RelayCost) -> None:
        self.exchange = exchange
        self.chunked = framing == "chunked"
        self.cost = cost
        self.done: asyncio.Future[None] = exchange.flow.loop.create_future()
        self._out: list[bytes] = [head]
        self._arrived = 0.0  # when the bytes waiting in _out arrived from vLLM (0: none)
        # The hot path's calls, looked up once: the client's write, the cost clock.
        self._write_out = exchange.write
        self._observe = cost.relay.observe
        # What the owner of an accounted request reads when it ends: every byte of the answer
        # was handed to the client's socket; the answer was also ended cleanly with the
        # client still connected; vLLM's side broke off (or timed out) before the end.
        self.wrote_all = False
        self.eof = False
        self.broke_off = False
        # The client's body was ended already (a stream's last event went out): what vLLM
        # sends after it is not the client's, and its end closes nothing more.
        self.body_ended = False

    def flush(self) -> None:
        out = self._out
        if out:
            self._write_out(out[0] if len(out) == 1 else b"".join(out))
            out.clear()
            if self._arrived:
                self._observe(time.perf_counter() - self._arrived)
                self._arrived = 0.0

    def _arrival(self, arrived: float) -> None:
        if not self._arrived:
            self._arrived = arrived

    def _send(self, payload: bytes) -> int:
        """Queue ``payload`` framed; the bytes it puts on the wire."""
        if self.chunked:
            payload = chunk(payload)
        self._out.append(payload)
        return len(payload)

    def _close_body(self) -> None:
        if self.chunked:
            self._out.append(LAST_CHUNK)
        self.body_ended = True
        self.flush()
        self.exchange.finish()
        self._resolve()

    def _break_client(self) -> None:
        """End the client's connection mid-body, so a body cut short never looks complete."""
        self.flush()
        self.exchange.break_off()
        self._resolve()

    def _resolve(self) -> None:
        if not self.done.done():
            self.done.set_result(None)


class PlainSink(_Sink):
    """A pass-through body, as it is."""

    def feed(self, data: bytes, arrived: float) -> None:
        if data:
            self._arrival(arrived)
            self._send(data)

    def end(self) -> None:
        self._close_body()

    def broke(self, cause: BaseException) -> None:
        self._break_client()


class BodySink(_Sink):
    """An accounted answer that is not a stream: relayed as it arrives, its usage read by
    ``scan`` (a 2xx answer's; None: not read). ``usage`` and ``finished_at`` are set when it
    ends."""

    def __init__(
        self,
        exchange: Exchange,
        framing: Framing,
        head: bytes,
        *,
        acks: AckTracker,
        scan: UsageReader | None,
        clock: Callable[[], float],
        cost: RelayCost,
    ) -> None:
        super().__init__(exchange, framing, head, cost)
        self.acks = acks
        self.clock = clock
        self.scanner = UsageScanner(scan) if scan is not None else None
        self.usage: tuple[int, int] | None = None  # (completion, prompt)
        self.finished_at: float | None = None

    def feed(self, data: bytes, arrived: float) -> None:
        if not data:
            return
        self._arrival(arrived)
        if self.scanner is not None:
            self.scanner.feed(data)
        self.acks.wrote(self._send(data), 0)

    def end(self) -> None:
        self.usage = self.scanner.tokens() if self.scanner is not None else None
        self.wrote_all = True
        self.finished_at = self.clock()
        self._close_body()
        self.eof = not self.exchange.disconnected

    def broke(self, cause: BaseException) -> None:
        self.broke_off = True
        self._break_client()


class StreamSink(_Sink):
    """An accounted stream, counted and cut by its dialect's ``counter`` to what the client
    asked for; its writes go to ``timing`` and ``acks``."""

    def __init__(
        self,
        exchange: Exchange,
        framing: Framing,
        head: bytes,
        *,
        counter: StreamCounter,
        timing: StreamTiming,
        acks: AckTracker,
        relay: RelaySettings,
        dialect: Dialect,
        on_done: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(exchange, framing, head, relay.cost)
        self.on_done = on_done
        self.relay = relay
        self.dialect = dialect
        self.clock = relay.clock
        self.rewriter = counter
        self.timing = timing
        self.acks = acks

    def feed(self, data: bytes, arrived: float) -> None:
        if self.body_ended:
            return  # past the stream's last event: nothing more is the client's
        if not self._arrived:
            self._arrived = arrived
        rewriter = self.rewriter
        events = rewriter.events
        payload, tokens = rewriter.feed(data)
        self.cost.events += rewriter.events - events
        if payload:
            self._write(payload, tokens)
            if rewriter.done:
                self.wrote_all = True  # the end marker is with the client's kernel
                if rewriter.ended:
                    # The body's end goes in the same write as its last event, not after
                    # vLLM's own end: a client that closes as it reads [DONE] then has nothing
                    # unread, so it closes with a FIN that acknowledges everything, not a reset
                    # that acknowledges nothing. The answer is over for the client; vLLM's
                    # connection goes back to the pool once its own end comes.
                    self._finish()
        if self.on_done is not None and (
            rewriter.done or rewriter.final_completion_tokens is not None
        ):
            # The stream's end is relayed (this read's bytes go out in its flush), or the final
            # usage was dropped for the client: the request is over in vLLM, whatever its
            # connection does next.
            done, self.on_done = self.on_done, None
            done()

    def end(self) -> None:
        if self.body_ended:
            return  # the client's answer ended with its last event
        rewriter = self.rewriter
        # Shutdown closes vLLM's side, which can look like a clean end before [DONE].
        if self.relay.phase() == "cutting" and not rewriter.done:
            self._error(None)
        else:
            out = rewriter.finish()
            if out.payload:
                self._write(out.payload, out.completion_tokens)
            self.wrote_all = True
        self._finish()

    def broke(self, cause: BaseException) -> None:
        if self.body_ended:
            return  # vLLM broke off after the last event: the client has its whole answer
        if not self.rewriter.done:
            self._error(cause)
        self._finish()

    def _finish(self) -> None:
        self.rewriter.close()
        self._close_body()
        self.eof = not self.exchange.disconnected

    def _error(self, cause: BaseException | None) -> None:
        """The error event that ends a stream vLLM did not finish (headers are long gone)."""
        self.broke_off = True
        sequence = self.rewriter.events  # the events handed out before this one
        if self.relay.phase() == "cutting":
            event = self.dialect.error_event(
                503, SHUTTING_DOWN, "server_shutdown", sequence=sequence
            )
        else:
            reason = "timed out" if isinstance(cause, TimeoutError) else "broke off"
            message = f"vLLM's stream {reason}"
            event = self.dialect.error_event(502, message, "upstream_error", sequence=sequence)
        self._send(event)

    def _write(self, payload: bytes, tokens: int) -> None:
        # _send and wire.chunk inlined: this runs once per event of every stream.
        if self.chunked:
            payload = b"%x\r\n%b\r\n" % (len(payload), payload)
        self._out.append(payload)
        acks = self.acks
        before = acks.written_tokens
        if tokens > before:
            self.timing.tokens_written(self.clock(), self.rewriter.prompt_tokens + before)
            acks.wrote(len(payload), tokens)
        else:
            acks.wrote(len(payload), before)


class InflatingStreamSink(StreamSink):
    """An accounted SSE stream that vLLM compressed (gzip or deflate, :data:`INFLATABLE`) though
    kvtax asked for identity: inflated and rewritten like any stream, one piece of at most
    :data:`_INFLATE_PIECE` bytes per turn of the event loop. While a read's bytes are still being
    inflated, vLLM's side is paused (``upstream``), and inflating stops while the client is full
    (this sink is what the exchange relays from: its :class:`~kvtax.serve.proxy.flow.Source`).
    Gzip members back to back (RFC 1952 2.2) are read one after another. Bytes zlib cannot read
    end the stream as a break does."""

    def __init__(
        self,
        exchange: Exchange,
        framing: Framing,
        head: bytes,
        *,
        counter: StreamCounter,
        timing: StreamTiming,
        acks: AckTracker,
        relay: RelaySettings,
        dialect: Dialect,
        upstream: Source,
        on_done: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(
            exchange,
            framing,
            head,
            counter=counter,
            timing=timing,
            acks=acks,
            relay=relay,
            dialect=dialect,
            on_done=on_done,
        )
        self.upstream = upstream
        self.failed = False
        # 32 + MAX_WBITS: a gzip or a zlib header, whichever comes.
        self._inflater = zlib.decompressobj(32 + zlib.MAX_WBITS)
        self._pending = b""  # compressed bytes of the last read, still to inflate
        self._ending = False  # vLLM's body ended; end once the pending bytes are inflated
        self._client_full = False
        self._scheduled = False
        self._read_at = 0.0  # when the read being inflated arrived

    # -- the upstream connection's calls -----------------------------------------------------
    def feed(self, data: bytes, arrived: float) -> None:
        if self.failed or not data:
            return
        self._pending += data
        self._read_at = arrived
        self._step()

    def end(self) -> None:
        if self.failed:
            return
        self._ending = True
        self._step()

    def broke(self, cause: BaseException) -> None:
        if not self.failed:
            self.failed = True
            self._pending = b""
            super().broke(cause)

    # -- the client's flow control (Source) ---------------------------------------------------
    def pause_reading(self) -> None:
        self._client_full = True
        self.upstream.pause_reading()

    def resume_reading(self) -> None:
        self._client_full = False
        self._schedule()

    # -- inflating, a piece at a time ---------------------------------------------------------
    def _step(self) -> None:
        """Inflate one piece of what is pending, write it, and plan the next."""
        self._scheduled = False
        if self.failed or self.done.done():
            return
        try:
            plain = self._inflate()
        except zlib.error as exc:
            self.failed = True
            self._pending = b""
            super().broke(exc)
            self.flush()
            return
        if plain:
            super().feed(plain, self._read_at)
            self.flush()
        inflater = self._inflater
        if self._pending or inflater.unconsumed_tail or (inflater.eof and inflater.unused_data):
            self.upstream.pause_reading()  # vLLM waits until this read is inflated
            self._schedule()
        elif self._ending:
            try:
                rest = self._inflater.flush()
            except zlib.error as exc:
                self.failed = True
                super().broke(exc)
                return
            if rest:
                super().feed(rest, self._read_at)
            super().end()
        elif not self._client_full:
            self.upstream.resume_reading()

    def _inflate(self) -> bytes:
        inflater = self._inflater
        tail = inflater.unconsumed_tail
        if tail:
            return inflater.decompress(tail, _INFLATE_PIECE)
        if inflater.eof and (inflater.unused_data or self._pending):
            # The next gzip member: what followed the last one's end starts it.
            rest = inflater.unused_data + self._pending
            self._pending = b""
            self._inflater = inflater = zlib.decompressobj(32 + zlib.MAX_WBITS)
            return inflater.decompress(rest, _INFLATE_PIECE)
        data, self._pending = self._pending, b""
        return inflater.decompress(data, _INFLATE_PIECE) if data else b""

    def _schedule(self) -> None:
        if not self._scheduled and not self._client_full and not self.done.done():
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._step)
