"""OpenAI's Responses API, ``/v1/responses``: what the OpenAI Agents SDK and newer OpenAI
clients call. Pure, no I/O.

vLLM streams it as typed events (``response.created``, ``response.output_text.delta``,
``response.function_call_arguments.delta``, ... ``response.completed``;
``vllm/entrypoints/openai/responses/``). Usage arrives once, in ``response.completed``; the
delta events carry none, and a text delta can hold many tokens (its detokenizer holds back bytes
that are not yet whole characters). The only per-token data vLLM can add, logprobs, come on
text deltas alone and skip the outputs that made no event, so they would not count either. So
kvtax asks for nothing and counts by :class:`~kvtax.delivery.events.EventCounter`: one token
per ``.delta`` event as a floor, ``response.completed``'s ``output_tokens`` as the exact total.

The prompt is ``instructions`` and ``input`` (a string, or items whose content parts hold the
text; an ``input_image`` or ``input_file`` is not counted as text); the output is limited by
``max_output_tokens``. Errors take OpenAI's shape, as vLLM's own do on this route; a stream's
last event is the API's ``error`` event.

Example::

    >>> RESPONSES.shape({"input": "hi", "max_output_tokens": 64}, whole=40).max_tokens
    64
"""

from __future__ import annotations

from typing import Any

from kvtax.delivery.asks import Scheme, UsageWish
from kvtax.delivery.dialects.base import (
    Dialect,
    Shape,
    StreamCounter,
    limit_of,
    lowered,
    size_of,
    split_raw,
)
from kvtax.delivery.dialects.messages import prompt_text
from kvtax.delivery.events import EventCounter, EventSpec
from kvtax.delivery.openai import responses_error_event
from kvtax.delivery.sse import Fingerprint, HoldBudget
from kvtax.delivery.usage import io_usage_tokens

__all__ = ["RESPONSES", "RESPONSES_EVENTS", "Responses"]

RESPONSES_EVENTS = EventSpec(
    # Every event that carries output is named response.<what>.delta (output text, reasoning,
    # a function's or a tool's arguments, code).
    content=b".delta\ndata: ",
    final=b"event: response.completed\n",
    done=b"event: response.completed\n",
    read=io_usage_tokens,
)


class Responses(Dialect):
    """``/v1/responses``; see the module docstring."""

    name = "responses"
    routes = ("/v1/responses",)
    read_keys = frozenset({"model", "stream", "max_output_tokens", "input", "instructions"})
    prompt_keys = frozenset({"input", "instructions"})

    def scheme(
        self, payload: dict[str, Any], *, version: str | None, ids_missing: bool = False
    ) -> Scheme:
        return "final_usage"

    def asks(
        self, payload: dict[str, Any], scheme: Scheme
    ) -> tuple[UsageWish, dict[str, Any]] | None:
        return UsageWish(), {}  # usage always ends the stream; nothing counts per event

    def shape(self, payload: Any, *, whole: int) -> Shape:
        if not isinstance(payload, dict):
            return Shape(0, None)
        decoded, raw, raw_media = split_raw(payload.get("instructions"), payload.get("input"))
        prompt, media = prompt_text(*decoded)
        size = size_of(prompt, whole) + raw
        return Shape(size, limit_of(payload, ("max_output_tokens",)), media or raw_media)

    def limit_fields(self, payload: dict[str, Any], limit: int) -> dict[str, Any]:
        return {"max_output_tokens": lowered(payload.get("max_output_tokens"), limit)}

    def counter(
        self,
        wish: UsageWish,
        scheme: Scheme,
        *,
        budget: HoldBudget | None = None,
        fingerprints: Fingerprint | None = None,
    ) -> StreamCounter:
        return EventCounter(RESPONSES_EVENTS)

    def usage_of(self, usage: object) -> tuple[int, int] | None:
        return io_usage_tokens(usage)

    def error_event(self, status: int, message: str, kind: str, *, sequence: int = 0) -> bytes:
        """The API's error event (``ResponseErrorEvent``), numbered after the events before."""
        return responses_error_event(message, kind, sequence=sequence)


RESPONSES = Responses()
