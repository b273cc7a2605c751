"""What the OpenAI dialects share: completions and chat completions. Pure, no I/O.

Both stream OpenAI chunks (``data: {...}`` events, ``data: [DONE]`` at the end), take
``stream_options`` and ``return_token_ids``, and answer errors as ``{"error": {...}}``. So both
are counted by one :class:`~kvtax.delivery.sse.StreamRewriter` and asked for usage by one rule
(:func:`~kvtax.delivery.asks.with_usage`); what differs is the body (a ``prompt`` or
``messages``), the keys that limit the output, and when vLLM's streams began to carry every
token's id (:attr:`OpenAIDialect.ids_since`) and which fields hide them
(:meth:`OpenAIDialect.ids_hidden`).

Example::

    class Completions(OpenAIDialect):
        ids_since = (0, 10, 2)
        ...
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, ClassVar

from kvtax.delivery.asks import Scheme, UsageWish, release_of, with_usage
from kvtax.delivery.dialects.base import Dialect, StreamCounter, lowered
from kvtax.delivery.lax import lax_bool
from kvtax.delivery.sse import Fingerprint, HoldBudget, StreamRewriter

__all__ = ["LIMIT_KEYS", "READ_KEYS", "OpenAIDialect"]

# The keys that limit an OpenAI request's output: vLLM's chat API reads the first, then the
# second; its completions API the second only. A clamp lowers every one a body has.
LIMIT_KEYS = ("max_completion_tokens", "max_tokens")
# The fields both OpenAI dialects read: the model, the stream and its usage options, the
# output's limits and ``n``.
READ_KEYS = frozenset({"model", "stream", "stream_options", "return_token_ids", "n", *LIMIT_KEYS})


class OpenAIDialect(Dialect):
    """An OpenAI API: usage asked for by ``stream_options``, events counted by their ids where
    vLLM gives them (:attr:`ids_since` on, unless :meth:`ids_hidden`), by continuous usage
    elsewhere. See :mod:`kvtax.delivery.asks` for the schemes and their cost to vLLM."""

    #: The first vLLM release whose streams of this API carry every token's id.
    ids_since: ClassVar[tuple[int, int, int]]
    #: The keys that limit the output, in the order this API of vLLM's reads them.
    limit_keys: ClassVar[tuple[str, ...]]

    @abstractmethod
    def ids_hidden(self, payload: dict[str, Any]) -> bool:
        """A field of this request makes vLLM drop or change the ids it would stream."""

    def scheme(
        self, payload: dict[str, Any], *, version: str | None, ids_missing: bool = False
    ) -> Scheme:
        """Token ids where this vLLM gives every one of them, else continuous usage: a vLLM
        before :attr:`ids_since`, one whose streams came without ids (``ids_missing``), an
        unknown ``version``, a client that pays for continuous usage itself, and a request
        whose fields hide the ids (:meth:`ids_hidden`)."""
        release = release_of(version)
        if ids_missing or release is None or release < self.ids_since:
            return "usage"
        options = payload.get("stream_options")
        if isinstance(options, dict) and lax_bool(options.get("continuous_usage_stats"), False):
            return "usage"  # the client pays for continuous usage anyway: read it
        return "usage" if self.ids_hidden(payload) else "token_ids"

    def asks(
        self, payload: dict[str, Any], scheme: Scheme
    ) -> tuple[UsageWish, dict[str, Any]] | None:
        return with_usage(payload, scheme)

    def limit_fields(self, payload: dict[str, Any], limit: int) -> dict[str, Any]:
        """Every limit key the body has, lowered (whichever one vLLM reads is then within the
        limit); for one without any, ``max_tokens``, which every vLLM reads on both APIs."""
        present = [key for key in LIMIT_KEYS if key in payload] or ["max_tokens"]
        return {key: lowered(payload.get(key), limit) for key in present}

    def counter(
        self,
        wish: UsageWish,
        scheme: Scheme,
        *,
        budget: HoldBudget | None = None,
        fingerprints: Fingerprint | None = None,
    ) -> StreamCounter:
        return StreamRewriter(wish, scheme=scheme, budget=budget, fingerprints=fingerprints)
