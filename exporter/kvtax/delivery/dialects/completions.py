"""The OpenAI completions API, ``/v1/completions``: a ``prompt`` in, text out. Pure, no I/O.

A ``prompt`` is a string, one list of token ids, or a list of either: vLLM serves each item of
a list as a request of its own, under the same ``max_tokens`` and ``n`` (:attr:`Shape.prompts`).
Its streams carry every token's id from vLLM 0.10.2, except with ``echo``, which puts the
prompt's ids in the first event and drops the echoed text the client would see.

Example::

    >>> COMPLETIONS.shape({"prompt": ["a", "b"], "max_tokens": "7"}, whole=40)
    Shape(prompt_bytes=9, max_tokens=7, media=False, prompts=2, n=1)
"""

from __future__ import annotations

from typing import Any

from kvtax.delivery.dialects.base import MAX_COUNT, Shape, count_of, limit_of, size_of
from kvtax.delivery.dialects.openai import READ_KEYS, OpenAIDialect
from kvtax.delivery.lax import lax_bool

__all__ = ["COMPLETIONS", "Completions"]


class Completions(OpenAIDialect):
    """``/v1/completions``; see the module docstring."""

    name = "completions"
    routes = ("/v1/completions",)
    read_keys = READ_KEYS | {"prompt", "echo"}
    ids_since = (0, 10, 2)
    limit_keys = ("max_tokens",)  # CompletionRequest has no other

    def ids_hidden(self, payload: dict[str, Any]) -> bool:
        return lax_bool(payload.get("echo"), False) is not False

    def shape(self, payload: Any, *, whole: int) -> Shape:
        if not isinstance(payload, dict):
            return Shape(0, None)
        prompt = payload.get("prompt", "")
        return Shape(
            size_of(prompt, whole),
            limit_of(payload, self.limit_keys),
            False,
            _prompts_in(prompt),
            count_of(payload.get("n")),
        )


def _prompts_in(prompt: Any) -> int:
    """The prompts of a ``prompt``: a string or one list of token ids is one; a list of
    strings or of token-id lists is one per item."""
    if not isinstance(prompt, list) or not prompt:
        return 1
    if all(isinstance(item, int) and not isinstance(item, bool) for item in prompt):
        return 1
    return min(len(prompt), MAX_COUNT)


COMPLETIONS = Completions()
