"""What the proxy sends to vLLM, and the one client it sends it with.

:func:`new_session` builds the proxy's single shared upstream client. :func:`request_headers`
and :func:`response_headers` drop the hop-by-hop headers (RFC 9110 7.6.1) in each direction and
pass every other header as it came. :func:`prepare` reads an accounted request's body once: it
learns the model and, for a stream, asks vLLM for usage on every chunk (:func:`kvtax.delivery.
sse.with_usage`); any other body goes to vLLM byte for byte. The JSON it read stays with it
(:class:`Prepared`) for the admission gate. :func:`upload` hands a body to aiohttp in the form
it sends fastest.

Example::

    session = new_session()
    prepared = prepare(await read_bounded(request.content, limit))
    await session.post(url, headers=request_headers(request.headers, identity=True),
                       data=upload(prepared.body), skip_auto_headers=NO_AUTO)
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from multidict import CIMultiDict

from kvtax.delivery.sse import UsageWish, with_usage

__all__ = [
    "NO_AUTO",
    "UPSTREAM_IDLE",
    "Prepared",
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


@dataclass(frozen=True, slots=True)
class Prepared:
    """An accounted request, its body read once: the model, the usage wish, the bytes for
    vLLM and the JSON they hold (``payload``; None when the body is not JSON), which the
    admission gate sizes without reading the body again."""

    model: str | None
    wish: UsageWish | None
    body: bytes
    payload: Any = None
    # Read by the standard parser: written back by it, so that vLLM reads the same values.
    lenient: bool = False

    def rewritten(self, payload: Any) -> bytes | None:
        """``payload`` (this request's, changed) as a body for vLLM; None if it cannot be
        written."""
        return _dumps(payload, lenient=self.lenient)


_LONG_DIGITS = re.compile(rb"[0-9]{19}")


def _loads(body: bytes) -> tuple[Any, bool]:
    """A request body as JSON, and whether it took the standard parser: orjson, or Python's
    for what orjson refuses but Python's (vLLM's) accepts (NaN, Infinity, lone surrogates), so
    such a body is still understood. ValueError when neither reads it.

    A body with a run of 19 or more digits goes to Python's parser first: orjson (3.10+) reads
    an integer past 64 bits as a float, and writing the body back would hand vLLM ``1e+29``
    for the client's exact integer. Such runs are rare, and the search is one C-level scan.
    """
    if _LONG_DIGITS.search(body) is None:
        try:
            return orjson.loads(body), False
        except orjson.JSONDecodeError:
            pass
    try:
        return json.loads(body), True
    except RecursionError as exc:  # nested past what either parser follows
        raise ValueError("nested too deeply") from exc


def _dumps(payload: Any, *, lenient: bool) -> bytes | None:
    """``payload`` as JSON: orjson for what it read; else the standard encoder, ASCII-only, which
    writes NaN, Infinity and lone surrogates (escaped) as Python's parser reads them, and what
    orjson will not nest (past 254 levels). None when neither can write it."""
    if not lenient:
        with contextlib.suppress(orjson.JSONEncodeError):
            return orjson.dumps(payload)
    try:
        return json.dumps(payload).encode()
    except (ValueError, RecursionError):
        return None


def prepare(body: bytes) -> Prepared:
    """An accounted request as vLLM should get it.

    A stream's body is rewritten to ask vLLM for usage (the wish says what the client asked
    for); any other body goes as it came, and vLLM answers the 400 for one that is not JSON.
    """
    try:
        payload, lenient = _loads(body)
    except ValueError:
        return Prepared(None, None, body)
    if not isinstance(payload, dict):
        return Prepared(None, None, body, payload, lenient)
    model = payload.get("model")
    name = model if isinstance(model, str) else None
    if payload.get("stream") is not True:
        return Prepared(name, None, body, payload, lenient)
    wish, upstream_payload = with_usage(payload)
    rewritten = _dumps(upstream_payload, lenient=lenient)
    if rewritten is None:  # too deep to write back: sent as it came, its usage not asked for
        return Prepared(name, None, body, payload, lenient)
    return Prepared(name, wish, rewritten, upstream_payload, lenient)
