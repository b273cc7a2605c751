"""The relay's one-call scan: the C build and the Python one answer alike, and both answer what
the rewriter's line reader would, or leave the read to it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtax.delivery import sse
from kvtax.delivery.asks import UsageWish
from kvtax.delivery.eventscan import IdsRead, extensions_off, scan_ids_py, scan_usage_py
from kvtax.delivery.sse import StreamRewriter
from kvtax_dev.fakevllm.events import DONE

if extensions_off():
    pytest.skip("KVTAX_NO_EXTENSIONS is set: the C scan is switched off", allow_module_level=True)

from kvtax.delivery._eventscan import scan_ids as scan_ids_c
from kvtax.delivery._eventscan import scan_usage as scan_usage_c

Scan = Callable[[bytes, bool, bool], IdsRead | None]


def _event(
    index: bytes = b"0",
    ids: bytes = b"5",
    *,
    prompt: bytes | None = None,
    finish: bytes = b"null",
    data: bytes = b"data: ",
) -> bytes:
    prompt_part = b',"prompt_token_ids":[' + prompt + b"]" if prompt is not None else b""
    return (
        data
        + b'{"id":"cmpl-1","object":"text_completion","model":"m","choices":[{"index":'
        + index
        + b',"text":"a","finish_reason":'
        + finish
        + prompt_part
        + b',"token_ids":['
        + ids
        + b"]}]}\n\n"
    )


# Pieces an event is made of, in vLLM's shape and out of it: what a differential test needs to
# reach every branch of both scanners.
_IDS = st.sampled_from([b"", b"5", b"5,6", b"1,2,3,4", b"7,", b"]", b"1 ,2"])
_INDEX = st.sampled_from([b"0", b"1", b"00", b"12", b"1234567890", b"", b"-1", b'"0"'])
_FINISH = st.sampled_from([b"null", b'"stop"', b'"length"'])
_PROMPT = st.sampled_from([None, b"", b"1", b"1,2,3", b"1,2]"])
_DATA = st.sampled_from([b"data: ", b"data:", b"data:  ", b": ", b"event: x\ndata: "])


@st.composite
def _reads(draw: st.DrawFn) -> bytes:
    events = draw(
        st.lists(
            st.builds(_event, _INDEX, _IDS, prompt=_PROMPT, finish=_FINISH, data=_DATA),
            min_size=1,
            max_size=20,
        )
    )
    return _broken(draw, events, [b"\n", b"]", b",", b"[", b'"choices":[', b"\r", b"x"])


def _broken(draw: st.DrawFn, events: list[bytes], pieces: list[bytes]) -> bytes:
    """``events`` joined, with up to three of ``pieces`` put in anywhere and perhaps a byte
    taken out: a shape a generator of pieces would not think of."""
    read = bytearray(b"".join(events))
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, len(read)))
        read[at:at] = draw(st.sampled_from(pieces))
    if draw(st.booleans()):
        del read[draw(st.integers(0, len(read) - 1))]
    return bytes(read)


@settings(max_examples=1500)
@given(_reads(), st.booleans(), st.booleans())
def test_the_c_scan_answers_every_read_as_the_python_one_does(
    read: bytes, keep_ids: bool, include_usage: bool
) -> None:
    """Byte for byte, count for count, on reads of vLLM's shape and on reads broken anywhere."""
    assert scan_ids_c(read, keep_ids, include_usage) == scan_ids_py(read, keep_ids, include_usage)


@pytest.mark.parametrize("scan", [scan_ids_c, scan_ids_py], ids=["compiled", "python"])
def test_a_read_of_one_choices_events_is_counted_and_cut_in_one_call(scan: Scan) -> None:
    """Three events, the first with the prompt's ids: tokens summed, ids cut to null, the prompt
    counted; with the ids asked for, the read is handed back as it came."""
    read = _event(ids=b"5,6", prompt=b"1,2,3") + _event(ids=b"7") + _event(ids=b"8,9,10")
    scanned = scan(read, False, False)
    assert scanned is not None
    payload, choice, tokens, prompt, events = scanned
    assert (choice, tokens, prompt, events) == (0, 6, 3, 3)
    assert payload.count(b'"token_ids":null') == 3
    assert b'"prompt_token_ids":null' in payload
    assert b"[" not in payload.replace(b'"choices":[', b"")
    kept = scan(read, True, False)
    assert kept is not None
    assert kept[0] == read


@pytest.mark.parametrize("scan", [scan_ids_c, scan_ids_py], ids=["compiled", "python"])
@pytest.mark.parametrize(
    "read",
    [
        _event(index=b"0") + _event(index=b"1"),  # two choices: the line reader keeps order
        _event(finish=b'"stop"'),  # a terminal chunk the fingerprint goes on
        _event() + b"\n",  # an odd newline after the last event
        _event()[:-1],  # no blank line at the end
        b'data: {"choices":[],"usage":{"prompt_tokens":1}}\n\n',  # the usage-only chunk
        _event(index=b"1234567890"),  # no vLLM's choice index
        _event(data=b"event: x\ndata: "),  # a line before the data line
    ],
    ids=["choices", "terminal", "odd-newline", "unended", "usage", "long-index", "two-lines"],
)
def test_a_read_out_of_the_common_shape_is_left_to_the_line_reader(scan: Scan, read: bytes) -> None:
    assert scan(read, False, False) is None


@pytest.mark.usefixtures("each_scan")
@pytest.mark.parametrize("newlines", [1, 3])
def test_newlines_after_the_last_event_go_out_as_they_came(newlines: int) -> None:
    """A read that ends in more blank lines than the event's own (odd or even) loses none."""
    rw = StreamRewriter(UsageWish(), scheme="token_ids")
    read = _event() + b"\n" * newlines
    out = rw.feed(read)
    assert out.payload == read.replace(b'"token_ids":[5]', b'"token_ids":null')
    assert out.completion_tokens == 1


# vLLM 0.32's own streams as kvtax asks for them (scripts/capture-fixtures.py --only apis).
_CAPTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm" / "apis"


@pytest.mark.parametrize("capture", ["0.32-completions-ids.sse", "0.32-chat-ids.sse"])
@pytest.mark.parametrize("scan", [scan_ids_c, scan_ids_py], ids=["compiled", "python"])
def test_a_real_vllm_stream_is_read_in_one_call_per_ordinary_event(
    capture: str, scan: Scan
) -> None:
    """Every event of the real stream but the role chunk, the terminal chunk (held for the
    fingerprint), the usage chunk and [DONE] takes the one-call path: the scan is not silently
    missing vLLM's real shape."""
    events = [e + b"\n\n" for e in (_CAPTURES / capture).read_bytes().split(b"\n\n") if e]
    scanned = [scan(e, False, False) for e in events]
    taken = [r for r in scanned if r is not None]
    assert len(taken) == len(events) - (4 if "chat" in capture else 3)
    assert sum(r[2] for r in taken) == 11  # of the 12 tokens: the terminal chunk's is not here


@pytest.mark.usefixtures("each_scan")
@pytest.mark.parametrize("capture", ["0.32-completions-ids.sse", "0.32-chat-ids.sse"])
@pytest.mark.parametrize(
    "wish", [UsageWish(), UsageWish(include_usage=True), UsageWish(True, False, True)], ids=str
)
def test_a_real_vllm_stream_reads_alike_with_and_without_the_scan(
    capture: str, wish: UsageWish, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Read event by event, the rewriter gives the same bytes and counts with the scan as the
    line reader alone does, and counts vLLM's own 12 tokens."""
    events = [e + b"\n\n" for e in (_CAPTURES / capture).read_bytes().split(b"\n\n") if e]

    def run() -> tuple[bytes, int, int]:
        rw = StreamRewriter(wish, scheme="token_ids")
        out = b"".join(rw.feed(e).payload for e in events) + rw.finish().payload
        return out, rw.completion_tokens, rw.prompt_tokens

    with_scan = run()
    monkeypatch.setattr(sse, "scan_ids", lambda data, keep_ids, include_usage: None)
    assert with_scan == run()
    assert with_scan[1] == 12


def test_the_switch_reads_set_and_zero_as_a_user_would(monkeypatch: pytest.MonkeyPatch) -> None:
    """KVTAX_NO_EXTENSIONS=1 turns the C scan off; unset, empty or 0 leave it on."""
    for value, off in (("1", True), ("yes", True), ("0", False), ("", False)):
        monkeypatch.setenv("KVTAX_NO_EXTENSIONS", value)
        assert extensions_off() is off
    monkeypatch.delenv("KVTAX_NO_EXTENSIONS")
    assert extensions_off() is False


# -- the usage scheme's scan ---------------------------------------------------------------------

_USAGE = b'"usage":{"prompt_tokens":%b,"total_tokens":9,"completion_tokens":%b%b}'


def _usage_event(
    index: bytes = b"0",
    tokens: bytes = b"2",
    *,
    prompt: bytes = b"3",
    details: bytes = b"",
    finish: bytes = b"null",
    data: bytes = b"data: ",
) -> bytes:
    """An event of vLLM's continuous-usage shape, its usage the last key."""
    return (
        data
        + b'{"id":"chatcmpl-1","object":"chat.completion.chunk","model":"m","choices":[{"index":'
        + index
        + b',"delta":{"content":"a"},"logprobs":null,"finish_reason":'
        + finish
        + b"}],"
        + _USAGE % (prompt, tokens, details)
        + b"}\n\n"
    )


_COUNT = st.sampled_from([b"0", b"2", b"17", b"", b"x", b"1" * 19, b"12345678901234567"])
_DETAILS = st.sampled_from(
    [
        b"",
        b',"prompt_tokens_details":null',
        b',"prompt_tokens_details":{"cached_tokens":4}',
        b',"prompt_tokens_details":{"cached_tokens":}',
        b',"prompt_tokens_details":{}',
        b',"prompt_tokens_details":nul',
        b', "x":1',
    ]
)


@st.composite
def _usage_reads(draw: st.DrawFn) -> bytes:
    events = draw(
        st.lists(
            st.builds(
                _usage_event,
                _INDEX,
                _COUNT,
                prompt=_COUNT,
                details=_DETAILS,
                finish=_FINISH,
                data=_DATA,
            ),
            min_size=1,
            max_size=20,
        )
    )
    pieces = [b"\n", b"}", b",", b'"usage":{', b'"choices":[', b"\r", b"x", b"9"]
    return _broken(draw, events, pieces)


@settings(max_examples=1500)
@given(_usage_reads(), st.booleans(), st.booleans())
def test_the_c_usage_scan_answers_every_read_as_the_python_one_does(
    read: bytes, keep: bool, include_usage: bool
) -> None:
    """Byte for byte, count for count, on reads of vLLM's usage shape and on reads broken
    anywhere."""
    assert scan_usage_c(read, keep, include_usage) == scan_usage_py(read, keep, include_usage)


@pytest.mark.parametrize("scan", [scan_usage_c, scan_usage_py], ids=["compiled", "python"])
def test_a_read_of_one_choices_usage_events_counts_by_its_last_event(scan: Scan) -> None:
    """Three events: the count is the last event's (each says the choice's count so far), the
    usage is cut unless the client asked for it, and the details vLLM may add are read too."""
    details = b',"prompt_tokens_details":{"cached_tokens":4}'
    read = (
        _usage_event(tokens=b"1")
        + _usage_event(tokens=b"2", details=b',"prompt_tokens_details":null')
        + _usage_event(tokens=b"4", details=details)
    )
    scanned = scan(read, False, False)
    assert scanned is not None
    payload, choice, tokens, prompt, events = scanned
    assert (choice, tokens, prompt, events) == (0, 4, 3, 3)
    assert b"usage" not in payload
    assert payload.count(b"}]}\n\n") == 3
    kept = scan(read, True, False)
    assert kept is not None
    assert kept[0] == read


@pytest.mark.parametrize("scan", [scan_usage_c, scan_usage_py], ids=["compiled", "python"])
@pytest.mark.parametrize(
    "read",
    [
        _usage_event(index=b"0") + _usage_event(index=b"1"),
        _usage_event(finish=b'"stop"'),
        _usage_event() + b"\n",
        _usage_event()[:-1],
        b'data: {"choices":[],"usage":{"prompt_tokens":1,"total_tokens":2,"completion_tokens":1}}'
        b"\n\n",
        _usage_event(index=b"1234567890"),
        _usage_event(tokens=b"1" * 19),
        _usage_event(data=b"event: x\ndata: "),
        _usage_event(details=b',"prompt_tokens_details":{}'),
    ],
    ids=[
        "choices",
        "terminal",
        "odd-newline",
        "unended",
        "usage-chunk",
        "long-index",
        "long-count",
        "two-lines",
        "other-details",
    ],
)
def test_a_usage_read_out_of_the_common_shape_is_left_to_the_line_reader(
    scan: Scan, read: bytes
) -> None:
    assert scan(read, False, False) is None


def _usage_stream() -> list[bytes]:
    """A chat stream by continuous usage, as vLLM before 0.12 writes it: the role chunk, ten
    content events, the terminal chunk, the final usage chunk, [DONE]."""
    role = _usage_event(tokens=b"0").replace(b'{"content":"a"}', b'{"role":"assistant"}')
    content = [_usage_event(tokens=str(n).encode()) for n in range(1, 11)]
    final = _usage_event(tokens=b"11", finish=b'"stop"')
    usage = (
        b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","model":"m","choices":[],'
        b'"usage":{"prompt_tokens":3,"total_tokens":14,"completion_tokens":11}}\n\n'
    )
    return [role, *content, final, usage, DONE]


@pytest.mark.usefixtures("each_scan")
@pytest.mark.parametrize("per_read", [1, 3, 20])
@pytest.mark.parametrize(
    "wish",
    [UsageWish(), UsageWish(include_usage=True), UsageWish(True, True)],
    ids=["none", "include", "continuous"],
)
def test_a_usage_stream_reads_alike_with_and_without_the_scan(
    per_read: int, wish: UsageWish, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Read a few events at a time, the rewriter gives the same bytes and counts with the scan
    as its line reader alone does, and counts the stream's 11 tokens."""
    events = _usage_stream()
    # The content events are the common shape: the scan takes them.
    assert all(scan_usage_py(e, wish.continuous, wish.include_usage) for e in events[1:11])
    reads = [b"".join(events[i : i + per_read]) for i in range(0, len(events), per_read)]

    def run() -> tuple[bytes, int, int, int]:
        rw = StreamRewriter(wish, scheme="usage")
        out = b"".join(rw.feed(r).payload for r in reads) + rw.finish().payload
        return out, rw.completion_tokens, rw.prompt_tokens, rw.events

    with_scan = run()
    monkeypatch.setattr(sse, "scan_usage", lambda data, keep, include_usage: None)
    assert with_scan == run()
    assert with_scan[1:3] == (11, 3)
