"""kvtax's own cost on /metrics moves with the traffic it relays: the time per read relayed, the
time per request forwarded, the events relayed, and how each stream was counted.

Through the real proxy port, in front of the vLLM-shaped fake that writes 0.32's fields.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvtax.delivery.cost import RELAY_BUCKETS
from kvtax.delivery.ledger import DeliveryLedger, ModelNames
from kvtax.expose.publish import proxy_samples
from kvtax.expose.samples import HistogramSample, Sample
from kvtax.serve.proxy import Proxy, ProxySettings
from kvtax_dev.fakevllm.aio import FakeVllm

STREAM = {"model": "m", "prompt": "x", "stream": True}


@pytest.fixture
async def relay() -> AsyncIterator[tuple[str, Proxy]]:
    vllm = FakeVllm(tokens=6, per_chunk=2)
    runner = web.AppRunner(vllm.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    names = ModelNames()
    names.update(["m"])
    proxy = Proxy(
        ProxySettings(upstream=f"http://127.0.0.1:{port}"),
        DeliveryLedger(names),
        vllm_version=lambda: "0.32.0",
    )
    bound = await proxy.start("127.0.0.1", 0)
    yield f"http://127.0.0.1:{bound}", proxy
    await proxy.stop()
    await runner.cleanup()


def _samples(proxy: Proxy) -> dict[tuple[str, tuple[str, ...]], Any]:
    out: dict[tuple[str, tuple[str, ...]], Any] = {}
    for s in proxy_samples(0, 0, 0, proxy.cost):
        out[(s.metric, s.labels)] = s.buckets if isinstance(s, HistogramSample) else s.value
        assert isinstance(s, Sample | HistogramSample)
    return out


def _count(buckets: tuple[tuple[float, float], ...]) -> float:
    return buckets[-1][1]  # +Inf: every observation


async def test_the_cost_series_move_with_every_stream_and_request(
    relay: tuple[str, Proxy],
) -> None:
    url, proxy = relay
    before = _samples(proxy)
    async with aiohttp.ClientSession() as session:
        for body in (STREAM, STREAM, {"model": "m", "prompt": "x"}):
            async with session.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                await resp.read()
        async with session.get(url + "/v1/models") as resp:
            await resp.read()
    after = _samples(proxy)
    reads = _count(after[("kvtax_proxy_relay_seconds", ())])
    assert reads > _count(before[("kvtax_proxy_relay_seconds", ())])
    # Every read took kvtax less than the largest bucket, on any machine.
    assert after[("kvtax_proxy_relay_seconds", ())][-2][1] == reads
    assert len(after[("kvtax_proxy_relay_seconds", ())]) == len(RELAY_BUCKETS) + 1
    # One forwarding per request: two streams, one whole answer, one pass-through.
    assert _count(after[("kvtax_proxy_forward_seconds", ())]) == 4
    # Each stream: 3 events of 2 tokens, and [DONE] (the usage chunk is cut for this client).
    assert after[("kvtax_proxy_events_relayed_total", ())] == 2 * 4
    assert after[("kvtax_proxy_streams_counted_total", ("token_ids",))] == 2
    assert after[("kvtax_proxy_streams_counted_total", ("usage",))] == 0
