"""vLLM's batch chat API, ``/v1/chat/completions/batch``: several conversations in one request,
one choice each. Pure, no I/O.

``messages`` is a list of conversations; vLLM runs each as a request of its own under the same
limit (``max_completion_tokens`` if set, else ``max_tokens``: not chat's ``or``, so a 0 stays
0), and answers them together, never streamed (vLLM refuses ``stream``), with their usage
summed. So the gate sizes one prompt per conversation, and the answer is counted by its usage
as it passes, like any answer that is not a stream.

Example::

    >>> BATCH_CHAT.shape({"messages": [[{"role": "user", "content": "a"}],
    ...                                [{"role": "user", "content": "b"}]],
    ...                   "max_tokens": 8}, whole=90).prompts
    2
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from kvtax.delivery.dialects.base import MAX_COUNT, Shape, bounded, count_of, scanned, size_of
from kvtax.delivery.dialects.chat import Chat, text_of

__all__ = ["BATCH_CHAT", "BatchChat"]


class BatchChat(Chat):
    """``/v1/chat/completions/batch``; see the module docstring."""

    name = "chat_batch"
    routes = ("/v1/chat/completions/batch",)

    def streams(self, payload: dict[str, Any]) -> bool:
        return False  # vLLM refuses a batch stream with its own 400

    def shape(self, payload: Any, *, whole: int) -> Shape:
        if not isinstance(payload, dict):
            return Shape(0, None)
        conversations = payload.get("messages")
        if isinstance(conversations, msgspec.Raw):
            return self._raw_shape(conversations, payload)
        conversations = conversations if isinstance(conversations, list) else []
        texts, media = [], False
        for conversation in conversations:
            text, left_out = text_of(conversation)
            texts.append(text)
            media = media or left_out
        return Shape(
            size_of(texts, whole),
            _limit(payload),
            media,
            max(1, min(len(conversations), MAX_COUNT)),
            count_of(payload.get("n")),
        )

    def _raw_shape(self, conversations: msgspec.Raw, payload: dict[str, Any]) -> Shape:
        """The shape of conversations left raw, measured by a scan: one conversation more
        than the ``],[`` between two of them (a message's lists are followed by a key or a
        brace, never by another list)."""
        size, media = scanned(conversations)
        count = len(_BETWEEN.findall(memoryview(conversations))) + 1
        n = count_of(payload.get("n"))
        return Shape(size, _limit(payload), media, min(count, MAX_COUNT), n)


_BETWEEN = re.compile(rb"\]\s*,\s*\[")


def _limit(payload: dict[str, Any]) -> int | None:
    stated = payload.get("max_completion_tokens")
    return bounded(stated if stated is not None else payload.get("max_tokens"))


BATCH_CHAT = BatchChat()
