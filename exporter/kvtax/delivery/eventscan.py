"""The relay's common read, counted and cut in one call: whole events of vLLM's ``token_ids``
shape, all of one choice.

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
    "IdsRead",
    "count_ids",
    "extensions_off",
    "scan_ids",
    "scan_ids_py",
]

# payload, choice, completion tokens, prompt tokens (-1: no prompt ids in the read), events.
IdsRead = tuple[bytes, int, int, int, int]

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
_EVENT_END = b"\n\n"
# A choice index longer than this is no vLLM's: the line reader takes it.
_MAX_INDEX_DIGITS = 9


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
    if not data.endswith(_EVENT_END) or data.endswith(b"\n\n\n"):
        return None  # an odd newline more after the last event is a line of its own
    out: list[bytes] = []
    if data.find(_EVENT_END) == len(data) - 2:
        # One event, the read of a paced stream: no split.
        one = _one(data[:-2], keep_ids, include_usage, out)
        if one is None:
            return None
        return data if keep_ids else b"".join(out), one[0], one[1], one[2], 1
    events = data.split(_EVENT_END)
    events.pop()  # what follows the last blank line: nothing
    choice, tokens, prompt = -1, 0, -1
    for event in events:
        one = _one(event, keep_ids, include_usage, out)
        if one is None or choice not in (-1, one[0]):
            return None
        choice = one[0]
        tokens += one[1]
        prompt = max(prompt, one[2])
    # Every event kept whole is the read as it came.
    payload = data if keep_ids else b"".join(out)
    return payload, choice, tokens, prompt, len(events)


def extensions_off() -> bool:
    """True when the environment asks for the Python scan (``KVTAX_NO_EXTENSIONS`` set, and not
    to ``0``)."""
    return os.environ.get("KVTAX_NO_EXTENSIONS", "") not in ("", "0")


def _compiled() -> Callable[[bytes, bool, bool], IdsRead | None] | None:
    if extensions_off():
        return None
    try:
        from kvtax.delivery._eventscan import scan_ids as native
    except ImportError:  # not built here (no C compiler at install): the Python one
        return None
    return native


_NATIVE = _compiled()
# True when scan_ids is the C one.
COMPILED = _NATIVE is not None
scan_ids: Callable[[bytes, bool, bool], IdsRead | None] = _NATIVE or scan_ids_py
