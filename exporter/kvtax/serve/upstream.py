"""What the proxy sends to vLLM, and the one client it sends it with.

:func:`new_session` builds the proxy's single shared upstream client. :func:`request_headers`
and :func:`response_headers` drop the hop-by-hop headers (RFC 9110 7.6.1) in each direction and
pass every other header as it came. :func:`prepare` reads an accounted request's body: it learns
the model and, for a stream, asks vLLM for usage on every chunk (:func:`kvtax.delivery.sse.
with_usage`); any other body goes to vLLM byte for byte. :func:`upload` hands a body to aiohttp
in the form it sends fastest.

Example::

    session = new_session()
    model, wish, body = prepare(await read_bounded(request.content, limit))
    await session.post(url, headers=request_headers(request.headers, identity=True),
                       data=upload(body), skip_auto_headers=NO_AUTO)
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping
from typing import Any

import aiohttp
import orjson
from multidict import CIMultiDict

from kvtax.delivery.sse import UsageWish, with_usage

__all__ = [
    "NO_AUTO",
    "UPSTREAM_IDLE",
    "new_session",
    "prepare",
    "read_timeout",
    "request_headers",
    "response_headers",
    "upload",
]

# RFC 9110 7.6.1 hop-by-hop headers, plus the ones aiohttp recomputes itself.
_HOP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "TE",
        "Trailer",
        "Trailers",
        "Transfer-Encoding",
        "Upgrade",
        "Host",
        "Content-Length",
    )
)
# Headers aiohttp's client would add on its own; the upstream must see only the client's.
NO_AUTO = ("User-Agent", "Accept", "Accept-Encoding", "Content-Type")
_ONE_WRITE = 1024**2
# Seconds an idle upstream connection is kept; below vLLM's own 5 s keep-alive.
UPSTREAM_IDLE = 2.0


def new_session() -> aiohttp.ClientSession:
    """The proxy's one upstream client (create it inside the running event loop)."""
    return aiohttp.ClientSession(
        # No pool limit: the pool must never queue a stream behind others. Idle connections
        # are dropped before vLLM drops them (uvicorn closes after 5 s): reusing one vLLM is
        # closing at that instant fails the request with a 502.
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=UPSTREAM_IDLE),
        # Relay encoded bodies as they are; never keep cookies between clients.
        auto_decompress=False,
        cookie_jar=aiohttp.DummyCookieJar(),
        timeout=aiohttp.ClientTimeout(total=None),
    )


def read_timeout(seconds: float) -> aiohttp.ClientTimeout:
    """No bound on a whole stream; ``seconds`` on connecting and between two reads."""
    return aiohttp.ClientTimeout(total=None, sock_connect=seconds, sock_read=seconds)


def request_headers(headers: Mapping[str, str], *, identity: bool) -> CIMultiDict[str]:
    """The client's headers for vLLM; ``identity`` also drops Accept-Encoding, so that an
    accounted response comes uncompressed and its usage can be read."""
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        lower = name.lower()
        if lower in _HOP or (identity and lower == "accept-encoding"):
            continue
        out.add(name, value)
    return out


def response_headers(headers: Mapping[str, str]) -> CIMultiDict[str]:
    """vLLM's headers for the client."""
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in _HOP)


def upload(body: bytes) -> bytes | io.BytesIO:
    """aiohttp writes a bytes body in one go; a large one goes file-like, in pieces."""
    return body if len(body) <= _ONE_WRITE else io.BytesIO(body)


def _loads(body: bytes) -> Any:
    """A request body as JSON: orjson, or the standard parser for what orjson refuses but
    Python's accepts (integers past 64 bits, NaN), so such a body is still understood."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return json.loads(body)


def prepare(body: bytes) -> tuple[str | None, UsageWish | None, bytes]:
    """(model, usage wish, body for vLLM) of an accounted request.

    A stream's body is rewritten to ask vLLM for usage (the wish says what the client asked
    for); any other body goes as it came, and vLLM answers the 400 for one that is not JSON.
    """
    try:
        payload = _loads(body)
    except ValueError:
        return None, None, body
    if not isinstance(payload, dict):
        return None, None, body
    model = payload.get("model")
    name = model if isinstance(model, str) else None
    if payload.get("stream") is not True:
        return name, None, body
    wish, upstream_payload = with_usage(payload)
    try:
        return name, wish, orjson.dumps(upstream_payload)
    except orjson.JSONEncodeError:  # integers past 64 bits: the standard encoder
        return name, wish, json.dumps(upstream_payload, ensure_ascii=False).encode()
