"""The generation APIs the proxy accounts for, one dialect each, and the one list of them.

Every API through which vLLM generates tokens is a dialect of one accounted request
(:class:`~kvtax.delivery.dialects.base.Dialect`): the paths vLLM routes to it, how to read its
request, what to ask vLLM for, how to count and cut its stream, how its errors read. The proxy,
the gate, the join's denominator and the docs read :data:`DIALECTS`; none keeps a list of paths
of its own.

Adding an API is one module beside these, a line in :data:`DIALECTS`, and its tests.

Example::

    >>> dialect_for("/v1/chat/completions").name
    'chat'
    >>> dialect_for("/v1/models") is None
    True
"""

from __future__ import annotations

from kvtax.delivery.dialects.base import Dialect, Shape, StreamCounter
from kvtax.delivery.dialects.chat import CHAT
from kvtax.delivery.dialects.completions import COMPLETIONS

__all__ = [
    "CHAT",
    "COMPLETIONS",
    "DIALECTS",
    "HANDLERS",
    "Dialect",
    "Shape",
    "StreamCounter",
    "dialect_for",
]

DIALECTS: tuple[Dialect, ...] = (COMPLETIONS, CHAT)

_BY_ROUTE: dict[str, Dialect] = {route: dialect for dialect in DIALECTS for route in dialect.routes}
# Every route of every dialect: the handler names vLLM's http_requests_total counts them by.
HANDLERS: tuple[str, ...] = tuple(_BY_ROUTE)


def dialect_for(route: str) -> Dialect | None:
    """The dialect of a request vLLM routes to ``route`` (kvtax.serve.proxy.head.route_of);
    None: not a generation API kvtax accounts for."""
    return _BY_ROUTE.get(route)
