"""What every request the proxy sends to vLLM goes through, and the request that is nothing more.

Both kinds of request (an accounted one, :mod:`~kvtax.serve.proxy.request`, and any other) write
a head for vLLM (:func:`upstream_head`: the client's headers less the hop-by-hop ones, the target
in origin form), pass vLLM's 1xx on (:func:`interim_to`), write vLLM's status and headers for
the client with the framing the client's version allows (:func:`response_framing`), and relay
the body read by read into a sink until it ends, vLLM paused while the client is full
(:func:`relay`).

:func:`pass_through` is a request to any path or method the proxy does not account for: its
body streamed to vLLM as it arrives, framed as it came, and vLLM's answer relayed as it is.

Example::

    head = upstream_head(exchange, upstream, len(body), identity=True)
    conn = await upstream.send(head + body, interim=interim_to(exchange))
    framing, head = response_framing(exchange, conn, rewritten=False)
    await relay(exchange, conn, PlainSink(exchange, framing, head, cost), relaying=busy)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from kvtax.delivery.cost import RelayCost
from kvtax.serve.proxy.answers import shutting_down, upstream_failure
from kvtax.serve.proxy.client import Cut, Unreachable, Upstream, UpstreamBroke, UpstreamConnection
from kvtax.serve.proxy.flow import Source
from kvtax.serve.proxy.relay import BodySink, PlainSink, StreamSink
from kvtax.serve.proxy.server import Exchange
from kvtax.serve.proxy.wire import (
    Framing,
    Headers,
    chunk,
    content_length,
    forwarded,
    header,
    request_head,
)

__all__ = [
    "coding_of",
    "interim_to",
    "is_event_stream",
    "pass_through",
    "relay",
    "response_framing",
    "upstream_head",
]

_STATUS_WITHOUT_LENGTH = frozenset({204}) | frozenset(range(100, 200))


def upstream_head(
    exchange: Exchange,
    upstream: Upstream,
    length: int | None,
    *,
    identity: bool,
    chunked: bool = False,
) -> bytes:
    """The request's head for vLLM; ``identity`` asks for an uncompressed answer, ``chunked``
    frames a body streamed on as chunks, and ``length`` None sends no body length."""
    request = exchange.head
    headers = forwarded(request.headers, identity=identity)
    if chunked:
        headers.append((b"Transfer-Encoding", b"chunked"))
    return request_head(
        request.method, upstream.prefix + request.origin, upstream.netloc, headers, length
    )


def interim_to(exchange: Exchange) -> Callable[[int, bytes, Headers], None]:
    """vLLM's 1xx go to the client, its hop-by-hop headers dropped."""
    return lambda status, reason, headers: exchange.interim(status, reason, forwarded(headers))


def response_framing(
    exchange: Exchange,
    conn: UpstreamConnection,
    *,
    rewritten: bool,
    decoded: bool = False,
    added: Sequence[tuple[bytes, bytes]] = (),
) -> tuple[Framing, bytes]:
    """The body's framing for the client, and vLLM's status and headers for it (written with
    the first bytes of the body that are in by then). ``rewritten``: the body's length changes
    on the way; ``decoded``: it goes to the client inflated; ``added``: kvtax's own headers."""
    request = exchange.head
    status = conn.status
    length = None if rewritten else _length(conn)
    framing: Framing
    if request.method == b"HEAD" or status in (204, 304):
        framing = "none"
    elif length is not None:
        framing = "length"
    elif request.version == b"1.0":
        framing = "close"
    else:
        framing = "chunked"
    headers = [*forwarded(conn.headers), *added]
    if decoded:  # inflated for the client: it gets the stream plain
        headers = [(k, v) for k, v in headers if k.lower() != b"content-encoding"]
    if framing == "none" and status not in _STATUS_WITHOUT_LENGTH:
        # Keep the length vLLM gave (the body a GET would have); there is no body to frame.
        # A 204 never has one (RFC 9110 8.6).
        given = header(conn.headers, b"content-length")
        if given is not None:
            headers.append((b"Content-Length", given))
    head = exchange.response_head(status, conn.reason, headers, framing, length=length)
    return framing, head


async def relay(
    exchange: Exchange,
    conn: UpstreamConnection,
    sink: PlainSink | BodySink | StreamSink,
    *,
    relaying: set[UpstreamConnection],
    source: Source | None = None,
) -> None:
    """Relay ``conn``'s body into ``sink`` until it ends, ``source`` (vLLM's connection unless
    said otherwise) paused while the client is full. ``relaying`` holds the connections being
    relayed, for shutdown's cut."""
    exchange.relay_from(source if source is not None else conn)
    relaying.add(conn)
    try:
        conn.attach(sink)
        await sink.done
    finally:
        relaying.discard(conn)
        exchange.relay_ended()
        if not conn.closed:
            conn.resume_reading()


async def pass_through(
    exchange: Exchange,
    upstream: Upstream,
    *,
    cost: RelayCost,
    relaying: set[UpstreamConnection],
    timeout: float,
) -> None:
    """Answer a request the proxy does not account for: sent on as it came, answered as vLLM
    answers. A body still arriving is streamed on, framed as it came (its length, or chunks);
    vLLM's answer goes back byte for byte, and the connection to vLLM back to the pool when
    both ends allow it."""
    request = exchange.head
    no_body = request.method == b"HEAD"
    began = time.perf_counter()
    try:
        if exchange.body_complete:
            body = exchange.buffered()
            has_body = bool(body) or request.method in (b"POST", b"PUT", b"PATCH")
            length = len(body) if has_body else None
            head = upstream_head(exchange, upstream, length, identity=False)
            conn = await upstream.send(head + body, no_body=no_body, interim=interim_to(exchange))
        else:
            chunked = request.chunked
            length = None if chunked else request.length
            head = upstream_head(exchange, upstream, length, identity=False, chunked=chunked)
            conn = await upstream.send(
                head + _body_start(exchange),
                no_body=no_body,
                streamed=exchange.stream_body,
                chunked=chunked,
                holder=exchange.upstream_holder,
                interim=interim_to(exchange),
            )
    except (Unreachable, UpstreamBroke, TimeoutError) as exc:
        _failed(exchange, exc, timeout)
        return
    except Cut:
        exchange.answer(shutting_down())
        return
    cost.forward.observe(conn.sent_at - began - conn.connecting)
    framing, head = response_framing(exchange, conn, rewritten=False)
    try:
        await relay(exchange, conn, PlainSink(exchange, framing, head, cost), relaying=relaying)
    finally:
        if conn.complete and not exchange.disconnected:
            upstream.release(conn)
        else:
            conn.close()


def _body_start(exchange: Exchange) -> bytes:
    """What arrived of a streamed body, framed as it goes to vLLM."""
    first = exchange.buffered()
    if not first:
        return b""
    return chunk(first) if exchange.head.chunked else first


def _failed(exchange: Exchange, exc: BaseException, timeout: float) -> None:
    """vLLM could not be reached or did not answer: 502 or 504, or the refusal of a body that
    broke off while it was being streamed (its framing was bad)."""
    if exchange.refusal is not None:
        exchange.answer(exchange.refusal)
        return
    timed_out = isinstance(exc, TimeoutError)
    broke = str(exc) if isinstance(exc, UpstreamBroke) else None
    exchange.answer(upstream_failure(timed_out, timeout, broke=broke))


def _length(conn: UpstreamConnection) -> int | None:
    """vLLM's Content-Length, unless chunks delimit the body."""
    if header(conn.headers, b"transfer-encoding") is not None:
        return None
    return content_length(conn.headers)


def coding_of(conn: UpstreamConnection) -> bytes | None:
    """vLLM's Content-Encoding, lower case, when it is one (gzip, say) other than identity."""
    value = header(conn.headers, b"content-encoding")
    coding = value.strip().lower() if value is not None else b""
    return None if coding in (b"", b"identity") else coding


def is_event_stream(conn: UpstreamConnection) -> bool:
    """vLLM answered with server-sent events."""
    value = header(conn.headers, b"content-type")
    return value is not None and value.split(b";", 1)[0].strip().lower() == b"text/event-stream"
