"""SageMaker's route, ``/invocations``: a chat or a completions body, on by default. Pure.

vLLM tries the body as a chat request first, then as a completions request, and runs the
handler of the first that validates (``vllm/entrypoints/serve/sagemaker/api_router.py``),
streams included. kvtax reads the whole body the same way: a body with a ``messages`` list is
chat, any other completions (:meth:`Invocations.resolve`), and from there the request is that
dialect's in everything but its API's name, which stays ``invocations``.

Example::

    >>> INVOCATIONS.resolve({"messages": [{"role": "user", "content": "hi"}]}).name
    'chat'
    >>> INVOCATIONS.resolve({"prompt": "hi"}).name
    'completions'
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvtax.delivery.asks import Scheme, UsageWish
from kvtax.delivery.dialects.base import Dialect, Shape, StreamCounter
from kvtax.delivery.dialects.chat import CHAT
from kvtax.delivery.dialects.completions import COMPLETIONS
from kvtax.delivery.sse import Fingerprint, HoldBudget

__all__ = ["INVOCATIONS", "Invocations"]


class Invocations(Dialect):
    """``/invocations``; see the module docstring. Each question is its resolved dialect's."""

    name = "invocations"
    routes = ("/invocations",)
    read_keys = CHAT.read_keys | COMPLETIONS.read_keys
    prompt_keys = CHAT.prompt_keys | COMPLETIONS.prompt_keys

    def resolve(self, payload: dict[str, Any]) -> Dialect:
        messages = payload.get("messages")
        if isinstance(messages, msgspec.Raw):  # a list too long to decode is a list all the same
            return CHAT if bytes(memoryview(messages)[:1]) == b"[" else COMPLETIONS
        return CHAT if isinstance(messages, list) else COMPLETIONS

    def scheme(
        self, payload: dict[str, Any], *, version: str | None, ids_missing: bool = False
    ) -> Scheme:
        return self.resolve(payload).scheme(payload, version=version, ids_missing=ids_missing)

    def asks(
        self, payload: dict[str, Any], scheme: Scheme
    ) -> tuple[UsageWish, dict[str, Any]] | None:
        return self.resolve(payload).asks(payload, scheme)

    def shape(self, payload: Any, *, whole: int) -> Shape:
        if not isinstance(payload, dict):
            return Shape(0, None)
        return self.resolve(payload).shape(payload, whole=whole)

    def limit_fields(self, payload: dict[str, Any], limit: int) -> dict[str, Any] | None:
        return self.resolve(payload).limit_fields(payload, limit)

    def counter(
        self,
        wish: UsageWish,
        scheme: Scheme,
        *,
        budget: HoldBudget | None = None,
        fingerprints: Fingerprint | None = None,
    ) -> StreamCounter:
        # Both of its dialects stream OpenAI chunks: one counter reads either.
        return CHAT.counter(wish, scheme, budget=budget, fingerprints=fingerprints)


INVOCATIONS = Invocations()
