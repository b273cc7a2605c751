"""The relay's common read, counted and cut in one call: whole events of vLLM's ``token_ids``
shape (:func:`scan_ids`), or of its continuous-usage shape (:func:`scan_usage`), all of one
choice.

A paced stream's read is one event; a busy one's, a few. :func:`scan_ids` takes such a read as
it came and answers in one step what :class:`~kvtax.delivery.sse.StreamRewriter` otherwise
works out line by line: the bytes the client gets (each event's ids cut to ``null`` unless it
asked for them), the choice, the completion tokens, the prompt's ids, and the number of events.
It answers None for any read that is not all such events (a role chunk, a terminal chunk the
fingerprint goes on, the usage chunk, another choice's event, a line split across reads), and
the rewriter then reads it line by line. So the scan decides nothing the line reader would
decide differently; it only spares the common read the line reader's work.

Two implementations, one behaviour: :func:`scan_ids_py` here, and ``kvtax.delivery._eventscan``
in C (``_eventscan.c``), built with the wheel when a C compiler is there. The C one runs one
native call per read, without a Python object per event, which is where the relay's CPU per
event goes (docs/delivery.md, "Compiled or pure Python"). Where it was not built, or with
``KVTAX_NO_EXTENSIONS=1`` in the environment, :data:`scan_ids` is the Python one.
tests/unit/test_eventscan.py holds the two to the same answers, and the rewriter's own tests run
under each.

An event of the shape, as vLLM writes it with ``return_token_ids`` (the prompt's ids only on a
choice's first event)::

    data: {"id":"x",...,"choices":[{"index":0,"text":"a",...,"token_ids":[5]}]}

and of the usage shape, which a vLLM before the ids (0.10.2 for completions, 0.12 for chat)
streams with ``continuous_usage_stats``: its usage the event's last key, the completion tokens
so far::

    data: {"id":"x",...,"choices":[{"index":0,...}],"usage":{"prompt_tokens":3,
    "total_tokens":5,"completion_tokens":2}}

:func:`scan_usage` (C, or :func:`scan_usage_py`) answers for such a read what the rewriter's
one-event step (``StreamRewriter._fast_usage``) answers event by event: the bytes the client
gets (the usage cut unless it asked for continuous usage), the choice, its completion tokens as
of the last event, the prompt tokens, and the number of events.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

# The constants and count_ids are the line reader's too (kvtax.delivery.sse): one spelling of
# vLLM's shape for both.
__all__ = [
    "CHOICES",
    "COMPILED",
    "DATA",
    "IDS",
    "NULL_IDS",
    "NULL_PROMPT_IDS",
    "PROMPT_IDS",
    "TERMINAL",
    "USAGE_KEY",
    "VLLM_USAGE",
    "IdsRead",
    "UsageRead",
    "count_ids",
    "extensions_off",
    "one_usage",
    "scan_ids",
    "scan_ids_py",
    "scan_usage",
    "scan_usage_py",
]

# payload, choice, completion tokens, prompt tokens (-1: no prompt ids in the read), events.
IdsRead = tuple[bytes, int, int, int, int]
# payload, choice, its completion tokens as of the read's last event, prompt tokens, events.
UsageRead = tuple[bytes, int, int, int, int]

# A data line of a JSON event. The SSE spec makes the space after the colon optional: vLLM
# writes it, other servers (and proxies in between) may not, and both must be read.
DATA = (b"data: {", b"data:{")
# The top-level choices: "]" right after the bracket is the usage-only chunk, else the first
# choice's index.
CHOICES = re.compile(rb'"choices":\[(?:(\])|\{"index":(\d+))')
TERMINAL = b'"finish_reason":"'
# An event's ids, as vLLM writes them when asked (return_token_ids): a choice's delta, and (the
# first event's) the prompt's. The leading quote tells "token_ids" from "prompt_token_ids"; a
# string inside the JSON cannot hold either unescaped.
IDS = b'"token_ids":['
PROMPT_IDS = b'"prompt_token_ids":['
NULL_IDS = b'"token_ids":null'
NULL_PROMPT_IDS = b'"prompt_token_ids":null'
# vLLM's usage object as it writes it, the event's last key: read in one match. Any other form
# (spaces, another key order, details) is found by the line reader, which counts braces.
USAGE_KEY = b',"usage":{'
VLLM_USAGE = re.compile(
    rb',"usage":\{"prompt_tokens":(\d+),"total_tokens":\d+,"completion_tokens":(\d+)'
    rb'(?:,"prompt_tokens_details":(?:null|\{"cached_tokens":\d+\}))?\}'
)
_EVENT_END = b"\n\n"
# A choice index longer than this is no vLLM's: the line reader takes it.
_MAX_INDEX_DIGITS = 9
# A token count longer than this does not fit the C scan's integers: the line reader takes it.
_MAX_COUNT_DIGITS = 18


def count_ids(event: bytes, start: int, stop: int) -> int:
    """The ids in ``event[start:stop]``, a JSON list's inside of integers: its commas and one."""
    return event.count(b",", start, stop) + 1 if stop > start else 0


def _one(
    event: bytes, keep_ids: bool, include_usage: bool, out: list[bytes]
) -> tuple[int, int, int] | None:
    """One event (without its blank line): its choice, tokens and prompt ids (-1: none), its
    bytes for the client appended to ``out``; None if it is not of the shape."""
    if not event.startswith(DATA) or event.find(b"\n") >= 0:
        return None
    start = event.rfind(IDS)
    if start < 0:
        return None
    stop = event.find(b"]", start)
    choices = CHOICES.search(event, 0, start)
    if stop < 0 or choices is None or choices.group(2) is None:
        return None
    index = choices.group(2)
    if len(index) > _MAX_INDEX_DIGITS:
        return None
    if not include_usage and event.find(TERMINAL, choices.end(), start) >= 0:
        return None  # a terminal chunk the fingerprint goes on
    prompt = event.find(PROMPT_IDS)
    if prompt > start:
        return None  # not the shape of vLLM's completions events
    tokens = count_ids(event, start + len(IDS), stop)
    prompt_tokens = -1
    if prompt >= 0:
        closed = event.find(b"]", prompt)
        if closed > start:
            return None  # the prompt's list does not close before the choice's ids
        prompt_tokens = count_ids(event, prompt + len(PROMPT_IDS), closed)
        if not keep_ids:
            out += (event[:prompt], NULL_PROMPT_IDS, event[closed + 1 : start], NULL_IDS)
            out += (event[stop + 1 :], _EVENT_END)
            return int(index), tokens, prompt_tokens
    if keep_ids:
        out += (event, _EVENT_END)
    else:
        out += (event[:start], NULL_IDS, event[stop + 1 :], _EVENT_END)
    return int(index), tokens, prompt_tokens


def scan_ids_py(data: bytes, keep_ids: bool, include_usage: bool) -> IdsRead | None:
    """``data``, whole events each ending in a blank line, if every one is an ordinary event
    of the ``token_ids`` scheme and all are one choice's: what the client gets, and the counts.
    ``keep_ids``: the client asked for the ids; ``include_usage``: for the usage chunk (so a
    terminal chunk is not held for the fingerprint). None: read it line by line."""
    return _scan(data, keep_ids, include_usage, _one, summed=True)


def one_usage(
    event: bytes, keep: bool, include_usage: bool, out: list[bytes]
) -> tuple[int, int, int] | None:
    """One event of the usage shape (without its blank line): its choice, completion tokens and
    prompt tokens, its bytes for the client appended to ``out``; None if it is not of the shape.
    ``keep``: the client asked for continuous usage, and the event goes as it came."""
    end = len(event) - 1  # the event's closing brace
    if not event.startswith(DATA) or event.find(b"\n") >= 0:
        return None
    start = event.rfind(USAGE_KEY, 0, end)
    exact = VLLM_USAGE.match(event, start) if start >= 0 else None
    if exact is None or exact.end() != end:
        return None
    choices = CHOICES.search(event, 0, start)
    if choices is None or choices.group(2) is None:
        return None  # the usage-only chunk, or choices in another shape
    index, tokens, prompt = choices.group(2), exact.group(2), exact.group(1)
    if len(index) > _MAX_INDEX_DIGITS or max(len(tokens), len(prompt)) > _MAX_COUNT_DIGITS:
        return None
    if not (keep or include_usage) and event.find(TERMINAL, choices.end(), start) >= 0:
        return None  # a terminal chunk the fingerprint goes on
    if keep:
        out += (event, _EVENT_END)
    else:
        out += (event[:start], event[end:], _EVENT_END)
    return int(index), int(tokens), int(prompt)


def scan_usage_py(data: bytes, keep: bool, include_usage: bool) -> UsageRead | None:
    """``data``, whole events each ending in a blank line, if every one is an ordinary event
    of the usage scheme and all are one choice's: what the client gets, and the counts.
    ``keep``: the client asked for continuous usage; ``include_usage``: for the final usage (so
    a terminal chunk is not held for the fingerprint). None: read it line by line."""
    # Each event's count is the choice's so far: the last event's is the read's.
    return _scan(data, keep, include_usage, one_usage, summed=False)


# One event's scanner: (event, keep, include_usage, out) -> (choice, tokens, prompt) or None.
_EventScan = Callable[[bytes, bool, bool, list[bytes]], tuple[int, int, int] | None]


def _scan(
    data: bytes, keep: bool, include_usage: bool, one: _EventScan, *, summed: bool
) -> tuple[bytes, int, int, int, int] | None:
    """The read loop both scans share (as the C one's ``scan_read``): every event by ``one``,
    all of one choice; the tokens ``summed`` over the events, or the last event's."""
    if not data.endswith(_EVENT_END) or data.endswith(b"\n\n\n"):
        return None  # an odd newline more after the last event is a line of its own
    if data.find(_EVENT_END) == len(data) - 2:
        events = [data[:-2]]  # one event, the read of a paced stream: no split
    else:
        events = data.split(_EVENT_END)
        events.pop()  # what follows the last blank line: nothing
    out: list[bytes] = []
    choice, tokens, prompt = -1, 0, -1
    for event in events:
        got = one(event, keep, include_usage, out)
        if got is None or choice not in (-1, got[0]):
            return None
        choice = got[0]
        tokens = tokens + got[1] if summed else got[1]
        prompt = max(prompt, got[2])
    # Every event kept whole is the read as it came.
    return data if keep else b"".join(out), choice, tokens, prompt, len(events)


def extensions_off() -> bool:
    """True when the environment asks for the Python scan (``KVTAX_NO_EXTENSIONS`` set, and not
    to ``0``)."""
    return os.environ.get("KVTAX_NO_EXTENSIONS", "") not in ("", "0")


Scan = Callable[[bytes, bool, bool], tuple[bytes, int, int, int, int] | None]


def _compiled() -> tuple[Scan, Scan] | None:
    if extensions_off():
        return None
    try:
        from kvtax.delivery._eventscan import scan_ids as ids
        from kvtax.delivery._eventscan import scan_usage as usage
    except ImportError:  # not built here (no C compiler at install): the Python ones
        return None
    return ids, usage


_NATIVE = _compiled()
# True when scan_ids and scan_usage are the C ones.
COMPILED = _NATIVE is not None
scan_ids: Scan = _NATIVE[0] if _NATIVE is not None else scan_ids_py
scan_usage: Scan = _NATIVE[1] if _NATIVE is not None else scan_usage_py
