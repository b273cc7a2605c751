"""vLLM's server-sent events, counted and rewritten so the client sees exactly what it asked for.

kvtax asks vLLM for what counts each event's tokens (:mod:`kvtax.delivery.asks`): by the
``token_ids`` scheme, each event's ids (``return_token_ids``) and the final usage chunk; by the
``usage`` scheme, a cumulative usage object in every event (``continuous_usage_stats``). The
client may have asked for less. :class:`StreamRewriter` takes upstream bytes as they arrive,
splits them into lines, counts each data line's tokens, and cuts out of the bytes what vLLM
would not have sent the client: the ids (``"token_ids":[...]`` and ``"prompt_token_ids":[...]``
become ``null``, as vLLM writes them when not asked), the ``usage`` field of ordinary chunks, the
trailing usage-only chunk; and it moves ``system_fingerprint`` back onto the terminal chunks,
where vLLM puts it when no usage chunk follows. Everything else passes byte for byte: the cut
is made on the raw bytes, never by re-serializing JSON, and an event with nothing to cut goes
out as it came. Pure: no I/O, no clock.

Working by line rather than by blank-line-separated event means an upstream that frames events
with single newlines is still read; a data line is read with or without the space after
``data:``, which the SSE spec makes optional. The common read (whole events of vLLM's own
shape, nothing held) is taken in one pass.

Lines end with LF, CRLF or a bare CR, as the SSE spec allows; each line goes out with the end
it came with. A bare CR is looked for only in a read that has one (vLLM writes LF), and a CR
that ends a read waits for the next byte, which may make it a CRLF.

``system_fingerprint``: vLLM computes it once at start and stamps it on the usage chunk that
kvtax asked for, so a client that asked for no usage must find it on each choice's terminal
chunk instead. A :class:`Fingerprint` shared by all streams learns it from every usage chunk;
once known, a terminal chunk is stamped as it passes, held by nothing. Until then a terminal
chunk is held for the usage chunk that names it, but never at the cost of another choice's
tokens (a line of another choice lets it go unstamped) and never past :data:`MAX_HELD` bytes.

A usage object is located on the bytes and then verified with a real JSON parse; a data line
whose usage cannot be parsed passes untouched and is counted (``unparsed``). An event of the
``token_ids`` scheme that carries no ids (a vLLM that ignored the field) counts as one token
(``ids_missing``; the proxy then asks this vLLM for usage instead). A line longer than the hold
limit, or one that would push every stream's held bytes over a shared :class:`HoldBudget`, is
passed on raw as it arrives (``oversized``): memory stays bounded and the client is never held
back, at the price of that line's count.

Example::

    wish, changes = with_usage(payload, "token_ids")   # kvtax.delivery.asks
    rw = StreamRewriter(wish, scheme="token_ids")
    out = rw.feed(b'data: {"id":"x","choices":[{"index":0,"text":"a","token_ids":[5]}]}\\n\\n')
    out.payload, out.completion_tokens   # ...,"token_ids":null}]}..., 1
"""

from __future__ import annotations

import re
from typing import NamedTuple

import orjson

from kvtax.delivery.asks import Scheme, UsageWish
from kvtax.delivery.eventscan import (
    CHOICES,
    DATA,
    IDS,
    NULL_IDS,
    NULL_PROMPT_IDS,
    PROMPT_IDS,
    TERMINAL,
    USAGE_KEY,
    VLLM_USAGE,
    IdsRead,
    UsageRead,
    count_ids,
    one_usage,
    scan_ids,
    scan_usage,
)
from kvtax.delivery.usage import usage_tokens

__all__ = ["MAX_HELD", "Fingerprint", "HoldBudget", "Relayed", "StreamRewriter"]

_USAGE_ANY = b'"usage"'
_DONE = (b"data: [DONE]", b"data:[DONE]")
# A chat role chunk (the first of each choice): no token, and vLLM gives it no ids.
_ROLE = b'"delta":{"role":'
# The usage-only chunk of the token_ids scheme, as vLLM writes it (include_usage).
_FINAL_USAGE = re.compile(
    rb'"usage":\{"prompt_tokens":(\d+),"total_tokens":\d+,"completion_tokens":(\d+)'
)
_FINGERPRINT = re.compile(rb'"system_fingerprint":("(?:[^"\\]|\\.)*")')
_NL = b"\n"
_EVENT_END = b"\n\n"

# A data line of vLLM's is a few hundred bytes; one this long is not worth holding to trim.
MAX_LINE = 256 * 1024
# Bytes of whole lines one stream may hold back waiting for the fingerprint (see the module doc).
MAX_HELD = 64 * 1024
_LINE_END = re.compile(rb"\r\n|\r|\n")


class Fingerprint:
    """vLLM's ``system_fingerprint`` as its last usage chunk named it (None: not seen yet)."""

    __slots__ = ("value",)

    def __init__(self, value: bytes | None = None) -> None:
        self.value = value


class HoldBudget:
    """Bytes all streams may hold back at once while waiting for a line to complete."""

    __slots__ = ("held", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def take(self, nbytes: int) -> bool:
        if self.held + nbytes > self.limit:
            return False
        self.held += nbytes
        return True

    def give(self, nbytes: int) -> None:
        self.held = max(0, self.held - nbytes)


class Relayed(NamedTuple):
    """Bytes to write to the client now, and the completion tokens they bring it up to (a
    tuple: one is made per read)."""

    payload: bytes
    completion_tokens: int


def _usage_span(line: bytes, start: int) -> tuple[int, int] | None:
    """Start and end of ``,"usage":{...}`` found at ``start`` in a data line, or None. A literal
    ``,"usage":{`` cannot occur inside a JSON string (its quotes would be escaped), and usage
    holds no strings with braces, so counting braces finds its end; the JSON parse that follows
    checks it."""
    pos = start + len(USAGE_KEY)
    depth = 1
    while depth:
        close = line.find(b"}", pos)
        if close < 0:
            return None
        depth += line.count(b"{", pos, close) - 1
        pos = close + 1
    return start, pos


def _parse_usage(line: bytes, span: tuple[int, int] | None) -> tuple[int, int] | None:
    if span is not None:
        try:
            return usage_tokens(orjson.loads(line[span[0] + len(USAGE_KEY) - 1 : span[1]]))
        except orjson.JSONDecodeError:
            return None
    # Not vLLM's compact form (spaces, another key order): read the whole event.
    try:
        event = orjson.loads(line[len(b"data:") :])
    except orjson.JSONDecodeError:
        return None
    return usage_tokens(event.get("usage")) if isinstance(event, dict) else None


def _stamped(line: bytes, cut: int, fingerprint: bytes) -> bytes:
    """``line`` with ``system_fingerprint`` where its usage was cut, as vLLM would have put it."""
    return line[:cut] + b',"system_fingerprint":' + fingerprint + line[cut:]


def _spaced_data(line: bytes) -> bool:
    """A data line whose JSON follows more whitespace than one space (the spec strips one
    space; JSON allows the rest). Only lines that are not ``data: {`` or ``data:{`` get here."""
    return line.startswith(b"data:") and line[5:].lstrip(b" \t").startswith(b"{")


class StreamRewriter:
    """Splits, counts and trims one stream. Feed it upstream bytes in arrival order.

    ``upstream_completion_tokens`` is what vLLM has sent so far, ``completion_tokens`` what has
    been handed out for writing; the difference is what a disconnect leaves undelivered.
    ``done`` is set once ``data: [DONE]`` has been handed out: the stream is complete.
    """

    def __init__(
        self,
        wish: UsageWish,
        *,
        scheme: Scheme = "usage",
        max_line: int = MAX_LINE,
        budget: HoldBudget | None = None,
        fingerprints: Fingerprint | None = None,
    ) -> None:
        self.wish = wish
        self.scheme = scheme
        self.ids_missing = 0
        self.events = 0  # events handed out whole (each ends at a blank line)
        self.max_line = max_line
        self.budget = budget
        self.fingerprints = fingerprints if fingerprints is not None else Fingerprint()
        self.prompt_tokens = 0
        self.final_completion_tokens: int | None = None
        self.completion_tokens = 0
        self.done = False
        self.ended = False  # the blank line after [DONE] went out too: nothing follows
        self.usage_lines = 0
        self.unparsed = 0
        self.oversized = 0
        self._buffer = bytearray()
        self._charged = 0  # bytes of _buffer taken from the budget
        self._raw = False  # passing an oversized line through until its newline
        self._skip_blank = False  # a dropped usage chunk's terminating blank line is next
        self._seen: dict[int, int] = {}
        self._emitted: dict[int, int] = {}
        # Held lines: bytes, cut position, choice, tokens, terminal (choice None: not data).
        self._held: list[tuple[bytes, int, int | None, int, bool]] = []
        self._held_bytes = 0
        # A hold was let go unstamped (another choice's line came, or MAX_HELD): hold no more.
        self._no_hold = False

    @property
    def upstream_completion_tokens(self) -> int:
        return max(sum(self._seen.values()), self.final_completion_tokens or 0)

    def feed(self, data: bytes) -> Relayed:
        # find(), not "in": bytes.__contains__ first tries its argument as an int, and the
        # TypeError it makes and drops costs more than the search (CPython 3.11).
        if data.find(b"\r") >= 0 or (self._buffer and self._buffer.endswith(b"\r")):
            return self._feed_any_ends(data)
        if not self._buffer and not self._raw and data.endswith(_EVENT_END):
            if not self._held and not self._skip_blank:
                # The common read, one call (see _events): tried here, a call sooner.
                wish = self.wish
                if self.scheme == "token_ids":
                    read = scan_ids(data, wish.token_ids, wish.include_usage)
                    if read is not None:
                        return self._scanned(read)
                else:
                    usage = scan_usage(data, wish.continuous, wish.include_usage)
                    if usage is not None:
                        return self._scanned_usage(usage)
            return self._events(data)
        return self._by_line(data)

    def _by_line(self, data: bytes) -> Relayed:
        """Any read of LF-ended lines: whole lines read one by one, a partial one held."""
        out: list[bytes] = []
        if self._raw:
            data = self._pass_raw(data, out)
        end = data.rfind(_NL)
        if end < 0:
            self._hold(data, out)
        else:
            if self._buffer:
                complete = bytes(self._buffer) + data[: end + 1]
                self._release()
            else:
                complete = data[: end + 1] if end + 1 < len(data) else data
            for line in complete.split(_NL)[:-1]:
                self._line(line, out)
            if end + 1 < len(data):
                self._hold(data[end + 1 :], out)
        return Relayed(b"".join(out), self.completion_tokens)

    def _events(self, data: bytes) -> Relayed:
        """The common read: whole events. A read whose events are all ordinary ones of one
        choice was counted and cut in one call before this (:meth:`feed`: :func:`scan_ids` or
        :func:`scan_usage`, in C where built); here each event of such a shape is, in one step,
        and any other goes line by line, which gives the same result for those. A read none of
        whose events needed a cut goes out as it came."""
        return self._each_event(data, self.scheme == "token_ids")

    def _scanned(self, read: IdsRead) -> Relayed:
        payload, choice, tokens, prompt, events = read
        self.events += events
        self._seen[choice] = self._emitted[choice] = self._seen.get(choice, 0) + tokens
        self.completion_tokens += tokens
        self.prompt_tokens = max(self.prompt_tokens, prompt)
        # tuple.__new__ in C: a NamedTuple's own __new__ is a Python function, a call per read.
        return tuple.__new__(Relayed, (payload, self.completion_tokens))

    def _scanned_usage(self, read: UsageRead) -> Relayed:
        payload, choice, tokens, prompt, events = read
        self.events += events
        self._usage_counted(choice, tokens, prompt, events)
        return tuple.__new__(Relayed, (payload, self.completion_tokens))

    def _usage_counted(self, choice: int, tokens: int, prompt: int, events: int) -> None:
        """``events`` ordinary events of the usage scheme read, the last saying ``choice`` has
        ``tokens`` so far (each event's count is the choice's so far)."""
        self.usage_lines += events
        self.prompt_tokens = max(self.prompt_tokens, prompt)
        self.completion_tokens += tokens - self._emitted.get(choice, 0)
        self._seen[choice] = self._emitted[choice] = tokens

    def _each_event(self, data: bytes, ids: bool) -> Relayed:
        """Whole events one by one: each of the common shape in one step, any other line by
        line."""
        out: list[bytes] = []
        events = data.split(_EVENT_END)
        if events.pop():
            # An odd newline after the last event: the read is lines, not events.
            return self._by_line(data)
        cut = False
        for event in events:
            if not self._held and not self._skip_blank:
                if ids:
                    wish = self.wish
                    read = scan_ids(event + _EVENT_END, wish.token_ids, wish.include_usage)
                    if read is not None:
                        cut = cut or not wish.token_ids
                        out.append(self._scanned(read).payload)
                        continue
                else:
                    kept = self._fast_usage(event, out)
                    if kept is not None:
                        self.events += 1
                        cut = cut or not kept
                        continue
            cut = True
            for line in event.split(_NL):
                self._line(line, out)
            self._line(b"", out)
        return Relayed(b"".join(out) if cut else data, self.completion_tokens)

    def _fast_usage(self, event: bytes, out: list[bytes]) -> bool | None:
        """An ordinary event of the usage scheme (:func:`~kvtax.delivery.eventscan.one_usage`:
        a data line whose last key is vLLM's own usage): counted and trimmed into ``out``.
        True: sent as it came; None: not such an event (nothing changed)."""
        keep = self.wish.continuous
        read = one_usage(event, keep, self.wish.include_usage, out)
        if read is None:
            return None
        self._usage_counted(*read, 1)
        return keep

    def _feed_any_ends(self, data: bytes) -> Relayed:
        """A read with a CR in it: lines split at LF, CRLF or a bare CR, each sent on with its
        own end. A CR that ends the read is held, to see whether an LF follows."""
        out: list[bytes] = []
        if self._raw:
            data = self._pass_raw(data, out, any_end=True)
        if self._buffer:
            data = bytes(self._buffer) + data
            self._release()
        pos = 0
        for match in _LINE_END.finditer(data):
            if match.group() == b"\r" and match.end() == len(data):
                break  # perhaps the first half of a CRLF
            self._line(data[pos : match.start()], out, match.group())
            pos = match.end()
        if pos < len(data):
            self._hold(data[pos:], out)
        return Relayed(b"".join(out), self.completion_tokens)

    def finish(self) -> Relayed:
        """End of the upstream stream: release held lines and any unterminated tail."""
        out: list[bytes] = []
        self._flush(None, out)
        if self._buffer:
            out.append(bytes(self._buffer))
            self._release()
        return Relayed(b"".join(out), self.completion_tokens)

    @property
    def held_bytes(self) -> int:
        """Bytes of a partial line held back, waiting for its end."""
        return len(self._buffer)

    def close(self) -> None:
        """Give back whatever the stream still holds of the shared budget."""
        self._release()

    # -- holding partial lines, within bounds --------------------------------------------------
    def _pass_raw(self, data: bytes, out: list[bytes], *, any_end: bool = False) -> bytes:
        """Inside an oversized line: pass bytes through up to and including its end (an LF, or
        with ``any_end`` a CR too)."""
        end = data.find(_NL)
        if any_end:
            cr = data.find(b"\r")
            if cr >= 0 and (end < 0 or cr < end):
                # A CRLF's LF goes with it; a CR that ends the read ends the line.
                end = cr + 1 if data[cr + 1 : cr + 2] == _NL else cr
        if end < 0:
            out.append(data)
            return b""
        out.append(data[: end + 1])
        self._raw = False
        return data[end + 1 :]

    def _hold(self, data: bytes, out: list[bytes]) -> None:
        if not data:
            return
        size = len(self._buffer) + len(data)
        needed = size - self._charged
        if size <= self.max_line and (self.budget is None or self.budget.take(needed)):
            self._buffer += data
            self._charged = size if self.budget is not None else 0
            return
        # Too long to hold: what is held goes first, then this line's bytes as they are.
        self.oversized += 1
        self._flush(None, out)
        if self._buffer:
            out.append(bytes(self._buffer))
            self._release()
        out.append(data)
        self._raw = True

    def _release(self) -> None:
        self._buffer = bytearray()
        if self.budget is not None and self._charged:
            self.budget.give(self._charged)
        self._charged = 0

    # -- one complete line ----------------------------------------------------------------------
    def _emit(self, line: bytes, choice: int | None, tokens: int, out: list[bytes]) -> None:
        out.append(line)
        if choice is not None:
            emitted = self._emitted
            self.completion_tokens += tokens - emitted.get(choice, 0)
            emitted[choice] = tokens

    def _flush(self, fingerprint: bytes | None, out: list[bytes]) -> None:
        for held, cut, choice, tokens, terminal in self._held:
            line = held
            if fingerprint is not None and terminal:
                line = _stamped(held, cut, fingerprint)
            self._emit(line, choice, tokens, out)
        self._held.clear()
        self._held_bytes = 0

    def _hold_line(self, item: tuple[bytes, int, int | None, int, bool], out: list[bytes]) -> None:
        """Hold a line for the fingerprint, within MAX_HELD; past it, let everything go."""
        self._held.append(item)
        self._held_bytes += len(item[0])
        if self._held_bytes > MAX_HELD:
            self._let_go(out)

    def _let_go(self, out: list[bytes]) -> None:
        """Release what is held unstamped, and hold nothing more in this stream."""
        self._no_hold = True
        self._flush(None, out)

    def _line(self, line: bytes, out: list[bytes], end: bytes = _NL) -> None:
        if self._skip_blank:
            self._skip_blank = False
            if not line.rstrip(b"\r"):
                return
        if not line or line == b"\r":
            self.events += 1  # the blank line that ends an event
            if self.done:
                self.ended = True
        if self.scheme == "token_ids" and (line.startswith(DATA) or _spaced_data(line)):
            self._ids_line(line, out, end=end)
            return
        if line.startswith(DATA) or _spaced_data(line):
            # vLLM's usage is the last key of its event: a search from the end finds it at once.
            start = line.rfind(USAGE_KEY)
            if start >= 0:
                exact = VLLM_USAGE.match(line, start)
                if exact is not None:
                    span = (start, exact.end())
                    tokens, prompt = int(exact.group(2)), int(exact.group(1))
                    self._counted(line, span, tokens, prompt, out, end=end)
                else:
                    self._usage_line(line, _usage_span(line, start), out, end)
                return
            if line.find(_USAGE_ANY) >= 0:
                self._usage_line(line, None, out, end)
                return
        elif line.rstrip(b"\r") in _DONE:
            self._flush(None, out)
            self.done = True
        self._pass(line + end, out)  # what follows a held line waits with it, in order

    def _ids_line(self, line: bytes, out: list[bytes], *, end: bytes) -> None:
        """A data line of the token_ids scheme: counted by its ids, which are cut to null
        unless the client asked for them."""
        choices = CHOICES.search(line)
        if choices is not None and choices.group(1):  # "choices":[]: the final usage chunk
            final = _FINAL_USAGE.search(line)
            parsed = (
                (int(final.group(2)), int(final.group(1)))
                if final is not None
                else _parse_usage(line, None)
            )
            if parsed is not None:
                self.usage_lines += 1
                self.prompt_tokens = max(self.prompt_tokens, parsed[1])
                self._final(line, parsed[0], out, end)
                return
            self.unparsed += 1
        if choices is None or choices.group(1):
            # Not a choice's event (an error event, say), or a usage chunk that does not parse:
            # it goes on as it came, in order.
            self._pass(line + end, out)
            return
        choice = int(choices.group(2) or 0)
        keep = self.wish.token_ids
        start = line.rfind(IDS)
        if start >= 0 and (stop := line.find(b"]", start)) >= 0:
            tokens = count_ids(line, start + len(IDS), stop)
            if not keep:
                line = line[:start] + NULL_IDS + line[stop + 1 :]
        elif line.find(_ROLE) >= 0:
            tokens = 0  # a chat role chunk: no token, no ids
        else:
            tokens = 1  # vLLM sent no ids though asked: the event counts as one token
            self.ids_missing += 1
        prompt = line.find(PROMPT_IDS)
        if prompt >= 0 and (stop := line.find(b"]", prompt)) >= 0:
            self.prompt_tokens = max(
                self.prompt_tokens, count_ids(line, prompt + len(PROMPT_IDS), stop)
            )
            if not keep:
                line = line[:prompt] + NULL_PROMPT_IDS + line[stop + 1 :]
        self._seen[choice] = self._seen.get(choice, 0) + tokens
        # vLLM puts the fingerprint last, before the event's closing brace.
        cut = len(line.rstrip(b"\r")) - 1
        self._place(line + end, cut, choice, self._seen[choice], out, choices=choices)

    def _pass(self, line: bytes, out: list[bytes]) -> None:
        """A line with nothing to count: out now, or behind what is held, in order."""
        if self._held:
            self._hold_line((line, 0, None, 0, False), out)
        else:
            out.append(line)

    def _usage_line(
        self, line: bytes, span: tuple[int, int] | None, out: list[bytes], end: bytes
    ) -> None:
        parsed = _parse_usage(line, span)
        if parsed is None:
            self.unparsed += 1
            self._flush(None, out)
            out.append(line + end)
            return
        self._counted(line, span, parsed[0], parsed[1], out, end=end)

    def _counted(
        self,
        line: bytes,
        span: tuple[int, int] | None,
        tokens: int,
        prompt: int,
        out: list[bytes],
        *,
        end: bytes,
    ) -> None:
        """A data line whose usage was read: ``tokens`` completion, ``prompt`` prompt tokens."""
        self.usage_lines += 1
        self.prompt_tokens = max(self.prompt_tokens, prompt)
        # The top-level choices come before the usage: one search finds them, and whether the
        # chunk is the usage-only one ("choices":[]).
        choices = CHOICES.search(line, 0, span[0] if span is not None else len(line))
        if choices is not None and choices.group(1):
            self._final(line, tokens, out, end)
        else:
            self._chunk(line, span, tokens, choices, out, end=end)

    def _final(self, line: bytes, tokens: int, out: list[bytes], end: bytes) -> None:
        """The trailing usage-only chunk: the exact total over all choices."""
        self.final_completion_tokens = tokens
        fp = _FINGERPRINT.search(line)
        if fp is not None:
            self.fingerprints.value = fp.group(1)
        if self.wish.include_usage:
            self._flush(None, out)
            out.append(line + end)
            self.completion_tokens = max(self.completion_tokens, tokens)
            return
        self._flush(fp.group(1) if fp else None, out)
        # The blank line that ends the dropped chunk goes with it.
        self._skip_blank = True

    def _chunk(
        self,
        line: bytes,
        span: tuple[int, int] | None,
        tokens: int,
        choices: re.Match[bytes] | None,
        out: list[bytes],
        *,
        end: bytes,
    ) -> None:
        """An ordinary chunk; ``choices`` is where its choices list opened, if found."""
        index = choices.group(2) if choices is not None else None
        choice = int(index) if index else 0
        self._seen[choice] = tokens
        if self.wish.continuous or span is None:
            # Continuous usage was asked for, or the usage is in a form we cannot cut cleanly.
            self._emit(line + end, choice, tokens, out)
            return
        start, stop = span
        self._place(line[:start] + line[stop:] + end, start, choice, tokens, out, choices=choices)

    def _place(
        self,
        line: bytes,
        cut: int,
        choice: int,
        tokens: int,
        out: list[bytes],
        *,
        choices: re.Match[bytes] | None,
    ) -> None:
        """An ordinary chunk, trimmed, bringing its choice to ``tokens``: out now, stamped
        with the fingerprint at ``cut`` if it is a terminal chunk the client gets none on, or
        held for the fingerprint."""
        if self.wish.include_usage:
            self._emit(line, choice, tokens, out)
            return
        after = choices.end() if choices is not None else 0
        terminal = line.find(TERMINAL, after, cut) >= 0
        if self._held and any(held[2] not in (None, choice) for held in self._held):
            # Another choice's tokens never wait for a fingerprint (n >= 2).
            self._let_go(out)
        known = self.fingerprints.value
        if terminal and known is not None and not self._held:
            # vLLM stamps system_fingerprint on terminal chunks only when no usage chunk
            # follows: known, it goes on now.
            self._emit(_stamped(line, cut, known), choice, tokens, out)
        elif (terminal and not self._no_hold) or self._held:
            # Not known yet: hold the terminal chunk (and, to keep the order, what comes
            # after) until the usage chunk tells it.
            self._hold_line((line, cut, choice, tokens, terminal), out)
        else:
            self._emit(line, choice, tokens, out)
