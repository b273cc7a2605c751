"""An accounted request's body, read once: its model, its usage wish and the bytes for vLLM.

:func:`prepare` reads the body's top level once (msgspec, into raw JSON values: one C-level scan
of its bytes) and decodes only what kvtax acts on, each piece bounded, so that what a body costs
is a scan of its bytes, never the decoding of all they hold:

- a field kvtax reads (``model``, ``stream``, its options, the output's limits, ``n``) is
  decoded when it is at most :data:`MAX_FIELD` long; a longer one is no value vLLM acts on
  either, and stays raw;
- a prompt field (a chat's ``messages``, a ``prompt``, a Responses ``input``...) is decoded for
  the gate when it is at most :data:`~kvtax.delivery.dialects.base.DECODE_LIMIT` long, its
  media parts (base64 images and audio) left unread; a longer one stays raw, and the gate
  measures it by scanning its bytes (:func:`~kvtax.delivery.dialects.base.scanned`);
- tokens vLLM's parser (Python's) reads and msgspec does not (``NaN``, ``Infinity``, a lone
  surrogate escape) are written over by JSON values of the same length in a copy read for the
  structure only (:func:`_top`): such a body takes the same path as any other.

It learns the model and, for a stream, asks vLLM for what counts each event's tokens, as the
request's dialect says (:mod:`kvtax.delivery.dialects`). The fields kvtax sets (the usage
options, the gate's clamp) are written without re-encoding what the client sent
(:meth:`Prepared.with_fields`): new keys go before the body's closing brace; a key the client
sent too is written once, in a top level put together from the client's own raw values. The
body goes to vLLM as its parts (:attr:`Prepared.parts`), views of the client's bytes, never
joined into a second copy. Any body kvtax cannot read goes to vLLM byte for byte, and vLLM
answers it.

The fields it read stay with it (:class:`Prepared`) for the gate, which sizes the request and
may clamp its completion limit without parsing it again. Pure: no I/O.

Example::

    prepared = prepare(body, COMPLETIONS)
    prepared.model, prepared.wish, prepared.parts
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, TypeAlias

import msgspec
import orjson

from kvtax.delivery.asks import Scheme, UsageWish
from kvtax.delivery.dialects import Dialect
from kvtax.delivery.dialects.base import DECODE_LIMIT
from kvtax.delivery.ledger import OTHER

__all__ = ["MAX_FIELD", "UNNAMED", "WHOLE_LIMIT", "Prepared", "prepare", "prepare_form"]

# A piece of the body for vLLM: the client's bytes (or a view of them), or fields kvtax wrote.
Buffer: TypeAlias = bytes | bytearray | memoryview
# The model of a request vLLM refuses before it picks a model: counted as ``other``.
UNNAMED = OTHER
_TOP = msgspec.json.Decoder(dict[str, msgspec.Raw])
_OBJECTS = msgspec.json.Decoder(list[dict[str, msgspec.Raw]])
# Bytes of a field kvtax reads (model, stream, its options, limits, n) that it decodes.
MAX_FIELD = 64 * 1024
# A body msgspec cannot read at all (nested past its depth, which vLLM's parser refuses too) is
# read whole by Python's parser up to this size, to learn its model; a larger one goes unread.
WHOLE_LIMIT = 1024 * 1024
# What Python's parser reads and msgspec does not, each written over by a JSON value of the same
# length in the copy msgspec reads: an infinity, a NaN, a surrogate escape (a lone one is
# refused; a pair is written over too, in the copy alone).
_NONSTANDARD = (
    (b"-Infinity", re.compile(rb"-Infinity"), b"-0.000000"),
    (b"Infinity", re.compile(rb"Infinity"), b"0.000000"),
    (b"NaN", re.compile(rb"NaN"), b"0.0"),
    (b"\\u", re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}"), b"\\u0030"),
)
# Content parts that are media: base64 the gate does not count as text, never decoded.
_MEDIA_PARTS = frozenset(
    {
        "image_url",
        "input_audio",
        "audio_url",
        "video_url",
        "image",
        "document",
        "input_image",
        "input_file",
        "file",
    }
)
# A top level's stand-in for a body read whole: its keys, for the fields kvtax sets.
_NULL = msgspec.Raw(b"null")
# A top level of more keys than this, put together anew, is joined into one buffer: a write per
# key would cost more than the copy.
_PARTS_LIMIT = 64


@dataclass(frozen=True, slots=True)
class Prepared:
    """An accounted request, its body read once: the model, the usage wish, the client's bytes
    (``source``), the fields read (``payload``; None when the body is not a JSON object), which
    the gate sizes without reading the body again, and the bytes for vLLM (:attr:`parts`)."""

    # None: the client named no model, and vLLM's default model serves it.
    model: str | None
    # A stream kvtax counts: what its client asked for (None: not a stream kvtax counts).
    wish: UsageWish | None
    source: bytes | bytearray
    # The fields kvtax read and set: small ones decoded, a prompt field over DECODE_LIMIT as
    # its raw JSON (msgspec.Raw), a read field over MAX_FIELD too (no value kvtax acts on).
    payload: Any = None
    # How the stream's tokens are counted (kvtax.delivery.asks), when ``wish`` is set.
    scheme: Scheme = "usage"
    # The dialect the request is, its body read (a route of several APIs resolves to one);
    # None: the body is no JSON object, and the route's dialect stands.
    dialect: Dialect | None = None
    # The body's top level as raw values (None: not an object msgspec read; nothing is set).
    top: Mapping[str, msgspec.Raw] | None = None
    # Read with non-standard tokens written over: a body only Python's parser reads.
    lenient: bool = False
    # The fields kvtax sets, each encoded, and the body for vLLM that has them (empty: the
    # client's bytes as they came).
    written: Mapping[str, bytes] | None = None
    rewritten: tuple[Buffer, ...] = ()
    # A multipart form's fields (an upload, never held): the fields kvtax sets are written into
    # it as it passes (kvtax.serve.proxy.form), as text; ``written`` holds them, UTF-8.
    form: bool = False

    @property
    def parts(self) -> tuple[Buffer, ...]:
        """The body for vLLM as buffers to write in turn, the client's bytes never copied."""
        return self.rewritten or (self.source,)

    @property
    def size(self) -> int:
        return sum(len(part) for part in self.parts)

    @property
    def body(self) -> bytes:
        """The body for vLLM in one piece (a copy: what the proxy sends is :attr:`parts`)."""
        parts = self.parts
        return parts[0] if isinstance(parts[0], bytes) and len(parts) == 1 else b"".join(parts)

    def with_fields(self, changed: Mapping[str, Any] | None) -> Prepared | None:
        """This request with the top-level ``changed`` fields set; None when they cannot be
        (no JSON object, a value kvtax cannot write, or None given)."""
        if changed is None or not isinstance(self.payload, dict):
            return None
        written = dict(self.written or {})
        if self.form:
            written.update({key: str(value).encode() for key, value in changed.items()})
            return replace(self, written=written, payload={**self.payload, **changed})
        if self.top is None:
            return None
        for key, value in changed.items():
            data = _dumps(value)
            if data is None:
                return None
            written[key] = data
        return replace(
            self,
            written=written,
            rewritten=_written(self.source, self.top, written, lenient=self.lenient),
            payload={**self.payload, **changed},
        )


def _written(
    source: bytes | bytearray,
    top: Mapping[str, msgspec.Raw],
    written: Mapping[str, bytes],
    *,
    lenient: bool,
) -> tuple[Buffer, ...]:
    """``source`` with the ``written`` fields set. Keys the client did not send go before its
    closing brace, the client's bytes untouched. When it sent one of them, the top level is put
    together anew from its raw values, each key once (the last of equal keys, the one Python's
    parser keeps; a strict parser refuses two); a lenient body, which only Python's parser
    reads, gets the keys appended all the same, and that parser keeps the last."""
    view = memoryview(source)
    if lenient or not any(key in top for key in written):
        close = source.rfind(b"}")  # msgspec read it: nothing but space follows the object
        comma = b"," if top else b""
        fields = b",".join(_field(key, data) for key, data in written.items())
        return (view[:close], comma + fields, view[close:])
    parts: list[Buffer] = [b"{"]
    for key, raw in top.items():
        parts += (_key(key), written.get(key) or memoryview(raw), b",")
    for key, data in written.items():
        if key not in top:
            parts += (_key(key), data, b",")
    parts[-1] = b"}"
    if len(top) > _PARTS_LIMIT:
        return (b"".join(parts),)
    return tuple(parts)


def _key(key: str) -> bytes:
    return json.dumps(key).encode() + b":"


def _field(key: str, data: bytes) -> bytes:
    return _key(key) + data


_LONG_DIGITS = re.compile(rb"[0-9]{19}")


def _loads(body: bytes | bytearray | msgspec.Raw) -> Any:
    """A field's JSON: orjson, or Python's parser for what orjson refuses but Python's (vLLM's)
    accepts. ValueError when neither reads it.

    A value with a run of 19 or more digits goes to Python's parser first: orjson (3.10+) reads
    an integer past 64 bits as a float, which written back would hand vLLM ``1e+29`` for the
    client's exact integer. Such runs are rare, and the search is one C-level scan.
    """
    data = bytes(body) if isinstance(body, msgspec.Raw) else body
    if _LONG_DIGITS.search(data) is None:
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            pass
    try:
        return json.loads(data)
    except RecursionError as exc:  # nested past what either parser follows
        raise ValueError("nested too deeply") from exc


def _dumps(value: Any) -> bytes | None:
    """A value kvtax sets, as JSON: orjson; else the standard encoder, ASCII-only (it writes
    what a lenient read gave back as Python's parser reads it). None when neither can."""
    with contextlib.suppress(orjson.JSONEncodeError):
        return orjson.dumps(value)
    try:
        return json.dumps(value).encode()
    except (ValueError, RecursionError):
        return None


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
                    kept[key] = _loads(value)
            light.append(kept)
    except (msgspec.DecodeError, ValueError):
        return _loads(raw)
    return light


def _light_part(part: Mapping[str, msgspec.Raw]) -> dict[str, Any]:
    """A content part as the gate reads it: a media part is its type alone (its data unread),
    a text part its type and text, any other part (a tool call, a tool's result) whole."""
    kind = part.get("type")
    named = _loads(kind) if kind is not None and len(kind) <= MAX_FIELD else None
    if isinstance(named, str) and named in _MEDIA_PARTS:
        return {"type": named}
    text = part.get("text")
    if text is not None:
        return {"type": named, "text": _loads(text)}
    return {key: _loads(value) for key, value in part.items()}


def _top(body: bytes | bytearray) -> tuple[Mapping[str, msgspec.Raw], bool] | None:
    """The body's top level as raw values, and whether non-standard tokens were written over
    to read it; None when it is no JSON object msgspec reads, even with them written over.

    They are written over in a copy (a bytearray, whose raw values msgspec gives as views into
    it), which is then given back the client's bytes: the raw values read as the client sent
    them, and a field kvtax decodes goes to Python's parser, which reads them as vLLM's does.
    """
    try:
        return _TOP.decode(body), False
    except (msgspec.DecodeError, RecursionError):
        pass
    spans = [
        (found.start(), found.end(), same_length)
        for marker, pattern, same_length in _NONSTANDARD
        if body.find(marker) >= 0
        for found in pattern.finditer(body)
    ]
    if not spans:
        return None
    neutral = bytearray(body)
    view = memoryview(neutral)
    for start, end, same_length in spans:
        view[start:end] = same_length
    try:
        top = _TOP.decode(neutral)
    except (msgspec.DecodeError, RecursionError):
        return None
    view[:] = body
    return top, True


def _read(top: Mapping[str, msgspec.Raw], dialect: Dialect) -> dict[str, Any]:
    """The fields of ``top`` that ``dialect`` reads, each decoded within its bound (see the
    module docstring); a field that cannot be decoded stays raw."""
    payload: dict[str, Any] = {}
    for key, raw in top.items():
        if key not in dialect.read_keys:
            continue
        prompt = key in dialect.prompt_keys
        if len(raw) > (DECODE_LIMIT if prompt else MAX_FIELD):
            payload[key] = raw
            continue
        try:
            payload[key] = _light_messages(raw) if key == "messages" else _loads(raw)
        except ValueError:
            payload[key] = raw
    return payload


def prepare(
    body: bytes | bytearray,
    dialect: Dialect,
    *,
    version: str | None = None,
    ids_missing: bool = False,
) -> Prepared:
    """An accounted request of ``dialect``'s API as vLLM should get it.

    A stream's body asks vLLM for what counts it (the dialect picks the scheme from vLLM's
    ``version``, whether this vLLM's streams came without ids, ``ids_missing``, and the
    request's fields; the wish says what the client asked for); any other body goes as it came,
    and vLLM answers the 400 for one that is not JSON. Fields are read as vLLM reads them
    (:mod:`kvtax.delivery.lax`): ``"stream": "true"``, ``1`` or ``"yes"`` stream. The model is
    None when the client named none (vLLM serves its default model); :data:`UNNAMED` when
    ``model`` is there but not a name vLLM accepts (vLLM refuses the request), or the body is
    not a JSON object.
    """
    read_top = _top(body)
    top: Mapping[str, msgspec.Raw] | None = None
    lenient = False
    if read_top is not None:
        top, lenient = read_top
        payload: Any = _read(top, dialect)
    elif len(body) <= WHOLE_LIMIT:
        # Nested past msgspec's depth: read whole by Python's parser, which alone reads it.
        try:
            payload = _loads(body)
        except ValueError:
            return Prepared(UNNAMED, None, body)
        if isinstance(payload, dict):
            top, lenient = dict.fromkeys(payload, _NULL), True
    else:
        return Prepared(UNNAMED, None, body)  # too large to read whole: vLLM answers it
    if not isinstance(payload, dict):
        return Prepared(UNNAMED, None, body, payload)
    dialect = dialect.resolve(payload)
    model = _model(dialect.model(payload))
    read = Prepared(model, None, body, payload, dialect=dialect, top=top, lenient=lenient)
    if not dialect.streams(payload):
        return read
    scheme = dialect.scheme(payload, version=version, ids_missing=ids_missing)
    asked = dialect.asks(payload, scheme)
    if asked is None:  # options vLLM refuses: it answers 400, kvtax adds nothing
        return read
    wish, changes = asked
    asking = read.with_fields(changes) if changes else read
    if asking is None:  # a value kvtax cannot write: sent as it came, its usage not asked for
        return read
    return replace(asking, wish=wish, scheme=scheme)


def prepare_form(
    fields: Mapping[str, str],
    dialect: Dialect,
    *,
    version: str | None = None,
    ids_missing: bool = False,
) -> Prepared:
    """An upload's request (a multipart form of ``dialect``'s API) from the ``fields`` read of
    it so far, as :func:`prepare` reads a JSON body: its model, and for a stream the wish and
    the fields to set (:attr:`Prepared.written`), which go into the form at its end."""
    payload = dict(fields)
    read = Prepared(_model(dialect.model(payload)), None, b"", payload, dialect=dialect, form=True)
    if not dialect.streams(payload):
        return read
    scheme = dialect.scheme(payload, version=version, ids_missing=ids_missing)
    asked = dialect.asks(payload, scheme)
    if asked is None:
        return read
    wish, changes = asked
    asking = read.with_fields(changes) if changes else read
    assert asking is not None  # a form's fields are text: always written
    return replace(asking, wish=wish, scheme=scheme)


def _model(value: Any) -> str | None:
    """The served name a request's ``model`` means: None for vLLM's default model (absent,
    null or empty: vLLM's ``if not model_name``), else the name, or :data:`UNNAMED` for a value
    vLLM's ``str | None`` field refuses (a number, a list: pydantic does not make them str)."""
    if value is None or value == "":
        return None
    return value if isinstance(value, str) else UNNAMED
