"""The gate against the real vLLM CPU engine (2,048 KV tokens): adaptive mode takes a
thrashing engine to zero new preemptions, and its 429s carry Retry-After.

A wave of long generations sent straight to vLLM makes it thrash. Meanwhile, and after, more
clients than the pool holds send the same requests through kvtax's proxy with
``--gate.mode=adaptive``. Once the direct wave has drained, the gate must hold the engine
free of new preemptions within SETTLE_SCRAPES of kvtax's scrapes, and keep it there while the
gated load goes on; the clients it sheds get 429 with Retry-After.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest

from kvtax_dev.exposition import read_series
from kvtax_dev.testbed import VllmEngine
from kvtax_dev.testbed.load import PROMPT
from kvtax_dev.testbed.sidecar import KvtaxProcess

M = "tiny-llama"
MAX_TOKENS = 500  # 41 + 500 tokens = 5 blocks of 128: the pool of 16 blocks holds three
DIRECT_WAVE = 16
GATED_CLIENTS = 24
# Scrapes (1 s apart) after the direct wave ends within which preemptions must stop, and the
# scrapes of gated load after that which must show none.
SETTLE_SCRAPES = 6
QUIET_SCRAPES = 10
SHED_REASONS = ("queue_full", "wait_expired")


@pytest.fixture
def kvtax(vllm_engine: VllmEngine) -> Iterator[KvtaxProcess]:
    # Preemptions are counted engine-wide: an earlier test's requests still leaving the engine
    # would be counted against the gate.
    vllm_engine.wait_idle()
    args = [
        "--gate.mode=adaptive",
        "--gate.block-size=128",
        "--gate.max-queue=6",
        "--gate.max-wait=30s",
    ]
    with KvtaxProcess(
        vllm_engine.url, proxy=True, scrape_interval="1s", window="30s", extra_args=args
    ) as proc:
        proc.wait_for(lambda m: m.get("kvtax_vllm_up") == 1.0, what="first scrape")
        yield proc


def _body() -> dict[str, Any]:
    return {
        "model": M,
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0,
    }


@dataclass
class Seen:
    completed: int = 0
    retry_after: list[str | None] = field(default_factory=list)
    other: list[int] = field(default_factory=list)


async def _one(session: aiohttp.ClientSession, url: str, seen: Seen) -> None:
    async with session.post(url + "/v1/completions", json=_body()) as resp:
        await resp.read()
        if resp.status == 200:
            seen.completed += 1
        elif resp.status == 429:
            seen.retry_after.append(resp.headers.get("Retry-After"))
        else:
            seen.other.append(resp.status)


async def _client(url: str, seen: Seen, stop: asyncio.Event) -> None:
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while not stop.is_set():
            await _one(session, url, seen)
            if seen.retry_after:
                await asyncio.sleep(0.2)  # a client in a hurry: it does not wait Retry-After


def _preemptions(engine: VllmEngine) -> float:
    page = read_series(engine.metrics_text())
    return sum(v for k, v in page.items() if k.startswith("vllm:num_preemptions_total"))


async def _scenario(engine: VllmEngine, kvtax: KvtaxProcess) -> dict[str, Any]:
    assert kvtax.proxy_url is not None
    gated, direct = Seen(), Seen()
    stop = asyncio.Event()
    before = await asyncio.to_thread(_preemptions, engine)
    clients = [
        asyncio.create_task(_client(kvtax.proxy_url, gated, stop)) for _ in range(GATED_CLIENTS)
    ]
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=timeout
    ) as session:
        await asyncio.gather(*(_one(session, engine.url, direct) for _ in range(DIRECT_WAVE)))
    thrash = await asyncio.to_thread(_preemptions, engine) - before
    # From here on only the gate sends work: count kvtax's scrapes and vLLM's preemptions.
    page = await asyncio.to_thread(kvtax.metrics)
    first_scrape = page["kvtax_scrapes_total"]
    timeline: list[tuple[float, float]] = []
    while True:
        page = await asyncio.to_thread(kvtax.metrics)
        scrapes = page["kvtax_scrapes_total"] - first_scrape
        timeline.append((scrapes, await asyncio.to_thread(_preemptions, engine)))
        if scrapes >= SETTLE_SCRAPES + QUIET_SCRAPES:
            break
        await asyncio.sleep(0.5)
    stop.set()
    await asyncio.gather(*clients)
    # Read once every client has stopped, so the gate's counters and the clients' tallies
    # cover the same requests (a 429 answered between the two would miss one side).
    final = await asyncio.to_thread(kvtax.metrics)
    return {
        "thrash": thrash,
        "direct": direct,
        "gated": gated,
        "timeline": timeline,
        "metrics": final,
    }


def test_adaptive_gate_stops_preemption_and_sheds_with_retry_after(
    vllm_engine: VllmEngine, kvtax: KvtaxProcess
) -> None:
    started = time.monotonic()
    run = asyncio.run(_scenario(vllm_engine, kvtax))
    timeline = run["timeline"]
    detail = f"timeline (scrapes, preemptions): {timeline}; kvtax log:\n{kvtax.log_tail()}"
    # The engine was thrashing: the direct wave alone is five times the pool.
    assert run["thrash"] > 0, detail
    assert run["direct"].completed == DIRECT_WAVE
    # Within SETTLE_SCRAPES of the wave's end preemptions stop, and stay stopped under load.
    settled = next(p for s, p in timeline if s >= SETTLE_SCRAPES)
    assert timeline[-1][1] == settled, detail
    metrics = run["metrics"]
    # The gated clients kept the gate busy: a queue formed and some were shed.
    gated = run["gated"]
    assert gated.completed > 0, detail
    assert gated.other == [], detail
    assert gated.retry_after, "no 429 from the gate: the load did not exceed its queue"
    assert all(v is not None and int(v) >= 1 for v in gated.retry_after), gated.retry_after
    shed = sum(metrics[f'kvtax_gate_rejections_total{{reason="{r}"}}'] for r in SHED_REASONS)
    assert shed == len(gated.retry_after)
    # It cut its cap on the preemptions it saw.
    assert metrics['kvtax_gate_cap_changes_total{direction="down"}'] >= 1, detail
    print(
        f"gate e2e: {run['thrash']:.0f} preemptions from the direct wave, none from scrape "
        f"{SETTLE_SCRAPES} to {timeline[-1][0]:.0f} after it; {gated.completed} gated "
        f"completions, {len(gated.retry_after)} 429s; {time.monotonic() - started:.0f}s"
    )
