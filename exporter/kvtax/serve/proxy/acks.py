"""Which bytes written to a client its TCP stack has acknowledged: delivery as the client saw it.

A write hands bytes to the kernel, not to the client. A client that stopped reading leaves them
queued in our socket, and one that hung up never gets them. :class:`AckTracker` records, for
each write, the offset its bytes end at and the tokens they bring the client up to, and reads
the kernel's count of acknowledged bytes (Linux ``TCP_INFO.tcpi_bytes_acked``) to confirm them.

The tracker reads through its own duplicate of the socket's descriptor. When a client reads
``[DONE]`` and closes at once, the connection sees the FIN and closes its transport before the
handler learns of it; the FIN carried the client's final acknowledgement, and the duplicate
keeps the socket (and that count) readable until :meth:`AckTracker.close`. A count of
acknowledged bytes, unlike the send queue's length, also survives a reset, which purges the
queue.

The kernel is asked only when an answer is needed: when a scrape credits running streams, when a
stream ends, and every :data:`CHECK_EVERY` writes to keep the list of pending writes short.
Where the kernel cannot tell (not a TCP socket, not Linux), a write counts once it returns.

Example::

    acks = AckTracker(request.transport)
    acks.wrote(len(payload), tokens=12)
    acks.refresh()  # -> tokens the client has acknowledged so far
    acks.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import socket
import struct
import termios
from collections import deque
from collections.abc import Callable
from typing import Literal

__all__ = ["CHECK_EVERY", "AckTracker", "Ending", "acknowledged"]

# Pending writes kept before the kernel is asked again: one syscall per this many chunks.
CHECK_EVERY = 32
# Seconds between readings of the client's acknowledgements at an answer's end, doubling up to
# the second: the first ones catch a reader's acknowledgement in flight, the last a stalled one.
_FIRST_LOOK = 0.001
_LAST_LOOK = 1.0

# How an answer's wait for its acknowledgements ended.
Ending = Literal["acknowledged", "gone", "stalled"]
# struct tcp_info (linux/tcp.h): tcpi_bytes_acked is a u64 at byte 120 since Linux 4.1.
_BYTES_ACKED = struct.Struct("Q")
_BYTES_ACKED_AT = 120
_INFO_SIZE = _BYTES_ACKED_AT + _BYTES_ACKED.size


def _queued(fd: int) -> int | None:
    """Bytes in the socket's send queue: written to the kernel, not yet acknowledged."""
    try:
        raw = fcntl.ioctl(fd, termios.TIOCOUTQ, b"\0\0\0\0")
    except OSError:
        return None
    return int(struct.unpack("i", raw)[0])


class _Probe:
    """A duplicate descriptor of one TCP socket, read with getsockopt and never with I/O."""

    __slots__ = ("_sock",)

    def __init__(self, fd: int, family: int) -> None:
        # A socket object owns the duplicate and closes it; it is never used for I/O. Its
        # family, type and protocol are given: asked, each is a syscall per request.
        self._sock: socket.socket | None = socket.socket(
            family, socket.SOCK_STREAM, socket.IPPROTO_TCP, fileno=os.dup(fd)
        )

    def acked(self) -> int | None:
        sock = self._sock
        if sock is None:
            return None
        try:
            raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _INFO_SIZE)
        except OSError:
            return None
        if len(raw) < _INFO_SIZE:
            return None
        return int(_BYTES_ACKED.unpack_from(raw, _BYTES_ACKED_AT)[0])

    def queued(self) -> int | None:
        return _queued(self._sock.fileno()) if self._sock is not None else None

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            # Closing the duplicate sends nothing; the connection ends when its transport closes.
            with contextlib.suppress(OSError):
                os.close(sock.detach())


def _probe_for(transport: asyncio.BaseTransport | None) -> _Probe | None:
    if transport is None or transport.is_closing():
        return None
    sock = transport.get_extra_info("socket")
    if sock is None or sock.type != socket.SOCK_STREAM:
        return None
    family = sock.family
    if family not in (socket.AF_INET, socket.AF_INET6):
        return None
    try:
        return _Probe(sock.fileno(), family)
    except OSError:
        return None


class AckTracker:
    """Tokens confirmed by the client's acknowledgements, for one response. See the module doc."""

    __slots__ = (
        "_base",
        "_pending",
        "_probe",
        "_sent",
        "_whole",
        "_whole_end",
        "acked",
        "confirmed",
        "written_tokens",
    )

    def __init__(self, transport: asyncio.BaseTransport | None, *, unsent: int = 0) -> None:
        self._probe = _probe_for(transport)
        self._sent = 0
        self._base = 0
        # (where a write's bytes end, the tokens they bring the client up to), unacknowledged.
        self._pending: deque[tuple[int, int]] = deque()
        self.confirmed = 0
        self._whole = 0  # the tokens of the writes acknowledged whole
        self._whole_end = 0  # and where the last of them ends
        self.acked = 0  # bytes of this response the client acknowledged
        self.written_tokens = 0
        if self._probe is not None:
            acked, queued = self._probe.acked(), self._probe.queued()
            buffered = (
                transport.get_write_buffer_size()
                if isinstance(transport, asyncio.WriteTransport)
                else 0
            )
            if acked is None or queued is None:
                self._drop_probe()
            else:
                # Everything written on this connection before our first byte: earlier
                # responses (keep-alive), and our own headers, queued, buffered or (``unsent``)
                # about to be written ahead of the body.
                self._base = acked + queued + buffered + unsent

    def wrote(self, nbytes: int, tokens: int) -> None:
        """A write of ``nbytes`` finished; its bytes bring the client up to ``tokens``."""
        self._sent += nbytes
        self.written_tokens = tokens
        if self._probe is None:
            self.confirmed = tokens
            return
        self._pending.append((self._sent, tokens))
        if len(self._pending) >= CHECK_EVERY:
            self.refresh()

    def refresh(self, *, partial: bool = False) -> int:
        """Ask the kernel again; return the tokens confirmed so far. ``partial``: the last
        reading of a response its client will not take whole, and the write the client
        acknowledged part of counts its share of tokens, by bytes (a write's events are of
        about one size: the count is then within one event of the client's)."""
        if self._probe is None or not self._pending:
            # Every write is confirmed already: a reading could change nothing.
            return self.confirmed
        acked = self._probe.acked()
        if acked is None:
            return self.confirmed
        through = self.acked = max(self.acked, acked - self._base)
        pending = self._pending
        while pending and pending[0][0] <= through:
            self._whole_end, self._whole = pending.popleft()
            self.confirmed = max(self.confirmed, self._whole)
        if partial and pending:
            end, tokens = pending[0]
            start = self._whole_end
            if through > start:
                share = (tokens - self._whole) * (through - start) // (end - start)
                self.confirmed = max(self.confirmed, self._whole + share)
        return self.confirmed

    @property
    def all_acknowledged(self) -> bool:
        """Every byte written so far reached the client (after :meth:`refresh`)."""
        return not self._pending if self._probe is not None else True

    def _drop_probe(self) -> None:
        if self._probe is not None:
            self._probe.close()
            self._probe = None

    def close(self) -> None:
        """Release the duplicate descriptor (the socket closes once the transport has too)."""
        self._drop_probe()


async def acknowledged(acks: AckTracker, *, gone: Callable[[], bool], patience: float) -> Ending:
    """Wait, at an answer's end, until the client's TCP stack acknowledged every byte written
    (``acknowledged``), the client is ``gone``, or it acknowledged nothing more for ``patience``
    seconds: its window stayed shut, it stopped reading (``stalled``).

    An answer that fits the kernel's send buffer is written at once whether the client reads
    or not: only the acknowledgements say it arrived. A client that reads acknowledges within a
    round trip (a delayed ACK: tens of milliseconds at most), so for it this is a reading of
    the kernel's count, or a few.
    """
    acks.refresh()
    if acks.all_acknowledged:
        return "acknowledged"
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[Ending] = loop.create_future()
    pause, acked, deadline = _FIRST_LOOK, acks.acked, loop.time() + patience
    timer: asyncio.TimerHandle | None = None

    def look() -> None:
        nonlocal pause, acked, deadline, timer
        acks.refresh()
        if acks.all_acknowledged:
            ended.set_result("acknowledged")
            return
        if gone():
            ended.set_result("gone")
            return
        now = loop.time()
        if acks.acked > acked:  # the client is taking it: the patience starts over
            acked, deadline, pause = acks.acked, now + patience, _FIRST_LOOK
        elif now >= deadline:
            ended.set_result("stalled")
            return
        timer = loop.call_later(min(pause, max(0.0, deadline - now)), look)
        pause = min(pause * 2, _LAST_LOOK)

    timer = loop.call_later(pause, look)
    try:
        return await ended
    finally:
        if timer is not None:
            timer.cancel()
