"""`prepare` reads an accounted body field by field: media is never decoded, and what it writes
back is the client's body with only the changed fields written anew.

The field-by-field read is checked against the whole-body read it replaced (orjson, Python's
parser for what orjson refuses) on generated bodies: the same model, the same wish, the same
fields for the gate, and a body vLLM reads as the same JSON.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import msgspec
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtax.delivery.dialects import CHAT, COMPLETIONS, Dialect
from kvtax.serve.proxy import prepare as prepare_module
from kvtax.serve.proxy.prepare import Prepared, prepare

IMAGE = "data:image/png;base64," + base64.b64encode(bytes(range(256)) * 4096 * 12).decode()


def _chat(**more: Any) -> dict[str, Any]:
    content = [
        {"type": "text", "text": "what is in this picture?"},
        {"type": "image_url", "image_url": {"url": IMAGE}},
    ]
    return {"model": "m", "messages": [{"role": "user", "content": content}], **more}


def test_a_chat_request_s_image_is_never_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    # Protection: the body was decoded whole (orjson, then written back whole): a 12 MiB image
    # cost about 18 ms of the event loop, every read of the proxy's waiting on it.
    body = orjson.dumps(_chat(stream=True))
    assert len(body) > 12 * 1024**2
    decoded: list[int] = []
    real = orjson.loads

    def counting(data: Any) -> Any:
        decoded.append(len(data))
        return real(data)

    # The orjson module prepare reads with is this one (prepare_module.orjson is orjson).
    monkeypatch.setattr(orjson, "loads", counting)
    prepared = prepare(body, CHAT)
    assert max(decoded) < 1024  # only the fields kvtax reads, never the image
    assert prepared.wish is not None
    assert prepared.model == "m"
    # The image goes to vLLM as the client's bytes; only stream_options is new.
    sent = json.loads(prepared.body)
    assert sent == {**json.loads(body), "stream_options": sent["stream_options"]}
    assert sent["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}


def test_the_gate_sizes_the_text_and_knows_the_image_is_there() -> None:
    """Messages past DECODE_LIMIT (a 12 MiB image) are measured by a scan: the image's data
    counts no bytes and is known to be there. Below the limit, they are decoded without the
    image, and sized as the whole body's read sizes them."""
    prepared = prepare(orjson.dumps(_chat()), CHAT)
    assert isinstance(prepared.payload["messages"], msgspec.Raw)
    shape = CHAT.shape(prepared.payload, whole=prepared.size)
    assert shape.media
    assert shape.prompt_bytes < 200
    small = _chat()
    small["messages"][0]["content"][1]["image_url"]["url"] = IMAGE[:100_000]
    prepared = prepare(orjson.dumps(small), CHAT)
    shape = CHAT.shape(prepared.payload, whole=prepared.size)
    assert shape == CHAT.shape(small, whole=prepared.size)
    assert shape.media


def test_a_clamp_changes_the_limit_and_nothing_else() -> None:
    body = orjson.dumps(_chat(max_tokens=5000, stream=True))
    prepared = prepare(body, CHAT)
    clamped = prepared.with_fields({"max_tokens": 50})
    assert clamped is not None
    sent = json.loads(clamped.body)
    assert sent["max_tokens"] == 50
    assert sent["messages"] == json.loads(body)["messages"]
    assert sent["stream_options"]["continuous_usage_stats"] is True


def test_a_key_sent_twice_is_read_and_sent_as_vllm_reads_it() -> None:
    # vLLM's parser (json.loads) keeps the last of two equal keys; so does kvtax, and the body
    # it writes back has that one only.
    body = b'{"model": "a", "stream": false, "model": "b", "stream": true}'
    prepared = prepare(body, COMPLETIONS)
    assert prepared.model == "b"
    assert prepared.wish is not None
    assert json.loads(prepared.body)["model"] == "b"


# -- against the whole-body read ------------------------------------------------------------
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
_parts = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": _values}),
    _values,
)
_messages = st.lists(
    st.one_of(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system"]), "content": st.text(max_size=10)}
        ),
        st.fixed_dictionaries({"role": st.just("user"), "content": st.lists(_parts, max_size=3)}),
        _values,
    ),
    max_size=3,
)
_bodies = st.fixed_dictionaries(
    {},
    optional={
        "model": st.one_of(st.text(max_size=4), _values),
        "stream": st.sampled_from([True, False, "true", 1, "maybe", None]),
        "stream_options": st.one_of(
            st.fixed_dictionaries(
                {},
                optional={
                    "include_usage": st.sampled_from([True, False, "yes", None, 3]),
                    "continuous_usage_stats": st.sampled_from([True, False, "1", None]),
                },
            ),
            _values,
        ),
        "messages": _messages,
        "prompt": st.one_of(st.text(max_size=10), st.lists(st.text(max_size=4), max_size=3)),
        "n": _values,
        "max_tokens": st.one_of(st.integers(-5, 10**6), st.text(max_size=3), _values),
        "other": _values,
    },
)


def _whole(body: bytes, dialect: Dialect) -> Prepared:
    """prepare() as it read bodies before: whole, by orjson or Python's parser."""
    real = prepare_module._TOP

    class Refusing:
        def decode(self, data: bytes) -> Any:
            raise msgspec.DecodeError("read whole")

    prepare_module._TOP = Refusing()  # type: ignore[assignment]
    try:
        return prepare(body, dialect)
    finally:
        prepare_module._TOP = real


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(_bodies, st.booleans())
def test_the_field_by_field_read_agrees_with_the_whole_read(
    payload: dict[str, Any], chat: bool
) -> None:
    body = json.dumps(payload).encode()
    dialect = CHAT if chat else COMPLETIONS
    fields, whole = prepare(body, dialect), _whole(body, dialect)
    assert fields.model == whole.model
    assert fields.wish == whole.wish
    assert dialect.shape(fields.payload, whole=len(body)) == dialect.shape(
        whole.payload, whole=len(body)
    )
    # vLLM reads the same request from both bodies.
    assert json.loads(fields.body) == json.loads(whole.body)
