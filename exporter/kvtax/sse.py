"""vLLM's server-sent events, rewritten so the client sees exactly what it asked for.

The proxy asks vLLM for usage on every chunk (``stream_options.include_usage`` and
``continuous_usage_stats``) because that is the only exact token count a stream carries. The
client may have asked for less. :class:`StreamRewriter` takes upstream bytes as they arrive,
splits them into events, reads each event's cumulative completion tokens, and cuts out of the
bytes what vLLM would not have sent the client: the ``usage`` field of ordinary chunks, the
trailing usage-only chunk, and it moves ``system_fingerprint`` back onto the terminal chunks,
where vLLM puts it when no usage chunk follows. Everything else passes byte for byte: the cut is
made on the raw bytes, never by re-serializing JSON. Pure: no I/O, no clock.

Example::

    wish, upstream = with_usage({"model": "m", "prompt": "hi", "stream": True})
    rw = StreamRewriter(wish)
    out = rw.feed(b'data: {"id":"x","choices":[{"index":0,"text":"a"}],"usage":{...}}\\n\\n')
    out.payload, out.completion_tokens
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

__all__ = ["Relayed", "StreamRewriter", "UsageWish", "with_usage"]

_USAGE_KEY = b',"usage":{'
_FINAL_CHOICES = b'"choices":[]'
_TERMINAL = b'"finish_reason":"'
_COMPLETION = re.compile(rb'"completion_tokens":(\d+)')
_PROMPT = re.compile(rb'"prompt_tokens":(\d+)')
_INDEX = re.compile(rb'"choices":\[\{"index":(\d+)')
_FINGERPRINT = re.compile(rb'"system_fingerprint":("(?:[^"\\]|\\.)*")')
_SEP = b"\n\n"


@dataclass(frozen=True, slots=True)
class UsageWish:
    """What the client asked vLLM to report (vLLM's own rule: continuous needs include)."""

    include_usage: bool = False
    continuous: bool = False


def with_usage(payload: dict[str, Any]) -> tuple[UsageWish, dict[str, Any]]:
    """The client's wish, and a copy of a streaming request that asks vLLM for full usage."""
    options = payload.get("stream_options")
    options = options if isinstance(options, dict) else {}
    include = options.get("include_usage") is True
    wish = UsageWish(include, include and options.get("continuous_usage_stats") is True)
    upstream = dict(payload)
    upstream["stream_options"] = {
        **options,
        "include_usage": True,
        "continuous_usage_stats": True,
    }
    return wish, upstream


@dataclass(frozen=True, slots=True)
class Relayed:
    """Bytes to write to the client now, and the completion tokens they bring it up to."""

    payload: bytes
    completion_tokens: int


def _usage_span(event: bytes) -> tuple[int, int] | None:
    """Start and end of ``,"usage":{...}`` in an event, or None. Usage holds no strings with
    braces, so counting braces is exact; a literal ``,"usage":{`` cannot occur inside a JSON
    string (its quotes would be escaped)."""
    start = event.rfind(_USAGE_KEY)
    if start < 0:
        return None
    pos = start + len(_USAGE_KEY)
    depth = 1
    while depth:
        close = event.find(b"}", pos)
        if close < 0:
            return None
        opened = event.count(b"{", pos, close)
        depth += opened - 1
        pos = close + 1
    return start, pos


class StreamRewriter:
    """Splits, counts and trims one stream. Feed it upstream bytes in arrival order.

    ``upstream_completion_tokens`` is what vLLM has sent so far, ``completion_tokens`` what has
    been handed out for writing; the difference is what a disconnect leaves undelivered.
    """

    def __init__(self, wish: UsageWish) -> None:
        self.wish = wish
        self.prompt_tokens = 0
        self.final_completion_tokens: int | None = None
        self._buffer = b""
        self._seen: dict[int, int] = {}
        self._emitted: dict[int, int] = {}
        # Held events: bytes, cut position, choice, tokens, and whether it is terminal.
        self._held: list[tuple[bytes, int, int, int, bool]] = []
        self.completion_tokens = 0

    @property
    def upstream_completion_tokens(self) -> int:
        return max(sum(self._seen.values()), self.final_completion_tokens or 0)

    def feed(self, data: bytes) -> Relayed:
        buffer = self._buffer + data if self._buffer else data
        end = buffer.rfind(_SEP)
        if end < 0:
            self._buffer = buffer
            return Relayed(b"", self.completion_tokens)
        self._buffer = buffer[end + 2 :]
        out: list[bytes] = []
        for event in buffer[: end + 2].split(_SEP)[:-1]:
            self._event(event + _SEP, out)
        return Relayed(b"".join(out), self.completion_tokens)

    def finish(self) -> Relayed:
        """End of the upstream stream: release held chunks and any unterminated tail."""
        out: list[bytes] = []
        self._flush(None, out)
        if self._buffer:
            out.append(self._buffer)
            self._buffer = b""
        return Relayed(b"".join(out), self.completion_tokens)

    def _emit(self, event: bytes, choice: int | None, tokens: int | None, out: list[bytes]) -> None:
        out.append(event)
        if choice is not None and tokens is not None:
            self._emitted[choice] = tokens
            self.completion_tokens = sum(self._emitted.values())

    def _flush(self, fingerprint: bytes | None, out: list[bytes]) -> None:
        for event, cut, choice, tokens, terminal in self._held:
            stamped = event
            if fingerprint is not None and terminal:
                stamped = event[:cut] + b',"system_fingerprint":' + fingerprint + event[cut:]
            self._emit(stamped, choice, tokens, out)
        self._held.clear()

    def _event(self, event: bytes, out: list[bytes]) -> None:
        span = _usage_span(event) if event.startswith(b"data: {") else None
        if span is None:
            # [DONE], comments, error events: vLLM's own bytes, untouched.
            self._flush(None, out)
            out.append(event)
            return
        start, end = span
        usage = event[start:end]
        found = _COMPLETION.search(usage)
        tokens = int(found.group(1)) if found else 0
        prompt = _PROMPT.search(usage)
        if prompt is not None:
            self.prompt_tokens = max(self.prompt_tokens, int(prompt.group(1)))

        if _FINAL_CHOICES in event:
            # The trailing usage-only chunk: the exact total over all choices.
            self.final_completion_tokens = tokens
            if self.wish.include_usage:
                self._flush(None, out)
                out.append(event)
                self.completion_tokens = max(self.completion_tokens, tokens)
            else:
                fp = _FINGERPRINT.search(event)
                self._flush(fp.group(1) if fp else None, out)
            return

        index = _INDEX.search(event)
        choice = int(index.group(1)) if index else 0
        self._seen[choice] = tokens
        if self.wish.continuous:
            self._emit(event, choice, tokens, out)
            return
        trimmed = event[:start] + event[end:]
        terminal = _TERMINAL in event
        if not self.wish.include_usage and (terminal or self._held):
            # vLLM stamps system_fingerprint on terminal chunks only when no usage chunk
            # follows; hold them (and, to keep the order, what comes after) until the usage
            # chunk tells us the fingerprint.
            self._held.append((trimmed, start, choice, tokens, terminal))
            return
        self._emit(trimmed, choice, tokens, out)
