"""Keep credentials out of logs: :func:`redact_url` strips the parts of a URL that can carry
credentials (user, password, query) before kvtax logs it.

Example::

    log.warning("reading %s failed", redact_url("http://u:pw@gw:4000/metrics?key=k"))
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

__all__ = ["redact_url"]


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
