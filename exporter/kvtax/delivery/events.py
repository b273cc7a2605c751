"""Streams of named events that carry no token count: counted as they pass, exact at their end.

vLLM's Anthropic Messages and OpenAI Responses APIs stream typed server-sent events
(``event: content_block_delta`` then ``data: {...}``), converted from its chat path inside the
API server. Neither puts a token count on the events that carry output: usage comes once, in
the stream's last events (Anthropic's ``message_delta``, the Responses API's
``response.completed``), and nothing a request can ask for adds one per event. (Measured on
vLLM 0.32: 12 tokens arrived in 7 Messages deltas and in 2 Responses deltas, its detokenizer
holding back bytes that are not yet whole characters.)

So :class:`EventCounter` counts what it can, at no cost to vLLM and none to the bytes:

- every **content event** (one that carries output: text, reasoning, a tool call's arguments)
  counts one token: each holds at least one, so the count is a floor, and it is what a stream
  cut before its end is credited with;
- the **final event**'s usage is the exact total, which a completed stream is counted by;
- the **done event** marks the stream's end, once its blank line has passed.

Nothing is cut: kvtax asks these APIs for nothing the client did not, so every byte goes on
as it came, and a read is scanned (a few C-level counts and finds), never parsed, but for the
final event's usage object. Pure: no I/O.

Example::

    counter = EventCounter(MESSAGES_EVENTS)      # kvtax.delivery.dialects.messages
    out = counter.feed(b'event: content_block_delta\\ndata: {...}\\n\\n')
    out.payload, out.completion_tokens           # the bytes as they came, 1
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtax.delivery.sse import Relayed
from kvtax.delivery.usage import UsageReader, UsageScanner

__all__ = ["EventCounter", "EventSpec"]

_EVENT_END = b"\n\n"


@dataclass(frozen=True, slots=True)
class EventSpec:
    """How one API's named events read. ``content`` is the byte pattern that marks each
    content event, ``empty`` one that marks a content event carrying no token (Anthropic's
    ``signature_delta``); ``final`` starts the event whose usage is the total, and ``done`` the
    event that ends the stream (both the event line, ``event: NAME\\n``); ``read`` reads the
    usage object."""

    content: bytes
    final: bytes
    done: bytes
    read: UsageReader
    empty: bytes | None = None

    @property
    def longest(self) -> int:
        patterns = (self.content, self.final, self.done, self.empty or b"", _EVENT_END)
        return max(len(p) for p in patterns)


class EventCounter:
    """Counts one stream of named events; see the module docstring. The attributes are those
    of :class:`~kvtax.delivery.dialects.base.StreamCounter`."""

    __slots__ = (
        "_ending",
        "_final",
        "_spec",
        "_tail",
        "completion_tokens",
        "done",
        "ended",
        "events",
        "final_completion_tokens",
        "ids_missing",
        "prompt_tokens",
        "usage_lines",
    )

    def __init__(self, spec: EventSpec) -> None:
        self._spec = spec
        self.completion_tokens = 0
        self.final_completion_tokens: int | None = None
        self.prompt_tokens = 0
        self.done = False
        # Never: these APIs do not define their end event as the last bytes of the body, so
        # the client's answer ends with vLLM's.
        self.ended = False
        self.events = 0
        self.usage_lines = 0
        self.ids_missing = 0  # no ids are asked for: never any missing
        # The last bytes of the previous read: a pattern can straddle two reads.
        self._tail = b""
        # The final event's bytes are scanned for its usage until the event ends.
        self._final: UsageScanner | None = None
        self._ending = False  # the done event began; done once its blank line passed

    @property
    def upstream_completion_tokens(self) -> int:
        return max(self.completion_tokens, self.final_completion_tokens or 0)

    def feed(self, data: bytes) -> Relayed:
        """Count one read; its bytes go on as they came."""
        spec, tail = self._spec, self._tail
        window = tail + data if tail else data
        seen = len(tail)
        content = _new(window, spec.content, seen)
        if spec.empty is not None:
            content -= _new(window, spec.empty, seen)
        self.completion_tokens += content
        self.events += _new(window, _EVENT_END, seen)
        if self.final_completion_tokens is None:
            self._scan_final(window, seen)
        if not self.done:
            self._watch_end(window, seen)
        self._tail = window[-(spec.longest - 1) :]
        return Relayed(data, self.completion_tokens)

    def finish(self) -> Relayed:
        """The stream ended: a final event cut short still gives what usage it held."""
        if self._final is not None:
            self._settle_final()
        return Relayed(b"", self.completion_tokens)

    def close(self) -> None:
        """Nothing is held: there is nothing to give back."""

    # -- the final event's usage, and the end ------------------------------------------------
    def _scan_final(self, window: bytes, seen: int) -> None:
        final = self._final
        if final is None:
            start = window.find(self._spec.final, _first(seen, self._spec.final))
            if start < 0:
                return
            final = self._final = UsageScanner(self._spec.read)
        else:
            start = seen
        end = window.find(_EVENT_END, start)
        final.feed(window[start : len(window) if end < 0 else end])
        if end >= 0:
            self._settle_final()

    def _settle_final(self) -> None:
        final, self._final = self._final, None
        tokens = final.tokens() if final is not None else None
        if tokens is None:
            return
        self.usage_lines += 1
        completion, prompt = tokens
        self.final_completion_tokens = completion
        self.prompt_tokens = max(self.prompt_tokens, prompt)
        # Every token is accounted for once the total is known: what is handed out from here
        # on brings the client up to it.
        self.completion_tokens = max(self.completion_tokens, completion)

    def _watch_end(self, window: bytes, seen: int) -> None:
        if not self._ending:
            start = window.find(self._spec.done, _first(seen, self._spec.done))
            if start < 0:
                return
            self._ending = True
        else:
            start = seen - 1 if seen else 0  # the blank line may have begun in the tail
        if window.find(_EVENT_END, start) >= 0:
            self.done = True


def _first(seen: int, pattern: bytes) -> int:
    """Where a match of ``pattern`` not counted with the previous read can start: one that
    starts earlier ends inside the tail, which that read held whole."""
    return max(0, seen - len(pattern) + 1)


def _new(window: bytes, pattern: bytes, seen: int) -> int:
    """Matches of ``pattern`` in ``window`` that the previous read did not count."""
    return window.count(pattern, _first(seen, pattern))
