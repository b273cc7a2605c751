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

from kvtax.delivery.dialects.audio import TRANSCRIPTIONS, TRANSLATIONS
from kvtax.delivery.dialects.base import Dialect, Shape, StreamCounter
from kvtax.delivery.dialects.batch import BATCH_CHAT
from kvtax.delivery.dialects.chat import CHAT
from kvtax.delivery.dialects.completions import COMPLETIONS
from kvtax.delivery.dialects.generate import GENERATE
from kvtax.delivery.dialects.invocations import INVOCATIONS
from kvtax.delivery.dialects.messages import MESSAGES
from kvtax.delivery.dialects.responses import RESPONSES

__all__ = [
    "APIS",
    "BATCH_CHAT",
    "CHAT",
    "COMPLETIONS",
    "DIALECTS",
    "GENERATE",
    "HANDLERS",
    "INVOCATIONS",
    "MESSAGES",
    "RESPONSES",
    "TRANSCRIPTIONS",
    "TRANSLATIONS",
    "UNCOUNTED",
    "Dialect",
    "Shape",
    "StreamCounter",
    "dialect_for",
]

DIALECTS: tuple[Dialect, ...] = (
    COMPLETIONS,
    CHAT,
    BATCH_CHAT,
    RESPONSES,
    MESSAGES,
    GENERATE,
    INVOCATIONS,
    TRANSCRIPTIONS,
    TRANSLATIONS,
)
# The API label of kvtax's series: one per dialect, a small fixed set.
APIS: tuple[str, ...] = tuple(dialect.name for dialect in DIALECTS)

# Routes on which vLLM 0.32 generates tokens that kvtax relays without counting them: Cohere's
# chat, and two scoring APIs that generate a token per item.
# They are no dialect, but their requests are the engine's work all the same: the join's
# denominator counts them, so that their traffic shows as coverage below 1, never as tokens
# generated and not delivered.
UNCOUNTED: tuple[str, ...] = (
    "/cohere/v2/chat",
    "/v1/systemone",
    "/generative_scoring",
)

_BY_ROUTE: dict[str, Dialect] = {route: dialect for dialect in DIALECTS for route in dialect.routes}
# Every generation route: the handler names vLLM's http_requests_total counts them by.
HANDLERS: tuple[str, ...] = (*_BY_ROUTE, *UNCOUNTED)


def dialect_for(route: str) -> Dialect | None:
    """The dialect of a request vLLM routes to ``route`` (kvtax.serve.proxy.head.route_of);
    None: not a generation API kvtax accounts for."""
    return _BY_ROUTE.get(route)
