"""What every generation API tells kvtax, behind one interface: :class:`Dialect`. Pure, no I/O.

vLLM serves several APIs that make its engine generate tokens. To kvtax each is a dialect of one
accounted request, and differs from the others in a few answers only:

- **where**: the paths vLLM routes to it (:attr:`Dialect.routes`), which are also the
  ``handler`` label its ``http_requests_total`` counts them under (the join's denominator);
- **what the request says**: the top-level fields kvtax reads (:attr:`Dialect.read_keys`), the
  model, whether it streams, and what the gate sizes (:meth:`Dialect.shape`: the prompt's bytes,
  the output limit, ``n``) and may lower (:meth:`Dialect.limit_fields`);
- **what to ask vLLM for** so that every event of a stream can be counted at the least cost to
  vLLM (:meth:`Dialect.scheme`, :meth:`Dialect.asks`);
- **how an event counts** and what to cut from it that the client did not ask for
  (:meth:`Dialect.counter`, a :class:`StreamCounter`);
- **how an error reads** in that API, as a body and as a stream's last event, and how its
  usage object reads (:meth:`Dialect.usage_of`).

A route may carry several APIs: SageMaker's ``/invocations`` takes a chat or a completions
body. Its dialect resolves, once the body is read, to the dialect the request is
(:meth:`Dialect.resolve`); the route's dialect names the request's API all the same.

The request's owner in the proxy asks its dialect these things and nothing else; the gate, the
ledger and the join read the list of dialects (:data:`kvtax.delivery.dialects.DIALECTS`),
never a list of paths. The field readers here (:func:`count_of`, :func:`size_of`,
:func:`limit_of`) read numbers as vLLM does and bound them, for every dialect.

Example::

    dialect = dialect_for("/v1/chat/completions")   # kvtax.delivery.dialects
    shape = dialect.shape(payload, whole=len(body))
    wish, changes = dialect.asks(payload, dialect.scheme(payload, version="0.32.0"))
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import msgspec
import orjson

from kvtax.delivery.asks import Scheme, UsageWish
from kvtax.delivery.lax import REFUSED, lax_bool, lax_int
from kvtax.delivery.openai import error_body, sse_error_event
from kvtax.delivery.sse import Fingerprint, HoldBudget, Relayed
from kvtax.delivery.usage import usage_tokens

__all__ = [
    "DECODE_LIMIT",
    "MAX_COUNT",
    "Dialect",
    "Shape",
    "StreamCounter",
    "bounded",
    "count_of",
    "limit_of",
    "scanned",
    "size_of",
    "split_raw",
]

# The bound of every count a client states (max_tokens, n): far past any model's length or
# vLLM's VLLM_MAX_N_SEQUENCES, so it changes no real request, and small enough that sums and
# products of such counts stay exact in a float. A larger value is this one.
MAX_COUNT = 2**31 - 1
# The bytes of a prompt field (messages, a prompt, an input) the proxy decodes for the gate: a
# longer one stays raw JSON (msgspec.Raw) and is measured by scanning its bytes (scanned), so
# that a large body costs a scan, never the decoding of millions of values.
DECODE_LIMIT = 256 * 1024
# What a prompt's bytes hold that is no text: base64 media, a data URL or a "data" field.
_MEDIA_DATA = re.compile(rb'"data(?::[^"]*|"\s*:\s*"[^"]*)"')
_MEDIA_KIND = re.compile(
    rb'"type"\s*:\s*"(?:image|image_url|input_image|input_audio|audio_url|video_url|document'
    rb'|input_file|file)"'
)


@dataclass(frozen=True, slots=True)
class Shape:
    """What admission reads of a request body: the prompt's size and the completion's limit.

    ``media``: the prompt also has parts that count as no bytes (images, audio); vLLM's count
    of its tokens includes theirs, so it says nothing about the tokens a byte of text costs.
    ``prompts``: the prompts of a ``prompt`` list (each is a request of its own to vLLM);
    ``n``: the sequences vLLM generates for each. ``max_tokens`` and ``n`` are within
    [1, :data:`MAX_COUNT`].
    """

    prompt_bytes: int
    max_tokens: int | None
    media: bool = False
    prompts: int = 1
    n: int = 1

    @property
    def sequences(self) -> int:
        """The sequences vLLM generates for this request, each up to ``max_tokens`` long."""
        return self.prompts * self.n


class StreamCounter(Protocol):
    """Counts one stream's tokens event by event and cuts what its client did not ask for.

    ``completion_tokens`` is what was handed out for writing so far,
    ``upstream_completion_tokens`` what vLLM sent; ``final_completion_tokens`` the stream's
    own exact total once its end said it (None before). ``done``: the stream's end marker was
    handed out. ``ended``: that marker's event was handed out whole, and it is the stream's last
    by its API's definition (OpenAI's ``data: [DONE]``): the client's answer may end there,
    without waiting for vLLM's end of body. ``events`` counts events handed out whole,
    ``usage_lines`` the events whose usage was read, ``ids_missing`` the events that came without
    the ids asked for.
    """

    completion_tokens: int
    final_completion_tokens: int | None
    prompt_tokens: int
    done: bool
    ended: bool
    events: int
    usage_lines: int
    ids_missing: int

    @property
    def upstream_completion_tokens(self) -> int: ...

    def feed(self, data: bytes) -> Relayed: ...

    def finish(self) -> Relayed: ...

    def close(self) -> None: ...


class Dialect(ABC):
    """One generation API, as the proxy, the gate and the join read it. See the module doc.

    A dialect holds no state: one instance serves every request of its API.
    """

    #: The API's name, a short fixed word (the API label of kvtax's series).
    name: ClassVar[str]
    #: The paths vLLM routes to this API, each also the handler name in http_requests_total.
    routes: ClassVar[tuple[str, ...]]
    #: The top-level fields kvtax decodes; every other field passes as the client's bytes.
    read_keys: ClassVar[frozenset[str]]
    #: Those of them that hold the prompt: decoded up to :data:`DECODE_LIMIT` bytes, a longer
    #: one measured raw (:func:`scanned`).
    prompt_keys: ClassVar[frozenset[str]] = frozenset()
    #: The request is a multipart form (an upload), read as it passes on to vLLM, never held
    #: whole; its fields' values are the form's text, and so are those kvtax sets.
    form: ClassVar[bool] = False

    def resolve(self, payload: dict[str, Any]) -> Dialect:
        """The dialect this request is, its body read (itself but for a route of several)."""
        return self

    def model(self, payload: dict[str, Any]) -> Any:
        """The request's ``model`` field as sent (None when absent)."""
        return payload.get("model")

    def streams(self, payload: dict[str, Any]) -> bool:
        """The request asks for a stream, as vLLM reads its ``stream`` flag."""
        return lax_bool(payload.get("stream"), False) is True

    @abstractmethod
    def scheme(
        self, payload: dict[str, Any], *, version: str | None, ids_missing: bool = False
    ) -> Scheme:
        """How to count this streamed request's tokens, from vLLM's ``version`` and the
        request's fields; ``ids_missing``: a stream of this vLLM came without ids."""

    @abstractmethod
    def asks(
        self, payload: dict[str, Any], scheme: Scheme
    ) -> tuple[UsageWish, dict[str, Any]] | None:
        """The client's wish and the top-level fields to set so that vLLM's stream can be
        counted by ``scheme`` (empty: nothing to add); None when vLLM refuses the options as
        given (it answers 400, and kvtax must not make it an accepted request)."""

    @abstractmethod
    def shape(self, payload: Any, *, whole: int) -> Shape:
        """What the gate sizes of a parsed body (``whole``: the body's length); a prompt field
        may be raw JSON (msgspec.Raw, see :attr:`prompt_keys`). A body that is not an object has
        size 0 and no limit (vLLM answers its 400)."""

    @abstractmethod
    def limit_fields(self, payload: dict[str, Any], limit: int) -> dict[str, Any] | None:
        """The top-level fields that hold the output to at most ``limit`` tokens; None when
        they cannot be written (a field that holds the limit is too long to read)."""

    @abstractmethod
    def counter(
        self,
        wish: UsageWish,
        scheme: Scheme,
        *,
        budget: HoldBudget | None = None,
        fingerprints: Fingerprint | None = None,
    ) -> StreamCounter:
        """A counter for one stream whose client asked for ``wish``, counted by ``scheme``."""

    def usage_of(self, usage: object) -> tuple[int, int] | None:
        """(completion, prompt) tokens of an answer's usage object (OpenAI's unless a dialect
        says otherwise), or None when it is not one."""
        return usage_tokens(usage)

    def error_body(self, status: int, message: str, kind: str) -> Mapping[str, object]:
        """kvtax's own error in this API's shape (OpenAI's unless a dialect says otherwise)."""
        return error_body(status, message, kind)

    def error_event(self, status: int, message: str, kind: str, *, sequence: int = 0) -> bytes:
        """The error as the last event of a stream whose head went out long ago; ``sequence``:
        the events before it (an API that numbers its events)."""
        return sse_error_event(status, message, kind)

    def __repr__(self) -> str:
        return f"<dialect {self.name}>"


def count_of(value: Any) -> int:
    """A count (``n``) as vLLM reads it, bounded: absent, null or a value vLLM refuses (it then
    answers 400 and generates nothing) count as 1."""
    read = lax_int(value)
    if not isinstance(read, int) or read < 1:  # None, or REFUSED
        return 1
    return min(read, MAX_COUNT)


def bounded(value: Any) -> int | None:
    """A limit as vLLM reads it, within [1, MAX_COUNT]; None when it is no positive count."""
    read = lax_int(value)
    if not isinstance(read, int) or read < 1:  # None, or REFUSED
        return None
    return min(read, MAX_COUNT)


def limit_of(payload: dict[str, Any], keys: Iterable[str]) -> int | None:
    """The output limit vLLM applies when it reads ``keys`` in order and takes the first set
    to a positive count (``max_completion_tokens or max_tokens``: a null or 0 leaves the next
    in force). Each is read as vLLM's ``int`` field reads it (``"50"`` and ``50.0`` are 50) and
    bounded by :data:`MAX_COUNT`. None: no limit stated, or one vLLM refuses (the worst case is
    assumed)."""
    for key in keys:
        read = lax_int(payload.get(key))
        if read is REFUSED:
            return None
        if read:
            return bounded(read)
    return None


def lowered(value: Any, limit: int) -> Any:
    """A limit within ``limit``: as the client wrote it (``"50"`` stays ``"50"``) when vLLM
    reads it as a count that is, else ``limit``."""
    read = bounded(value)
    return value if read is not None and read <= limit else limit


def size_of(prompt: Any, whole: int) -> int:
    """A prompt's bytes: a string's UTF-8 (a lone surrogate, which Python's parser lets through,
    as its 3 bytes), a raw one's as :func:`scanned` measures them, anything else's compact
    JSON. When orjson cannot write it (nested past 254 levels, integers past 64 bits), the
    whole body's length: never less than the prompt, and no second encoder to hit its
    recursion limit."""
    if isinstance(prompt, msgspec.Raw):
        return scanned(prompt)[0]
    if isinstance(prompt, str):
        return len(prompt.encode("utf-8", "surrogatepass"))
    try:
        return len(orjson.dumps(prompt))
    except orjson.JSONEncodeError:
        return whole


def scanned(raw: msgspec.Raw) -> tuple[int, bool]:
    """A prompt field left raw, measured by scanning its bytes: its length less its media's
    data (a data URL, a ``"data"`` field's base64), and whether it has media parts. A string
    counts its quotes and escapes, a structure its keys and punctuation: more than its text,
    as the compact JSON of a decoded prompt does.

    >>> scanned(msgspec.Raw(b'[{"type":"image","source":{"data": "iVBORw0KGgo="}}]'))
    (32, True)
    """
    data = memoryview(raw)
    size = len(data)
    size -= sum(len(found[0]) - 2 for found in _MEDIA_DATA.finditer(data))
    return size, size < len(data) or _MEDIA_KIND.search(data) is not None


def split_raw(*values: Any) -> tuple[list[Any], int, bool]:
    """``values`` decoded, and the :func:`scanned` size and media of those left raw."""
    decoded: list[Any] = []
    size, media = 0, False
    for value in values:
        if isinstance(value, msgspec.Raw):
            bytes_, has_media = scanned(value)
            size, media = size + bytes_, media or has_media
        else:
            decoded.append(value)
    return decoded, size, media
