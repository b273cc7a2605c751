"""The OpenAI completions API, ``/v1/completions``: a ``prompt`` in, text out. Pure, no I/O.

A ``prompt`` is a string, one list of token ids, or a list of either: vLLM serves each item of
a list as a request of its own, under the same ``max_tokens`` and ``n`` (:attr:`Shape.prompts`).
A request without ``max_tokens`` (or with a null one) is limited to :data:`DEFAULT_MAX_TOKENS`,
the API's own default; other APIs' default is the model's room.
Its streams carry every token's id from vLLM 0.10.2, except with ``echo``, which puts the
prompt's ids in the first event and drops the echoed text the client would see.

Example::

    >>> COMPLETIONS.shape({"prompt": ["a", "b"], "max_tokens": "7"}, whole=40)
    Shape(prompt_bytes=9, max_tokens=7, media=False, prompts=2, n=1)
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from kvtax.delivery.dialects.base import MAX_COUNT, Shape, count_of, limit_of, size_of
from kvtax.delivery.dialects.openai import READ_KEYS, OpenAIDialect
from kvtax.delivery.lax import lax_bool

__all__ = ["COMPLETIONS", "DEFAULT_MAX_TOKENS", "Completions"]

# CompletionRequest's max_tokens default, in every vLLM since 0.6; vLLM reads a null one as it
# too (vLLM PR 45491; before it, a null ran to the model's room and then failed with a 500).
DEFAULT_MAX_TOKENS = 16


class Completions(OpenAIDialect):
    """``/v1/completions``; see the module docstring."""

    name = "completions"
    routes = ("/v1/completions",)
    read_keys = READ_KEYS | {"prompt", "echo"}
    prompt_keys = frozenset({"prompt"})
    ids_since = (0, 10, 2)
    limit_keys = ("max_tokens",)  # CompletionRequest has no other

    def ids_hidden(self, payload: dict[str, Any]) -> bool:
        return lax_bool(payload.get("echo"), False) is not False

    def shape(self, payload: Any, *, whole: int) -> Shape:
        if not isinstance(payload, dict):
            return Shape(0, None)
        prompt = payload.get("prompt", "")
        if isinstance(prompt, msgspec.Raw):  # too long to decode: its bytes, scanned
            # A string's quotes are no prompt; its escapes count as written (a little more).
            size = len(prompt) - 2 if bytes(memoryview(prompt)[:1]) == b'"' else len(prompt)
            n = count_of(payload.get("n"))
            return Shape(size, self._limit(payload), False, _raw_prompts(prompt), n)
        return Shape(
            size_of(prompt, whole),
            self._limit(payload),
            False,
            _prompts_in(prompt),
            count_of(payload.get("n")),
        )

    def _limit(self, payload: dict[str, Any]) -> int | None:
        """The output limit vLLM applies: the API's default when none (or null) is stated."""
        if payload.get("max_tokens") is None:
            return DEFAULT_MAX_TOKENS
        return limit_of(payload, self.limit_keys)


def _prompts_in(prompt: Any) -> int:
    """The prompts of a ``prompt``: a string or one list of token ids is one; a list of
    strings or of token-id lists is one per item."""
    if not isinstance(prompt, list) or not prompt:
        return 1
    if all(isinstance(item, int) and not isinstance(item, bool) for item in prompt):
        return 1
    return min(len(prompt), MAX_COUNT)


_FIRST_ITEM = re.compile(rb"\[\s*(.)", re.DOTALL)


def _raw_prompts(raw: msgspec.Raw) -> int:
    """The prompts of a ``prompt`` left raw, counted by a scan: a list of token-id lists has
    one ``[`` per item, a list of strings two unescaped quotes per item (a string that ends in
    an escaped backslash counts one more: a larger footprint, never a smaller one). Only those
    two are copied, to be counted (a memoryview has no count); a string or a list of ids is one
    prompt, known from its first bytes."""
    first = _FIRST_ITEM.match(bytes(memoryview(raw)[:_HEAD]).lstrip())
    if first is None or first[1] not in (b"[", b'"'):
        return 1  # a string, token ids, or no list vLLM serves
    data = bytes(raw)
    if first[1] == b"[":
        return max(1, min(data.count(b"[") - 1, MAX_COUNT))
    quotes = data.count(b'"') - data.count(b'\\"')
    return max(1, min(quotes // 2, MAX_COUNT))


# Bytes of a raw prompt read to tell its shape (past any whitespace before its first item).
_HEAD = 4096


COMPLETIONS = Completions()
