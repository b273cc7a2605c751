"""A scriptable upstream, a recorder of what reached it, raw-socket clients, and a proxy in front.

The one "fake upstream + proxy" rig for tests of kvtax's front door, built so that every byte
on both sides of the proxy is the test's:

- :class:`RawUpstream`: an asyncio server on ``127.0.0.1:0`` (the kernel's port, read back)
  standing in for vLLM. Each request the proxy sends is parsed with h11 (strict RFC 9112, so a
  request kvtax writes badly is caught here) and recorded as a :class:`Seen`: method, target,
  headers as sent, body as it arrives, trailers, which upstream connection it came on. Its
  answer is a :data:`Script`, an async function of the request and its :class:`Link` (the
  connection) that writes raw bytes, pauses, closes: anything a misbehaving vLLM can do.
  Scripts run in order per connection, from the moment a request's head is complete, so a
  script can watch the body arrive (``await seen.complete.wait()`` to wait for all of it).
- Scripts: :func:`answer` (one response, framed as asked), :func:`writes` (raw pieces),
  :class:`VllmLike` (vLLM-shaped answers built from the request: streams with usage as vLLM
  sends it, whole completions, ``/v1/models``, an echo for any other path), and the event and
  response builders they use (:func:`completion_event`, :func:`response_bytes`).
- Raw-socket client helpers: :func:`raw_request`, :func:`post`, :func:`read_head`,
  :func:`read_reply` (a strict reader of one response), :func:`closed`, :func:`events`, and
  :func:`connect` (optionally with a small receive buffer, for a client that stops reading).
- :class:`Front`: a started :class:`~kvtax.serve.proxy.Proxy` (``start(host, 0)``) in front of
  a :class:`RawUpstream`, with the ledger readers tests need; :func:`front_door` is the pytest
  fixture that makes them and tears them down.

Nothing here times anything: :func:`until` and the ``WAIT``/``GUARD`` bounds only keep a broken
relay from hanging a test.

Example::

    async def test_x(front_door: StartFront) -> None:
        front = await front_door(VllmLike(tokens=3))
        reply = await front.exchange(post("/v1/completions", STREAM))
        assert front.upstream.seen[0].target == b"/v1/completions"
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import socket
import urllib.parse
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import h11
import httptools
import pytest

from kvtax.delivery.ledger import DeliveryLedger, ModelNames
from kvtax.expose.publish import ledger_samples
from kvtax.expose.samples import Sample
from kvtax.serve.proxy import Proxy, ProxySettings
from kvtax.serve.proxy.gatekeeper import Gate
from kvtax_dev.process import until

__all__ = [
    "CHAT",
    "FINGERPRINT",
    "GUARD",
    "LAST_CHUNK",
    "STREAM",
    "WAIT",
    "WHOLE",
    "Front",
    "Link",
    "RawUpstream",
    "Reply",
    "Script",
    "Seen",
    "StartFront",
    "VllmLike",
    "answer",
    "chunk",
    "closed",
    "completion_event",
    "connect",
    "echo",
    "events",
    "front_door",
    "post",
    "raw_request",
    "read_head",
    "read_reply",
    "read_streamed",
    "response_bytes",
    "routed",
    "sse",
    "start_front",
    "stop_front",
    "stream_head",
    "until",
    "usage_event",
    "writes",
]

# Bounds against hangs only: nothing here is expected to take more than a fraction of them.
# The answer to a 24 MiB accounted chat body (read whole, counted and sent on) can take seconds
# on a busy machine, hence 30 s.
WAIT = 30.0
# What a test waits for something a correct relay does at once (a 100, a close, an event): long
# enough for a loaded machine, short enough that a broken relay fails the test in seconds.
GUARD = 5.0

STREAM = {"model": "m", "prompt": "x", "stream": True}
WHOLE = {"model": "m", "prompt": "x"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}]}

# A request head the recorder reads whole (h11's default is 16 KiB; the proxy allows 64 KiB).
_MAX_HEAD = 1024**2


# -- raw HTTP/1.x on the client's side ------------------------------------------------------------
def raw_request(
    method: str,
    path: str,
    body: bytes = b"",
    *,
    version: str = "1.1",
    headers: Sequence[tuple[str, str]] = (),
    host: str | None = "kvtax.test",
) -> bytes:
    """A request's bytes; a Content-Length is added for a body unless ``headers`` frame it;
    ``host`` None sends no Host."""
    lines = [f"{method} {path} HTTP/{version}"]
    if host is not None:
        lines.append(f"Host: {host}")
    lines += [f"{k}: {v}" for k, v in headers]
    framed = {k.lower() for k, _ in headers} & {"content-length", "transfer-encoding"}
    if body and not framed:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def post(path: str, payload: Any, *, version: str = "1.1", **more: str) -> bytes:
    headers = [("Content-Type", "application/json"), *more.items()]
    return raw_request("POST", path, json.dumps(payload).encode(), version=version, headers=headers)


@dataclass(frozen=True)
class Reply:
    version: str
    status: int
    headers: list[tuple[str, str]]
    body: bytes = b""
    chunked: bool = False

    def header(self, name: str) -> str | None:
        values = [v for k, v in self.headers if k.lower() == name.lower()]
        assert len(values) <= 1, f"{name} sent {len(values)} times"
        return values[0] if values else None

    def json(self) -> Any:
        return json.loads(self.body)


async def _line(reader: asyncio.StreamReader) -> bytes:
    line = await reader.readuntil(b"\r\n")
    return line[:-2]


async def read_head(reader: asyncio.StreamReader) -> Reply:
    """A status line and headers, strictly parsed: an HTTP/1.0 or 1.1 status line, a three-digit
    code, well-formed header lines."""
    status = (await _line(reader)).decode("latin-1")
    version, code, *_ = status.split(" ", 2)
    assert version in ("HTTP/1.0", "HTTP/1.1"), status
    assert len(code) == 3, status
    assert code.isdigit(), status
    headers = []
    while line := await _line(reader):
        name, colon, value = line.decode("latin-1").partition(":")
        assert colon, line
        assert name, line
        assert name == name.strip(), line  # no space before the colon (RFC 9112 5.1)
        headers.append((name, value.strip()))
    return Reply(version, int(code), headers)


async def _chunked(reader: asyncio.StreamReader) -> bytes:
    parts = []
    while size := int((await _line(reader)).split(b";", 1)[0], 16):
        parts.append(await reader.readexactly(size))
        assert await reader.readexactly(2) == b"\r\n"
    while await _line(reader):  # trailers
        pass
    return b"".join(parts)


async def _reply(reader: asyncio.StreamReader, method: str) -> Reply:
    head = await read_head(reader)
    if 100 <= head.status < 200 or head.status in (204, 304) or method == "HEAD":
        return head
    encoding, length = head.header("Transfer-Encoding"), head.header("Content-Length")
    if encoding is not None:
        assert encoding.lower() == "chunked", encoding
        return Reply(head.version, head.status, head.headers, await _chunked(reader), True)
    if length is not None:
        return Reply(head.version, head.status, head.headers, await reader.readexactly(int(length)))
    # Neither: the body runs to the end of the connection.
    return Reply(head.version, head.status, head.headers, await reader.read())


async def read_reply(
    reader: asyncio.StreamReader, *, method: str = "GET", limit: float = WAIT
) -> Reply:
    """The next response (or interim 1xx) on ``reader``, its body unframed."""
    return await asyncio.wait_for(_reply(reader, method), limit)


async def read_streamed(
    reader: asyncio.StreamReader, into: bytearray, *, method: str = "GET"
) -> Reply:
    """The next final response, its body appended to ``into`` piece by piece as it arrives (so a
    test can watch it grow); interim 1xx answers are skipped. The Reply's body is all of it."""
    head = await read_head(reader)
    while 100 <= head.status < 200:
        head = await read_head(reader)
    if head.status in (204, 304) or method == "HEAD":
        return head
    encoding, length = head.header("Transfer-Encoding"), head.header("Content-Length")
    if encoding is not None:
        assert encoding.lower() == "chunked", encoding
        while size := int((await _line(reader)).split(b";", 1)[0], 16):
            while size:
                piece = await reader.read(size)
                if not piece:
                    raise asyncio.IncompleteReadError(b"", size)
                into += piece
                size -= len(piece)
            assert await reader.readexactly(2) == b"\r\n"
        while await _line(reader):  # trailers
            pass
    elif length is not None:
        left = int(length)
        while left:
            piece = await reader.read(min(left, 256 * 1024))
            if not piece:
                raise asyncio.IncompleteReadError(b"", left)
            into += piece
            left -= len(piece)
    else:
        while piece := await reader.read(256 * 1024):
            into += piece
    return Reply(head.version, head.status, head.headers, bytes(into), encoding is not None)


async def closed(reader: asyncio.StreamReader, limit: float = WAIT) -> bool:
    """The peer closed the connection, and sent nothing more before it did (False: it sent
    more, or it was still open after ``limit`` seconds)."""
    try:
        return await asyncio.wait_for(reader.read(), limit) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def events(body: bytes) -> list[bytes]:
    """The SSE events of a stream's body, each without its blank line."""
    assert body.endswith(b"\n\n"), body[-40:]
    return body[:-2].split(b"\n\n")


async def connect(
    port: int, *, rcvbuf: int | None = None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to ``port`` on loopback; ``rcvbuf`` sets a small receive buffer before the
    connect (so the kernel does not grow it), for a client that stops reading."""
    if rcvbuf is None:
        return await asyncio.open_connection("127.0.0.1", port)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    except BaseException:
        sock.close()
        raise
    # A small StreamReader limit too: the reader's own buffer must not soak up what the
    # client does not read.
    return await asyncio.open_connection(sock=sock, limit=rcvbuf)


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


class RawUpstream:
    """The scriptable stand-in for vLLM; see the module docstring.

    ``script`` answers every request unless :meth:`then` queued one-shot scripts, which answer
    the next requests in the order they arrive. ``seen`` holds every request in arrival order,
    ``links`` every connection.
    """

    def __init__(self, script: Script | None = None) -> None:
        self.script: Script = script or VllmLike()
        self.queued: deque[Script] = deque()
        self.seen: list[Seen] = []
        self.links: list[Link] = []
        self.server: asyncio.Server | None = None
        self.port = 0
        self._serving: set[asyncio.Task[None]] = set()
        self._answering: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def forget(self) -> None:
        """Drop what was recorded so far, and the connections already closed: a long run of
        examples (the differential) keeps only what the next one needs."""
        self.seen.clear()
        self.links = [link for link in self.links if not link.lost.is_set()]

    def then(self, *scripts: Script) -> None:
        """Answer the next requests with these scripts, one each, then ``script`` again."""
        self.queued.extend(scripts)

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = int(self.server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        for link in self.links:
            link.abort()
        # Scripts still waiting are ours to cancel; each connection's own task (asyncio's
        # callback) ends as its reader sees the close.
        for task in list(self._answering):
            task.cancel()
        pending = list(self._answering | self._serving)
        if pending:
            await asyncio.wait(pending, timeout=WAIT)
        if self.server is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._serving.add(task)
        link = Link(len(self.links), reader, writer)
        self.links.append(link)
        requests: asyncio.Queue[Seen | None] = asyncio.Queue()
        answering = asyncio.create_task(self._answer(link, requests))
        self._answering.add(answering)
        try:
            await self._read(link, requests)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            link.lost.set()
            requests.put_nowait(None)
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await answering
            self._answering.discard(answering)
            writer.close()
            self._serving.discard(task)

    async def _read(self, link: Link, requests: asyncio.Queue[Seen | None]) -> None:
        parser = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEAD)
        current: Seen | None = None
        while True:
            data = await link.reader.read(256 * 1024)
            link.received += data
            parser.receive_data(data)
            while True:
                try:
                    event = parser.next_event()
                except h11.RemoteProtocolError as exc:
                    # The proxy wrote a request h11 refuses: recorded, answered, dropped.
                    link.error = f"{exc} after {bytes(link.received[-200:])!r}"
                    link.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                    link.close()
                    return
                if isinstance(event, h11.Request):
                    current = Seen(
                        event.method,
                        event.target,
                        event.http_version,
                        list(event.headers.raw_items()),
                        link,
                    )
                    self.seen.append(current)
                    requests.put_nowait(current)
                elif isinstance(event, h11.Data):
                    assert current is not None
                    current.body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    assert current is not None
                    current.trailers = list(event.headers.raw_items())
                    current.complete.set()
                    current = None
                    # The next request on this connection: a fresh parser for what is left
                    # (h11 would wait for our response, which scripts write raw).
                    leftover, _ = parser.trailing_data
                    parser = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEAD)
                    if leftover:  # (b"" would tell h11 the connection closed)
                        parser.receive_data(leftover)
                elif event is h11.NEED_DATA or event is h11.PAUSED:
                    break
                elif isinstance(event, h11.ConnectionClosed):
                    return
            if not data:
                return

    async def _answer(self, link: Link, requests: asyncio.Queue[Seen | None]) -> None:
        while (seen := await requests.get()) is not None:
            script = self.queued.popleft() if self.queued else self.script
            try:
                await script(seen, link)
            except (ConnectionError, asyncio.IncompleteReadError):
                return


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


def chat_messages(n: int) -> bytes:
    """A streamed chat request of ``n`` small messages (37 bytes each)."""
    one = b'{"role":"user","content":"hi there"}'
    return b'{"model":"m","stream":true,"messages":[' + b",".join([one] * n) + b"]}"


def costly_bodies(size: int) -> list[tuple[str, str, bytes]]:
    """Issue 43's costly request bodies, each about ``size`` bytes: (name, path, body). Each is
    millions of small JSON values but the last two: a field kvtax never reads (the control) and
    the same with a NaN, which only Python's parser (vLLM's) reads."""
    chat, completions = "/v1/chat/completions", "/v1/completions"
    pad = b'"' + b"a" * size + b'"'
    return [
        ("small messages", chat, chat_messages(size // 37)),
        ("empty messages", chat, b'{"model":"m","messages":[' + _many(b"{}", size // 3) + b"]}"),
        ("token ids", completions, b'{"model":"m","prompt":[' + _many(b"1", size // 2) + b"]}"),
        (
            "empty prompt lists",
            completions,
            b'{"model":"m","prompt":[' + _many(b"[]", size // 3) + b"]}",
        ),
        ("an unread field", completions, b'{"model":"m","prompt":"x","pad":' + pad + b"}"),
        (
            "an unread field and NaN",
            completions,
            b'{"model":"m","prompt":"x","x":NaN,"pad":' + pad + b"}",
        ),
    ]


def _many(value: bytes, n: int) -> bytes:
    return b",".join([value] * n)


def _dump(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


FINGERPRINT = "vllm-0.32.0-fake1234"


def completion_event(
    index: int,
    text: str,
    *,
    finish: str | None = None,
    usage: tuple[int, int] | None = None,
    chat: bool = False,
    fingerprint: bool = False,
    model: str = "m",
) -> dict[str, Any]:
    """One chunk of a stream as vLLM writes it: ``usage`` is (prompt, completion) tokens, cumulative
    for this choice (``continuous_usage_stats``)."""
    choice: dict[str, Any] = {"index": index}
    if chat:
        choice["delta"] = {"content": text}
    else:
        choice["text"] = text
    choice["finish_reason"] = finish
    kind = "chat.completion.chunk" if chat else "text_completion"
    chunk: dict[str, Any] = {
        "id": "cmpl-1",
        "object": kind,
        "created": 1,
        "model": model,
        "choices": [choice],
    }
    if usage is not None:
        prompt, completion = usage
        chunk["usage"] = {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
        }
    if fingerprint:
        chunk["system_fingerprint"] = FINGERPRINT
    return chunk


def usage_event(
    prompt: int, completion: int, *, chat: bool = False, model: str = "m"
) -> dict[str, Any]:
    """The trailing usage-only chunk (``include_usage``)."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {
        "id": "cmpl-1",
        "object": kind,
        "created": 1,
        "model": model,
        "choices": [],
        "usage": {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
        },
        "system_fingerprint": FINGERPRINT,
    }


def sse(payload: dict[str, Any] | str, newline: bytes = b"\n") -> bytes:
    """One SSE event: ``data: <json>`` (or ``data: [DONE]``) and its blank line."""
    data = payload.encode() if isinstance(payload, str) else _dump(payload)
    return b"data: " + data + newline + newline


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


@dataclass
class VllmLike:
    """A script that answers the way vLLM does, from the request itself.

    ``/v1/completions`` and ``/v1/chat/completions``: a stream (chunked SSE, ``tokens`` per
    choice, usage per ``stream_options`` as vLLM sends it: per choice and cumulative with
    ``continuous_usage_stats``, a usage-only chunk with ``include_usage``,
    ``system_fingerprint`` on terminal chunks only when no usage chunk follows), or a whole
    completion with its usage. ``/v1/models`` lists ``m``. Any other path: an echo of what came
    (method, target, body length and sha256) as JSON. ``filler`` pads each token's text;
    ``per_write`` events go in one write; ``delay`` seconds between writes.
    """

    tokens: int = 5
    filler: int = 0
    per_write: int = 1
    delay: float = 0.0
    prompt_tokens: int = 3
    # Called with the link after each write of a stream: a test's hook to pause vLLM.
    after_write: Callable[[int], Awaitable[None]] | None = None

    async def __call__(self, seen: Seen, link: Link) -> None:
        await seen.complete.wait()
        path = seen.path
        if path in (b"/v1/completions", b"/v1/chat/completions") and seen.method == b"POST":
            await self._completion(seen, link, chat=path.endswith(b"chat/completions"))
        elif path == b"/v1/models":
            body = _dump({"object": "list", "data": [{"id": "m", "object": "model"}]})
            await link.send(response_bytes(200, [("Content-Type", "application/json")], body))
        else:
            await link.send(echo(seen))

    async def _completion(self, seen: Seen, link: Link, *, chat: bool) -> None:
        try:
            payload = seen.json()
        except ValueError:
            body = _dump({"error": {"message": "invalid JSON", "type": "BadRequestError"}})
            await link.send(response_bytes(400, [("Content-Type", "application/json")], body))
            return
        n = int(payload.get("n") or 1)
        model = payload.get("model") or "m"
        if not payload.get("stream"):
            text = "x" * self.tokens
            choices = [
                {"index": i, "message": {"role": "assistant", "content": text}}
                if chat
                else {"index": i, "text": text}
                for i in range(n)
            ]
            usage = {
                "prompt_tokens": self.prompt_tokens,
                "total_tokens": self.prompt_tokens + n * self.tokens,
                "completion_tokens": n * self.tokens,
            }
            body = _dump({"id": "cmpl-1", "model": model, "choices": choices, "usage": usage})
            await link.send(response_bytes(200, [("Content-Type", "application/json")], body))
            return
        options = payload.get("stream_options") or {}
        include = bool(options.get("include_usage"))
        continuous = include and bool(options.get("continuous_usage_stats"))
        await link.send(stream_head())
        pending: list[bytes] = []
        writes_done = 0

        async def flush() -> None:
            nonlocal writes_done
            if pending:
                await link.send(chunk(b"".join(pending)))
                pending.clear()
                writes_done += 1
                if self.after_write is not None:
                    await self.after_write(writes_done)
                if self.delay:
                    await asyncio.sleep(self.delay)

        for sent in range(1, self.tokens + 1):
            for index in range(n):
                finish = "length" if sent == self.tokens else None
                event = completion_event(
                    index,
                    "t" + "." * self.filler,
                    finish=finish,
                    usage=(self.prompt_tokens, sent) if continuous else None,
                    chat=chat,
                    fingerprint=finish is not None and not include,
                    model=model,
                )
                pending.append(sse(event))
                if len(pending) >= self.per_write:
                    await flush()
        if include:
            pending.append(sse(usage_event(self.prompt_tokens, n * self.tokens, chat=chat)))
        pending.append(sse("[DONE]"))
        await flush()
        await link.send(LAST_CHUNK)


def echo(seen: Seen) -> bytes:
    """An answer saying what came: method, target, body length and digest."""
    body = _dump(
        {
            "method": seen.method.decode("latin-1"),
            "target": seen.target.decode("latin-1"),
            "length": len(seen.body),
            "sha256": hashlib.sha256(seen.body).hexdigest(),
        }
    )
    return response_bytes(200, [("Content-Type", "application/json")], body)


# -- the proxy in front ---------------------------------------------------------------------------
@dataclass
class Front:
    """A started Proxy in front of a RawUpstream, and the client connections a test opened."""

    upstream: RawUpstream
    proxy: Proxy
    port: int
    writers: list[asyncio.StreamWriter] = field(default_factory=list)

    async def connect(
        self, *, rcvbuf: int | None = None
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await connect(self.port, rcvbuf=rcvbuf)
        self.writers.append(writer)
        return reader, writer

    async def exchange(self, request: bytes, *, method: str = "GET") -> Reply:
        """One request on a fresh connection and its response."""
        reader, writer = await self.connect()
        writer.write(request)
        await writer.drain()
        return await read_reply(reader, method=method)

    def outcomes(self, model: str = "m") -> dict[str, float]:
        """Requests settled by outcome (non-zero ones) for ``model``."""
        return {
            s.labels[1]: s.value
            for s in ledger_samples(self.proxy.ledger.counts())
            if isinstance(s, Sample)
            and s.metric == "kvtax_requests_total"
            and s.labels[0] == model
            and s.value
        }

    def delivered(self, model: str = "m") -> float:
        totals = self.proxy.ledger.totals()
        return totals[model].delivered if model in totals else 0.0

    async def settled(self, n: int, model: str = "m", limit: float = GUARD) -> dict[str, float]:
        """The outcomes once ``n`` requests settled and none is in flight (called once the
        client has its answer, when settling is a matter of a turn of the loop)."""

        def done() -> bool:
            return sum(self.outcomes(model).values()) >= n and self.proxy.in_flight == 0

        await until(done, limit)
        return self.outcomes(model)


StartFront = Callable[..., Coroutine[Any, Any, Front]]


async def start_front(
    script: Script | None = None, *, gate: Gate | None = None, **settings: Any
) -> Front:
    """A RawUpstream answering with ``script`` and a Proxy in front of it, both on port 0."""
    upstream = RawUpstream(script)
    await upstream.start()
    names = ModelNames()
    names.update(["m"])
    proxy = Proxy(
        ProxySettings(upstream=upstream.url, **settings), DeliveryLedger(names), gate=gate
    )
    port = await proxy.start("127.0.0.1", 0)
    return Front(upstream, proxy, port)


async def stop_front(front: Front) -> None:
    for writer in front.writers:
        writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await writer.wait_closed()
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(WAIT):
            await front.proxy.stop()
    await front.upstream.stop()


@pytest.fixture
async def front_door() -> AsyncIterator[StartFront]:
    """``await front_door(script, gate=..., **ProxySettings)``: a started :class:`Front`,
    torn down after the test."""
    fronts: list[Front] = []

    async def start(script: Script | None = None, **kwargs: Any) -> Front:
        front = await start_front(script, **kwargs)
        fronts.append(front)
        return front

    yield start
    for front in fronts:
        await stop_front(front)
