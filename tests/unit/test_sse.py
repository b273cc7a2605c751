"""StreamRewriter: exact counts from continuous usage, and the client's stream restored."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from kvtax.delivery import sse
from kvtax.delivery.asks import UsageWish, with_usage
from kvtax.delivery.sse import HoldBudget, StreamRewriter
from kvtax_dev.fakevllm.events import DONE, done

# Every test here runs with the one-call scan in C and in Python (tests/unit/conftest.py).
pytestmark = pytest.mark.usefixtures("each_scan")

FP = '"system_fingerprint":"vllm-0.32.0-abc"'


def _chunk(text: str, tokens: int, *, finish: str | None = None, index: int = 0) -> bytes:
    finish_json = json.dumps(finish)
    choice = f'{{"index":{index},"text":{json.dumps(text)},"finish_reason":{finish_json}}}'
    usage = (
        f'"usage":{{"prompt_tokens":4,"total_tokens":{4 + tokens},"completion_tokens":{tokens}}}'
    )
    return f'data: {{"id":"c","choices":[{choice}],{usage}}}\n\n'.encode()


def _final(tokens: int) -> bytes:
    usage = f'{{"prompt_tokens":4,"total_tokens":{4 + tokens},"completion_tokens":{tokens}}}'
    return f'data: {{"id":"c","choices":[],"usage":{usage},{FP}}}\n\n'.encode()


UPSTREAM = [
    _chunk("he", 1),
    _chunk('l"}{lo', 3),
    _chunk("!", 4, finish="length"),
    _final(4),
    DONE,
]


def _run(wish: UsageWish, pieces: list[bytes]) -> tuple[bytes, StreamRewriter]:
    rw = StreamRewriter(wish)
    out = b"".join(rw.feed(p).payload for p in pieces) + rw.finish().payload
    return out, rw


def test_with_usage_records_the_wish_and_asks_for_everything() -> None:
    asked = with_usage({"model": "m", "stream": True, "stream_options": {"x": 1}})
    assert asked is not None
    wish, upstream = asked
    assert wish == UsageWish(include_usage=False, continuous=False)
    assert upstream["stream_options"] == {
        "x": 1,
        "include_usage": True,
        "continuous_usage_stats": True,
    }
    asked = with_usage({"stream_options": {"continuous_usage_stats": True}})
    assert asked is not None
    assert asked[0] == UsageWish(False, False)  # vLLM ignores continuous without include


def test_client_that_asked_for_everything_gets_the_bytes_unchanged() -> None:
    out, rw = _run(UsageWish(True, True), UPSTREAM)
    assert out == b"".join(UPSTREAM)
    assert rw.completion_tokens == 4
    assert rw.prompt_tokens == 4


def test_usage_is_cut_and_fingerprint_moves_to_the_terminal_chunk() -> None:
    out, rw = _run(UsageWish(False, False), UPSTREAM)
    events = out.decode().split("\n\n")[:-1]
    assert len(events) == 4  # three chunks and [DONE]: no usage chunk
    assert all('"usage"' not in e for e in events)
    assert events[2].endswith(f',"finish_reason":"length"}}],{FP}}}')
    assert '"system_fingerprint"' not in events[0] + events[1]
    assert json.loads(events[1].removeprefix("data: "))["choices"][0]["text"] == 'l"}{lo'
    assert events[3] == "data: [DONE]"
    assert rw.completion_tokens == 4
    assert rw.final_completion_tokens == 4


def test_include_usage_without_continuous_keeps_only_the_final_chunk() -> None:
    out, _ = _run(UsageWish(True, False), UPSTREAM)
    events = out.decode().split("\n\n")[:-1]
    assert [('"usage"' in e) for e in events] == [False, False, False, True, False]
    assert "system_fingerprint" not in events[2]


@pytest.mark.parametrize("size", [1, 7, 50])
def test_any_split_of_the_bytes_gives_the_same_output(size: int) -> None:
    whole = b"".join(UPSTREAM)
    pieces = [whole[i : i + size] for i in range(0, len(whole), size)]
    assert _run(UsageWish(False, False), pieces)[0] == _run(UsageWish(False, False), [whole])[0]


def test_tokens_count_only_once_handed_out() -> None:
    rw = StreamRewriter(UsageWish(False, False))
    first = rw.feed(UPSTREAM[0] + UPSTREAM[1][:10])
    assert first.completion_tokens == 1
    assert rw.upstream_completion_tokens == 1
    held = rw.feed(UPSTREAM[1][10:] + UPSTREAM[2])
    # The terminal chunk waits for the fingerprint: vLLM has sent 4, the client got 3.
    assert held.completion_tokens == 3
    assert rw.upstream_completion_tokens == 4


def test_choices_are_counted_separately() -> None:
    pieces = [
        _chunk("a", 1, index=0),
        _chunk("b", 1, index=1),
        _chunk("c", 2, index=0, finish="stop"),
        _chunk("d", 3, index=1, finish="stop"),
        _final(5),
        DONE,
    ]
    out, rw = _run(UsageWish(False, False), pieces)
    assert rw.completion_tokens == 5
    texts = [
        json.loads(e.removeprefix("data: "))["choices"][0]["text"]
        for e in out.decode().split("\n\n")[:-2]
    ]
    assert texts == ["a", "b", "c", "d"]  # order kept while terminal chunks were held


def test_error_events_and_comments_pass_through() -> None:
    error: dict[str, Any] = {"error": {"message": "x", "type": "BadRequestError", "code": 400}}
    pieces = [b": ping\n\n", b"data: " + json.dumps(error).encode() + b"\n\n"]
    out, rw = _run(UsageWish(False, False), pieces)
    assert out == b"".join(pieces)
    assert rw.completion_tokens == 0


def test_unterminated_tail_is_released_at_the_end() -> None:
    out, _ = _run(UsageWish(True, True), [done(end=b"")])
    assert out == b"data: [DONE]"


def test_a_line_longer_than_the_hold_limit_passes_raw_and_memory_stays_bounded() -> None:
    # Protection: a 10 MB event with no newline is not held whole (twenty such streams took
    # 470 MB); it passes as it arrives, and the rewriter resumes at the next line.
    rw = StreamRewriter(UsageWish(False, False), max_line=64 * 1024)
    huge = b'data: {"id":"c","choices":[{"index":0,"text":"' + b"z" * (10 * 1024**2) + b'"}]}\n\n'
    pieces = [huge[i : i + 65536] for i in range(0, len(huge), 65536)]
    out = []
    for piece in pieces:
        out.append(rw.feed(piece).payload)
        assert rw.held_bytes <= 64 * 1024
    out.append(rw.feed(_chunk("a", 3)).payload)
    out.append(rw.finish().payload)
    relayed = b"".join(out)
    assert relayed.startswith(huge)
    assert rw.oversized == 1
    assert rw.upstream_completion_tokens == 3  # the next line was read normally


def test_the_shared_budget_bounds_what_all_streams_hold_together() -> None:
    budget = HoldBudget(100_000)
    streams = [StreamRewriter(UsageWish(False, False), budget=budget) for _ in range(5)]
    partial = b'data: {"id":"c","choices":[{"index":0,"text":"' + b"q" * 30_000
    passed = 0
    for rw in streams:
        passed += len(rw.feed(partial).payload)
        assert budget.held <= 100_000
    assert passed > 0  # the streams past the budget passed their bytes on instead of holding
    for rw in streams:
        rw.close()
    assert budget.held == 0


def test_a_partial_line_fed_byte_by_byte_is_reassembled() -> None:
    out, rw = _run(UsageWish(False, False), [bytes([b]) for b in b"".join(UPSTREAM)])
    reference, _ = _run(UsageWish(False, False), UPSTREAM)
    assert out == reference
    assert rw.completion_tokens == 4


def test_usage_that_is_not_a_usage_object_is_counted_as_unparsed() -> None:
    bad = (
        b'data: {"id":"c","choices":[{"index":0,"text":"a"}],"usage":{"completion_tokens":"x"}}\n\n'
    )
    out, rw = _run(UsageWish(False, False), [bad, DONE])
    assert out == bad + b"data: [DONE]\n\n"  # passed untouched
    assert rw.unparsed == 1
    assert rw.usage_lines == 0


def _tight(event: bytes) -> bytes:
    """``event`` framed with no space after ``data:``, as the SSE spec allows."""
    return event.replace(b"data: ", b"data:", 1)


@pytest.mark.parametrize(
    "wish", [UsageWish(), UsageWish(include_usage=True), UsageWish(True, True)], ids=str
)
@pytest.mark.parametrize("whole", [True, False], ids=["one-read", "byte-by-byte"])
def test_data_without_a_space_is_read_and_trimmed_as_with_one(wish: UsageWish, whole: bool) -> None:
    # Protection: `data:{` (no space, allowed by the SSE spec) was not read as a data line: 0
    # tokens counted, and the usage the client did not ask for leaked into every chunk.
    spaced = b"".join(UPSTREAM)
    tight = b"".join(_tight(e) for e in UPSTREAM)
    assert b"data: " not in tight
    pieces = [tight] if whole else [bytes([b]) for b in tight]
    out, rw = _run(wish, pieces)
    reference, ref_rw = _run(wish, [spaced])
    assert out == reference.replace(b"data: ", b"data:")
    assert _state(rw) == _state(ref_rw)
    assert rw.completion_tokens == 4
    assert rw.done


def test_data_after_more_whitespace_is_still_a_json_event() -> None:
    # The spec strips one space; JSON allows the rest.
    event = UPSTREAM[0].replace(b"data: ", b"data:  \t")
    out, rw = _run(UsageWish(), [event])
    assert rw.completion_tokens == 1
    assert b'"usage"' not in out


def test_with_usage_reads_the_flags_as_vllm_does() -> None:
    # Protection: `include_usage: "true"` was read as false, so the usage chunk the client asked
    # for (and vLLM would have sent it) was cut out.
    payload: dict[str, Any] = {"stream": True, "stream_options": {"include_usage": "true"}}
    asked = with_usage(payload)
    assert asked is not None
    wish, upstream = asked
    assert wish == UsageWish(include_usage=True, continuous=False)
    # The client's own value stays as it wrote it; only what is missing is added.
    assert upstream["stream_options"] == {"include_usage": "true", "continuous_usage_stats": True}
    assert payload["stream_options"] == {"include_usage": "true"}  # not changed in place
    every = {"stream_options": {"include_usage": 1, "continuous_usage_stats": "yes"}}
    assert with_usage(every) == (UsageWish(True, True), {})  # nothing to add
    assert with_usage({"stream_options": {"include_usage": "off"}}) == (
        UsageWish(False, False),
        {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    )


@pytest.mark.parametrize(
    "options",
    ["yes", [], {"include_usage": "maybe"}, {"include_usage": True, "continuous_usage_stats": 2}],
)
def test_with_usage_leaves_options_vllm_refuses_alone(options: object) -> None:
    # vLLM answers these with a 400: writing valid options over them would make it stream.
    assert with_usage({"stream": True, "stream_options": options}) is None


def _state(rw: StreamRewriter) -> tuple[object, ...]:
    return (
        rw.completion_tokens,
        rw.upstream_completion_tokens,
        rw.prompt_tokens,
        rw.final_completion_tokens,
        rw.usage_lines,
        rw.unparsed,
        rw.done,
    )


def _random_stream(rng: random.Random) -> list[bytes]:
    """A stream of 1-2 choices in vLLM's shapes, with a few foreign ones, cut into reads."""
    events: list[bytes] = []
    counts = [0, 0]
    for _ in range(rng.randint(1, 12)):
        choice = rng.randint(0, 1)
        counts[choice] += rng.randint(1, 3)
        shape = rng.random()
        if shape < 0.75:
            events.append(_chunk("t", counts[choice], index=choice))
        elif shape < 0.85:  # another key order: not vLLM's compact usage
            events.append(
                b'data: {"id":"c","usage":{"completion_tokens":%d,"prompt_tokens":4},'
                b'"choices":[{"index":%d,"text":"x"}]}\n\n' % (counts[choice], choice)
            )
        elif shape < 0.92:
            events.append(b": keep-alive comment\n\n")
        else:
            events.append(_chunk("!", counts[choice], finish="stop", index=choice))
    events += [_final(sum(counts)), DONE]
    # The space after "data:" is optional (SSE spec): some events come without it.
    events = [_tight(e) if rng.random() < 0.3 else e for e in events]
    body = b"".join(events)
    reads: list[bytes] = []
    while body:  # reads cut at event ends mostly, anywhere sometimes
        if rng.random() < 0.7:
            ends = max(1, rng.randint(1, 3) * len(events[0]))
            cut = body.find(b"\n\n", min(ends, len(body) - 1))
            cut = len(body) if cut < 0 else cut + 2
        else:
            cut = rng.randint(1, len(body))
        reads.append(body[:cut])
        body = body[cut:]
    return reads


@pytest.mark.parametrize(
    "wish", [UsageWish(), UsageWish(include_usage=True), UsageWish(True, True)], ids=str
)
def test_whole_events_in_one_pass_give_what_the_line_path_gives(
    wish: UsageWish, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The one-pass path for reads of whole vLLM events must change nothing but the cost: the
    # same bytes to the client and the same counts as line by line, on any stream and any cuts.
    rng = random.Random(20261201)
    streams = [_random_stream(rng) for _ in range(400)]
    fast = [_run(wish, reads) for reads in streams]
    monkeypatch.setattr(StreamRewriter, "_fast_usage", lambda self, event, out: None)
    monkeypatch.setattr(sse, "scan_usage", lambda data, keep, include_usage: None)
    slow = [_run(wish, reads) for reads in streams]
    for (fast_out, fast_rw), (slow_out, slow_rw) in zip(fast, slow, strict=True):
        assert fast_out == slow_out
        assert _state(fast_rw) == _state(slow_rw)
