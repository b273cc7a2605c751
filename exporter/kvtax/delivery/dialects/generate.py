"""vLLM's tokens-in, tokens-out API, ``/inference/v1/generate`` (``--enable-scale-out``): what
RL trainers and disaggregated serving call. Pure, no I/O.

The request is token ids and a ``sampling_params`` object (``max_tokens`` and ``n`` in it); the
answer is token ids, so every event of a stream carries its ids (the API's output, never cut)
and counts exactly by them. kvtax asks only for the final usage chunk
(``stream_options.include_usage``), the exact total, and cuts it again when the client did not
ask. Its chunks are not OpenAI chat chunks and carry no ``system_fingerprint``: the counter
never stamps one. Errors take OpenAI's shape, as vLLM's own do here.

Example::

    >>> GENERATE.shape({"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 8, "n": 2}},
    ...                whole=60)
    Shape(prompt_bytes=7, max_tokens=8, media=False, prompts=1, n=2)
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvtax.delivery.asks import Scheme, UsageWish
from kvtax.delivery.dialects.base import (
    Dialect,
    Shape,
    StreamCounter,
    count_of,
    limit_of,
    lowered,
    size_of,
)
from kvtax.delivery.lax import REFUSED, lax_bool
from kvtax.delivery.sse import Fingerprint, HoldBudget, StreamRewriter

__all__ = ["GENERATE", "Generate"]


class Generate(Dialect):
    """``/inference/v1/generate``; see the module docstring."""

    name = "generate"
    routes = ("/inference/v1/generate",)
    read_keys = frozenset({"model", "stream", "stream_options", "token_ids", "sampling_params"})
    prompt_keys = frozenset({"token_ids"})

    def scheme(
        self, payload: dict[str, Any], *, version: str | None, ids_missing: bool = False
    ) -> Scheme:
        return "token_ids"  # the ids are the answer itself, on every version that serves it

    def asks(
        self, payload: dict[str, Any], scheme: Scheme
    ) -> tuple[UsageWish, dict[str, Any]] | None:
        """The final usage chunk, if the client did not ask for it; options vLLM refuses are
        left for vLLM to answer (None)."""
        options = payload.get("stream_options")
        if options is None:
            options = {}
        elif not isinstance(options, dict):
            return None
        include = lax_bool(options.get("include_usage"), False)
        continuous = lax_bool(options.get("continuous_usage_stats"), False)
        if REFUSED in (include, continuous):
            return None
        wish = UsageWish(bool(include), bool(include) and bool(continuous), token_ids=True)
        if include:
            return wish, {}
        return wish, {"stream_options": {**options, "include_usage": True}}

    def shape(self, payload: Any, *, whole: int) -> Shape:
        if not isinstance(payload, dict):
            return Shape(0, None)
        params = payload.get("sampling_params")
        params = params if isinstance(params, dict) else {}
        return Shape(
            size_of(payload.get("token_ids", []), whole),
            limit_of(params, ("max_tokens",)),
            False,
            1,
            count_of(params.get("n")),
        )

    def limit_fields(self, payload: dict[str, Any], limit: int) -> dict[str, Any] | None:
        params = payload.get("sampling_params")
        if isinstance(params, msgspec.Raw):
            return None  # too long to read: written anew, the client's parameters would be lost
        params = params if isinstance(params, dict) else {}
        return {
            "sampling_params": {**params, "max_tokens": lowered(params.get("max_tokens"), limit)}
        }

    def counter(
        self,
        wish: UsageWish,
        scheme: Scheme,
        *,
        budget: HoldBudget | None = None,
        fingerprints: Fingerprint | None = None,
    ) -> StreamCounter:
        # A fingerprint of its own, never learnt: these chunks carry none to stamp back.
        return StreamRewriter(wish, scheme="token_ids", budget=budget, fingerprints=Fingerprint())


GENERATE = Generate()
