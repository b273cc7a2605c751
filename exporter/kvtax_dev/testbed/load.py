"""Async load driver for the testbed engine (or a proxy in front of it).

:func:`drive` fires OpenAI-style completion or chat requests at a fixed concurrency and
returns one :class:`RequestResult` per request. Requests use ``ignore_eos`` and a fixed
``max_tokens`` so every request generates exactly as much as asked: that is what makes
KV demand, and therefore preemption, predictable. Used by the e2e tests, the demo and
the benchmarks.

Depends only on the standard library and aiohttp.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

# 40 tokens with the tiny model's tokenizer, so 41 with the BOS it prepends on
# /v1/completions. (Chat requests add the template's role markers on top.)
PROMPT = (
    "Please write a long story about a lighthouse keeper who counts the ships "
    "that pass at night and the sea."
)
PROMPT_TOKENS = 41
# Token ids a distinct prompt is drawn from: inside the tiny model's vocabulary (512), above the
# few ids its tokenizer reserves for special tokens.
_PROMPT_IDS = range(16, 500)


def distinct_prompts(count: int, tokens: int, seed: int = 0) -> list[list[int]]:
    """``count`` prompts of ``tokens`` token ids each that share no prefix block: what makes
    vLLM's prefix cache hold nothing for a request but its own KV. The completions API takes a
    prompt as token ids, so each is exactly ``tokens`` long (vLLM adds no BOS to ids)."""
    rng = random.Random(seed)
    return [[rng.choice(_PROMPT_IDS) for _ in range(tokens)] for _ in range(count)]


@dataclass(frozen=True, slots=True)
class RequestResult:
    """What one client saw for one request."""

    index: int
    status: int
    """HTTP status; 0 when no response arrived (connection error or timeout)."""
    completion_tokens: int | None
    """``usage.completion_tokens`` when the server reported usage, else None."""
    prompt_tokens: int | None
    chunks: int
    """Streamed SSE events that carried a choice (0 for non-streamed requests)."""
    text: str
    finish_reason: str | None
    ttft_s: float | None
    """Seconds from sending to the first streamed text; None if none arrived or not streamed."""
    latency_s: float
    disconnected: bool
    """True when the client closed the stream early on purpose."""
    error: str | None = None
    arrivals: tuple[float, ...] = ()
    """Seconds from sending to each streamed event that carried text (empty if not streamed)."""

    @property
    def ok(self) -> bool:
        """Completed with HTTP 200, without an intentional or accidental cut."""
        return self.status == 200 and not self.disconnected and self.error is None


def _body(
    model: str,
    *,
    prompt: str | Sequence[int],
    max_tokens: int,
    stream: bool,
    include_usage: bool | None,
    continuous_usage: bool,
    chat: bool,
    seed: int,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        # vLLM extension: generate max_tokens regardless of EOS, so demand is fixed.
        "ignore_eos": True,
        "stream": stream,
        "seed": seed,
    }
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt if isinstance(prompt, str) else list(prompt)
    if stream and include_usage is not None:
        options: dict[str, bool] = {"include_usage": include_usage}
        if continuous_usage:
            options["continuous_usage_stats"] = True
        body["stream_options"] = options
    return body


def _choice_text(choice: dict[str, Any], chat: bool) -> str:
    if chat:
        # Streamed chat puts text in delta, non-streamed in message.
        part = choice.get("delta") or choice.get("message") or {}
        return str(part.get("content") or "")
    return str(choice.get("text") or "")


@dataclass(slots=True)
class _Seen:
    """What the client has read of one answer so far."""

    began: float
    chat: bool
    chunks: int = 0
    parts: list[str] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    ttft: float | None = None
    arrivals: list[float] = field(default_factory=list)

    def choices(self, choices: list[dict[str, Any]], streamed: bool) -> None:
        texts = [_choice_text(choice, self.chat) for choice in choices]
        if streamed and any(texts):
            self.arrivals.append(time.monotonic() - self.began)
            if self.ttft is None:
                self.ttft = self.arrivals[0]
        for choice, text in zip(choices, texts, strict=True):
            self.parts.append(text)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason


async def _read_stream(
    resp: aiohttp.ClientResponse, seen: _Seen, disconnect_after_chunks: int | None
) -> bool:
    """Read SSE events into ``seen``; True when the client hung up on purpose."""
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            break
        event = json.loads(data)
        seen.usage = event.get("usage") or seen.usage
        choices = event.get("choices") or []
        if not choices:
            continue  # the trailing usage-only event
        seen.chunks += 1
        seen.choices(choices, streamed=True)
        if disconnect_after_chunks is not None and seen.chunks >= disconnect_after_chunks:
            # Drop the connection mid-stream, as an impatient client would; vLLM should
            # notice and abort the request.
            resp.close()
            return True
    return False


async def _one(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    *,
    index: int,
    chat: bool,
    disconnect_after_chunks: int | None,
    on_head: Callable[[int], None] | None = None,
) -> RequestResult:
    seen = _Seen(began=time.monotonic(), chat=chat)
    status = 0
    disconnected = False
    error: str | None = None
    try:
        async with session.post(url, json=body) as resp:
            status = resp.status
            if on_head is not None:
                on_head(index)
            if status != 200:
                error = (await resp.text())[:500]
            elif body["stream"]:
                disconnected = await _read_stream(resp, seen, disconnect_after_chunks)
            else:
                payload = await resp.json()
                seen.usage = payload.get("usage")
                seen.choices(payload.get("choices", []), streamed=False)
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    usage = seen.usage
    return RequestResult(
        index=index,
        status=status,
        completion_tokens=None if usage is None else usage.get("completion_tokens"),
        prompt_tokens=None if usage is None else usage.get("prompt_tokens"),
        chunks=seen.chunks,
        text="".join(seen.parts),
        finish_reason=seen.finish_reason,
        ttft_s=seen.ttft,
        latency_s=time.monotonic() - seen.began,
        disconnected=disconnected,
        error=error,
        arrivals=tuple(seen.arrivals),
    )


async def drive(
    url: str,
    model: str,
    *,
    concurrency: int,
    max_tokens: int,
    stream: bool,
    include_usage: bool | None = None,
    disconnect_after_chunks: int | None = None,
    chat: bool = False,
    seed: int = 0,
    requests: int | None = None,
    prompt: str = PROMPT,
    prompts: Sequence[str | Sequence[int]] | None = None,
    continuous_usage: bool = False,
    timeout_s: float = 600.0,
    for_seconds: float | None = None,
    on_head: Callable[[int], None] | None = None,
) -> list[RequestResult]:
    """Send ``requests`` (default: ``concurrency``) requests, ``concurrency`` at a time; or,
    with ``for_seconds``, keep ``concurrency`` in flight until that many seconds have passed,
    then send no more and wait for those still open (``requests`` is then ignored).

    ``url`` is the server base (``http://host:port``); the path is /v1/completions, or
    /v1/chat/completions with ``chat``. ``include_usage`` sets
    ``stream_options.include_usage`` on streamed requests (None leaves it unset, as most
    clients do). Request *i* carries ``seed + i``, and ``prompts[i % len(prompts)]`` when
    ``prompts`` is given (text or token ids, e.g. :func:`distinct_prompts`), else ``prompt``.
    Results are in request order.

    A load for a time, not a count, holds its overload for as long on a fast machine as on a
    slow one: a test that compares seconds of steady overload gets the same number of them.

    ``on_head(i)`` is called as request *i*'s response head arrives: vLLM sends a stream's head
    as it takes the request, before any token, so a test holding the engine still
    (:mod:`kvtax_dev.testbed.freeze`) knows when every request is in.
    """
    total = concurrency if requests is None else requests
    endpoint = url.rstrip("/") + ("/v1/chat/completions" if chat else "/v1/completions")
    # No connection cap beyond ours: aiohttp's default of 100 would silently throttle. And a
    # fresh connection per request: a pooled keep-alive connection that the server closes just
    # as it is reused fails with ServerDisconnectedError before the request reaches the server
    # (seen in CI against vLLM's uvicorn mid-overload: 13 of 192 requests). A load generator must
    # not invent failures; loopback connects cost microseconds.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=timeout_s)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one(index: int) -> RequestResult:
            body = _body(
                model,
                prompt=prompt if not prompts else prompts[index % len(prompts)],
                max_tokens=max_tokens,
                stream=stream,
                include_usage=include_usage,
                continuous_usage=continuous_usage,
                chat=chat,
                seed=seed + index,
            )
            return await _one(
                session,
                endpoint,
                body,
                index=index,
                chat=chat,
                disconnect_after_chunks=disconnect_after_chunks,
                on_head=on_head,
            )

        if for_seconds is not None:
            return await _for_a_time(one, concurrency, for_seconds)
        gate = asyncio.Semaphore(concurrency)

        async def run(index: int) -> RequestResult:
            async with gate:
                return await one(index)

        return list(await asyncio.gather(*(run(i) for i in range(total))))


async def _for_a_time(
    one: Callable[[int], Awaitable[RequestResult]], concurrency: int, seconds: float
) -> list[RequestResult]:
    """``concurrency`` clients, each sending its next request as its last one ends, until
    ``seconds`` have passed; the results in request order."""
    indexes = itertools.count()
    results: list[RequestResult] = []
    start = time.monotonic()

    async def client() -> None:
        while time.monotonic() - start < seconds:
            results.append(await one(next(indexes)))

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return sorted(results, key=lambda r: r.index)


__all__ = ["PROMPT", "PROMPT_TOKENS", "RequestResult", "distinct_prompts", "drive"]
