"""Request footprint, token budget, queue order and Retry-After of the gate."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pytest

from kvtax.delivery.dialects import CHAT, Shape, dialect_for
from kvtax.delivery.dialects.base import MAX_COUNT
from kvtax.gate.footprint import (
    MAX_FOOTPRINT,
    MAX_TOKENS_PER_BYTE,
    MIN_TOKENS_PER_BYTE,
    TokenEstimator,
    blocks_of,
    check_budget,
    footprint_of,
)
from kvtax.gate.order import queue_key, retry_after

COMPLETIONS = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"


def shape_of(body: Any, path: str, *, whole: int) -> Shape:
    """The shape the gate reads of ``body`` sent to ``path``: its dialect's."""
    dialect = dialect_for(path)
    assert dialect is not None
    return dialect.shape(body, whole=whole)


def with_max_tokens(payload: dict[str, Any], limit: int) -> dict[str, Any]:
    """The body as the gate's clamp writes it (an OpenAI dialect's limit fields)."""
    return {**payload, **CHAT.limit_fields(payload, limit)}


def _shape(body: Any, path: str) -> Shape:
    return shape_of(body, path, whole=len(json.dumps(body)))


def test_shape_reads_prompt_or_messages_and_the_limit() -> None:
    assert _shape({"prompt": "héllo", "max_tokens": 5}, COMPLETIONS).prompt_bytes == 6
    chat = _shape(
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9}, CHAT_PATH
    )
    assert chat.max_tokens == 9
    assert chat.prompt_bytes > 2
    assert _shape({"prompt": "x", "max_tokens": True}, COMPLETIONS).max_tokens == 1  # vLLM's 1
    assert _shape({"prompt": "x", "max_tokens": -3}, COMPLETIONS).max_tokens is None
    assert _shape(["not", "an", "object"], COMPLETIONS).prompt_bytes == 0


def test_a_prompt_no_encoder_writes_is_the_whole_body() -> None:
    # Protection: the prompt was sized through Python's encoder, which raises RecursionError
    # on nesting orjson read (a 500 from kvtax); orjson cannot write it either.
    deep: list[Any] = []
    for _ in range(1000):
        deep = [deep]
    assert shape_of({"prompt": deep}, COMPLETIONS, whole=4321).prompt_bytes == 4321
    # A lone surrogate (Python's parser lets it through) is sized, not an error.
    assert shape_of({"prompt": "a\ud800"}, COMPLETIONS, whole=99).prompt_bytes == 4


def test_completions_read_max_tokens_only() -> None:
    # Protection: vLLM's completions endpoint has no max_completion_tokens (it ignores the
    # key); reading it first let a small one hide a huge max_tokens from the budget.
    body = {"prompt": "x", "max_tokens": 5000, "max_completion_tokens": 10}
    assert _shape(body, COMPLETIONS).max_tokens == 5000
    # ... and its prompt is `prompt`, whatever `messages` says.
    big = {"prompt": "y" * 1000, "messages": []}
    assert _shape(big, COMPLETIONS).prompt_bytes == 1000


@pytest.mark.parametrize(
    ("limits", "read"),
    [
        ({"max_completion_tokens": 10, "max_tokens": 5000}, 10),
        ({"max_completion_tokens": None, "max_tokens": 5000}, 5000),
        ({"max_completion_tokens": 0, "max_tokens": 5000}, 5000),
        ({"max_tokens": 5000}, 5000),
        ({"max_completion_tokens": None}, None),
    ],
)
def test_chat_reads_the_limit_vllm_applies(limits: dict[str, int | None], read: int | None) -> None:
    # Protection: vLLM's chat endpoint takes `max_completion_tokens or max_tokens`; a null
    # max_completion_tokens hid the max_tokens vLLM then applied.
    body = {"messages": [{"role": "user", "content": "hi"}], **limits}
    assert _shape(body, CHAT_PATH).max_tokens == read


def test_with_max_tokens_lowers_every_limit_the_body_states() -> None:
    both = {"max_completion_tokens": 10, "max_tokens": 5000}
    assert with_max_tokens(both, 100) == {"max_completion_tokens": 10, "max_tokens": 100}
    hidden = {"max_completion_tokens": None, "max_tokens": 5000}
    assert with_max_tokens(hidden, 100) == {"max_completion_tokens": 100, "max_tokens": 100}
    assert with_max_tokens({"max_completion_tokens": 900}, 10) == {"max_completion_tokens": 10}
    assert with_max_tokens({"prompt": "x"}, 10) == {"prompt": "x", "max_tokens": 10}


def test_estimator_over_counts_then_learns_from_usage() -> None:
    est = TokenEstimator()
    assert est.estimate(400) == 140
    for _ in range(30):
        est = est.learned(400, 100)
    assert 100 <= est.estimate(400) <= 105
    assert est.learned(4, 100) is est  # too short to learn from


def test_the_learned_ratio_stays_in_its_band() -> None:
    # Protection: one global ratio serves every request; a burst of prompts whose bytes do not
    # show their tokens (base64 images counted as text) dragged it towards 0.002, and every
    # later text prompt was then counted about a hundred times too short.
    est = TokenEstimator()
    for _ in range(50):
        est = est.learned(200_000, 400)  # a picture's base64 and its few hundred tokens
    assert est.tokens_per_byte == MIN_TOKENS_PER_BYTE
    assert est.estimate(400) == 40
    for _ in range(50):
        est = est.learned(20, 2000)
    assert est.tokens_per_byte == MAX_TOKENS_PER_BYTE


def _chat(*parts: Mapping[str, object]) -> Shape:
    return _shape({"messages": [{"role": "user", "content": list(parts)}]}, CHAT_PATH)


def test_an_image_part_is_no_prompt_bytes() -> None:
    # Protection: only text is sized; an image part's base64 counted as prompt bytes.
    text = {"type": "text", "text": "what is in this picture?"}
    picture = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 99_999}}
    sound = {"type": "input_audio", "input_audio": {"data": "B" * 99_999, "format": "wav"}}
    plain = _chat(text)
    mixed = _chat(text, picture, sound)
    assert mixed.prompt_bytes == plain.prompt_bytes < 100
    assert mixed.media
    assert not plain.media
    assert not _shape({"messages": [{"role": "user", "content": "hi"}]}, CHAT_PATH).media


def test_blocks_round_up() -> None:
    assert blocks_of(1, 16) == 1
    assert blocks_of(16, 16) == 1
    assert blocks_of(17, 16) == 2


def test_budget_passes_what_fits() -> None:
    assert check_budget(100, 200, 512, "reject").action == "ok"
    assert check_budget(100, 200, None, "reject").action == "ok"


def test_budget_rejects_with_a_clear_message() -> None:
    verdict = check_budget(100, 600, 512, "reject")
    assert verdict.action == "reject"
    assert "--gate.token-budget" in verdict.message
    assert "at most 412" in verdict.message
    assert check_budget(100, None, 512, "reject").action == "reject"


def test_budget_clamps_max_tokens_to_the_room_left() -> None:
    assert check_budget(100, 600, 512, "clamp").max_tokens == 412
    assert check_budget(100, None, 512, "clamp").max_tokens == 412


def test_a_prompt_over_the_budget_is_rejected_even_when_clamping() -> None:
    assert check_budget(600, 10, 512, "clamp").action == "reject"


def test_queue_orders() -> None:
    fifo = sorted([queue_key("fifo", seq=2, footprint=1), queue_key("fifo", seq=1, footprint=9)])
    assert fifo[0] == (1, 1)
    short = sorted(
        [queue_key("shortest", seq=1, footprint=900), queue_key("shortest", seq=2, footprint=50)]
    )
    assert short[0] == (50, 2)


def test_retry_after_from_the_completion_rate() -> None:
    assert retry_after(ahead=9, completions=20, span=10.0, limit=60) == 5
    assert retry_after(ahead=0, completions=100, span=1.0, limit=60) == 1
    assert retry_after(ahead=1000, completions=1, span=60.0, limit=30) == 30
    assert retry_after(ahead=3, completions=0, span=60.0, limit=30) == 30


@pytest.mark.parametrize("written", [50, "50", 50.0, " 50 ", "+50"])
def test_limits_are_read_as_vllm_reads_them(written: object) -> None:
    # Protection: "50" and 50.0 read as no max_tokens at all, so the budget refused a request
    # vLLM serves with a limit of 50 (pydantic's lax int).
    assert _shape({"prompt": "x", "max_tokens": written}, COMPLETIONS).max_tokens == 50
    chat = {"messages": [], "max_completion_tokens": written, "max_tokens": 9000}
    assert _shape(chat, CHAT_PATH).max_tokens == 50
    assert check_budget(10, 50, 100, "reject").action == "ok"


@pytest.mark.parametrize("written", [50.5, "fifty", "1e3", [50], {"n": 50}])
def test_a_limit_vllm_refuses_is_no_limit(written: object) -> None:
    assert _shape({"prompt": "x", "max_tokens": written}, COMPLETIONS).max_tokens is None
    # ... on chat too, rather than falling through to a max_tokens vLLM never reaches.
    chat = {"messages": [], "max_completion_tokens": written, "max_tokens": 5}
    assert _shape(chat, CHAT_PATH).max_tokens is None


def test_clamping_keeps_a_limit_that_fits_as_the_client_wrote_it() -> None:
    # Protection: a limit written "50" was no count, so clamping replaced it by the whole room.
    assert with_max_tokens({"max_tokens": "50"}, 100) == {"max_tokens": "50"}
    assert with_max_tokens({"max_tokens": 50.0}, 100) == {"max_tokens": 50.0}
    assert with_max_tokens({"max_tokens": "500"}, 100) == {"max_tokens": 100}


@pytest.mark.parametrize(
    "huge",
    [10**309, 10**310, 10**5000, str(10**400), 1e308],
    ids=["1e309", "1e310", "1e5000", "str-1e400", "float-1e308"],
)
def test_every_count_a_client_sends_is_bounded(huge: object) -> None:
    # Protection: max_tokens = 10**309 went into float arithmetic unbounded: OverflowError in
    # the gate's p95 (its follower died) and, at 10**310, in the ticket's blocks (a 500).
    body = {"prompt": "x", "max_tokens": huge, "n": huge}
    shape = _shape_of_raw(body)
    assert shape.max_tokens in (MAX_COUNT, None)  # a 4000-digit string: vLLM refuses it
    assert shape.n in (MAX_COUNT, 1)
    tokens = footprint_of(10, shape.max_tokens or MAX_COUNT, prompts=shape.prompts, n=shape.n)
    assert tokens <= MAX_FOOTPRINT
    assert float(tokens) < float("inf")
    assert blocks_of(tokens, 16) > 0
    assert check_budget(10, shape.max_tokens, 100, "reject").action == "reject"


def _shape_of_raw(body: dict[str, Any]) -> Shape:
    return shape_of(body, COMPLETIONS, whole=1)


def test_a_count_vllm_reports_is_bounded_too() -> None:
    learned = TokenEstimator().learned(100, 10**400)
    assert learned.tokens_per_byte == MAX_TOKENS_PER_BYTE


@pytest.mark.parametrize(
    ("body", "prompts", "n"),
    [
        ({"prompt": "one"}, 1, 1),
        ({"prompt": [1, 2, 3]}, 1, 1),  # one prompt of token ids
        ({"prompt": ["a", "b", "c"]}, 3, 1),
        ({"prompt": [[1, 2], [3], [4]], "n": 2}, 3, 2),
        ({"prompt": "one", "n": "50"}, 1, 50),
        ({"prompt": "one", "n": 4.0}, 1, 4),
        ({"prompt": "one", "n": None}, 1, 1),
        ({"prompt": "one", "n": "many"}, 1, 1),  # vLLM refuses the request: nothing runs
        ({"prompt": "one", "n": 0}, 1, 1),
    ],
)
def test_the_shape_counts_prompts_and_n(body: dict[str, Any], prompts: int, n: int) -> None:
    shape = _shape(body, COMPLETIONS)
    assert (shape.prompts, shape.n) == (prompts, n)
    assert shape.sequences == prompts * n


def test_a_chats_messages_are_one_prompt_and_n_counts() -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    shape = _shape({"messages": messages, "n": 3, "max_completion_tokens": 8}, CHAT_PATH)
    assert (shape.prompts, shape.n, shape.max_tokens) == (1, 3, 8)


def test_the_footprint_holds_every_sequence() -> None:
    assert footprint_of(10, 64) == 74
    assert footprint_of(10, 64, n=50) == 50 * 74
    assert footprint_of(100, 64, prompts=50) == 100 + 50 * 64


def test_the_budget_counts_every_sequence() -> None:
    # Protection: n=50 with max_tokens=64 passed a budget of 100 tokens, and vLLM generated
    # 3,200; a list of 50 prompts did the same.
    assert check_budget(5, 64, 100, "reject").action == "ok"
    many = check_budget(5, 64, 100, "reject", n=50)
    assert many.action == "reject"
    assert "50 sequences" in many.message
    assert check_budget(5, 64, 100, "reject", prompts=50).action == "reject"
    # Clamping: n * (prompt + m) <= budget.
    assert check_budget(10, 64, 100, "clamp", n=2).max_tokens == 40
    assert check_budget(10, 64, 100, "clamp", prompts=3).max_tokens == 30
    assert check_budget(10, 30, 100, "clamp", prompts=3).action == "ok"
    assert check_budget(30, 1, 100, "clamp", n=4).action == "reject"  # no room for a token
