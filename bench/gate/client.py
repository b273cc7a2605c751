"""bench.gate's clients: the request bodies, one attempt and its record, open and closed loops."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import aiohttp

from bench.gate.arrivals import (
    Spec,
    prompt_ids,
)
from bench.gate.stats import (
    REFUSED,
    Record,
    Refusal,
)

# -- talking to the server --------------------------------------------------------------------


def request_body(spec: Spec, salt: str, model: str) -> bytes:
    return json.dumps(
        {
            "model": model,
            "prompt": prompt_ids(spec, salt),
            "max_tokens": spec.max_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
        separators=(",", ":"),
    ).encode()


def tokens_of(event: dict[str, Any], count: int) -> int:
    """Completion tokens so far after one stream event: its cumulative usage when it has one,
    else one more for a chunk with a choice."""
    usage = event.get("usage")
    so_far = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if isinstance(so_far, int):
        return max(count, so_far)
    return count + 1 if event.get("choices") else count


async def attempt(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    rec: Record,
    t0: float,
    *,
    headers: Mapping[str, str] | None = None,
) -> None:
    """One try of one request, into ``rec``; times are seconds after ``t0``. ``headers``: the
    request's own besides its content type (a tenant's, for the gate's fair shares)."""
    began = time.monotonic()
    try:
        async with session.post(
            url + "/v1/completions",
            data=body,
            headers={"Content-Type": "application/json", **(headers or {})},
        ) as resp:
            rec.status = resp.status
            if resp.status in REFUSED:
                await resp.read()
                seconds = time.monotonic() - began
                rec.refusals.append(Refusal(resp.status, seconds, resp.headers.get("Retry-After")))
                return
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
                return
            count = 0
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    rec.completed = True
                    break
                now = time.monotonic() - t0
                grown = tokens_of(json.loads(data), count)
                if grown > count:
                    if rec.first is None:
                        rec.first = now
                    rec.events.append((now, grown))
                    count = grown
    except aiohttp.ClientError as exc:
        rec.error = f"{type(exc).__name__}: {exc}"


def new_session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=30),
        connector=aiohttp.TCPConnector(limit=0),
    )


def new_record(spec: Spec, sent: float) -> Record:
    return Record(spec.index, spec.long, spec.prompt_tokens, spec.max_tokens, sent=sent)


async def _finish(tasks: Sequence[asyncio.Task[None]], until: float, t0: float) -> float:
    """Wait for ``tasks`` until ``until`` seconds after ``t0``, cancel the rest; the cutoff."""
    if tasks:
        await asyncio.wait(tasks, timeout=max(0.0, until - (time.monotonic() - t0)))
    cutoff = time.monotonic() - t0
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return cutoff


async def open_loop(
    url: str,
    specs: Sequence[Spec],
    salt: str,
    model: str,
    *,
    duration: float,
    drain: float,
    headers: Callable[[Spec], Mapping[str, str]] | None = None,
) -> tuple[list[Record], float]:
    """Send each request at its time, once; wait ``drain`` seconds past the window for the
    rest. Returns the records and the cutoff (seconds after the start). ``headers``: each
    request's own headers."""
    bodies = [request_body(s, salt, model) for s in specs]  # built before the clock starts
    records = [new_record(s, s.at) for s in specs]
    async with new_session() as session:
        t0 = time.monotonic()

        async def one(spec: Spec, body: bytes, rec: Record) -> None:
            delay = spec.at - (time.monotonic() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            rec.sent = time.monotonic() - t0
            await attempt(session, url, body, rec, t0, headers=headers(spec) if headers else None)

        tasks = [
            asyncio.create_task(one(s, b, r))
            for s, b, r in zip(specs, bodies, records, strict=True)
        ]
        await asyncio.sleep(max(0.0, duration - (time.monotonic() - t0)))
        cutoff = await _finish(tasks, duration + drain, t0)
    return records, cutoff


def retry_wait(retry_after: str | None) -> float:
    """How long a closed-loop client waits after a refusal: Retry-After (at most 5 s), else 1 s."""
    try:
        return min(5.0, max(0.0, float(retry_after))) if retry_after else 1.0
    except ValueError:
        return 1.0


async def closed_loop(
    url: str,
    clients: int,
    specs: Iterator[Spec],
    salt: str,
    model: str,
    *,
    duration: float,
    drain: float,
) -> tuple[list[Record], float]:
    """``clients`` clients, each sending its next request when the last one ended, retrying a
    refusal after Retry-After, starting nothing after ``duration``; ``drain`` as in open_loop."""
    records: list[Record] = []
    async with new_session() as session:
        t0 = time.monotonic()

        async def client() -> None:
            while time.monotonic() - t0 < duration:
                spec = next(specs)
                body = request_body(spec, salt, model)
                rec = new_record(spec, time.monotonic() - t0)
                records.append(rec)
                while True:
                    await attempt(session, url, body, rec, t0)
                    if not rec.refused or time.monotonic() - t0 >= duration:
                        break
                    await asyncio.sleep(retry_wait(rec.refusals[-1].retry_after))

        tasks = [asyncio.create_task(client()) for _ in range(clients)]
        cutoff = await _finish(tasks, duration + drain, t0)
    return records, cutoff
