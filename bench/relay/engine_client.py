"""The clients of bench.relay.engine_relay: one streamed completion, read as a client sees it, and
a closed-loop round of them."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvtax_dev.testbed.load import PROMPT

# The testbed's tiny model, as the engine serves it.
MODEL = "tiny-llama"


@dataclass
class Stream:
    """What one client saw of one streamed completion."""

    status: int = 0
    ttfb: float | None = None
    """Seconds from sending to the response headers."""
    ttft: float | None = None
    events: int = 0
    """Events that carried a choice."""
    usage: int | None = None
    """``completion_tokens`` of the final usage chunk (the one without choices)."""
    last_continuous: int | None = None
    """``completion_tokens`` of the last event that carried both a choice and usage."""
    token_ids: int = 0
    """Sum of ``len(choices[0].token_ids)`` over the events."""
    body_bytes: int = 0
    """Bytes of the ``data:`` lines that carried a choice."""
    error: str | None = None


def request_body(max_tokens: int, extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        **extra,
    }


async def stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Stream:
    s = Stream()
    began = time.monotonic()
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            s.status = resp.status
            s.ttfb = time.monotonic() - began
            if resp.status != 200:
                s.error = (await resp.text())[:200]
                return s
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                event = json.loads(line[6:])
                usage = event.get("usage")
                choices = event.get("choices")
                if not choices:
                    if usage:
                        s.usage = usage["completion_tokens"]
                    continue
                if s.ttft is None:
                    s.ttft = time.monotonic() - began
                s.events += 1
                s.body_bytes += len(line)
                if usage:
                    s.last_continuous = usage["completion_tokens"]
                s.token_ids += len(choices[0].get("token_ids") or ())
    except (TimeoutError, aiohttp.ClientError) as exc:
        s.error = repr(exc)
    return s


async def run_round(
    url: str, clients: int, requests_: int, body: dict[str, Any], stagger: float = 0.0
) -> tuple[list[Stream], float]:
    """``requests_`` streams from ``clients`` closed-loop clients, client j starting
    ``j * stagger`` seconds after the first; the streams and the wall time.

    Each stream goes out on a connection of its own, in both arms, as the load tester's do
    (docs/loadtest.md, "Errors"): a reused connection can meet vLLM's keep-alive close, armed
    as an answer ends, when the engine runs late, and the stream then fails before vLLM read
    it, stopping the run ("Server disconnected", seen in the direct arm)."""
    left = [requests_]
    done: list[Stream] = []
    timeout = aiohttp.ClientTimeout(total=600)
    connector = aiohttp.TCPConnector(limit=clients, force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def client(j: int) -> None:
            await asyncio.sleep(j * stagger)
            while left[0] > 0:
                left[0] -= 1
                done.append(await stream(session, url, body))

        started = time.monotonic()
        await asyncio.gather(*(client(j) for j in range(clients)))
        wall = time.monotonic() - started
    return done, wall
