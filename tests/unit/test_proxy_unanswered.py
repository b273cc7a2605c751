"""Accounted requests that end before vLLM answered them: queued in the gate, not yet
sent, or still waiting for vLLM's status line, when their client leaves or kvtax shuts down.

Each test names the protection it checks; each fails when that protection is removed. The time
limits only guard against hangs: each is far beyond what the protected path takes, and far
below what the unprotected one does (--gate.max-wait, aiohttp's 60 s shutdown wait).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvtax.delivery.ledger import DeliveryLedger, ModelNames
from kvtax.gate.cap import CapSettings
from kvtax.serve.proxy import Proxy, ProxySettings
from kvtax.serve.proxy.gatekeeper import Gate, GateSettings
from kvtax_dev.fakevllm.aio import serve
from kvtax_dev.fakevllm.events import DONE
from kvtax_dev.process import until

STREAM = {"model": "m", "prompt": "long", "max_tokens": 16, "stream": True}
WHOLE = {"model": "m", "prompt": "whole", "max_tokens": 16}
QUICK = {"model": "m", "prompt": "quick", "max_tokens": 16}
HANG_GUARD = 20.0  # seconds; see the module docstring


@dataclass
class SlowVllm:
    """A vLLM whose stream runs until ``finish`` is set and whose whole answer never comes
    (its status line would come at the end); ``QUICK`` is answered at once."""

    prompts: list[str] = field(default_factory=list)  # of the requests it received
    gone: int = 0  # requests whose connection the proxy closed before they ended
    finish: asyncio.Event = field(default_factory=asyncio.Event)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.prompts.append(body["prompt"])
        if body["prompt"] == QUICK["prompt"]:
            usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
            return web.json_response({"choices": [{"index": 0, "text": "ok"}], "usage": usage})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        try:
            if body.get("stream"):
                await response.prepare(request)
                chunk = json.dumps({"choices": [{"index": 0, "text": "ok"}]}).encode()
                await response.write(b"data: " + chunk + b"\n\n")
            await self.finish.wait()
        except asyncio.CancelledError:
            self.gone += 1
            raise
        await response.write(DONE)
        await response.write_eof()
        return response


@pytest.fixture
async def vllm() -> AsyncIterator[tuple[SlowVllm, str]]:
    fake = SlowVllm()
    app = web.Application()
    app.router.add_post("/v1/completions", fake.completions)
    runner, url = await serve(app, handler_cancellation=True)
    yield fake, url
    fake.finish.set()
    await runner.cleanup()


Start = Callable[[Gate | None], Awaitable[tuple[str, Proxy]]]


@pytest.fixture
async def start(vllm: tuple[SlowVllm, str]) -> AsyncIterator[Start]:
    started: list[Proxy] = []

    async def go(gate: Gate | None) -> tuple[str, Proxy]:
        names = ModelNames()
        names.update(["m"])
        proxy = Proxy(ProxySettings(upstream=vllm[1]), DeliveryLedger(names), gate=gate)
        port = await proxy.start("127.0.0.1", 0)
        started.append(proxy)
        return f"http://127.0.0.1:{port}", proxy

    yield go
    for proxy in started:
        await proxy.stop()


def _gate() -> Gate:
    # One request at a time; a wait far past any guard, so max-wait never answers for the gate.
    return Gate(GateSettings(cap=CapSettings(mode="static", static_cap=1), max_wait=600.0))


async def _post(client: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with client.post(url + "/v1/completions", json=body) as resp:
        return resp.status, await resp.json(content_type=None)


async def _settled(proxy: Proxy, n: int) -> dict[str, float]:
    """The outcomes, once ``n`` requests settled."""

    def outcomes() -> dict[str, float]:
        counts = proxy.ledger.counts()
        return {k: v for book in counts.values() for k, v in book.outcomes.items() if v}

    assert await until(lambda: sum(outcomes().values()) >= n)
    return outcomes()


def _is_shutdown_answer(status: int, body: Any) -> bool:
    return status == 503 and body["error"]["type"] == "server_shutdown"


async def test_a_client_that_leaves_while_queued_is_client_disconnected(
    vllm: tuple[SlowVllm, str], start: Start
) -> None:
    # Protection: a request vLLM never saw whose client left is the client's doing; it was
    # counted as upstream_error (no status from vLLM), blaming vLLM for a queue kvtax keeps.
    fake, _ = vllm
    gate = _gate()
    url, proxy = await start(gate)
    async with (
        aiohttp.ClientSession() as client,
        client.post(url + "/v1/completions", json=STREAM) as running,
    ):
        await running.content.readline()  # the long stream holds the one slot
        async with aiohttp.ClientSession() as leaving:
            queued = asyncio.ensure_future(_post(leaving, url, WHOLE))
            assert await until(lambda: gate.queued == 1)
            queued.cancel()
        assert await _settled(proxy, 1) == {"client_disconnected": 1}
    assert fake.prompts == ["long"]


async def test_shutdown_turns_the_queued_away_at_once_and_sends_vllm_nothing_new(
    vllm: tuple[SlowVllm, str], start: Start
) -> None:
    # Protection: the gate closes when shutdown begins. The queued request waited until
    # max-wait, or until a running request ended and freed its slot, and was then sent to a
    # vLLM that kvtax was stopping in front of.
    fake, _ = vllm
    gate = _gate()
    url, proxy = await start(gate)
    async with aiohttp.ClientSession() as client:
        async with client.post(url + "/v1/completions", json=STREAM) as running:
            await running.content.readline()
            queued = asyncio.ensure_future(_post(client, url, WHOLE))
            assert await until(lambda: gate.queued == 1)
            stopping = asyncio.create_task(proxy.stop(grace=600.0))
            async with asyncio.timeout(HANG_GUARD):
                status, body = await queued
            assert _is_shutdown_answer(status, body)
            # Answered while the stream still runs in the grace period, not at its end.
            assert proxy.state == "draining"
            assert not stopping.done()
            fake.finish.set()  # the stream ends within the grace period, freeing its slot
            text = await running.text()
        async with asyncio.timeout(HANG_GUARD):
            await stopping
    assert text.rstrip().endswith("data: [DONE]")
    assert fake.prompts == ["long"]  # the queued request never reached vLLM
    assert await _settled(proxy, 2) == {"completed": 1, "shutdown": 1}
    assert (gate.queued, gate.in_flight) == (0, 0)


async def test_a_request_vllm_has_not_answered_is_ended_at_the_cut(
    vllm: tuple[SlowVllm, str], start: Start
) -> None:
    # Protection: the cut also ends requests still waiting for vLLM's status line, which for
    # a non-streamed request comes only at the end of the generation. Only answered requests
    # were closed: vLLM kept generating, and aiohttp waited 60 s for the handler.
    fake, _ = vllm
    url, proxy = await start(None)
    async with aiohttp.ClientSession() as client:
        waiting = asyncio.ensure_future(_post(client, url, WHOLE))
        assert await until(lambda: len(fake.prompts) == 1)
        stopping = asyncio.create_task(proxy.stop(grace=0.1))
        async with asyncio.timeout(HANG_GUARD):
            status, body = await waiting
            await stopping
    assert _is_shutdown_answer(status, body)
    assert await until(lambda: fake.gone == 1)  # vLLM saw its connection closed, and aborts
    assert await _settled(proxy, 1) == {"shutdown": 1}
    assert proxy.ledger.counts()["m"].joined_requests == 1  # vLLM had it


async def test_a_request_arriving_while_draining_is_not_sent(
    vllm: tuple[SlowVllm, str], start: Start
) -> None:
    # Protection: once shutdown began nothing new goes to vLLM, gate or not; a request on a
    # kept-alive connection was sent to vLLM and could run past the grace period.
    fake, _ = vllm
    url, proxy = await start(None)
    connector = aiohttp.TCPConnector(limit=1)  # one connection, kept alive and reused
    async with aiohttp.ClientSession(connector=connector) as client:
        assert (await _post(client, url, QUICK))[0] == 200
        async with aiohttp.ClientSession() as other:
            running = await other.post(url + "/v1/completions", json=STREAM)
            await running.content.readline()  # keeps the proxy draining
            stopping = asyncio.create_task(proxy.stop(grace=600.0))
            assert await until(lambda: proxy.state == "draining")
            # The drain closed the idle kept-alive connection at once, as uvicorn and nginx
            # do, and accepts no new one: the request fails to be sent, or (had it raced the
            # close) gets the shutdown 503. It never reaches vLLM.
            try:
                status, body = await _post(client, url, QUICK)
            except aiohttp.ClientConnectionError:
                pass
            else:
                assert _is_shutdown_answer(status, body)
            fake.finish.set()
            await running.read()
            running.close()
        async with asyncio.timeout(HANG_GUARD):
            await stopping
    assert fake.prompts == ["quick", "long"]
    outcomes = await _settled(proxy, 2)
    assert outcomes.pop("completed") == 2
    assert outcomes in ({}, {"shutdown": 1})
