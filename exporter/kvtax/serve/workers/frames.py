"""What a proxy worker and its parent say to each other: the messages, and their framing.

One Unix stream socket joins each worker to the parent (a socketpair the parent made). Each
message is one MessagePack value (msgspec, a tagged array) after its length as 4 bytes, little
endian. bench/relay/workers.py measured this transport before it was built: a settled record
costs the parent 5 to 6 µs against 4 to 4.6 µs settled in process (bench/results/workers-ipc.md).

The worker says:

- :class:`Ready`: it listens on the proxy port;
- :class:`Opened`: an accounted request began (the parent settles those a dead worker never
  settled);
- :class:`Learned`: a model vLLM answered for (once per name);
- :class:`Credit`: tokens a running stream's client has so far (at each :class:`Tick`);
- :class:`Settled`: one request's :class:`~kvtax.delivery.ledger.RequestRecord`;
- :class:`Stats`: its gauges and its relay cost, cumulative (at each tick and at its end);
- with the gate on, :class:`Ask` (may this request go to vLLM?), :class:`Leave` (it is over, or
  its client left while it waited) and :class:`Rejected` (a refusal it decided itself).

The parent says :class:`Tick` (credit your running streams; vLLM's version as the scrape last
read it), :class:`Answer` (the gate's word on an ask) and :class:`Stop` (drain within
``grace`` seconds, then exit).

Example:

    >>> frames = Frames(TO_PARENT)
    >>> frames.feed(encode(Ready(pid=42)) + encode(Opened())[:3])
    [Ready(pid=42)]
    >>> frames.feed(encode(Opened())[3:])
    [Opened()]
"""

from __future__ import annotations

import struct
from typing import Any, Generic, TypeVar

import msgspec

from kvtax.delivery.ledger import ITL_BUCKETS, HistogramAccumulator, RequestRecord

__all__ = [
    "MAX_FRAME",
    "TO_PARENT",
    "TO_WORKER",
    "Answer",
    "Ask",
    "Credit",
    "FrameError",
    "Frames",
    "Learned",
    "Leave",
    "Opened",
    "Ready",
    "Rejected",
    "Settled",
    "Stats",
    "Stop",
    "Tick",
    "encode",
]

_LENGTH = struct.Struct("<I")
# No message comes near it (a record with its histogram is ~200 bytes); a length past it means
# the stream is not frames, and the link is dropped rather than a buffer grown without end.
MAX_FRAME = 1 << 20


class Ready(msgspec.Struct, tag="ready", array_like=True, frozen=True):
    pid: int


class Opened(msgspec.Struct, tag="opened", array_like=True, frozen=True):
    pass


class Learned(msgspec.Struct, tag="learned", array_like=True, frozen=True):
    model: str


class Credit(msgspec.Struct, tag="credit", array_like=True, frozen=True):
    model: str | None
    tokens: int
    api: str | None


class Settled(msgspec.Struct, tag="settled", array_like=True, frozen=True):
    """One settled :class:`RequestRecord`, every field of it (its ITL histogram as bucket
    counts and sum: :func:`_to_wire`, :func:`_from_wire`)."""

    record: RequestRecord


class Stats(msgspec.Struct, tag="stats", array_like=True, frozen=True):
    """A worker's gauges now, and its counters since it started."""

    streams_open: int
    retries: int
    encoded_streams: int
    events: int
    relay: tuple[list[int], float]
    forward: tuple[list[int], float]
    schemes: dict[str, int]
    cpu: float  # its process's CPU seconds, user and system


class Ask(msgspec.Struct, tag="ask", array_like=True, frozen=True):
    """May this request go to vLLM? Sized and budgeted by the worker: the parent's gate issues
    its ticket (the KV blocks, the fair share) and lets it in or sheds it."""

    id: int
    prompt: int
    limit: int | None
    prompts: int
    n: int
    headers: list[tuple[bytes, bytes]]  # the fairness and priority headers only
    carried: bool


class Leave(msgspec.Struct, tag="leave", array_like=True, frozen=True):
    """The asked request is over for vLLM, or its client left while it waited."""

    id: int


class Rejected(msgspec.Struct, tag="rejected", array_like=True, frozen=True):
    """A refusal the worker decided (over the token budget, vLLM's own 503), for the count."""

    reason: str


class Answer(msgspec.Struct, tag="answer", array_like=True, frozen=True):
    """The parent gate's word on an ask: None, let in; else why not, and the Retry-After."""

    id: int
    reason: str | None
    retry_after: int


class Tick(msgspec.Struct, tag="tick", array_like=True, frozen=True):
    version: str | None


class Stop(msgspec.Struct, tag="stop", array_like=True, frozen=True):
    grace: float


ToParent = Ready | Opened | Learned | Credit | Settled | Stats | Ask | Leave | Rejected
ToWorker = Tick | Stop | Answer
TO_PARENT: type[ToParent] = ToParent  # type: ignore[assignment]  # a union, as msgspec reads it
TO_WORKER: type[ToWorker] = ToWorker  # type: ignore[assignment]


def _to_wire(value: Any) -> Any:
    if isinstance(value, HistogramAccumulator):
        return value.raw()
    raise NotImplementedError(f"{type(value).__name__} has no frame form")


def _from_wire(kind: type, value: Any) -> Any:
    # A record's one histogram is its ITL's; counts of another length are not frames.
    if kind is HistogramAccumulator:
        return HistogramAccumulator.restored(ITL_BUCKETS, *value)
    raise NotImplementedError(f"{kind.__name__} has no frame form")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_to_wire)
M = TypeVar("M")


class FrameError(ValueError):
    """Bytes on a worker link that are not its frames."""


def encode(message: ToParent | ToWorker) -> bytes:
    """One message as its frame: its length, then its MessagePack."""
    body = _ENCODER.encode(message)
    return _LENGTH.pack(len(body)) + body


class Frames(Generic[M]):
    """Frames in, messages of type ``kind`` out, however the bytes were split."""

    __slots__ = ("_buffer", "_decoder")

    def __init__(self, kind: type[M]) -> None:
        self._buffer = bytearray()
        self._decoder = msgspec.msgpack.Decoder(kind, dec_hook=_from_wire)

    def feed(self, data: bytes) -> list[M]:
        """The messages ``data`` completed; FrameError if the stream is not frames."""
        buffer = self._buffer
        buffer += data
        messages: list[M] = []
        at, end = 0, len(buffer)
        while end - at >= _LENGTH.size:
            (size,) = _LENGTH.unpack_from(buffer, at)
            if size > MAX_FRAME:
                raise FrameError(f"a frame of {size} bytes (at most {MAX_FRAME})")
            start = at + _LENGTH.size
            if end - start < size:
                break
            try:
                messages.append(self._decoder.decode(memoryview(buffer)[start : start + size]))
            except (msgspec.DecodeError, ValueError) as exc:
                raise FrameError(str(exc)) from None
            at = start + size
        del buffer[:at]
        return messages
