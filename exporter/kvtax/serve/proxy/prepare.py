"""An accounted request's body, read once: its model, its usage wish and the bytes for vLLM.

:func:`prepare` reads the body's JSON once. It learns the model and, for a stream, asks vLLM for
usage on every chunk (:func:`kvtax.delivery.sse.with_usage`); any other body goes to vLLM byte
for byte. The JSON it read stays with it (:class:`Prepared`) for the gate, which sizes
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

from kvtax.delivery.lax import lax_bool
from kvtax.delivery.ledger import OTHER
from kvtax.delivery.sse import UsageWish, with_usage

__all__ = ["UNNAMED", "Prepared", "prepare"]

# The model of a request vLLM refuses before it picks a model: counted as ``other``.
UNNAMED = OTHER


@dataclass(frozen=True, slots=True)
class Prepared:
    """An accounted request, its body read once: the model, the usage wish, the bytes for
    vLLM and the JSON they hold (``payload``; None when the body is not JSON), which the
    gate sizes without reading the body again."""

    # None: the client named no model, and vLLM's default model serves it.
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
    Fields are read as vLLM reads them (:mod:`kvtax.delivery.lax`): ``"stream": "true"``, ``1``
    or ``"yes"`` stream. The model is None when the client named none (vLLM serves its default
    model); :data:`UNNAMED` when ``model`` is there but not a name vLLM accepts (vLLM refuses the
    request), or the body is not a JSON object.
    """
    try:
        payload, lenient = _loads(body)
    except ValueError:
        return Prepared(UNNAMED, None, body)
    if not isinstance(payload, dict):
        return Prepared(UNNAMED, None, body, payload, lenient)
    name = _model(payload.get("model"))
    if lax_bool(payload.get("stream"), False) is not True:
        return Prepared(name, None, body, payload, lenient)
    asked = with_usage(payload)
    if asked is None:  # options vLLM refuses: it answers 400, kvtax adds nothing
        return Prepared(name, None, body, payload, lenient)
    wish, upstream_payload = asked
    if upstream_payload is payload:  # the client asked for all of it already
        return Prepared(name, wish, body, payload, lenient)
    rewritten = _dumps(upstream_payload, lenient=lenient)
    if rewritten is None:  # too deep to write back: sent as it came, its usage not asked for
        return Prepared(name, None, body, payload, lenient)
    return Prepared(name, wish, rewritten, upstream_payload, lenient)


def _model(value: Any) -> str | None:
    """The served name a request's ``model`` means: None for vLLM's default model (absent,
    null or empty: vLLM's ``if not model_name``), else the name, or :data:`UNNAMED` for a value
    vLLM's ``str | None`` field refuses (a number, a list: pydantic does not make them str)."""
    if value is None or value == "":
        return None
    return value if isinstance(value, str) else UNNAMED
