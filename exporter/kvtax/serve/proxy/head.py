"""A client's request head: the checks a front door makes before anything reaches vLLM, and the
path vLLM will route the request by. Pure: no I/O.

httptools (llhttp) parses the head; it is lenient where nginx and RFC 9112 are not, and it says
nothing of where a request goes. :func:`request_line_problem` checks the request line's bytes
before the parser sees them (one space between its three parts, a version of 1.0 or 1.1);
:func:`head_problem` checks the parsed head (a single Host on HTTP/1.1, a transfer coding of
``chunked`` alone, and none at all on HTTP/1.0). Either returns the refusal, which the
connection answers in the request's turn and then closes.

:func:`route_of` is the path vLLM's server routes on: uvicorn takes the path of the target as
``httptools.parse_url`` reads it (an absolute-form target's authority and a fragment dropped),
then percent-decodes it. So ``POST http://host/v1/completions``, ``/v1/%63ompletions`` and
``/v1/completions#x`` all reach vLLM's completions handler, and kvtax counts and gates them as
``/v1/completions``. :attr:`RequestHead.origin` is the target sent on: the raw path and query,
in origin form.

Example::

    problem = request_line_problem(b"POST /v1/completions HTTP/1.1")   # None: fine
    head = RequestHead.of(b"POST", b"/v1/%63ompletions", b"1.1", headers, keep_alive=True)
    head.route, head.origin      # "/v1/completions", b"/v1/%63ompletions"
"""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass

import httptools

from kvtax.serve.proxy.answers import bad_request, not_implemented, version_not_supported
from kvtax.serve.proxy.wire import Answer, Headers, content_length, header

__all__ = ["RequestHead", "asks_keep_alive", "head_problem", "request_line_problem", "route_of"]

# method SP request-target SP HTTP-version (RFC 9112 3): the method a token, the target free of
# whitespace and controls, exactly one space between them.
_REQUEST_LINE = re.compile(
    rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+ [^\x00-\x20\x7f]+ HTTP/(?P<version>[0-9]\.[0-9])\r?"
)
_VERSIONS = frozenset({b"1.0", b"1.1"})


def request_line_problem(line: bytes) -> Answer | None:
    """The refusal of a request line (its bytes up to the LF, the CR included), or None.

    Two spaces where one belongs, a line without a version (HTTP/0.9) or bare words are a 400;
    a version other than 1.0 and 1.1 (``HTTP/2.0`` sent to an HTTP/1 port) is a 505, answered
    in HTTP/1.1 whatever the client wrote.
    """
    match = _REQUEST_LINE.fullmatch(line)
    if match is None or not line.endswith(b"\r"):
        return bad_request(400, "malformed request line")
    if match["version"] not in _VERSIONS:
        return version_not_supported()
    return None


def head_problem(version: bytes, headers: Headers) -> Answer | None:
    """The refusal of a parsed head, or None: Host and Transfer-Encoding as RFC 9112 reads them.

    - HTTP/1.1 needs a Host, and no request may have several (3.2): a 400.
    - A transfer coding on an HTTP/1.0 request makes its framing faulty (6.1): a 400, and the
      connection closes, so no request glued behind it is ever read.
    - A coding other than ``chunked`` alone (``identity, chunked``, ``gzip, chunked``) is one
      kvtax does not implement: a 501, as nginx answers.
    """
    hosts = sum(1 for name, _ in headers if name.lower() == b"host")
    if hosts > 1 or (version == b"1.1" and not hosts):
        return bad_request(400, "a request needs exactly one Host header")
    codings = [value for name, value in headers if name.lower() == b"transfer-encoding"]
    if not codings:
        return None
    if version == b"1.0":
        return bad_request(400, "Transfer-Encoding is not allowed on an HTTP/1.0 request")
    if b",".join(codings).strip().lower() != b"chunked":
        return not_implemented("only Transfer-Encoding: chunked is supported")
    return None


def asks_keep_alive(headers: Headers) -> bool:
    """A Connection header names keep-alive (what an HTTP/1.0 request needs to keep its
    connection; Proxy-Connection does not count)."""
    return any(
        token.strip().lower() == b"keep-alive"
        for name, value in headers
        if name.lower() == b"connection"
        for token in value.split(b",")
    )


def route_of(target: bytes) -> tuple[str, bytes] | None:
    """The path vLLM routes ``target`` on (uvicorn's rule: parse_url's path, percent-decoded),
    and the target to send on in origin form (raw path and query); None when the target is no
    URL uvicorn reads (it answers that request 400 itself)."""
    try:
        parsed = httptools.parse_url(target)
    except httptools.HttpParserInvalidURLError:
        return None
    raw = parsed.path or b"/"
    try:
        path = raw.decode("ascii")
    except UnicodeDecodeError:
        return None
    if "%" in path:
        path = urllib.parse.unquote(path)
    origin = raw + b"?" + parsed.query if parsed.query is not None else raw
    return path, origin


@dataclass(slots=True)
class RequestHead:
    """A request's head as the relay acts on it. ``route`` is the path vLLM will route it by
    (:func:`route_of`), ``origin`` the target sent on; ``length`` the Content-Length, if any."""

    method: bytes
    target: bytes
    version: bytes
    headers: Headers
    keep_alive: bool
    route: str
    origin: bytes
    length: int | None
    chunked: bool
    expect: bool

    @classmethod
    def of(
        cls, method: bytes, target: bytes, version: bytes, headers: Headers, *, keep_alive: bool
    ) -> RequestHead | None:
        """The head of a request the parser accepted and :func:`head_problem` let through;
        None when its target is no URL."""
        routed = route_of(target)
        if routed is None:
            return None
        route, origin = routed
        expect = header(headers, b"expect")
        return cls(
            method=method,
            target=target,
            version=version,
            headers=headers,
            keep_alive=keep_alive,
            route=route,
            origin=origin,
            length=content_length(headers),
            chunked=header(headers, b"transfer-encoding") is not None,
            # A 100 goes to HTTP/1.1 clients only (RFC 9110 10.1.1).
            expect=version == b"1.1" and expect is not None and expect.lower() == b"100-continue",
        )

    @classmethod
    def refused(cls, version: bytes, method: bytes = b"") -> RequestHead:
        """The head of a request refused before its head was whole: nothing of it is known but
        the version to answer in and, once its line was read, its method."""
        return cls(method, b"", version, [], False, "", b"", None, False, False)

    @property
    def has_body(self) -> bool:
        return self.chunked or bool(self.length)
