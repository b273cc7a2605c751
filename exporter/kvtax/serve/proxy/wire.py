"""HTTP/1.1 as bytes on the wire: heads, body framing, hop-by-hop headers, kvtax's own answers.

The relay parses with httptools (llhttp) and writes with these functions; nothing here does I/O.
Headers travel as ``(name, value)`` byte pairs in the order and case they came.
:func:`forwarded` drops the hop-by-hop headers of RFC 9110 7.6.1, the ones a ``Connection``
header names included, since each hop frames its own message. :func:`request_head` and
:func:`response_head` write a head in one piece, its framing chosen by the relay
(:data:`Framing`). :class:`Answer` is a whole response of kvtax's own: the proxy's errors are
OpenAI-style JSON (:mod:`kvtax.delivery.openai`).

Example::

    head = request_head(b"POST", b"/v1/completions", b"127.0.0.1:8000",
                        forwarded(headers, identity=True), len(body))
    client.write(response_head(b"1.1", 200, b"OK", forwarded(up_headers), "chunked", close=False))
    client.write(chunk(b"data: {...}\\n\\n"))
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Literal

from kvtax.delivery.openai import error_body

__all__ = [
    "CONTINUE",
    "LAST_CHUNK",
    "MAX_HEAD",
    "MAX_LINE",
    "Answer",
    "Framing",
    "Headers",
    "chunk",
    "content_length",
    "forwarded",
    "header",
    "request_head",
    "response_head",
]

Headers = list[tuple[bytes, bytes]]
# How a response body is delimited to the client: a Content-Length, chunks, the connection's
# close (an HTTP/1.0 client of a body whose length is unknown), or no body at all.
Framing = Literal["length", "chunked", "close", "none"]

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
LAST_CHUNK = b"0\r\n\r\n"
# Bytes of start line and headers one message may have, a client's request or vLLM's answer
# (its interim answers included); and of one line of a request's head (aiohttp's and nginx's
# 8 KiB buffers).
MAX_HEAD = 64 * 1024
MAX_LINE = 8190

# RFC 9110 7.6.1 hop-by-hop headers; Host, Content-Length and Expect are written anew by the
# relay for the next hop (it answers 100-continue itself and sends the body whole).
_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"content-length",
        b"expect",
    }
)


def header(headers: Sequence[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    """The first value of header ``name`` (lower case), or None."""
    for key, value in headers:
        if key.lower() == name:
            return value
    return None


def content_length(headers: Sequence[tuple[bytes, bytes]]) -> int | None:
    """The Content-Length the parser accepted, or None when the message has none."""
    value = header(headers, b"content-length")
    return int(value) if value is not None and value.strip().isdigit() else None


def forwarded(headers: Iterable[tuple[bytes, bytes]], *, identity: bool = False) -> Headers:
    """``headers`` for the next hop, without the hop-by-hop ones; ``identity`` replaces
    Accept-Encoding with ``identity``, so that an accounted response comes uncompressed and its
    usage is read (no Accept-Encoding at all would mean any coding is acceptable)."""
    headers = list(headers)
    named: set[bytes] = set()
    for key, value in headers:
        if key.lower() == b"connection":
            named.update(token.strip().lower() for token in value.split(b","))
    out: Headers = []
    for key, value in headers:
        lower = key.lower()
        if lower in _HOP or lower in named or (identity and lower == b"accept-encoding"):
            continue
        out.append((key, value))
    if identity:
        out.append((b"Accept-Encoding", b"identity"))
    return out


def request_head(
    method: bytes, target: bytes, host: bytes, headers: Headers, length: int | None
) -> bytes:
    """A request head for vLLM; ``length`` None sends no body."""
    parts = [method, b" ", target, b" HTTP/1.1\r\nHost: ", host, b"\r\n"]
    for key, value in headers:
        parts += (key, b": ", value, b"\r\n")
    if length is not None:
        parts.append(b"Content-Length: %d\r\n" % length)
    parts.append(b"\r\n")
    return b"".join(parts)


def response_head(
    version: bytes,
    status: int,
    reason: bytes,
    headers: Headers,
    framing: Framing,
    *,
    close: bool,
    length: int | None = None,
) -> bytes:
    """A response head for the client, in its HTTP version, delimited by ``framing``."""
    parts = [b"HTTP/", version, b" %d " % status, reason or _reason(status), b"\r\n"]
    for key, value in headers:
        parts += (key, b": ", value, b"\r\n")
    if framing == "length":
        parts.append(b"Content-Length: %d\r\n" % (length or 0))
    elif framing == "chunked":
        parts.append(b"Transfer-Encoding: chunked\r\n")
    if close:
        parts.append(b"Connection: close\r\n")
    elif version == b"1.0":
        parts.append(b"Connection: keep-alive\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)


def chunk(payload: bytes) -> bytes:
    """``payload`` as one chunk of a chunked body (never empty: that would end the body)."""
    return b"%x\r\n%b\r\n" % (len(payload), payload)


def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b"Unknown"


@dataclass(frozen=True, slots=True)
class Answer:
    """A whole response of kvtax's own; ``close`` ends the connection after it."""

    status: int
    body: bytes
    headers: Headers = field(default_factory=list)
    close: bool = False

    @classmethod
    def error(
        cls,
        status: int,
        message: str,
        kind: str,
        *,
        close: bool = False,
        headers: Sequence[tuple[bytes, bytes]] = (),
        shape: Callable[[int, str, str], Mapping[str, object]] = error_body,
    ) -> Answer:
        """A JSON error in the request's API's ``shape``: OpenAI's
        (``{"error": {message, type, param, code}}``) unless it says otherwise."""
        body = json.dumps(shape(status, message, kind)).encode()
        return cls(status, body, [(b"Content-Type", b"application/json"), *headers], close)

    def encode(self, version: bytes, *, close: bool, head_only: bool = False) -> bytes:
        """The response as bytes for a client speaking HTTP/``version`` (``head_only``: the
        answer to a HEAD, its Content-Length and no body)."""
        head = response_head(
            version, self.status, b"", self.headers, "length", close=close, length=len(self.body)
        )
        return head if head_only else head + self.body
