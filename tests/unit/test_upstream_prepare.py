"""What `prepare` makes of an accounted request's body, read once for the relay and the gate."""

from __future__ import annotations

import json
import math

import pytest

from kvtax.delivery.asks import UsageWish
from kvtax.delivery.dialects import COMPLETIONS
from kvtax.serve.proxy.prepare import UNNAMED, prepare


def test_the_json_read_stays_with_the_request() -> None:
    plain = prepare(b'{"model": "m", "prompt": "hi", "max_tokens": 5}', COMPLETIONS)
    assert plain.payload == {"model": "m", "prompt": "hi", "max_tokens": 5}
    assert plain.wish is None
    stream = prepare(b'{"model": "m", "prompt": "hi", "stream": true}', COMPLETIONS)
    # The gate reads (and may clamp) what vLLM gets: the copy that asks for usage.
    assert stream.payload["stream_options"]["include_usage"] is True
    assert json.loads(stream.body) == stream.payload
    assert prepare(b"not json", COMPLETIONS).payload is None


def test_a_stream_only_pythons_parser_reads_is_written_back_as_it_reads_it() -> None:
    # Protection: the rewritten stream went through orjson, which writes NaN as null.
    prepared = prepare(b'{"model": "m", "stream": true, "x": NaN}', COMPLETIONS)
    assert prepared.wish is not None
    assert math.isnan(json.loads(prepared.body)["x"])


def test_a_stream_with_a_lone_surrogate_is_still_rewritten() -> None:
    # Protection: neither encoder wrote the lone surrogate back (UnicodeEncodeError, a 500).
    prepared = prepare(b'{"model": "m", "stream": true, "prompt": "a\\ud800b"}', COMPLETIONS)
    assert prepared.wish is not None
    assert json.loads(prepared.body)["prompt"] == "a\ud800b"


def test_a_stream_too_deep_for_msgspec_is_counted_its_bytes_untouched() -> None:
    """A body past msgspec's depth that Python's parser reads is asked for its usage by fields
    written after the client's bytes, never by writing the deep value anew."""
    # Protection: writing it back raised RecursionError, and the client got a 500 from kvtax.
    body = b'{"model": "m", "stream": true, "x": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    prepared = prepare(body, COMPLETIONS)
    assert prepared.body.startswith(body[:-1])
    assert prepared.wish is not None
    assert prepared.model == "m"
    options = b'"stream_options":{"include_usage":true,"continuous_usage_stats":true}'
    assert prepared.body == body[:-1] + b"," + options + b"}"


def test_a_body_too_deep_for_either_parser_is_not_json() -> None:
    body = b'{"x": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    prepared = prepare(body, COMPLETIONS)
    assert prepared.payload is None
    assert prepared.body == body


@pytest.mark.parametrize("flag", ["true", 1, "yes", 1.0, "on", "1"])
def test_stream_given_as_vllm_reads_it_is_accounted_as_a_stream(flag: object) -> None:
    # Protection: `"stream": "true"` (or 1, "yes") streams on vLLM (pydantic's lax bool), but
    # kvtax sent it unchanged and read no usage: 0 tokens counted, no TTFT or ITL.
    prepared = prepare(
        json.dumps({"model": "m", "prompt": "hi", "stream": flag}).encode(), COMPLETIONS
    )
    assert prepared.wish == UsageWish(include_usage=False, continuous=False)
    sent = json.loads(prepared.body)
    assert sent["stream"] == flag  # the client's own value goes on
    assert sent["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}


@pytest.mark.parametrize("flag", ["false", 0, "no", None, "maybe", 2, [], "off"])
def test_what_vllm_does_not_stream_goes_as_it_came(flag: object) -> None:
    body = json.dumps({"model": "m", "prompt": "hi", "stream": flag}).encode()
    prepared = prepare(body, COMPLETIONS)
    assert prepared.wish is None
    assert prepared.body == body


def test_usage_the_client_asked_for_with_a_string_is_its_wish() -> None:
    body = {"model": "m", "stream": "true", "stream_options": {"include_usage": "true"}}
    prepared = prepare(json.dumps(body).encode(), COMPLETIONS)
    assert prepared.wish == UsageWish(include_usage=True, continuous=False)
    assert json.loads(prepared.body)["stream_options"] == {
        "include_usage": "true",
        "continuous_usage_stats": True,
    }


def test_a_stream_that_asked_for_everything_goes_byte_for_byte() -> None:
    body = (
        b'{"model":"m","stream":1,'
        b'"stream_options":{"include_usage":"yes","continuous_usage_stats":true}}'
    )
    prepared = prepare(body, COMPLETIONS)
    assert prepared.wish == UsageWish(include_usage=True, continuous=True)
    assert prepared.body is body


def test_stream_options_vllm_refuses_are_not_overwritten() -> None:
    # vLLM answers 400 for these; kvtax writing valid options over them would make vLLM stream.
    for options in ("x", {"include_usage": "maybe"}):
        body = json.dumps({"model": "m", "stream": True, "stream_options": options}).encode()
        prepared = prepare(body, COMPLETIONS)
        assert prepared.wish is None
        assert prepared.body == body


@pytest.mark.parametrize(
    ("model", "name"),
    [("m", "m"), (None, None), ("", None), (5, UNNAMED), (["m"], UNNAMED)],
)
def test_the_model_is_read_as_vllm_picks_it(model: object, name: str | None) -> None:
    # No model, null or "" is vLLM's default model (None); a value vLLM's `str` field refuses
    # is no model at all.
    payload: dict[str, object] = {"prompt": "hi"}
    if model is not None:
        payload["model"] = model
    assert prepare(json.dumps(payload).encode(), COMPLETIONS).model == name
    assert prepare(b"not json", COMPLETIONS).model == UNNAMED
