"""An accounted request's body, read once: its model, its usage wish and the bytes for vLLM.

:func:`prepare` reads the body's top level once, field by field (msgspec, into raw JSON
values): each field kvtax acts on is parsed, and the chat messages' media parts (base64 images
and audio, tens of MiB) are skipped unread, so a 12 MiB request costs a scan of its bytes, not
their decoding. It learns the model and, for a stream, asks vLLM for what counts each event's
tokens, by the scheme that costs vLLM least where it is exact (:mod:`kvtax.delivery.asks`:
each event's ids and the final usage chunk, or continuous usage). A body to change (the usage
options, the gate's clamp) is written anew at its top level only
(:meth:`Prepared.with_fields`): every other value goes on as the client's own bytes. A body
msgspec does not read (NaN, a top level that is not an object) is read whole by the standard
parsers instead; any body kvtax cannot read goes to vLLM byte for byte, and vLLM answers it.

The JSON it read stays with it (:class:`Prepared`) for the gate, which sizes it and may clamp
its completion limit without parsing it again. Pure: no I/O.

Example::

    prepared = prepare(body, COMPLETIONS)
    prepared.model, prepared.wish, prepared.body
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import orjson

from kvtax.delivery.asks import Scheme, UsageWish
from kvtax.delivery.dialects import Dialect
from kvtax.delivery.ledger import OTHER

__all__ = ["UNNAMED", "Prepared", "prepare"]

# The model of a request vLLM refuses before it picks a model: counted as ``other``.
UNNAMED = OTHER
_TOP = msgspec.json.Decoder(dict[str, msgspec.Raw])
_OBJECTS = msgspec.json.Decoder(list[dict[str, msgspec.Raw]])


@dataclass(frozen=True, slots=True)
class Prepared:
    """An accounted request, its body read once: the model, the usage wish, the bytes for
    vLLM and the JSON they hold (``payload``; None when the body is not JSON; a chat message's
    media parts are empty objects in it, their data unread), which the gate sizes without
    reading the body again."""

    # None: the client named no model, and vLLM's default model serves it.
    model: str | None
    # A stream kvtax counts: what its client asked for (None: not a stream kvtax counts).
    wish: UsageWish | None
    body: bytes
    payload: Any = None
    # Read by the standard parser: written back by it, so that vLLM reads the same values.
    lenient: bool = False
    # The body's top level as raw JSON values, in order (None: read whole). ``payload`` then
    # holds only the fields kvtax reads.
    fields: Mapping[str, msgspec.Raw] | None = None
    # How the stream's tokens are counted (kvtax.delivery.asks), when ``wish`` is set.
    scheme: Scheme = "usage"
    # The dialect the request is, its body read (a route of several APIs resolves to one);
    # None: the body is no JSON object, and the route's dialect stands.
    dialect: Dialect | None = None

    def with_fields(self, changed: Mapping[str, Any]) -> bytes | None:
        """This request's body with the top-level ``changed`` fields set (added at the end when
        new); None if it cannot be written."""
        if self.fields is None:
            return _dumps({**self.payload, **changed}, lenient=self.lenient)
        return _rewritten(self.fields, changed)


_LONG_DIGITS = re.compile(rb"[0-9]{19}")


def _loads(body: bytes | msgspec.Raw) -> tuple[Any, bool]:
    """A request body as JSON, and whether it took the standard parser: orjson, or Python's
    for what orjson refuses but Python's (vLLM's) accepts (NaN, Infinity, lone surrogates), so
    such a body is still understood. ValueError when neither reads it.

    A body with a run of 19 or more digits goes to Python's parser first: orjson (3.10+) reads
    an integer past 64 bits as a float, and writing the body back would hand vLLM ``1e+29``
    for the client's exact integer. Such runs are rare, and the search is one C-level scan.
    """
    data = bytes(body) if isinstance(body, msgspec.Raw) else body
    if _LONG_DIGITS.search(data) is None:
        try:
            return orjson.loads(data), False
        except orjson.JSONDecodeError:
            pass
    try:
        return json.loads(data), True
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


def _rewritten(fields: Mapping[str, msgspec.Raw], changed: Mapping[str, Any]) -> bytes | None:
    """The top level written anew from its raw values, ``changed`` ones replaced or added.
    Only the changed values are encoded; the rest are the client's bytes. (A key the client
    sent twice is written once, with the last value: the one vLLM's parser keeps.)"""
    parts: list[bytes | memoryview] = []
    try:
        for key, raw in fields.items():
            value = changed.get(key, raw) if key in changed else raw
            encoded = memoryview(raw) if value is raw else _dumps(value, lenient=False)
            if encoded is None:
                return None
            parts += (b"," if parts else b"", orjson.dumps(key), b":", encoded)
        for key, value in changed.items():
            if key not in fields:
                encoded = _dumps(value, lenient=False)
                if encoded is None:
                    return None
                parts += (b"," if parts else b"", orjson.dumps(key), b":", encoded)
    except orjson.JSONEncodeError:  # a key with a lone surrogate
        return None
    return b"{" + b"".join(parts) + b"}"


def _light_messages(raw: msgspec.Raw) -> Any:
    """Chat messages as the gate reads them, with each media part an empty object: its data
    (base64, tens of MiB) is never decoded. Messages of another shape are read whole."""
    try:
        messages = _OBJECTS.decode(raw)  # RecursionError cannot come: the top level read it
        light: list[dict[str, Any]] = []
        for message in messages:
            kept: dict[str, Any] = {}
            for key, value in message.items():
                if key == "content" and bytes(memoryview(value)[:1]) == b"[":
                    kept[key] = [_light_part(part) for part in _OBJECTS.decode(value)]
                else:
                    kept[key] = _loads(value)[0]
            light.append(kept)
    except (msgspec.DecodeError, ValueError):
        return _loads(raw)[0]
    return light


def _light_part(part: Mapping[str, msgspec.Raw]) -> dict[str, Any]:
    """A content part: its text if it has one (the gate counts text), else nothing of it."""
    text = part.get("text")
    if text is None:
        return {}
    return {"text": _loads(text)[0]}


def _read(body: bytes, keys: frozenset[str]) -> tuple[Any, bool, Mapping[str, msgspec.Raw] | None]:
    """The body's JSON, whether the standard parser read it, and its raw top level (None when
    read whole); of a top level read field by field, only ``keys`` are decoded. ValueError when
    nothing reads it."""
    try:
        fields = _TOP.decode(body)
    except (msgspec.DecodeError, RecursionError):  # not for msgspec (NaN, say), or too deep
        payload, lenient = _loads(body)
        return payload, lenient, None
    try:
        # Only the fields kvtax acts on are decoded: a body of a million other keys costs a
        # scan, not a million decodes.
        payload = {
            key: _light_messages(raw) if key == "messages" else _loads(raw)[0]
            for key, raw in fields.items()
            if key in keys
        }
    except ValueError:
        payload, lenient = _loads(body)
        return payload, lenient, None
    return payload, False, fields


def prepare(
    body: bytes, dialect: Dialect, *, version: str | None = None, ids_missing: bool = False
) -> Prepared:
    """An accounted request of ``dialect``'s API as vLLM should get it.

    A stream's body is rewritten to ask vLLM for what counts it (the dialect picks the scheme
    from vLLM's ``version``, whether this vLLM's streams came without ids, ``ids_missing``,
    and the request's fields; the wish says what the client asked for); any other body goes
    as it came, and vLLM answers the 400 for one that is not JSON.
    Fields are read as vLLM reads them (:mod:`kvtax.delivery.lax`): ``"stream": "true"``, ``1``
    or ``"yes"`` stream. The model is None when the client named none (vLLM serves its default
    model); :data:`UNNAMED` when ``model`` is there but not a name vLLM accepts (vLLM refuses the
    request), or the body is not a JSON object.
    """
    try:
        payload, lenient, fields = _read(body, dialect.read_keys)
    except ValueError:
        return Prepared(UNNAMED, None, body)
    if not isinstance(payload, dict):
        return Prepared(UNNAMED, None, body, payload, lenient)
    dialect = dialect.resolve(payload)
    read = Prepared(
        _model(dialect.model(payload)), None, body, payload, lenient, fields, dialect=dialect
    )
    if not dialect.streams(payload):
        return read
    scheme = dialect.scheme(payload, version=version, ids_missing=ids_missing)
    asked = dialect.asks(payload, scheme)
    if asked is None:  # options vLLM refuses: it answers 400, kvtax adds nothing
        return read
    wish, changes = asked
    if not changes:  # the client asked for all of it already
        return Prepared(read.model, wish, body, payload, lenient, fields, scheme, dialect)
    rewritten = read.with_fields(changes)
    if rewritten is None:  # too deep to write back: sent as it came, its usage not asked for
        return read
    # What the gate reads is what vLLM gets: a clamp starts from the body as it now is.
    upstream = {**payload, **changes}
    if fields is not None:
        fields = {**fields, **{key: msgspec.Raw(orjson.dumps(v)) for key, v in changes.items()}}
    return Prepared(read.model, wish, rewritten, upstream, lenient, fields, scheme, dialect)


def _model(value: Any) -> str | None:
    """The served name a request's ``model`` means: None for vLLM's default model (absent,
    null or empty: vLLM's ``if not model_name``), else the name, or :data:`UNNAMED` for a value
    vLLM's ``str | None`` field refuses (a number, a list: pydantic does not make them str)."""
    if value is None or value == "":
        return None
    return value if isinstance(value, str) else UNNAMED
