"""Anthropic's Messages API, ``/v1/messages``: what the Anthropic SDK and the agents built on it
call. Pure, no I/O.

vLLM serves it by converting the request to a chat completion and the chat stream back into
Anthropic's named events (``vllm/entrypoints/anthropic/serving.py``). It asks its own chat path
for continuous usage on every Messages stream, whatever the client asked, but passes usage on in
two events only: ``message_start`` (the input tokens) and the last ``message_delta`` (the output
tokens). No field of the request adds a count per event, so kvtax asks for nothing and counts by
:class:`~kvtax.delivery.events.EventCounter`: one token per ``content_block_delta`` (text,
thinking, a tool's input; not the ``signature_delta`` vLLM adds to close a thinking block) as a
floor, and the ``message_delta``'s ``output_tokens`` as the exact total.

``max_tokens`` is required by the API (vLLM refuses a request without it), and there is no
``n``. The prompt is the ``system`` text and the messages' text blocks; an image block is
base64 the gate does not count as text. kvtax's own errors take Anthropic's shape,
``{"type": "error", "error": {"type": ..., "message": ...}}``, so that the SDK raises its own
exception for the status (``RateLimitError`` for a 429); a stream's last event is
``event: error``.

Example::

    >>> MESSAGES.shape({"max_tokens": 64, "system": "be brief",
    ...                 "messages": [{"role": "user", "content": "hi"}]}, whole=90).max_tokens
    64
"""

from __future__ import annotations

import json
from collections.abc import Mapping
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
from kvtax.delivery.events import EventCounter, EventSpec
from kvtax.delivery.sse import Fingerprint, HoldBudget
from kvtax.delivery.usage import io_usage_tokens

__all__ = ["MESSAGES", "MESSAGES_EVENTS", "Messages", "anthropic_type"]

MESSAGES_EVENTS = EventSpec(
    content=b"event: content_block_delta\n",
    empty=b'"delta":{"type":"signature_delta"',
    final=b"event: message_delta\n",
    done=b"event: message_stop\n",
    read=io_usage_tokens,
)

# Anthropic's error types by the status kvtax answers with (its API's own table).
_TYPES = {
    400: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def anthropic_type(status: int) -> str:
    """The Anthropic error type of a status kvtax answers with."""
    return _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


class Messages(Dialect):
    """``/v1/messages``; see the module docstring."""

    name = "messages"
    routes = ("/v1/messages",)
    read_keys = frozenset({"model", "stream", "max_tokens", "messages", "system"})
    prompt_keys = frozenset({"messages", "system"})

    def scheme(
        self, payload: dict[str, Any], *, version: str | None, ids_missing: bool = False
    ) -> Scheme:
        return "final_usage"

    def asks(
        self, payload: dict[str, Any], scheme: Scheme
    ) -> tuple[UsageWish, dict[str, Any]] | None:
        return UsageWish(), {}  # nothing to ask: vLLM asks its chat path for usage itself

    def shape(self, payload: Any, *, whole: int) -> Shape:
        if not isinstance(payload, dict):
            return Shape(0, None)
        decoded, raw, raw_media = split_raw(payload.get("system"), payload.get("messages"))
        prompt, media = prompt_text(*decoded)
        size = size_of(prompt, whole) + raw
        return Shape(size, limit_of(payload, ("max_tokens",)), media or raw_media)

    def limit_fields(self, payload: dict[str, Any], limit: int) -> dict[str, Any]:
        return {"max_tokens": lowered(payload.get("max_tokens"), limit)}

    def counter(
        self,
        wish: UsageWish,
        scheme: Scheme,
        *,
        budget: HoldBudget | None = None,
        fingerprints: Fingerprint | None = None,
    ) -> StreamCounter:
        return EventCounter(MESSAGES_EVENTS)

    def usage_of(self, usage: object) -> tuple[int, int] | None:
        return io_usage_tokens(usage)

    def error_body(self, status: int, message: str, kind: str) -> Mapping[str, object]:
        return {"type": "error", "error": {"type": anthropic_type(status), "message": message}}

    def error_event(self, status: int, message: str, kind: str, *, sequence: int = 0) -> bytes:
        data = json.dumps(self.error_body(status, message, kind), separators=(",", ":"))
        return b"event: error\ndata: " + data.encode() + b"\n\n"


# Content blocks that carry no text: what the gate cannot count by their bytes.
_MEDIA = frozenset({"image", "document", "input_image", "input_file", "input_audio"})


def prompt_text(*parts: Any) -> tuple[list[Any], bool]:
    """The text of a prompt made of strings, message lists and content-block lists, and whether
    any block was left out (an image, a document: base64 the gate does not count as text).
    Walked with a stack of its own: a body nested past the interpreter's recursion limit is
    a request like any other.

    >>> prompt_text("sys", [{"role": "user", "content": [{"type": "text", "text": "hi"},
    ...                                                  {"type": "image", "source": {}}]}])
    (['sys', 'hi'], True)
    """
    texts: list[Any] = []
    media = False
    stack: list[Any] = list(reversed(parts))
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            texts.append(value)
        elif isinstance(value, list):
            stack.extend(reversed(value))
        elif isinstance(value, dict):
            text, kind = value.get("text"), value.get("type")
            if isinstance(text, str):
                texts.append(text)
            elif isinstance(kind, str) and kind in _MEDIA:
                media = True
            elif "content" in value:
                stack.append(value["content"])
            elif "input" in value:
                texts.append(value["input"])  # a tool call's input, sent back as prompt
            elif "arguments" in value:
                texts.append(value["arguments"])
        elif value is not None:
            texts.append(value)
    return texts, media


MESSAGES = Messages()
