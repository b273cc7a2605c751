"""A client connection's flow control, shared by the connection and its exchanges.

The proxy's server side (:mod:`~kvtax.serve.proxy.server`) reads a client only while nothing
holds it back, and writes to it only as fast as it reads. :class:`FlowControl` is that state for
one connection, as uvicorn's ``FlowControl`` is:

- **reading** pauses while any :class:`Hold` holds it (the pipeline bound, a streamed body
  waiting for vLLM, vLLM's socket full of that body, the drain, a refusal) and resumes once the
  last one is released;
- **writing**: while the client's socket is full (the transport's ``pause_writing``), the
  :attr:`~FlowControl.source` being relayed to it (vLLM's side of the exchange) is paused and
  :attr:`~FlowControl.writable` is clear; a client that leaves it full for ``send_timeout``
  seconds (nginx's ``send_timeout``) has gone away, and its transport is aborted.

Example::

    flow = FlowControl(transport, send_timeout=60.0, on_resume=connection.parse_waiting)
    flow.hold(Hold.BODY)         # a streamed body waits for vLLM's connection
    flow.source = upstream       # paused while the client is full
    flow.release(Hold.BODY)
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable
from typing import Protocol

__all__ = ["BodyWriter", "FlowControl", "Hold", "Latch", "Source", "peer_of"]

log = logging.getLogger("kvtax.serve.proxy")


class Hold(enum.Enum):
    """Why reading a client is paused; it resumes once no reason holds."""

    BODY = "a body waits for its request's turn, or for vLLM's connection"
    UPSTREAM = "vLLM's socket is full of the client's body"
    PIPELINE = "requests wait behind the one being answered"
    DRAINING = "kvtax is shutting down"
    REFUSED = "what the client sent last is refused or past a limit"


class Source(Protocol):
    """What is paused while the client's socket is full: vLLM's side of the exchange."""

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


class BodyWriter(Protocol):
    """Where a streamed request body goes: vLLM's connection."""

    def send_body(self, data: bytes) -> None: ...

    def end_body(self) -> None: ...

    def abort_body(self) -> None: ...


class FlowControl:
    """A connection's reading and writing state, shared by it and its exchanges.

    Reading is paused while any :class:`Hold` holds (:meth:`hold`, :meth:`release`); once the
    last one is released, reading resumes and ``on_resume`` is called (the connection parses
    what waited). While the client's socket is full (``pause_writing``), :attr:`source` is
    paused and :attr:`writable` is clear; a client that leaves it full for ``send_timeout``
    seconds has gone away, and its transport is aborted.
    """

    __slots__ = (
        "_holds",
        "_on_resume",
        "_send_timeout",
        "_stalled",
        "closed",
        "loop",
        "source",
        "transport",
        "writable",
        "write_paused",
    )

    def __init__(
        self, transport: asyncio.Transport, *, send_timeout: float, on_resume: Callable[[], None]
    ) -> None:
        self.transport = transport
        # The connection's loop, looked up once: each lookup is a getpid() syscall (CPython 3.11
        # checks the loop was not inherited through a fork), and requests made several each.
        self.loop = asyncio.get_running_loop()
        self.closed = False
        self.write_paused = False
        self.writable = asyncio.Event()
        self.writable.set()
        self.source: Source | None = None
        self._holds: set[Hold] = set()
        self._on_resume = on_resume
        self._send_timeout = send_timeout
        self._stalled: asyncio.TimerHandle | None = None

    @property
    def read_paused(self) -> bool:
        return bool(self._holds)

    def hold(self, reason: Hold) -> None:
        """Pause reading the client while ``reason`` holds."""
        if not self._holds and not self.closed:
            self.transport.pause_reading()
        self._holds.add(reason)

    def release(self, reason: Hold) -> None:
        """``reason`` no longer holds; reading resumes when nothing else does."""
        if reason not in self._holds:
            return
        self._holds.discard(reason)
        if not self._holds:
            if not self.closed:
                self.transport.resume_reading()
            self._on_resume()

    def release_all(self) -> None:
        """Read whatever comes from here on (a refused client lingering before the close)."""
        self._holds.clear()
        self.transport.resume_reading()

    def pause_writing(self) -> None:
        self.write_paused = True
        self.writable.clear()
        if self.source is not None:
            self.source.pause_reading()
        if self._stalled is None:
            self._stalled = self.loop.call_later(self._send_timeout, self._stall)

    def resume_writing(self) -> None:
        if not self.write_paused:
            return
        self.write_paused = False
        self.writable.set()
        if self._stalled is not None:
            self._stalled.cancel()
            self._stalled = None
        if self.source is not None:
            self.source.resume_reading()

    def holder(self, reason: Hold) -> Latch:
        """``reason``'s hold on reading, for what holds it from outside (vLLM's side of a
        streamed body: :class:`~kvtax.serve.proxy.client.Holder`)."""
        return Latch(self, reason)

    def lost(self) -> None:
        """The connection is gone: nothing waits on the client any more."""
        self.closed = True
        if self._stalled is not None:
            self._stalled.cancel()
        self.writable.set()

    @property
    def send_timeout(self) -> float:
        return self._send_timeout

    def _stall(self) -> None:
        self._stalled = None
        self.give_up()

    def give_up(self) -> None:
        """The client took nothing for send_timeout (its socket, or its TCP window, stayed
        full): it has gone away, and its connection is aborted."""
        peer = peer_of(self.transport)
        log.debug("client %s read nothing for %gs; closing", peer, self._send_timeout)
        self.transport.abort()


def peer_of(transport: asyncio.BaseTransport | None) -> str:
    """The client's address, for a log line (nothing else of the client is ever logged)."""
    peer = transport.get_extra_info("peername") if transport is not None else None
    return str(peer[0]) if isinstance(peer, tuple) and peer else "an unknown peer"


class Latch:
    """One reason's hold on a connection's reading (:meth:`FlowControl.holder`)."""

    __slots__ = ("_flow", "_reason")

    def __init__(self, flow: FlowControl, reason: Hold) -> None:
        self._flow, self._reason = flow, reason

    def hold(self) -> None:
        self._flow.hold(self._reason)

    def release(self) -> None:
        self._flow.release(self._reason)
