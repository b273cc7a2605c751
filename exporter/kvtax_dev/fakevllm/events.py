"""The bytes of vLLM 0.32's completions and chat answers, built without I/O: the event builder.

Every stand-in for vLLM in this checkout writes its OpenAI answers through this module, so
vLLM's rules are written once: ``data: <json>\\n\\n`` events; a chat stream opening with a role
chunk per choice; ``n`` choices in turn, ``per_chunk`` tokens per event; 0.32's
``prompt_token_ids`` and ``token_ids`` (null unless ``return_token_ids`` was asked, the prompt's
ids on a choice's first event); cumulative usage per choice with ``continuous_usage_stats``; a
usage-only chunk with ``include_usage``; ``system_fingerprint`` on the terminal chunks only when
no usage chunk follows; ``[DONE]``; and the whole (non-streamed) answers. What differs between
the stand-ins (a token's text, the ids, the fields vLLM writes null, ``data:`` without its
space) is a :class:`Style`; what one request asks for is an :class:`Ask`. The named-event APIs,
generate and the audio streams are in :mod:`kvtax_dev.fakevllm.apis`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "DONE",
    "FINGERPRINT",
    "RAW",
    "TESTS",
    "Ask",
    "Event",
    "Style",
    "completion_event",
    "done",
    "dump",
    "encode",
    "head",
    "role_chunk",
    "sse",
    "stream",
    "token_chunk",
    "usage",
    "usage_chunk",
    "usage_event",
    "whole",
]

FINGERPRINT = "vllm-0.32.0-fake1234"


def dump(obj: Any) -> bytes:
    """Compact JSON with text left as UTF-8, as vLLM's pydantic models serialize."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def usage(prompt: int, completion: int) -> dict[str, int]:
    """OpenAI usage, in the key order vLLM writes it."""
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }


def done(*, lead: bytes = b"data: ", end: bytes = b"\n\n") -> bytes:
    """A stream's last event, ``data: [DONE]``: ``lead`` ``b"data:"`` drops the space, ``end`` is
    what closes the event (``b""``: nothing, for a reader fed the line alone)."""
    return lead + b"[DONE]" + end


DONE = done()
# completion_event's keyword ``usage`` hides the function inside it.
_usage = usage


def encode(obj: dict[str, Any], *, lead: bytes = b"data: ") -> bytes:
    """One ``data:`` event of ``obj``, with its blank line."""
    return lead + dump(obj) + b"\n\n"


def sse(payload: dict[str, Any] | str, newline: bytes = b"\n") -> bytes:
    """One event as a raw script writes it: ``data: <json>`` (a str as it is, such as
    ``"[DONE]"``), each of its two line ends ``newline`` (a test of CRLF framing passes
    ``b"\\r\\n"``)."""
    data = payload.encode() if isinstance(payload, str) else dump(payload)
    return b"data: " + data + newline + newline


@dataclass(frozen=True)
class Style:
    """How one stand-in writes what vLLM writes: the parts its users have always differed in.

    The defaults are the unit tests' aiohttp fake (:data:`TESTS`); :data:`RAW` is the raw
    transport's; the benches' upstreams define their own.
    """

    id: str = "cmpl-1"
    # The usage-only chunk's id where it is not ``id`` (the relay bench's upstream).
    usage_id: str | None = None
    created: int = 1
    # When set, ``created`` is read from it for each event (the soak's wall clock).
    clock: Callable[[], int] | None = None
    # One token's text: a quote and braces in it catch a reader that scans JSON by hand.
    piece: str = 'ab"c}{'
    # vLLM's null fields: ``logprobs`` before finish_reason (and both in the role chunk),
    # ``stop_reason`` after it.
    logprobs: bool = False
    stop_reason: bool = False
    # 0.32's token id fields, null unless the request asked for them.
    ids: bool = True
    # Every prompt token's id; None counts them 1, 2, 3...
    prompt_id: int | None = 11
    # The first token id of each event; with ``count_ids``, of the stream (ids go on counting).
    first_token_id: int = 100
    count_ids: bool = False
    # A chat stream opens with a role chunk per choice.
    role: bool = True
    fingerprint: str | None = FINGERPRINT
    # Also on the terminal chunks when no usage chunk follows (vLLM's rule).
    terminal_fingerprint: bool = True
    # A whole answer with only id, model, choices (index and content) and usage.
    bare_whole: bool = False
    # ``b"data:"`` frames events without the space (vLLM never does; a reader must not care).
    lead: bytes = b"data: "


TESTS = Style()
RAW = Style(piece="t", ids=False, role=False, bare_whole=True)


@dataclass(frozen=True)
class Ask:
    """What one request asks for, as the stand-in read it."""

    chat: bool = False
    model: str = "m"
    # Completion tokens per choice, and the choices (``n`` times the prompts).
    tokens: int = 5
    choices: int = 1
    # One prompt's tokens, and how many prompts usage counts.
    prompt: int = 3
    prompts: int = 1
    per_chunk: int = 1
    # Characters added to each event's text, to make a stream heavy.
    filler: int = 0
    tools: bool = False
    include: bool = False
    continuous: bool = False
    ids: bool = False

    @property
    def prompt_tokens(self) -> int:
        return self.prompt * self.prompts


def head(
    style: Style, ask: Ask, *, whole: bool = False, chunk_id: str | None = None
) -> dict[str, Any]:
    """The fields every answer and chunk opens with."""
    kind = "chat.completion" if ask.chat else "text_completion"
    if ask.chat and not whole:
        kind += ".chunk"
    created = style.clock() if style.clock is not None else style.created
    return {"id": chunk_id or style.id, "object": kind, "created": created, "model": ask.model}


def _prompt_ids(style: Style, count: int) -> list[int]:
    if style.prompt_id is None:
        return list(range(1, count + 1))
    return [style.prompt_id] * count


def _token_ids(style: Style, sent: int, step: int) -> list[int]:
    first = style.first_token_id + (sent if style.count_ids else 0)
    return list(range(first, first + step))


def role_chunk(style: Style, ask: Ask, index: int) -> dict[str, Any]:
    """Choice ``index``'s opening chat chunk: the role, no tokens; the prompt's ids at the top
    level (the first choice's only)."""
    choice: dict[str, Any] = {"index": index, "delta": {"role": "assistant", "content": ""}}
    if style.logprobs:
        choice |= {"logprobs": None, "finish_reason": None}
    chunk = head(style, ask)
    chunk["choices"] = [choice]
    if style.ids:
        chunk["prompt_token_ids"] = (
            _prompt_ids(style, ask.prompt) if ask.ids and not index else None
        )
    if ask.continuous:
        chunk["usage"] = usage(ask.prompt_tokens, 0)
    return chunk


def _content(ask: Ask, text: str, step: int) -> dict[str, Any]:
    if not ask.chat:
        return {"text": text}
    if ask.tools:
        call = {"index": 0, "function": {"arguments": '{"usage":{' * step}}
        return {"delta": {"tool_calls": [call]}}
    return {"delta": {"content": text}}


def token_chunk(style: Style, ask: Ask, index: int, sent: int, step: int) -> dict[str, Any]:
    """Choice ``index``'s chunk of ``step`` tokens after the ``sent`` it already has."""
    finish = "length" if sent + step == ask.tokens else None
    choice: dict[str, Any] = {"index": index}
    choice |= _content(ask, style.piece * step + "." * ask.filler, step)
    if style.logprobs:
        choice["logprobs"] = None
    choice["finish_reason"] = finish
    if style.stop_reason:
        choice["stop_reason"] = None
    if style.ids:
        if not ask.chat:  # a chat stream's prompt ids are in its role chunk
            first = ask.ids and sent == 0
            choice["prompt_token_ids"] = _prompt_ids(style, ask.prompt) if first else None
        choice["token_ids"] = _token_ids(style, sent, step) if ask.ids else None
    chunk = head(style, ask)
    chunk["choices"] = [choice]
    if ask.continuous:
        chunk["usage"] = usage(ask.prompt_tokens, sent + step)
    terminal = finish is not None and style.terminal_fingerprint and not ask.include
    if terminal and style.fingerprint is not None:
        chunk["system_fingerprint"] = style.fingerprint
    return chunk


def usage_chunk(style: Style, ask: Ask, completion: int) -> dict[str, Any]:
    """The usage-only chunk ``include_usage`` asks for: no choices, the stream's totals."""
    chunk = head(style, ask, chunk_id=style.usage_id)
    chunk["choices"] = []
    chunk["usage"] = usage(ask.prompt_tokens, completion)
    if style.fingerprint is not None:
        chunk["system_fingerprint"] = style.fingerprint
    return chunk


@dataclass(frozen=True)
class Event:
    """One event of a stream, with what a transport paces or breaks it by."""

    kind: Literal["role", "token", "usage", "done"]
    index: int  # the choice (0 for the usage chunk and [DONE])
    sent: int  # the choice's tokens before this event (the stream's, after it, for the last two)
    data: bytes


def stream(style: Style, ask: Ask) -> Iterator[Event]:
    """The whole stream of ``ask``, event by event, each built as it is asked for."""
    if ask.chat and style.role:
        for index in range(ask.choices):
            yield Event("role", index, 0, encode(role_chunk(style, ask, index), lead=style.lead))
    sent = [0] * ask.choices
    while sum(sent) < ask.tokens * ask.choices:
        for index in range(ask.choices):  # each choice in turn, as vLLM's output loop sends
            step = min(ask.per_chunk, ask.tokens - sent[index])
            chunk = token_chunk(style, ask, index, sent[index], step)
            yield Event("token", index, sent[index], encode(chunk, lead=style.lead))
            sent[index] += step
    total = sum(sent)
    if ask.include:
        yield Event("usage", 0, total, encode(usage_chunk(style, ask, total), lead=style.lead))
    yield Event("done", 0, total, done(lead=style.lead))


def _whole_choice(style: Style, ask: Ask, index: int, text: str) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index}
    if not ask.chat:
        choice["text"] = text
    elif ask.tools:
        function = {"name": "f", "arguments": "{}"}
        call = {"id": "call-1", "type": "function", "function": function}
        choice["message"] = {"role": "assistant", "content": None, "tool_calls": [call]}
    else:
        choice["message"] = {"role": "assistant", "content": text}
    if not style.bare_whole:
        choice["finish_reason"] = "length"
    return choice


def whole(style: Style, ask: Ask, text: str) -> dict[str, Any]:
    """A non-streamed answer: ``ask.choices`` choices of ``text``, and the usage of
    ``ask.tokens`` per choice."""
    if style.bare_whole:
        answer: dict[str, Any] = {"id": style.id, "model": ask.model}
    else:
        answer = head(style, ask, whole=True)
    answer["choices"] = [_whole_choice(style, ask, i, text) for i in range(ask.choices)]
    answer["usage"] = usage(ask.prompt_tokens, ask.tokens * ask.choices)
    return answer


def completion_event(
    index: int,
    text: str,
    *,
    finish: str | None = None,
    usage: tuple[int, int] | None = None,
    chat: bool = False,
    fingerprint: bool = False,
    model: str = "m",
) -> dict[str, Any]:
    """One chunk of a raw script's own making, in :data:`RAW`'s style: ``usage`` is (prompt,
    completion) tokens, cumulative for this choice (``continuous_usage_stats``)."""
    choice: dict[str, Any] = {"index": index, **_content(Ask(chat=chat), text, 1)}
    choice["finish_reason"] = finish
    chunk = head(RAW, Ask(chat=chat, model=model))
    chunk["choices"] = [choice]
    if usage is not None:
        chunk["usage"] = _usage(*usage)
    if fingerprint:
        chunk["system_fingerprint"] = FINGERPRINT
    return chunk


def usage_event(
    prompt: int, completion: int, *, chat: bool = False, model: str = "m"
) -> dict[str, Any]:
    """The usage-only chunk (``include_usage``) of a raw script's own making."""
    return usage_chunk(RAW, Ask(chat=chat, model=model, prompt=prompt), completion)
