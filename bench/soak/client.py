"""The soak's clients: a deterministic mix of requests, and what each client saw of its answer.

:func:`plan` draws the mix from a seed. Each :class:`Spec` is a request body whose ``soak_*``
fields tell the upstream (:class:`kvtax_dev.fakevllm.faulty.Plan`) how to answer, so the client
knows what it should get. :func:`run_one` sends it through kvtax and behaves as its kind says;
it returns a :class:`~bench.soak.compare.ClientRecord` of what it actually saw (status, outcome,
tokens) and names any difference from what the upstream sent as a ``problem``.

Kinds: ``done_close`` reads a stream to ``[DONE]`` and closes the connection that instant (as
the OpenAI SDK does); ``full`` reads to the end and releases the connection normally;
``disconnect`` hangs up mid-stream while the upstream holds the stream; ``whole`` is
non-streamed, with a body of 1 KB to 3 MB arriving in several writes; ``error`` gets a 500 with
a JSON body; ``drop`` and ``drop_whole`` get an upstream that breaks off mid-stream or mid-body;
``slow`` reads a heavy stream a little at a time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.soak.compare import ClientRecord
from kvtax_dev.fakevllm.faulty import WORD

__all__ = ["HANGUP_MODEL", "KINDS", "MODEL", "SeenStream", "Spec", "plan", "run_one"]

MODEL = "tiny-llama"  # the model of the capture the upstream serves on /metrics
# Clients that hang up mid-stream use a model of their own: kvtax's delivered tokens for them
# are a range, and on a label of their own that range cannot hide tokens missing elsewhere.
HANGUP_MODEL = "tiny-llama-hangup"
# Kind and weight in the mix (per 1,000 requests).
KINDS = {
    "done_close": 300,
    "full": 230,
    "disconnect": 100,
    "whole": 250,
    "error": 50,
    "drop": 40,
    "drop_whole": 20,
    "slow": 10,
}
# Non-streamed body sizes (bytes) and their weights: mostly small, a few of several MB.
_SIZES = ((1_000, 40), (16_000, 30), (200_000, 15), (1_000_000, 10), (3_000_000, 5))
_SLOW_READ, _SLOW_PAUSE = 8192, 0.01


@dataclass(frozen=True, slots=True)
class Spec:
    """One request: its kind, path and body, and the tokens the upstream will send."""

    kind: str
    path: str
    body: dict[str, Any] = field(hash=False)
    tokens: int = 0
    after: int = 0  # for ``disconnect`` and ``drop``: tokens sent before the hold or the drop
    usage: str = "none"  # what a streaming client asked for: none, include or continuous


def _stream_body(rng: random.Random, tokens: int, model: str) -> tuple[dict[str, Any], str]:
    usage = rng.choice(("none", "include", "continuous"))
    body: dict[str, Any] = {"model": model, "stream": True, "max_tokens": tokens}
    if usage != "none":
        body["stream_options"] = {
            "include_usage": True,
            "continuous_usage_stats": usage == "continuous",
        }
    return body, usage


def _spec(rng: random.Random, kind: str) -> Spec:
    path = rng.choice(("/v1/completions", "/v1/chat/completions"))
    prompt = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {}
    if kind in ("whole", "drop_whole") or (kind == "error" and rng.random() < 0.5):
        size = rng.choices([s for s, _ in _SIZES], [w for _, w in _SIZES])[0]
        tokens = rng.randint(1, 64)
        body: dict[str, Any] = {"model": MODEL, "max_tokens": tokens, "soak_body_bytes": size}
        body |= {"soak_writes": rng.randint(2, 8), "soak_pause": rng.uniform(0, 0.02)}
        body["soak_length"] = rng.random() < 0.5
        if kind != "whole":
            body["soak_fault"] = "drop" if kind == "drop_whole" else "error"
        return Spec(kind, path, body | prompt, tokens)
    tokens = rng.randint(200, 300) if kind == "slow" else rng.randint(2, 64)
    body, usage = _stream_body(rng, tokens, HANGUP_MODEL if kind == "disconnect" else MODEL)
    after = rng.randint(1, tokens - 1)
    if kind in ("done_close", "full"):
        body["soak_per_chunk"] = rng.choice((1, 1, 1, 2, 3))
        body["soak_interval"] = rng.choice((0.0, 0.0, 0.0, 0.001))
    elif kind == "slow":
        body["soak_filler"] = 1000  # ~300 KB per stream: more than the sockets buffer
    elif kind == "disconnect":
        body |= {"soak_hold": True, "soak_after": after}
    elif kind in ("drop", "error"):
        body |= {"soak_fault": kind, "soak_after": after}
    return Spec(kind, path, body | prompt, tokens, after, usage)


def plan(requests: int, seed: int) -> list[Spec]:
    """``requests`` specs, the same for the same seed."""
    rng = random.Random(seed)
    kinds = rng.choices(list(KINDS), list(KINDS.values()), k=requests)
    return [_spec(rng, kind) for kind in kinds]


@dataclass(slots=True)
class SeenStream:
    """The events of one stream as its client parsed them."""

    usage_wish: str
    words: int = 0
    usage: int | None = None
    done: bool = False
    error: bool = False
    broken: bool = False  # the connection broke before the end of the stream
    problem: str = ""
    tail: bytes = b""

    def feed(self, data: bytes) -> None:
        events = (self.tail + data).split(b"\n\n")
        self.tail = events.pop()
        for event in events:
            self._event(event)

    def _event(self, event: bytes) -> None:
        if event == b"data: [DONE]":
            self.done = True
            return
        try:
            obj = json.loads(event.removeprefix(b"data: "))
        except ValueError:
            self.problem = f"an event that is not JSON: {event[:60]!r}"
            return
        if "error" in obj:
            self.error = True
            return
        choices = obj.get("choices") or []
        if obj.get("usage"):
            self.usage = obj["usage"]["completion_tokens"]
            # kvtax asks vLLM for usage on every chunk and must cut out what the client did not
            # ask for: none at all, or (include_usage alone) all but the usage-only chunk.
            if self.usage_wish == "none" or (self.usage_wish == "include" and choices):
                self.problem = "usage the client did not ask for"
        for choice in choices:
            text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            self.words += text.count(WORD)

    @property
    def tokens(self) -> int:
        return self.words if self.usage is None else self.usage


async def _read_stream(resp: aiohttp.ClientResponse, spec: Spec) -> tuple[SeenStream, bool]:
    """Read as the kind says; True when the client hung up before the end of the stream."""
    seen = SeenStream(spec.usage)
    if spec.kind == "slow":
        while data := await resp.content.read(_SLOW_READ):
            seen.feed(data)
            await asyncio.sleep(_SLOW_PAUSE)
        return seen, False
    try:
        async for data in resp.content.iter_any():
            seen.feed(data)
            if spec.kind == "done_close" and seen.done:
                resp.close()  # the instant [DONE] is read, before the end of the HTTP body
                return seen, False
            if spec.kind == "disconnect" and seen.words >= spec.after and not seen.done:
                resp.close()
                return seen, True
    except aiohttp.ClientPayloadError:
        seen.broken = True
    return seen, False


def _stream_record(spec: Spec, status: int, seen: SeenStream, hung_up: bool) -> ClientRecord:
    if hung_up:
        outcome = "client_disconnected"
    elif seen.error or seen.broken:
        outcome = "upstream_error"
    else:
        outcome = "completed" if seen.done else "stream_ended_without_done"
    problem = seen.problem
    if seen.usage is not None and seen.usage != seen.words:
        problem = problem or f"usage says {seen.usage} tokens, the text carried {seen.words}"
    return ClientRecord(spec.kind, outcome, status, seen.tokens, problem)


def _whole_record(spec: Spec, status: int, data: bytes) -> tuple[ClientRecord, str]:
    """The record of a non-streamed answer, and the error message it carried, if any."""
    outcome = "completed" if status < 400 else "upstream_4xx" if status < 500 else "upstream_error"
    try:
        answer = json.loads(data)
    except ValueError:
        problem = f"{status} with {len(data):,} bytes, not JSON"
        return ClientRecord(spec.kind, outcome, status, 0, problem), ""
    if status >= 300:
        error = answer.get("error") if isinstance(answer, dict) else None
        message = error.get("message", "") if isinstance(error, dict) else ""
        return ClientRecord(spec.kind, outcome, status), f"({message})"
    tokens = int(answer["usage"]["completion_tokens"])
    size = spec.body.get("soak_body_bytes", 0)
    problem = f"{len(data)} of {size} B" if len(data) != size else ""
    return ClientRecord(spec.kind, outcome, status, tokens, problem), ""


# The outcome each kind should end in, as its client sees it.
_EXPECTED = {
    "done_close": "completed",
    "full": "completed",
    "slow": "completed",
    "whole": "completed",
    "disconnect": "client_disconnected",
    "error": "upstream_error",
    "drop": "upstream_error",
    "drop_whole": "upstream_error",
}


def _judge(spec: Spec, record: ClientRecord, note: str = "") -> ClientRecord:
    """Name how the record differs from what the upstream sent for this spec."""
    if record.problem:
        return record
    if spec.kind == "error":
        tokens = 0
    elif spec.kind == "drop":
        tokens = spec.after
    else:
        tokens = 0 if spec.kind == "drop_whole" else spec.tokens
    problem = ""
    if record.outcome != _EXPECTED[spec.kind]:
        problem = f"expected {_EXPECTED[spec.kind]}, saw {record.status} {record.outcome} {note}"
    elif spec.kind == "error" and record.status != 500:
        problem = f"vLLM's 500 reached the client as {record.status}"
    elif spec.kind == "disconnect":
        problem = "" if record.tokens >= spec.after else f"hung up at {record.tokens} tokens"
    elif record.tokens != tokens:
        problem = f"expected {tokens} tokens, received {record.tokens}"
    return dataclasses.replace(record, problem=problem.strip())


async def run_one(session: aiohttp.ClientSession, base: str, spec: Spec) -> ClientRecord:
    """Send one request through kvtax, behave as its kind says, and record what was seen."""
    status, note = 0, ""
    try:
        async with session.post(base + spec.path, json=spec.body) as resp:
            status = resp.status
            if spec.body.get("stream") and resp.content_type == "text/event-stream":
                seen, hung_up = await _read_stream(resp, spec)
                record = _stream_record(spec, status, seen, hung_up)
            else:
                record, note = _whole_record(spec, status, await resp.read())
    except (aiohttp.ClientError, TimeoutError) as exc:
        # The client's view of a connection that broke: the server side failed it.
        record = ClientRecord(spec.kind, "upstream_error", status)
        note = f"({type(exc).__name__}: {exc})"
    return _judge(spec, dataclasses.replace(record, model=spec.body["model"]), note)
