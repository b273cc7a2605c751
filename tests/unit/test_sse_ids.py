"""StreamRewriter by the token_ids scheme: each event counted by its ids, the ids cut to null
as vLLM writes them unasked, and the client's stream otherwise as vLLM sent it.

The events are vLLM 0.32's own shapes (``model_dump_json(exclude_unset=True)`` of its
``CompletionStreamResponse`` and ``ChatCompletionStreamResponse``): ``prompt_token_ids`` and
``token_ids`` on every completions choice, null unless asked; the chat role chunk with none, and
the prompt's ids at the chunk's top level.
"""

from __future__ import annotations

import json
import random

import pytest

from kvtax.delivery import sse
from kvtax.delivery.asks import UsageWish
from kvtax.delivery.sse import Fingerprint, StreamRewriter
from kvtax_dev.fakevllm.events import DONE

# Every test here runs with the one-call scan in C and in Python (tests/unit/conftest.py).
pytestmark = pytest.mark.usefixtures("each_scan")

FP = "vllm-0.32.0-abc"


def _completion(
    index: int, ids: list[int] | None, *, prompt: list[int] | None = None, finish: str | None = None
) -> bytes:
    choice = {
        "index": index,
        "text": "t" * len(ids or [1]),
        "logprobs": None,
        "finish_reason": finish,
        "stop_reason": None,
        "prompt_token_ids": prompt,
        "token_ids": ids,
    }
    chunk = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m"}
    chunk["choices"] = [choice]
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


def _fingerprinted(event: bytes) -> bytes:
    """A terminal chunk as vLLM writes it when no usage chunk follows."""
    return event[: -len(b"}\n\n")] + f',"system_fingerprint":"{FP}"}}\n\n'.encode()


def _usage(completion: int, prompt: int = 3) -> bytes:
    usage = {"prompt_tokens": prompt, "total_tokens": prompt + completion}
    usage["completion_tokens"] = completion
    chunk = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m"}
    body = {**chunk, "choices": [], "usage": usage, "system_fingerprint": FP}
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def _stream(n: int = 1, tokens: int = 3, per_event: int = 1) -> tuple[list[bytes], list[bytes]]:
    """(what vLLM sends kvtax, asked for ids; what it sends a client that asked for nothing)."""
    asked: list[bytes] = []
    plain: list[bytes] = []
    sent = [0] * n
    while min(sent) < tokens:
        for index in range(n):
            step = min(per_event, tokens - sent[index])
            ids = list(range(100 + sent[index], 100 + sent[index] + step))
            first = sent[index] == 0
            sent[index] += step
            finish = "length" if sent[index] == tokens else None
            asked.append(
                _completion(index, ids, prompt=[7, 8, 9] if first else None, finish=finish)
            )
            unasked = _completion(index, None, finish=finish)
            unasked = unasked.replace(b'"text":"t"', b'"text":"' + b"t" * step + b'"')
            plain.append(_fingerprinted(unasked) if finish else unasked)
    asked += [_usage(n * tokens), DONE]
    plain.append(DONE)
    return asked, plain


def _run(
    wish: UsageWish, reads: list[bytes], fp: Fingerprint | None = None
) -> tuple[bytes, StreamRewriter]:
    rw = StreamRewriter(wish, scheme="token_ids", fingerprints=fp)
    out = b"".join(rw.feed(r).payload for r in reads) + rw.finish().payload
    return out, rw


@pytest.mark.parametrize("per_event", [1, 3])
def test_each_event_counts_its_ids_and_the_client_gets_what_vllm_sends_it(per_event: int) -> None:
    asked, plain = _stream(tokens=7, per_event=per_event)
    out, rw = _run(UsageWish(), asked)
    assert out == b"".join(plain)
    assert rw.completion_tokens == rw.final_completion_tokens == 7
    assert rw.prompt_tokens == 3
    assert rw.ids_missing == 0


def test_a_client_that_asked_for_the_ids_and_the_usage_gets_every_byte() -> None:
    asked, _ = _stream(tokens=4)
    out, rw = _run(UsageWish(include_usage=True, token_ids=True), asked)
    assert out == b"".join(asked)
    assert rw.completion_tokens == 4


def test_a_client_cut_off_mid_stream_is_credited_the_ids_it_was_sent() -> None:
    # Protection: what a client that leaves received is the ids of what reached it, not the
    # final usage (which never came): three events of 3 ids, then vLLM's connection gone.
    asked, _ = _stream(tokens=12, per_event=3)
    rw = StreamRewriter(UsageWish(), scheme="token_ids")
    counts = [rw.feed(event).completion_tokens for event in asked[:3]]
    assert counts == [3, 6, 9]
    assert rw.upstream_completion_tokens == 9


def test_n2_streams_count_each_choice_and_never_hold_one_for_the_other() -> None:
    asked, plain = _stream(n=2, tokens=3)
    out, rw = _run(UsageWish(), asked, Fingerprint(json.dumps(FP).encode()))
    assert out == b"".join(plain)
    assert rw.completion_tokens == 6


def test_the_fingerprint_learnt_from_one_stream_stamps_the_next_as_it_passes() -> None:
    fp = Fingerprint()
    first, plain = _stream(tokens=2)
    out, _ = _run(UsageWish(), first, fp)
    assert out == b"".join(plain)
    assert fp.value == json.dumps(FP).encode()
    # Now known: the terminal chunk goes out stamped in the read it came in.
    rw = StreamRewriter(UsageWish(), scheme="token_ids", fingerprints=fp)
    terminal = rw.feed(first[1]).payload
    assert terminal == plain[1]


def test_a_chat_stream_s_role_chunk_counts_nothing_and_its_prompt_ids_go() -> None:
    head = b'{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":'
    role = head + b'[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
    role += b'"finish_reason":null}]'
    content = head + b'[{"index":0,"delta":{"content":"hi"},"logprobs":null,"finish_reason":null,'
    reads = [
        b"data: " + role + b',"prompt_token_ids":[1,2,3,4]}\n\n',
        b"data: " + content + b'"token_ids":[9,10]}]}\n\n',
    ]
    out, rw = _run(UsageWish(include_usage=True), reads)
    assert out == (
        b"data: " + role + b',"prompt_token_ids":null}\n\n'
        b"data: " + content + b'"token_ids":null}]}\n\n'
    )
    assert rw.completion_tokens == 2
    assert rw.prompt_tokens == 4
    assert rw.ids_missing == 0


def test_events_without_the_ids_asked_for_count_one_each_and_say_so() -> None:
    # A vLLM that ignores return_token_ids: the stream still goes on, each event counted as one
    # token (the proxy then asks that vLLM for usage), and the final usage still rules.
    reads = [_completion(0, None), _completion(0, None), _usage(5), DONE]
    out, rw = _run(UsageWish(), reads)
    assert rw.ids_missing == 2
    assert rw.final_completion_tokens == 5
    assert b'"usage"' not in out


def _random_ids_stream(rng: random.Random) -> list[bytes]:
    """A stream of 1-2 choices in vLLM's shapes, with foreign ones, cut into reads."""
    events: list[bytes] = []
    sent = [0, 0]
    for _ in range(rng.randint(1, 12)):
        choice = rng.randint(0, 1)
        step = rng.randint(1, 3)
        ids = list(range(sent[choice], sent[choice] + step))
        first = sent[choice] == 0
        sent[choice] += step
        shape = rng.random()
        if shape < 0.8:
            events.append(_completion(choice, ids, prompt=[1, 2] if first else None))
        elif shape < 0.88:
            events.append(b": keep-alive comment\n\n")
        elif shape < 0.94:
            events.append(_completion(choice, ids, finish="stop"))
        else:
            events.append(_completion(choice, None))
    events += [_usage(sum(sent)), DONE]
    events = [e.replace(b"data: ", b"data:", 1) if rng.random() < 0.3 else e for e in events]
    body = b"".join(events)
    reads: list[bytes] = []
    while body:
        cut = body.find(b"\n\n", rng.randint(1, len(body))) if rng.random() < 0.7 else -1
        cut = rng.randint(1, len(body)) if cut < 0 else cut + 2
        reads.append(body[:cut])
        body = body[cut:]
    return reads


@pytest.mark.parametrize(
    "wish",
    [UsageWish(), UsageWish(include_usage=True), UsageWish(True, False, True)],
    ids=str,
)
def test_the_one_step_path_gives_what_the_line_path_gives(
    wish: UsageWish, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The one-step path for vLLM's own events must change nothing but the cost.
    rng = random.Random(20261203)
    streams = [_random_ids_stream(rng) for _ in range(400)]
    fast = [_run(wish, reads) for reads in streams]
    monkeypatch.setattr(sse, "scan_ids", lambda data, keep_ids, include_usage: None)
    slow = [_run(wish, reads) for reads in streams]
    for (fast_out, fast_rw), (slow_out, slow_rw) in zip(fast, slow, strict=True):
        assert fast_out == slow_out
        state = ("completion_tokens", "prompt_tokens", "final_completion_tokens", "ids_missing")
        assert [getattr(fast_rw, k) for k in state] == [getattr(slow_rw, k) for k in state]
