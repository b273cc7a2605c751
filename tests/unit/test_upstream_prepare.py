"""What `prepare` makes of an accounted request's body, read once for the relay and the gate."""

from __future__ import annotations

import json
import math

from kvtax.serve.proxy.prepare import prepare


def test_the_json_read_stays_with_the_request() -> None:
    plain = prepare(b'{"model": "m", "prompt": "hi", "max_tokens": 5}')
    assert plain.payload == {"model": "m", "prompt": "hi", "max_tokens": 5}
    assert plain.wish is None
    stream = prepare(b'{"model": "m", "prompt": "hi", "stream": true}')
    # The gate reads (and may clamp) what vLLM gets: the copy that asks for usage.
    assert stream.payload["stream_options"]["include_usage"] is True
    assert json.loads(stream.body) == stream.payload
    assert prepare(b"not json").payload is None


def test_a_stream_only_pythons_parser_reads_is_written_back_as_it_reads_it() -> None:
    # Protection: the rewritten stream went through orjson, which writes NaN as null.
    prepared = prepare(b'{"model": "m", "stream": true, "x": NaN}')
    assert prepared.wish is not None
    assert math.isnan(json.loads(prepared.body)["x"])


def test_a_stream_with_a_lone_surrogate_is_still_rewritten() -> None:
    # Protection: neither encoder wrote the lone surrogate back (UnicodeEncodeError, a 500).
    prepared = prepare(b'{"model": "m", "stream": true, "prompt": "a\\ud800b"}')
    assert prepared.wish is not None
    assert json.loads(prepared.body)["prompt"] == "a\ud800b"


def test_a_stream_too_deep_to_write_back_goes_as_it_came() -> None:
    # Protection: writing it back raised RecursionError, and the client got a 500 from kvtax.
    body = b'{"model": "m", "stream": true, "x": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    prepared = prepare(body)
    assert prepared.body == body
    assert prepared.wish is None
    assert prepared.model == "m"


def test_a_body_too_deep_for_either_parser_is_not_json() -> None:
    body = b'{"x": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    prepared = prepare(body)
    assert prepared.payload is None
    assert prepared.body == body
