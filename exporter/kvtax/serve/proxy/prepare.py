"""An accounted request's body, read once: its model, its usage wish and the bytes for vLLM.

:func:`prepare` reads the body's JSON once. It learns the model and, for a stream, asks vLLM for
usage on every chunk (:func:`kvtax.delivery.sse.with_usage`); any other body goes to vLLM byte
for byte. The JSON it read stays with it (:class:`Prepared`) for the admission gate, which sizes
it and may clamp its completion limit without parsing it again. Pure: no I/O.

Example::

    prepared = prepare(body)
    prepared.model, prepared.wish, prepared.body
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass
from typing import Any

import orjson

from kvtax.delivery.sse import UsageWish, with_usage

__all__ = ["Prepared", "prepare"]


@dataclass(frozen=True, slots=True)
class Prepared:
    """An accounted request, its body read once: the model, the usage wish, the bytes for
    vLLM and the JSON they hold (``payload``; None when the body is not JSON), which the
    admission gate sizes without reading the body again."""

    model: str | None
    wish: UsageWish | None
    body: bytes
    payload: Any = None
    # Read by the standard parser: written back by it, so that vLLM reads the same values.
    lenient: bool = False

    def rewritten(self, payload: Any) -> bytes | None:
        """``payload`` (this request's, changed) as a body for vLLM; None if it cannot be
        written."""
        return _dumps(payload, lenient=self.lenient)


_LONG_DIGITS = re.compile(rb"[0-9]{19}")


def _loads(body: bytes) -> tuple[Any, bool]:
    """A request body as JSON, and whether it took the standard parser: orjson, or Python's
    for what orjson refuses but Python's (vLLM's) accepts (NaN, Infinity, lone surrogates), so
    such a body is still understood. ValueError when neither reads it.

    A body with a run of 19 or more digits goes to Python's parser first: orjson (3.10+) reads
    an integer past 64 bits as a float, and writing the body back would hand vLLM ``1e+29``
    for the client's exact integer. Such runs are rare, and the search is one C-level scan.
    """
    if _LONG_DIGITS.search(body) is None:
        try:
            return orjson.loads(body), False
        except orjson.JSONDecodeError:
            pass
    try:
        return json.loads(body), True
    except RecursionError as exc:  # nested past what either parser follows
        raise ValueError("nested too deeply") from exc


def _dumps(payload: Any, *, lenient: bool) -> bytes | None:
    """``payload`` as JSON: orjson for what it read; else the standard encoder, ASCII-only, which
    writes NaN, Infinity and lone surrogates (escaped) as Python's parser reads them, and what
    orjson will not nest (past 254 levels). None when neither can write it."""
    if not lenient:
        with contextlib.suppress(orjson.JSONEncodeError):
            return orjson.dumps(payload)
    try:
        return json.dumps(payload).encode()
    except (ValueError, RecursionError):
        return None


def prepare(body: bytes) -> Prepared:
    """An accounted request as vLLM should get it.

    A stream's body is rewritten to ask vLLM for usage (the wish says what the client asked
    for); any other body goes as it came, and vLLM answers the 400 for one that is not JSON.
    """
    try:
        payload, lenient = _loads(body)
    except ValueError:
        return Prepared(None, None, body)
    if not isinstance(payload, dict):
        return Prepared(None, None, body, payload, lenient)
    model = payload.get("model")
    name = model if isinstance(model, str) else None
    if payload.get("stream") is not True:
        return Prepared(name, None, body, payload, lenient)
    wish, upstream_payload = with_usage(payload)
    rewritten = _dumps(upstream_payload, lenient=lenient)
    if rewritten is None:  # too deep to write back: sent as it came, its usage not asked for
        return Prepared(name, None, body, payload, lenient)
    return Prepared(name, wish, rewritten, upstream_payload, lenient)
