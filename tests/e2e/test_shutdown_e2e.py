"""SIGTERM during 20 live streams through a real ``kvtax serve`` in front of the real engine.

Ten short streams finish inside the grace period; ten long ones cannot, and must end cleanly:
an OpenAI-style ``server_shutdown`` error event and a proper end of stream, never a reset. The
process exits 0 and its last log line accounts for all 20 requests.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
from dataclasses import dataclass

import aiohttp

from kvtax_dev.testbed import VllmEngine
from kvtax_dev.testbed.load import PROMPT
from kvtax_dev.testbed.sidecar import KvtaxProcess

STREAMS = 20
# Short enough that a long stream cannot finish in it on a fast engine (the whole test took
# 7.5 s on one, the long streams finishing inside the 2 s this was), long enough for a short
# one's last 7 tokens under the 20-way load.
GRACE_S = 1


@dataclass
class StreamEnd:
    chunks: int = 0
    done: bool = False  # saw data: [DONE]
    shutdown_error: bool = False
    finish_reason: str | None = None
    broken: str | None = None  # a transport error instead of an end of stream


async def _stream(
    session: aiohttp.ClientSession,
    url: str,
    *,
    model: str,
    max_tokens: int,
    first: asyncio.Event,
    end: StreamEnd,
) -> None:
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
    }
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    end.done = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    end.shutdown_error = event["error"].get("type") == "server_shutdown"
                    continue
                end.chunks += 1
                first.set()
                reason = event["choices"][0].get("finish_reason")
                end.finish_reason = reason or end.finish_reason
    except aiohttp.ClientError as exc:
        end.broken = repr(exc)


async def _run(kvtax: KvtaxProcess, model: str) -> tuple[list[StreamEnd], int | None]:
    assert kvtax.proxy_url is not None
    ends = [StreamEnd() for _ in range(STREAMS)]
    firsts = [asyncio.Event() for _ in range(STREAMS)]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        # Short streams finish well inside the grace period; long ones (900 tokens under a
        # 20-way load on a 2,048-token pool) cannot.
        tasks = [
            asyncio.create_task(
                _stream(
                    session,
                    kvtax.proxy_url,
                    model=model,
                    max_tokens=8 if i % 2 == 0 else 900,
                    first=firsts[i],
                    end=ends[i],
                )
            )
            for i in range(STREAMS)
        ]
        await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), timeout=120)
        code = await asyncio.to_thread(kvtax.stop, signal.SIGTERM, 120.0)
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
    return ends, code


def test_sigterm_drains_then_ends_streams_cleanly(vllm_engine: VllmEngine) -> None:
    kvtax = KvtaxProcess(
        vllm_engine.url, proxy=True, extra_args=[f"--shutdown.grace-period={GRACE_S}s"]
    )
    kvtax.start()
    try:
        kvtax.wait_for(lambda m: m.get("kvtax_vllm_up") == 1.0, what="first scrape")
        ends, code = asyncio.run(_run(kvtax, vllm_engine.model_name))
    finally:
        kvtax.stop()
    assert code == 0, kvtax.log_tail()
    assert not [e.broken for e in ends if e.broken], [e.broken for e in ends]
    completed = [e for e in ends if e.finish_reason == "length" and e.done]
    cut = [e for e in ends if e.shutdown_error]
    # Every stream either completed or was ended with the shutdown event, never both.
    assert len(completed) + len(cut) == STREAMS, ends
    assert not [e for e in cut if e.finish_reason == "length"]
    assert len(completed) >= STREAMS // 2  # the short ones fit in the grace period
    assert cut, "no long stream outlived the grace period; the test proves nothing"
    # The ledger settled every request before the process exited.
    # The line is logfmt (the default --log.format), so the message ends at its closing quote.
    settled = re.findall(r'requests settled by outcome: ([^"\n]*)', kvtax.log_tail(80))
    assert settled, kvtax.log_tail()
    counts = {name: float(n) for name, n in (part.split() for part in settled[-1].split(", "))}
    assert counts["completed"] == len(completed)
    assert counts["shutdown"] == len(cut)
    assert sum(counts.values()) == STREAMS
