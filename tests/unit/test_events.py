"""The counter of named-event streams (Messages, Responses) and the other APIs' dialects, on
bodies captured from vLLM 0.32 (``scripts/capture-fixtures.py``: 12 tokens each).

A completed stream is exact by its final usage however its bytes are split into reads; before
that, each content event counts one token, a floor; nothing is ever cut; the stream is done
only once its last event has passed whole.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from kvtax.delivery.asks import UsageWish
from kvtax.delivery.dialects import GENERATE, MESSAGES, RESPONSES, Dialect, dialect_for
from kvtax.delivery.dialects.messages import MESSAGES_EVENTS, anthropic_type
from kvtax.delivery.dialects.responses import RESPONSES_EVENTS
from kvtax.delivery.events import EventCounter
from kvtax.delivery.usage import UsageScanner

APIS = Path(__file__).resolve().parents[1] / "fixtures" / "vllm" / "apis"
STREAMS = [("0.32-messages.sse", MESSAGES), ("0.32-responses.sse", RESPONSES)]


def _splits(data: bytes, seed: int) -> list[bytes]:
    """``data`` cut into reads of random sizes (1 byte to a few events)."""
    rng, out, at = random.Random(seed), [], 0
    while at < len(data):
        size = rng.choice([1, 2, 3, 7, 40, 150, 600])
        out.append(data[at : at + size])
        at += size
    return out


@pytest.mark.parametrize(("name", "dialect"), STREAMS, ids=["messages", "responses"])
@pytest.mark.parametrize("seed", range(20))
def test_a_captured_stream_counts_the_same_however_its_reads_fall(
    name: str, dialect: Dialect, seed: int
) -> None:
    body = (APIS / name).read_bytes()
    counter = dialect.counter(UsageWish(), "final_usage")
    relayed = b""
    for piece in _splits(body, seed) if seed else [body]:
        assert not counter.done
        relayed += counter.feed(piece).payload
    relayed += counter.finish().payload
    assert relayed == body  # nothing cut, nothing held
    assert counter.done
    assert counter.final_completion_tokens == 12
    assert counter.completion_tokens == 12
    assert counter.prompt_tokens in (28, 29)
    assert counter.events == body.count(b"\n\n")


def test_content_events_count_one_token_each_until_the_total_comes() -> None:
    body = (APIS / "0.32-messages.sse").read_bytes()
    end = body.index(b"event: message_delta")
    counter = EventCounter(MESSAGES_EVENTS)
    out = counter.feed(body[:end])
    deltas = body.count(b"event: content_block_delta\n")
    assert out.completion_tokens == deltas == 7  # 12 tokens came in 7 events: a floor
    assert counter.final_completion_tokens is None
    assert counter.feed(body[end:]).completion_tokens == 12


def test_a_signature_delta_carries_no_token() -> None:
    events = b""
    for delta in ({"type": "thinking_delta", "thinking": "so"}, {"type": "signature_delta"}):
        event = {"type": "content_block_delta", "delta": delta, "index": 0}
        data = json.dumps(event, separators=(",", ":"))  # compact, as vLLM writes it
        events += b"event: content_block_delta\ndata: " + data.encode() + b"\n\n"
    counter = EventCounter(MESSAGES_EVENTS)
    assert counter.feed(events).completion_tokens == 1


def test_the_stream_is_done_only_once_its_last_event_passed_whole() -> None:
    body = (APIS / "0.32-responses.sse").read_bytes()
    last = body.index(b"event: response.completed")
    counter = EventCounter(RESPONSES_EVENTS)
    counter.feed(body[: last + 40])
    assert not counter.done  # response.completed began; its data is still coming
    counter.feed(body[last + 40 : -1])
    assert not counter.done  # one "\n" of its blank line still missing
    counter.feed(body[-1:])
    assert counter.done


def test_a_stream_that_ends_without_its_final_event_keeps_the_floor() -> None:
    body = (APIS / "0.32-responses.sse").read_bytes()
    counter = EventCounter(RESPONSES_EVENTS)
    counter.feed(body[: body.index(b"event: response.output_text.done")])
    counter.finish()
    assert counter.final_completion_tokens is None
    assert counter.completion_tokens == body.count(b".delta\ndata: ") == 2
    assert counter.usage_lines == 0


def test_a_generate_stream_counts_each_event_s_ids_and_keeps_them() -> None:
    body = (APIS / "0.32-generate.sse").read_bytes()
    wish, changes = GENERATE.asks({"stream": True}, "token_ids") or (UsageWish(), {})
    assert changes == {"stream_options": {"include_usage": True}}
    counter = GENERATE.counter(wish, "token_ids")
    relayed = b"".join(counter.feed(piece).payload for piece in _splits(body, 3))
    relayed += counter.finish().payload
    assert counter.final_completion_tokens == 12
    assert counter.completion_tokens == 12
    assert b'"token_ids":[' in relayed  # the API's own output: never cut
    assert b'"usage":{' not in relayed  # the total kvtax asked for, cut again
    assert b"system_fingerprint" not in relayed


@pytest.mark.parametrize(
    ("name", "route"),
    [
        ("0.32-messages.json", "/v1/messages"),
        ("0.32-responses.json", "/v1/responses"),
        ("0.32-generate.json", "/inference/v1/generate"),
        ("0.32-chat-batch.json", "/v1/chat/completions/batch"),
    ],
)
def test_a_whole_answer_s_usage_reads_in_its_api_s_terms(name: str, route: str) -> None:
    dialect = dialect_for(route)
    assert dialect is not None
    scanner = UsageScanner(dialect.usage_of)
    for piece in _splits((APIS / name).read_bytes(), 5):
        scanner.feed(piece)
    tokens = scanner.tokens()
    assert tokens is not None
    completion, prompt = tokens
    assert completion == (24 if "batch" in name else 12)  # two conversations of 12
    assert prompt > 0


def test_anthropic_errors_are_typed_as_its_api_types_them() -> None:
    assert [anthropic_type(s) for s in (400, 413, 429, 502, 503, 504)] == [
        "invalid_request_error",
        "request_too_large",
        "rate_limit_error",
        "api_error",
        "overloaded_error",
        "timeout_error",
    ]
    body = MESSAGES.error_body(429, "slow down", "rate_limit_exceeded")
    assert body == {"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}
    event = MESSAGES.error_event(502, "vLLM's stream broke off", "upstream_error")
    assert event.startswith(b"event: error\ndata: {")
    assert event.endswith(b"\n\n")
    numbered = RESPONSES.error_event(502, "broke off", "upstream_error", sequence=7)
    assert json.loads(numbered.split(b"data: ")[1])["sequence_number"] == 7
