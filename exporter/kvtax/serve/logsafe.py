"""Keep credentials out of logs: aiohttp's own error records, and URLs that kvtax logs.

A malformed request (``Authorization: Bearer SECRET\\x01``, or a header over 8 KiB) makes
aiohttp's server log ``Error handling request`` at ERROR with the parser's exception, whose text
quotes the offending bytes: the header value, token and all. :func:`install` puts a filter on
aiohttp's loggers that rewrites such records to the error's class and the peer, with no
exception text and no traceback. It is installed once, at start, and covers every aiohttp
server in the process: the web port, and aiohttp's client (the scrape). The proxy port is not
aiohttp's: its own parser (:mod:`kvtax.serve.proxy.server`) never logs a request's bytes, only
the peer and the status it answered. :func:`redact_url` strips the parts of a URL that can carry
credentials before kvtax logs it.

Example::

    logging.basicConfig(level="INFO")
    install()
"""

from __future__ import annotations

import logging
from urllib.parse import urlsplit, urlunsplit

from aiohttp.http_exceptions import HttpProcessingError

__all__ = ["AIOHTTP_LOGGERS", "BadRequestFilter", "install", "redact_url"]

# aiohttp logs to these by name; a filter on a logger sees only records logged on that logger.
AIOHTTP_LOGGERS = (
    "aiohttp.access",
    "aiohttp.client",
    "aiohttp.internal",
    "aiohttp.server",
    "aiohttp.web",
    "aiohttp.websocket",
)


def _bad_request(error: BaseException | None) -> HttpProcessingError | None:
    """The HTTP parse error in ``error``'s chain, if any: its text echoes the client's bytes."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, HttpProcessingError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


class BadRequestFilter(logging.Filter):
    """Rewrites records about malformed requests to the error class and the peer."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        parse_error = _bad_request(error)
        if parse_error is None:
            return True
        # aiohttp logs "Error handling request from %s" with the peer as the only argument.
        peer = record.args[0] if isinstance(record.args, tuple) and record.args else "unknown"
        record.msg = "bad request from %s: %s (details withheld: they may hold credentials)"
        record.args = (peer, type(parse_error).__name__)
        record.exc_info = None
        record.exc_text = None
        record.stack_info = None
        return True


_FILTER = BadRequestFilter()


def install() -> None:
    """Put the filter on aiohttp's loggers; calling it again changes nothing."""
    for name in AIOHTTP_LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)


def redact_url(url: str) -> str:
    """``url`` without user, password, query and fragment, which may carry credentials."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return "(a malformed URL)"
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{host}:{port}" if port is not None else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))
