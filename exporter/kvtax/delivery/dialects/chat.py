"""The OpenAI chat completions API, ``/v1/chat/completions``: ``messages`` in. Pure, no I/O.

The prompt is the messages; a message's ``content`` may be a list of parts, of which the gate
counts the text only: an image or audio part is mostly base64, and counted as text it would
make one picture weigh like a book (:attr:`Shape.media` says one was left out). The output is
limited by ``max_completion_tokens or max_tokens``. Its streams carry every token's id from
vLLM 0.12.0 (tool calls and reasoning before that lacked theirs: vLLM issues 27482 and 28246,
fixed by PRs 29074 and 28256), unless ``include_reasoning: false`` hides them.

Example::

    >>> body = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9}
    >>> CHAT.shape(body, whole=80).max_tokens
    9
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvtax.delivery.dialects.base import Shape, count_of, limit_of, scanned, size_of
from kvtax.delivery.dialects.openai import LIMIT_KEYS, READ_KEYS, OpenAIDialect
from kvtax.delivery.lax import lax_bool

__all__ = ["CHAT", "Chat", "text_of"]


class Chat(OpenAIDialect):
    """``/v1/chat/completions``; see the module docstring."""

    name = "chat"
    routes = ("/v1/chat/completions",)
    read_keys = READ_KEYS | {"messages", "include_reasoning"}
    prompt_keys = frozenset({"messages"})
    ids_since = (0, 12, 0)
    limit_keys = LIMIT_KEYS  # ChatCompletionRequest.to_sampling_params's order

    def ids_hidden(self, payload: dict[str, Any]) -> bool:
        return lax_bool(payload.get("include_reasoning"), True) is not True

    def shape(self, payload: Any, *, whole: int) -> Shape:
        if not isinstance(payload, dict):
            return Shape(0, None)
        messages = payload.get("messages")
        if isinstance(messages, msgspec.Raw):  # too long to decode: one scan measures it
            size, media = scanned(messages)
            return Shape(
                size, limit_of(payload, self.limit_keys), media, 1, count_of(payload.get("n"))
            )
        prompt, media = text_of(messages)
        return Shape(
            size_of(prompt, whole),
            limit_of(payload, self.limit_keys),
            media,
            1,  # a chat's messages are one prompt
            count_of(payload.get("n")),
        )


def text_of(messages: Any) -> tuple[Any, bool]:
    """Chat messages with each list of content parts cut down to the parts' text, and whether
    any part was left out. Messages left raw stay so (:func:`~kvtax.delivery.dialects.base.
    size_of` measures them by a scan), their media found by it."""
    if isinstance(messages, msgspec.Raw):
        return messages, scanned(messages)[1]
    if not isinstance(messages, list):
        return messages, False
    kept: list[Any] = []
    media = False
    for message in messages:
        parts = message.get("content") if isinstance(message, dict) else None
        if not isinstance(parts, list):
            kept.append(message)
            continue
        texts = [part["text"] for part in parts if _is_text(part)]
        media = media or len(texts) < len(parts)
        kept.append({**message, "content": texts})
    return kept, media


def _is_text(part: Any) -> bool:
    return isinstance(part, dict) and isinstance(part.get("text"), str)


CHAT = Chat()
