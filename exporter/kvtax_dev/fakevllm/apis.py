"""The bytes of vLLM 0.32's other generation APIs, built without I/O: the event builder's second
half (:mod:`kvtax_dev.fakevllm.events` has completions and chat).

Anthropic's ``/v1/messages`` and OpenAI's ``/v1/responses`` stream named events
(``event: <name>\\ndata: <json>\\n\\n``) with usage at their end only: :class:`Named` builds
one such stream, in the lean fields the unit tests' fake has always written or, ``full``, in
every field and the key order of a capture of the real engine (the relay bench's upstream). The
token-in, token-out ``/inference/v1/generate`` carries token ids in every event; the batch chat
API is a whole chat answer (:func:`~kvtax_dev.fakevllm.events.whole`). The audio APIs' streams
are replayed from a capture of vLLM's own generator, which the caller reads:
:func:`speech_chunks` parses it, :func:`speech_event` keeps each chunk's usage as the request's
options ask.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvtax_dev.fakevllm.events import dump, encode, usage

__all__ = [
    "GENERATE_ID",
    "Named",
    "generate_chunk",
    "generate_usage",
    "generate_whole",
    "named",
    "speech_chunks",
    "speech_event",
    "speech_text",
]


def named(name: str, data: dict[str, Any]) -> bytes:
    """One named event."""
    return b"event: %b\ndata: %b\n\n" % (name.encode(), dump(data))


_BLOCK_START = {"type": "content_block_start", "content_block": {"type": "text", "text": ""}}
_STOP = {"stop_reason": "max_tokens", "stop_sequence": None}


@dataclass(frozen=True)
class Named:
    """One stream of ``/v1/messages`` (``messages``) or ``/v1/responses``: its opening events,
    one content event per :meth:`delta`, and its closing events with the usage.

    A Responses stream numbers every event (``sequence_number``): the opening ones take
    0, 1, ...; the caller numbers its deltas and closing events on from :attr:`opened`.
    """

    messages: bool
    model: str = "m"
    prompt: int = 3
    # Every field vLLM writes, in its order (null ones too), and Responses' output item events.
    full: bool = False
    message_id: str = "msg-1"
    response_id: str = "resp-1"
    item_id: str = "msg-1"
    created: int = 1

    @property
    def opened(self) -> int:
        """How many events :meth:`opening` writes."""
        return 2 if self.messages or not self.full else 3

    def opening(self) -> list[bytes]:
        if self.messages:
            message = {"type": "message", "role": "assistant", "content": []}
            start: dict[str, Any] = {"id": self.message_id, "model": self.model, **message}
            if self.full:  # vLLM's order, and its null stop fields
                start = {"id": self.message_id, **message, "model": self.model}
                start |= {"stop_reason": None, "stop_sequence": None}
            start["usage"] = {"input_tokens": self.prompt, "output_tokens": 0}
            opened = _BLOCK_START | {"index": 0}
            return [
                named("message_start", {"type": "message_start", "message": start}),
                named("content_block_start", opened),
            ]
        kinds = ["response.created", "response.in_progress"]
        if self.full:
            kinds.append("response.output_item.added")
        return [self._response(kind, sequence) for sequence, kind in enumerate(kinds)]

    def delta(self, sequence: int, piece: str) -> bytes:
        """The content event of ``piece``; ``sequence`` numbers it in a Responses stream."""
        if self.messages:
            text = {"type": "text_delta", "text": piece}
            data = {"type": "content_block_delta", "index": 0, "delta": text}
            if self.full:  # vLLM writes the delta before the index
                data = {"type": "content_block_delta", "delta": text, "index": 0}
            return named("content_block_delta", data)
        kind = "response.output_text.delta"
        body: dict[str, Any] = {"content_index": 0, "delta": piece, "item_id": self.item_id}
        body["logprobs"] = []
        if self.full:
            body["output_index"] = 0
        return named(kind, body | {"sequence_number": sequence, "type": kind})

    def closing(self, sequence: int, sent: int) -> list[bytes]:
        """The events after the last delta, the first numbered ``sequence``; ``sent`` tokens."""
        if self.messages:
            spent = {"input_tokens": self.prompt, "output_tokens": sent}
            ended: dict[str, Any] = {"type": "message_delta", "usage": spent, "delta": _STOP}
            if self.full:
                ended = {"type": "message_delta", "delta": _STOP, "usage": spent}
            return [
                named("content_block_stop", {"type": "content_block_stop", "index": 0}),
                named("message_delta", ended),
                named("message_stop", {"type": "message_stop"}),
            ]
        kinds = ["response.output_text.done"]
        if self.full:
            kinds.append("response.output_item.done")
        kinds.append("response.completed")
        return [self._response(kind, sequence + i, sent) for i, kind in enumerate(kinds)]

    def _response(self, kind: str, sequence: int, sent: int = 0) -> bytes:
        completed = kind == "response.completed"
        data: dict[str, Any]
        if kind in ("response.created", "response.in_progress") or completed:
            data = {"response": self._state(completed, sent)}
        elif self.full:
            data = {"output_index": 0}
        else:  # the text's end, as the lean stream has always said it
            data = {"content_index": 0, "text": "x"}
        return named(kind, data | {"sequence_number": sequence, "type": kind})

    def _state(self, completed: bool, sent: int) -> dict[str, Any]:
        """The response object that opens and closes a Responses stream."""
        spent = None
        if completed:
            spent = {"input_tokens": self.prompt, "output_tokens": sent}
            spent["total_tokens"] = self.prompt + sent
        status = "completed" if completed else "in_progress"
        if self.full:
            state: dict[str, Any] = {"id": self.response_id, "created_at": self.created}
            state |= {"model": self.model, "object": "response", "output": []}
            return state | {"status": status, "usage": spent}
        # The lean stream opened with its item's id and closed with the response's.
        ident = self.response_id if completed else self.item_id
        return {"id": ident, "model": self.model, "status": status, "usage": spent}


GENERATE_ID = "generate-tokens-1"


def generate_chunk(index: int, step: int, finish: str | None) -> dict[str, Any]:
    """One event of ``/inference/v1/generate``: ``step`` token ids for choice ``index``."""
    choice: dict[str, Any] = {"index": index, "finish_reason": finish, "stop_reason": None}
    choice |= {"token_ids": list(range(100, 100 + step)), "logprobs": None}
    return {"request_id": GENERATE_ID, "usage": None, "output_mode": "tokens", "choices": [choice]}


def generate_usage(prompt: int, completion: int) -> dict[str, Any]:
    """generate's final event, when ``include_usage`` asked for it."""
    return {
        "request_id": GENERATE_ID,
        "usage": usage(prompt, completion),
        "output_mode": "tokens",
        "choices": [],
    }


def generate_whole(model: str, choices: int, tokens: int, prompt: int) -> dict[str, Any]:
    """generate's non-streamed answer: ``tokens`` ids per choice."""
    return {
        "request_id": GENERATE_ID,
        "usage": usage(prompt, tokens * choices),
        "model": model,
        "choices": [
            {"index": i, "finish_reason": "length", "token_ids": [7] * tokens}
            for i in range(choices)
        ],
    }


def speech_chunks(capture: bytes) -> list[dict[str, Any]]:
    """The chunks of a captured audio stream (its ``data: {...}`` events; ``[DONE]`` left)."""
    events = capture.split(b"\n\n")
    return [json.loads(e[6:]) for e in events if e.startswith(b"data: {")]


def speech_event(chunk: dict[str, Any], *, include: bool, continuous: bool) -> bytes | None:
    """A captured chunk as a request with these options gets it (None: not at all, the final
    usage chunk nobody asked for)."""
    if not chunk["choices"] and not include:
        return None
    if chunk["choices"] and not continuous:
        chunk = {key: value for key, value in chunk.items() if key != "usage"}
    return encode(chunk)


def speech_text(chunks: list[dict[str, Any]]) -> str:
    """The text of a captured stream, for the non-streamed answer."""
    return "".join(c["choices"][0]["delta"]["content"] for c in chunks if c["choices"])
