"""The raw transport's wire: what reached the upstream, the connection a script answers on, and
the answers scripts write, every byte of them the test's.

:class:`~kvtax_dev.fakevllm.upstream.RawUpstream` parses each request the proxy sends with h11
and records it as a :class:`Seen`: method, target, headers as sent, body as it arrives,
trailers, the :class:`Link` (upstream connection) it came on. Its answer is a :data:`Script`, an
async function of the request and its link that writes raw bytes, pauses, closes: anything a
misbehaving vLLM can do. This module has the scripts that answer one way: :func:`answer` (one
response, framed as asked), :func:`writes` (raw pieces), :func:`echo`; and the framing pieces
scripts build from (:func:`response_bytes`, :func:`stream_head`, :func:`chunk`,
:data:`LAST_CHUNK`). The vLLM-shaped script is :class:`~kvtax_dev.fakevllm.vllmlike.VllmLike`,
whose events come from the builder, :mod:`kvtax_dev.fakevllm.events`.

Nothing here times anything: the ``WAIT`` and ``GUARD`` bounds only keep a broken relay from
hanging a test.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import urllib.parse
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import httptools

from kvtax_dev.fakevllm.events import dump

__all__ = [
    "GUARD",
    "LAST_CHUNK",
    "WAIT",
    "Link",
    "Script",
    "Seen",
    "answer",
    "chunk",
    "echo",
    "response_bytes",
    "routed",
    "stream_head",
    "writes",
]

# Bounds against hangs only: nothing here is expected to take more than a fraction of them.
# The answer to a 24 MiB accounted chat body (read whole, counted and sent on) can take seconds
# on a busy machine, hence 30 s.
WAIT = 30.0
# What a test waits for something a correct relay does at once (a 100, a close, an event): long
# enough for a loaded machine, short enough that a broken relay fails the test in seconds.
GUARD = 5.0


# -- what reached the upstream -------------------------------------------------------------------
@dataclass(eq=False)
class Seen:
    """One request as it reached the upstream, parsed by h11. ``headers`` keep the names' case
    and order as sent; ``body`` grows as the body arrives; ``complete`` is set at its end."""

    method: bytes
    target: bytes
    version: bytes
    headers: list[tuple[bytes, bytes]]
    link: Link
    body: bytearray = field(default_factory=bytearray)
    trailers: list[tuple[bytes, bytes]] = field(default_factory=list)
    complete: asyncio.Event = field(default_factory=asyncio.Event)

    def values(self, name: str) -> list[bytes]:
        return [v for k, v in self.headers if k.lower() == name.lower().encode()]

    def header(self, name: str) -> bytes | None:
        values = self.values(name)
        assert len(values) <= 1, f"{name} reached the upstream {len(values)} times"
        return values[0] if values else None

    def json(self) -> Any:
        return json.loads(bytes(self.body))

    @property
    def path(self) -> bytes:
        """The path vLLM routes this request to (:func:`routed`)."""
        return routed(self.target)


Script = Callable[[Seen, "Link"], Awaitable[None]]


def routed(target: bytes) -> bytes:
    """The path vLLM's server routes a request target to, as uvicorn computes it
    (``protocols/http/httptools_impl.py``): ``httptools.parse_url(target).path``, percent-decoded.
    So ``http://host/v1/completions``, ``/v1/%63ompletions``, ``/v1/completions#x`` and
    ``/v1%2Fcompletions`` all route to ``/v1/completions``."""
    try:
        path = httptools.parse_url(target).path or b""
    except httptools.HttpParserInvalidURLError:
        return target
    return urllib.parse.unquote_to_bytes(path) if b"%" in path else path


class Link:
    """One connection the proxy opened to the upstream; a script writes its answer here.

    ``received`` is every byte the proxy sent on it; ``sent`` every byte a script handed to the
    kernel (:meth:`send` counts after each drain); ``lost`` is set once the proxy closed it or
    it broke.
    """

    def __init__(self, index: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.index = index
        self.reader = reader
        self.writer = writer
        self.received = bytearray()
        self.sent = 0
        self.lost = asyncio.Event()
        self.error: str | None = None  # what h11 refused in the proxy's bytes

    def write(self, data: bytes) -> None:
        if not self.writer.is_closing():
            self.writer.write(data)
            self.sent += len(data)

    async def send(self, *pieces: bytes, pause: float = 0.0) -> None:
        """Write each piece and wait until the kernel took it; ``pause`` seconds (or one turn of
        the loop) between pieces, so that each tends to arrive in a read of its own."""
        for i, piece in enumerate(pieces):
            if i:
                await asyncio.sleep(pause)
            self.write(piece)
            await self.writer.drain()

    def close(self) -> None:
        self.writer.close()

    def abort(self) -> None:
        transport = self.writer.transport
        transport.abort()

    def set_sndbuf(self, size: int) -> None:
        sock = self.writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)


# -- answers ------------------------------------------------------------------------------------
def response_bytes(
    status: int = 200,
    headers: Sequence[tuple[str, str]] = (),
    body: bytes = b"",
    *,
    framing: str = "length",
    reason: str | None = None,
) -> bytes:
    """A response's bytes. ``framing``: ``length`` adds a Content-Length, ``chunked`` sends the
    body as one chunk, ``close`` and ``none`` add nothing (the body runs to the close, or
    there is none)."""
    phrase = reason if reason is not None else _phrase(status)
    lines = [f"HTTP/1.1 {status} {phrase}", *(f"{k}: {v}" for k, v in headers)]
    if framing == "length":
        lines.append(f"Content-Length: {len(body)}")
    elif framing == "chunked":
        lines.append("Transfer-Encoding: chunked")
        body = (b"%x\r\n%b\r\n" % (len(body), body) if body else b"") + b"0\r\n\r\n"
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Whatever"


def answer(
    status: int = 200,
    headers: Sequence[tuple[str, str]] = (),
    body: bytes = b"",
    *,
    framing: str = "length",
    close: bool = False,
) -> Script:
    """A script: once the request's body is in, one response; ``close`` closes after it."""

    async def script(seen: Seen, link: Link) -> None:
        await seen.complete.wait()
        await link.send(response_bytes(status, headers, body, framing=framing))
        if close:
            link.close()

    return script


def writes(*pieces: bytes, pause: float = 0.0, close: bool = False, whole: bool = True) -> Script:
    """A script writing raw ``pieces``, each in a read of its own where the loop allows;
    ``whole`` waits for the request's body first."""

    async def script(seen: Seen, link: Link) -> None:
        if whole:
            await seen.complete.wait()
        await link.send(*pieces, pause=pause)
        if close:
            link.close()

    return script


def stream_head(extra: Sequence[tuple[str, str]] = ()) -> bytes:
    """A stream's response head, chunked, as uvicorn sends it (the body follows in chunks)."""
    lines = [
        "HTTP/1.1 200 OK",
        "Content-Type: text/event-stream; charset=utf-8",
        *(f"{k}: {v}" for k, v in extra),
        "Transfer-Encoding: chunked",
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


LAST_CHUNK = b"0\r\n\r\n"


def echo(seen: Seen) -> bytes:
    """An answer saying what came: method, target, body length and digest."""
    body = dump(
        {
            "method": seen.method.decode("latin-1"),
            "target": seen.target.decode("latin-1"),
            "length": len(seen.body),
            "sha256": hashlib.sha256(seen.body).hexdigest(),
        }
    )
    return response_bytes(200, [("Content-Type", "application/json")], body)
