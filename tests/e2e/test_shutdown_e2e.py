"""SIGTERM during 14 live streams through a real ``kvtax serve`` in front of the real engine.

Four short streams finish inside the grace period; ten long ones cannot, and must end cleanly:
an OpenAI-style ``server_shutdown`` error event and a proper end of stream, never a reset. The
process exits 0 and its last log line accounts for every request.

Which stream outlives the grace period must not depend on how fast the engine is, nor on how
late a starved kvtax's timer fires. So the engine is frozen (:mod:`kvtax_dev.testbed.freeze`)
while the requests reach vLLM and SIGTERM comes, runs in short slices until the short streams
have ended, and stays frozen until kvtax has exited: the long ones are barely begun. A running
engine on a busy machine can finish every long stream within the grace period, and the test
would then prove nothing.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
from dataclasses import dataclass

import aiohttp

from kvtax_dev.process import HANG_GUARD_S, until
from kvtax_dev.testbed import VllmEngine
from kvtax_dev.testbed.load import PROMPT
from kvtax_dev.testbed.sidecar import KvtaxProcess

# Every stream's prompt takes one of the pool's 16 blocks, so all 14 are admitted at once and
# a short stream waits for no long one.
SHORT_STREAMS = 4
LONG_STREAMS = 10
STREAMS = SHORT_STREAMS + LONG_STREAMS
# Long enough for the short streams' slices however starved the machine; the long streams are
# frozen meanwhile, so it need not be short.
GRACE_S = 5


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
                reason = event["choices"][0].get("finish_reason")
                end.finish_reason = reason or end.finish_reason
    except aiohttp.ClientError as exc:
        end.broken = repr(exc)


async def _run(kvtax: KvtaxProcess, engine: VllmEngine) -> tuple[list[StreamEnd], int | None]:
    assert kvtax.proxy_url is not None
    ends = [StreamEnd() for _ in range(STREAMS)]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        with engine.freezer() as freezer:
            tasks = [
                asyncio.create_task(
                    _stream(
                        session,
                        kvtax.proxy_url,
                        model=engine.model_name,
                        max_tokens=8 if i < SHORT_STREAMS else 900,
                        end=ends[i],
                    )
                )
                for i in range(STREAMS)
            ]
            # Every request is in vLLM's hands, and none has a token, when SIGTERM comes.
            await asyncio.to_thread(
                kvtax.wait_for,
                lambda m: m.get("kvtax_proxy_forward_seconds_count") == STREAMS,
                what=f"{STREAMS} requests forwarded to vLLM",
            )
            stopping = asyncio.create_task(asyncio.to_thread(kvtax.stop, signal.SIGTERM, 120.0))
            assert await until(lambda: "shutting down" in kvtax.log_tail(), HANG_GUARD_S), (
                kvtax.log_tail()
            )
            assert not [e for e in ends if e.chunks], ends
            # The engine runs in slices until the short streams have ended: each needs 8
            # steps, each long one 900, so the long ones are barely begun when it stops for
            # good. However late kvtax's grace period then ends, they cannot finish first.
            shorts = tasks[:SHORT_STREAMS]
            await freezer.run_until(lambda: all(t.done() for t in shorts), limit=HANG_GUARD_S)
            code = await stopping
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=HANG_GUARD_S)
    return ends, code


def test_sigterm_drains_then_ends_streams_cleanly(vllm_engine: VllmEngine) -> None:
    kvtax = KvtaxProcess(
        vllm_engine.url, proxy=True, extra_args=[f"--shutdown.grace-period={GRACE_S}s"]
    )
    kvtax.start()
    try:
        kvtax.wait_for(lambda m: m.get("kvtax_vllm_up") == 1.0, what="first scrape")
        ends, code = asyncio.run(_run(kvtax, vllm_engine))
    finally:
        kvtax.stop()
    assert code == 0, kvtax.log_tail()
    assert not [e.broken for e in ends if e.broken], [e.broken for e in ends]
    completed = [e for e in ends if e.finish_reason == "length" and e.done]
    cut = [e for e in ends if e.shutdown_error]
    # Every stream either completed or was ended with the shutdown event, never both.
    assert len(completed) + len(cut) == STREAMS, ends
    assert not [e for e in cut if e.finish_reason == "length"]
    # The short ones finished inside the grace period; the long ones, frozen, could not.
    assert len(completed) == SHORT_STREAMS, ends
    assert len(cut) == LONG_STREAMS, ends
    # The ledger settled every request before the process exited.
    # The line is logfmt (the default --log.format), so the message ends at its closing quote.
    settled = re.findall(r'requests settled by outcome: ([^"\n]*)', kvtax.log_tail(80))
    assert settled, kvtax.log_tail()
    counts = {name: float(n) for name, n in (part.split() for part in settled[-1].split(", "))}
    assert counts["completed"] == len(completed)
    assert counts["shutdown"] == len(cut)
    assert sum(counts.values()) == STREAMS
