"""The raw transport's clients: requests as bytes, a strict reader of what comes back, and
raw-socket connections, for tests that hold every byte on the client's side of the proxy too.

:func:`raw_request` and :func:`post` make a request's bytes; :func:`read_head`,
:func:`read_reply` (one response, strictly parsed, its body unframed) and
:func:`read_streamed` (a body watched as it grows) read answers; :func:`closed` tells whether
the peer hung up; :func:`events` splits an SSE body; :func:`connect` opens a connection,
optionally with a small receive buffer for a client that stops reading. The request bodies of
issue 43's costly JSON (:func:`costly_bodies`) are here too, for the tests and the front-door
bench alike.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtax_dev.fakevllm.raw import WAIT

__all__ = [
    "CHAT",
    "STREAM",
    "WHOLE",
    "Reply",
    "chat_messages",
    "closed",
    "connect",
    "costly_bodies",
    "events",
    "post",
    "raw_request",
    "read_head",
    "read_reply",
    "read_streamed",
]

STREAM = {"model": "m", "prompt": "x", "stream": True}
WHOLE = {"model": "m", "prompt": "x"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}]}


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
