"""The Overview's "By API" row: which generation API the traffic and the waste come from.

vLLM serves several APIs that generate tokens (OpenAI completions, chat and Responses, Anthropic
Messages, batch chat, generate, SageMaker's /invocations), and the proxy counts each
(docs/delivery.md, "Every generation API"). Agent frameworks call the Responses and Messages
APIs, whose long outputs are where preemption hurts most: this row splits the proxy's delivered
tokens, its undelivered tokens and its errors by API, so that a waste or an error rate can be
traced to the clients behind it. Pure: no I/O.
"""

from __future__ import annotations

from kvtax.mixin.dashboards.common import TOK_S, sum_rate, sum_rate_regex
from kvtax.mixin.dashboards.model import Panel, Row, Target

__all__ = ["API_ROW"]

API = "api"
_ERRORS = "upstream_error|upstream_4xx|too_large|shed|shutdown"

_delivered = Panel(
    "Delivered tokens by API",
    "timeseries",
    (Target(sum_rate("kvtax_api_delivered_tokens_total", API), "{{api}}", stack=True),),
    TOK_S,
    "Completion tokens per second the proxy delivered to clients, stacked by the generation API "
    "they came through. The stack's top is the proxy's part of goodput. Tokens pushed by a "
    "gateway or counted from its metrics have no API and are not in it.",
    "KvtaxGoodputDiverging",
    width=8,
    min=0,
)

_undelivered = Panel(
    "Undelivered tokens by API",
    "timeseries",
    (Target(sum_rate("kvtax_api_undelivered_tokens_total", API), "{{api}}", stack=True),),
    TOK_S,
    "Completion tokens per second vLLM sent through the proxy that never reached their client "
    "(it left, or the stream broke), by API: where the waste of abandoned requests comes from. "
    "The Messages and Responses APIs carry no count per event, so a stream cut there counts "
    "one token per content event, a floor (docs/delivery.md).",
    "KvtaxGoodputDiverging",
    width=8,
    min=0,
)

_errors = Panel(
    "Error share by API",
    "timeseries",
    (
        Target(
            f"{sum_rate_regex('kvtax_api_requests_total', (('outcome', _ERRORS),), API)}"
            f" / {sum_rate('kvtax_api_requests_total', API)}",
            "{{api}}",
        ),
    ),
    "percentunit",
    "The share of each API's requests through the proxy that did not complete for the client: "
    "vLLM's 4xx and 5xx, kvtax's own refusals (too large, shed by the gate) and shutdown. A "
    "client that left is not an error here. One API far above the others points at its clients "
    "or at vLLM's support for it.",
    "KvtaxGateShedding",
    width=8,
    min=0,
    max=1,
)

API_ROW = Row("By API", (_delivered, _undelivered, _errors))
