"""vLLM's speech-to-text APIs, ``/v1/audio/transcriptions`` and ``/v1/audio/translations``: an
audio upload in, text out. Pure, no I/O.

The request is a multipart form, its audio tens of MiB: the proxy never holds it whole. It reads
the form's small fields as the upload passes on to vLLM (:mod:`kvtax.serve.proxy.form`) and
writes the fields it sets as parts of their own before the form's closing delimiter, so
:attr:`Dialect.form` is set and every field's value is the form's text. Starlette, which reads
the form for vLLM, keeps the last of two fields of one name, so kvtax's come last.

A stream carries no token ids, but vLLM counts every token it generated in its usage, those of
deltas it sent empty (and skipped) included: kvtax asks for the usage of every chunk
(``stream_include_usage`` and ``stream_continuous_usage_stats``, flattened into the form) and
counts by it, and cuts what the client did not ask for. vLLM refuses these options on a request
that does not stream, so they are set on streams only. Errors take OpenAI's shape.

The prompt is audio, which the gate cannot size by bytes: its shape is no text bytes and
``media``, and its output limit is ``max_completion_tokens``, which a clamp lowers.

Example::

    >>> TRANSCRIPTIONS.asks({"stream": "true"}, "usage")[1]
    {'stream_include_usage': 'true', 'stream_continuous_usage_stats': 'true'}
"""

from __future__ import annotations

from typing import Any, ClassVar

from kvtax.delivery.asks import Scheme, UsageWish
from kvtax.delivery.dialects.base import Dialect, Shape, StreamCounter, bounded, lowered
from kvtax.delivery.lax import REFUSED, lax_bool
from kvtax.delivery.sse import Fingerprint, HoldBudget, StreamRewriter

__all__ = ["TRANSCRIPTIONS", "TRANSLATIONS", "SpeechToText"]

_INCLUDE, _CONTINUOUS = "stream_include_usage", "stream_continuous_usage_stats"


class SpeechToText(Dialect):
    """An audio upload's API; see the module docstring."""

    form: ClassVar[bool] = True
    read_keys = frozenset({"model", "stream", _INCLUDE, _CONTINUOUS, "max_completion_tokens"})

    def scheme(
        self, payload: dict[str, Any], *, version: str | None, ids_missing: bool = False
    ) -> Scheme:
        return "usage"  # no ids in these streams: every chunk's usage counts them

    def asks(
        self, payload: dict[str, Any], scheme: Scheme
    ) -> tuple[UsageWish, dict[str, Any]] | None:
        include = lax_bool(payload.get(_INCLUDE), False)
        continuous = lax_bool(payload.get(_CONTINUOUS), False)
        if include is REFUSED or continuous is REFUSED:
            return None  # vLLM answers its 422
        # vLLM sends continuous usage only with the final usage asked for too.
        wish = UsageWish(include_usage=bool(include), continuous=bool(include and continuous))
        if include and continuous:
            return wish, {}
        return wish, {_INCLUDE: "true", _CONTINUOUS: "true"}

    def shape(self, payload: Any, *, whole: int) -> Shape:
        if not isinstance(payload, dict):
            return Shape(0, None)
        return Shape(0, bounded(payload.get("max_completion_tokens")), media=True)

    def limit_fields(self, payload: dict[str, Any], limit: int) -> dict[str, Any] | None:
        return {"max_completion_tokens": str(lowered(payload.get("max_completion_tokens"), limit))}

    def counter(
        self,
        wish: UsageWish,
        scheme: Scheme,
        *,
        budget: HoldBudget | None = None,
        fingerprints: Fingerprint | None = None,
    ) -> StreamCounter:
        # A fingerprint of its own, never learnt: these chunks carry none to stamp back.
        return StreamRewriter(wish, scheme="usage", budget=budget, fingerprints=Fingerprint())


class Transcriptions(SpeechToText):
    name = "transcription"
    routes = ("/v1/audio/transcriptions",)


class Translations(SpeechToText):
    name = "translation"
    routes = ("/v1/audio/translations",)


TRANSCRIPTIONS = Transcriptions()
TRANSLATIONS = Translations()
