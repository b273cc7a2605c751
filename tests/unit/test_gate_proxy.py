"""The gate in the proxy, in process: a held fake vLLM, the gate's queue and answers."""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvtax.delivery.ledger import DeliveryLedger, ModelNames
from kvtax.figures.derive import ModelFigures
from kvtax.gate.cap import CapSettings
from kvtax.gate.footprint import TokenEstimator
from kvtax.serve.config import Config
from kvtax.serve.proxy import Proxy, ProxySettings
from kvtax.serve.proxy.gatekeeper import Gate, GateSettings
from kvtax.serve.wiring import build
from kvtax_dev.fakevllm.aio import serve
from kvtax_dev.fakevllm.events import DONE
from kvtax_dev.ports import refused_port
from kvtax_dev.process import until


@dataclass
class HeldVllm:
    """A vLLM that answers a completion only when the test releases it, one per release."""

    hold: bool = True
    # Answer as vLLM 0.32 does when its --max-num-queued-reqs refuses (QueueOverflowError).
    queue_full: bool = False
    bodies: list[bytes] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    gone: int = 0

    def __post_init__(self) -> None:
        self.slots = asyncio.Semaphore(0)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.bodies.append(raw)
        self.headers.append(
            {k: v for k, v in request.headers.items() if k.lower() not in ("host",)}
        )
        if self.queue_full:
            message = "The engine is currently busy and cannot accept new requests."
            error = {"message": message, "type": "Service Unavailable", "code": 503}
            return web.json_response({"error": error}, status=503)
        try:
            if self.hold:
                await self.slots.acquire()
        except asyncio.CancelledError:
            self.gone += 1
            raise
        try:
            payload = json.loads(raw)
        except RecursionError:  # a body nested deeper than Python's parser follows
            payload = {}
        usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
        if payload.get("stream"):
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            chunk = {"choices": [{"index": 0, "text": "ok"}], "usage": usage}
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await response.write(DONE)
            await response.write_eof()
            return response
        return web.json_response({"choices": [{"index": 0, "text": "ok"}], "usage": usage})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
        return app


@pytest.fixture
async def vllm() -> AsyncIterator[tuple[HeldVllm, str]]:
    fake = HeldVllm()
    runner, url = await serve(fake.app(), handler_cancellation=True)
    yield fake, url
    await runner.cleanup()


Started = list[Proxy]


@pytest.fixture
async def proxies() -> AsyncIterator[Started]:
    started: Started = []
    yield started
    for proxy in started:
        await proxy.stop()


async def _start(started: Started, upstream: str, gate: Gate | None) -> str:
    names = ModelNames()
    names.update(["m"])
    proxy = Proxy(ProxySettings(upstream=upstream), DeliveryLedger(names), gate=gate)
    port = await proxy.start("127.0.0.1", 0)
    started.append(proxy)
    return f"http://127.0.0.1:{port}"


def _gate(**settings: Any) -> Gate:
    cap = settings.pop("cap", CapSettings(mode="static", static_cap=1))
    return Gate(GateSettings(cap=cap, **settings))


BODY = {"model": "m", "prompt": "hello there", "max_tokens": 16}


async def _post_status(url: str, prompt: str, headers: dict[str, str]) -> int:
    """The status of a completion of ``prompt`` sent with ``headers``, on its own session."""
    body = {**BODY, "prompt": prompt}
    async with (
        aiohttp.ClientSession() as client,
        client.post(url + "/v1/completions", json=body, headers=headers) as resp,
    ):
        return resp.status


async def _post(client: aiohttp.ClientSession, url: str, body: Any = None) -> tuple[int, Any, Any]:
    async with client.post(url + "/v1/completions", json=body or BODY) as resp:
        return resp.status, resp.headers, await resp.json()


async def test_a_full_queue_answers_429_with_retry_after_and_an_openai_error(
    vllm: tuple[HeldVllm, str], proxies: Started
) -> None:
    fake, upstream = vllm
    gate = _gate(max_queue=1)
    url = await _start(proxies, upstream, gate)
    async with aiohttp.ClientSession() as client:
        first = asyncio.ensure_future(_post(client, url))
        assert await until(lambda: len(fake.bodies) == 1)
        second = asyncio.ensure_future(_post(client, url))
        assert await until(lambda: gate.queued == 1)
        status, headers, body = await _post(client, url)
        assert status == 429
        assert int(headers["Retry-After"]) >= 1
        assert headers["X-Kvtax-Dropped-Reason"] == "queue_full"
        assert body["error"]["type"] == "rate_limit_exceeded"
        assert body["error"]["code"] == 429
        assert "--gate.max-queue" in body["error"]["message"]
        fake.slots.release()
        fake.slots.release()
        assert (await first)[0] == 200
        assert (await second)[0] == 200
    assert gate.rejections["queue_full"] == 1
    assert gate.in_flight == 0
    assert len(fake.bodies) == 2  # the shed request never reached vLLM
    outcomes = proxies[0].ledger.counts()
    assert sum(b.outcomes["shed"] for b in outcomes.values()) == 1


async def test_a_wait_past_max_wait_answers_429_with_retry_after(
    vllm: tuple[HeldVllm, str], proxies: Started
) -> None:
    fake, upstream = vllm
    gate = _gate(max_wait=0.05)
    url = await _start(proxies, upstream, gate)
    async with aiohttp.ClientSession() as client:
        first = asyncio.ensure_future(_post(client, url))
        assert await until(lambda: len(fake.bodies) == 1)
        status, headers, body = await _post(client, url)
        assert status == 429
        assert "Retry-After" in headers
        assert headers["X-Kvtax-Dropped-Reason"] == "wait_expired"
        assert "--gate.max-wait" in body["error"]["message"]
        fake.slots.release()
        await first
    assert gate.rejections["wait_expired"] == 1
    assert gate.queued == 0


async def _one_second_requests(gate: Gate, clock: list[float]) -> list[asyncio.Task[Any]]:
    """Requests of the test itself, straight at ``gate``: three served of 1 s each, enough for
    a service time, then one in flight and one queued behind it (1 s: within a 1 s bound)."""
    for _ in range(3):
        served = gate.ticket(1, 1)
        assert await gate.enter(served) is None
        clock[0] += 1.0
        gate.leave(served)
    assert await gate.enter(gate.ticket(1, 1)) is None
    queued = asyncio.ensure_future(gate.enter(gate.ticket(1, 1)))
    await asyncio.sleep(0)
    assert gate.queued == 1
    return [queued]


async def test_a_wait_foretold_past_max_wait_answers_429_at_once(
    vllm: tuple[HeldVllm, str], proxies: Started
) -> None:
    fake, upstream = vllm
    clock = [1000.0]
    gate = Gate(
        # A 2 s max-wait lets in a wait foretold up to 1 s (FORETOLD_SHARE).
        GateSettings(cap=CapSettings(mode="static", static_cap=1), max_wait=2.0),
        clock=lambda: clock[0],
    )
    url = await _start(proxies, upstream, gate)
    held = await _one_second_requests(gate, clock)
    try:
        async with aiohttp.ClientSession() as client:
            # One queued ahead, one in flight of 1 s: 2 s, over the 1 s bound.
            status, headers, body = await _post(client, url)
        assert status == 429
        assert headers["Retry-After"] == "2"  # at most --gate.max-wait
        assert headers["X-Kvtax-Dropped-Reason"] == "wait_predicted"
        assert body["error"]["type"] == "rate_limit_exceeded"
        assert "--gate.max-wait" in body["error"]["message"]
    finally:
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
    assert gate.rejections["wait_predicted"] == 1
    assert fake.bodies == []  # refused at the gate, never sent on
    outcomes = proxies[0].ledger.counts()
    assert sum(b.outcomes["shed"] for b in outcomes.values()) == 1


async def test_retry_after_follows_the_completion_rate(
    vllm: tuple[HeldVllm, str], proxies: Started
) -> None:
    fake, upstream = vllm
    fake.hold = False
    gate = _gate(max_wait=600.0)
    url = await _start(proxies, upstream, gate)
    async with aiohttp.ClientSession() as client:
        for _ in range(5):
            assert (await _post(client, url))[0] == 200
    # Five completions in well under a minute: the next slot is seconds away, not max-wait.
    assert gate.retry_after() < 600


async def test_a_queued_client_that_leaves_frees_its_place_at_once(
    vllm: tuple[HeldVllm, str], proxies: Started
) -> None:
    fake, upstream = vllm
    gate = _gate(max_queue=1)
    url = await _start(proxies, upstream, gate)
    async with aiohttp.ClientSession() as client:
        first = asyncio.ensure_future(_post(client, url))
        assert await until(lambda: len(fake.bodies) == 1)
        async with aiohttp.ClientSession() as leaving:
            queued = asyncio.ensure_future(_post(leaving, url))
            assert await until(lambda: gate.queued == 1)
            queued.cancel()
        # The client closed its connection: the gate dropped it from the queue...
        assert await until(lambda: gate.queued == 0)
        # ... so another request gets that place instead of a 429 queue_full.
        third = asyncio.ensure_future(_post(client, url))
        assert await until(lambda: gate.queued == 1)
        fake.slots.release()
        fake.slots.release()
        assert (await first)[0] == 200
        assert (await third)[0] == 200
    assert gate.rejections["queue_full"] == 0
    assert len(fake.bodies) == 2
    assert gate.in_flight == 0


async def test_a_client_leaving_while_vllm_answers_frees_its_slot(
    vllm: tuple[HeldVllm, str], proxies: Started
) -> None:
    fake, upstream = vllm
    gate = _gate()
    url = await _start(proxies, upstream, gate)
    async with aiohttp.ClientSession() as leaving:
        running = asyncio.ensure_future(_post(leaving, url))
        assert await until(lambda: gate.in_flight == 1)
        running.cancel()
    assert await until(lambda: gate.in_flight == 0)
    assert await until(lambda: fake.gone == 1)


@pytest.mark.parametrize(("order", "first_admitted"), [("fifo", 4000), ("shortest", 8)])
async def test_queue_order(
    vllm: tuple[HeldVllm, str], proxies: Started, order: str, first_admitted: int
) -> None:
    fake, upstream = vllm
    gate = _gate(order=order)
    url = await _start(proxies, upstream, gate)
    async with aiohttp.ClientSession() as client:
        tasks = [asyncio.ensure_future(_post(client, url, {**BODY, "max_tokens": 1}))]
        assert await until(lambda: len(fake.bodies) == 1)
        for n in (4000, 8):
            tasks.append(asyncio.ensure_future(_post(client, url, {**BODY, "max_tokens": n})))
            assert await until(lambda: gate.queued == len(tasks) - 1)
        fake.slots.release()
        assert await until(lambda: len(fake.bodies) == 2)
        fake.slots.release()
        fake.slots.release()
        await asyncio.gather(*tasks)
    assert json.loads(fake.bodies[1])["max_tokens"] == first_admitted


async def test_token_budget_rejects_with_a_400(
    vllm: tuple[HeldVllm, str], proxies: Started
) -> None:
    fake, upstream = vllm
    fake.hold = False
    gate = _gate(cap=CapSettings(mode="static", static_cap=8), token_budget=100)
    url = await _start(proxies, upstream, gate)
    async with aiohttp.ClientSession() as client:
        status, headers, body = await _post(client, url, {**BODY, "max_tokens": 500})
        assert status == 400
        assert headers["X-Kvtax-Dropped-Reason"] == "over_budget"
        assert body["error"]["type"] == "invalid_request_error"
        assert "--gate.token-budget" in body["error"]["message"]
        assert (await _post(client, url, {**BODY, "max_tokens": 50}))[0] == 200
    assert gate.rejections["over_budget"] == 1
    assert len(fake.bodies) == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_token_budget_clamps_max_tokens(
    vllm: tuple[HeldVllm, str], proxies: Started, stream: bool
) -> None:
    fake, upstream = vllm
    fake.hold = False
    gate = _gate(
        cap=CapSettings(mode="static", static_cap=8), token_budget=100, over_budget="clamp"
    )
    url = await _start(proxies, upstream, gate)
    async with aiohttp.ClientSession() as client:
        body = {**BODY, "max_tokens": 500, "stream": stream}
        async with client.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            await resp.read()
        no_limit = {"model": "m", "prompt": "hello there"}
        async with client.post(url + "/v1/completions", json=no_limit) as resp:
            assert resp.status == 200
    prompt = gate.estimator.estimate(len(b"hello there"))
    assert json.loads(fake.bodies[0])["max_tokens"] == 100 - prompt
    # No max_tokens: the API's default (16) is within the budget, and vLLM applies it.
    assert "max_tokens" not in json.loads(fake.bodies[1])


@pytest.mark.parametrize("over", ["reject", "clamp"])
async def test_max_completion_tokens_does_not_hide_max_tokens_on_completions(
    vllm: tuple[HeldVllm, str], proxies: Started, over: str
) -> None:
    # Protection: /v1/completions honours max_tokens only; a small max_completion_tokens
    # beside a huge max_tokens passed the budget and vLLM generated up to the huge one.
    fake, upstream = vllm
    fake.hold = False
    gate = _gate(cap=CapSettings(mode="static", static_cap=8), token_budget=100, over_budget=over)
    url = await _start(proxies, upstream, gate)
    body = {**BODY, "max_tokens": 100_000, "max_completion_tokens": 5}
    async with aiohttp.ClientSession() as client:
        status, _, answer = await _post(client, url, body)
    if over == "reject":
        assert status == 400
        assert "max_tokens=100000" in answer["error"]["message"]
        assert fake.bodies == []
    else:
        assert status == 200
        prompt = gate.estimator.estimate(len(b"hello there"))
        assert json.loads(fake.bodies[0])["max_tokens"] == 100 - prompt


async def _post_raw(url: str, body: bytes) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as client,
        client.post(url + "/v1/completions", data=body) as resp,
    ):
        return resp.status, await resp.json()


@pytest.mark.parametrize("over", ["reject", "clamp"])
async def test_a_body_only_pythons_parser_reads_meets_the_budget_too(
    vllm: tuple[HeldVllm, str], proxies: Started, over: str
) -> None:
    # Protection: the gate read the body with orjson alone, which refuses NaN; it then saw no
    # max_tokens at all, so `clamp` let 100000 through and `reject` named the wrong reason.
    fake, upstream = vllm
    fake.hold = False
    gate = _gate(cap=CapSettings(mode="static", static_cap=8), token_budget=100, over_budget=over)
    url = await _start(proxies, upstream, gate)
    body = b'{"model": "m", "prompt": "hello there", "max_tokens": 100000, "x": NaN}'
    status, answer = await _post_raw(url, body)
    if over == "reject":
        assert status == 400
        assert "max_tokens=100000" in answer["error"]["message"]
        assert fake.bodies == []
    else:
        assert status == 200
        sent = json.loads(fake.bodies[0])
        assert sent["max_tokens"] == 100 - gate.estimator.estimate(len(b"hello there"))
        assert math.isnan(sent["x"])  # written back as vLLM's parser reads it


DEEP = b"[" * 1000 + b"]" * 1000  # orjson reads it; Python's encoder does not write it


@pytest.mark.parametrize("over", [None, "clamp"])
async def test_a_deeply_nested_prompt_is_no_error_of_kvtax(
    vllm: tuple[HeldVllm, str], proxies: Started, over: str | None
) -> None:
    # Protection: sizing the prompt through Python's encoder raised RecursionError on a body
    # orjson had read, and the client got a 500 from kvtax, settled as vLLM's error. A clamp
    # writes the limit alone, never the prompt: such a body is clamped like any other.
    fake, upstream = vllm
    fake.hold = False
    budget = {} if over is None else {"token_budget": 10**6, "over_budget": over}
    gate = _gate(cap=CapSettings(mode="static", static_cap=8), **budget)
    url = await _start(proxies, upstream, gate)
    body = b'{"model": "m", "max_tokens": 10000000, "prompt": ' + DEEP + b"}"
    status, _ = await _post_raw(url, body)
    assert status == 200  # what vLLM answered
    if over is None:
        assert fake.bodies == [body]
    else:  # clamped: the limit written after the client's bytes, which go as they came
        assert fake.bodies[0].startswith(body[:-1])
        assert re.fullmatch(rb',"max_tokens":\d{1,7}}', fake.bodies[0][len(body) - 1 :])
    assert gate.in_flight == 0


def _exchange_bytes(fake: HeldVllm) -> list[tuple[bytes, dict[str, str]]]:
    return list(zip(fake.bodies, fake.headers, strict=True))


@pytest.mark.parametrize("stream", [False, True])
async def test_mode_off_is_byte_for_byte_the_plain_proxy(
    vllm: tuple[HeldVllm, str], proxies: Started, stream: bool
) -> None:
    """The proxy `kvtax serve` builds with the gate off, against the proxy without a gate:
    the same bytes reach vLLM and the same bytes reach the client."""
    fake, upstream = vllm
    fake.hold = False
    stack = build(Config(vllm_url=upstream))
    assert stack.proxy.gate is None
    assert stack.gate.settings.on is False
    port = await stack.proxy.start("127.0.0.1", 0)
    proxies.append(stack.proxy)
    plain = await _start(proxies, upstream, None)
    body = json.dumps({**BODY, "stream": stream}).encode()
    seen: list[tuple[int, bytes]] = []
    async with aiohttp.ClientSession() as client:
        for url in (plain, f"http://127.0.0.1:{port}"):
            async with client.post(
                url + "/v1/completions",
                data=body,
                headers={"Content-Type": "application/json", "X-Trace": "1"},
            ) as resp:
                seen.append((resp.status, await resp.read()))
    assert seen[0] == seen[1]
    to_vllm = _exchange_bytes(fake)
    assert to_vllm[0] == to_vllm[1]


async def test_a_gate_with_room_sends_vllm_the_same_bytes(
    vllm: tuple[HeldVllm, str], proxies: Started
) -> None:
    fake, upstream = vllm
    fake.hold = False
    plain = await _start(proxies, upstream, None)
    gated = await _start(proxies, upstream, _gate(cap=CapSettings(mode="static", static_cap=8)))
    body = json.dumps({**BODY, "stream": True}).encode()
    replies = []
    async with aiohttp.ClientSession() as client:
        for url in (plain, gated):
            async with client.post(
                url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
            ) as resp:
                replies.append(await resp.read())
    assert replies[0] == replies[1]
    assert fake.bodies[0] == fake.bodies[1]


async def test_cold_start_holds_the_engine_to_the_floor(
    vllm: tuple[HeldVllm, str], proxies: Started
) -> None:
    fake, upstream = vllm
    gate = _gate(cap=CapSettings(mode="adaptive", floor=2, ceiling=64))
    url = await _start(proxies, upstream, gate)
    async with aiohttp.ClientSession() as client:
        tasks = [asyncio.ensure_future(_post(client, url)) for _ in range(5)]
        assert await until(lambda: gate.queued == 3)
        assert await until(lambda: len(fake.bodies) == 2)
        assert gate.in_flight == 2  # no figures yet: the floor, not unlimited
        for _ in range(5):
            fake.slots.release()
        await asyncio.gather(*tasks)
    assert gate.admitted == 5


async def test_a_prompt_with_an_image_does_not_teach_the_estimator(
    vllm: tuple[HeldVllm, str], proxies: Started
) -> None:
    # Protection: vLLM's prompt tokens of a request with an image include the image's, which
    # none of the text bytes the gate counts show: learning from it pushed the ratio up.
    fake, upstream = vllm
    fake.hold = False
    gate = _gate(cap=CapSettings(mode="static", static_cap=8))
    url = await _start(proxies, upstream, gate)
    picture = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 4096}}
    text = {"type": "text", "text": "describe this picture in a few words"}
    body = {"model": "m", "messages": [{"role": "user", "content": [text, picture]}]}
    async with (
        aiohttp.ClientSession() as client,
        client.post(url + "/v1/chat/completions", json=body) as resp,
    ):
        assert resp.status == 200
        await resp.read()
    assert await until(lambda: proxies[0].in_flight == 0)
    assert gate.estimator == TokenEstimator()


@pytest.mark.parametrize("exponent", [309, 310])
async def test_a_huge_max_tokens_is_no_error_and_leaves_the_gate_working(
    vllm: tuple[HeldVllm, str], proxies: Started, exponent: int
) -> None:
    # Protection: max_tokens = 10**309 killed the gate's follower (OverflowError in its p95,
    # the cap held at the floor for good); 10**310 got a plain-text 500 from kvtax, recorded
    # as vLLM's error. The body vLLM gets is the client's: vLLM answers it.
    fake, upstream = vllm
    fake.hold = False
    gate = _gate(cap=CapSettings(mode="adaptive", floor=2, ceiling=64))
    url = await _start(proxies, upstream, gate)
    body = b'{"model": "m", "prompt": "hello there", "max_tokens": 1' + b"0" * exponent + b"}"
    status, answer = await _post_raw(url, body)
    assert status == 200
    assert answer["choices"]
    assert fake.bodies == [body]
    p95 = gate.footprint_p95
    assert p95 is not None
    assert math.isfinite(p95)
    gate.observe({})  # the controller steps on
    assert gate.in_flight == 0


@pytest.mark.parametrize(
    "extra",
    # 20 short prompts: their bytes alone leave room for one prompt's 64 tokens.
    [{"n": 20}, {"n": "20"}, {"prompt": ["a"] * 20}, {"prompt": [[1]] * 20}],
    ids=["n", "n-string", "prompt-list", "token-lists"],
)
async def test_n_and_prompt_lists_meet_the_token_budget(
    vllm: tuple[HeldVllm, str], proxies: Started, extra: dict[str, Any]
) -> None:
    # Protection: n=50 with max_tokens=64 under a budget of 100 was admitted and vLLM
    # generated 3,200 tokens; a list of 50 prompts did the same.
    fake, upstream = vllm
    fake.hold = False
    gate = _gate(cap=CapSettings(mode="static", static_cap=8), token_budget=100)
    url = await _start(proxies, upstream, gate)
    async with aiohttp.ClientSession() as client:
        status, _, answer = await _post(client, url, {**BODY, "max_tokens": 64, **extra})
    assert status == 400
    assert "20 sequences" in answer["error"]["message"]
    assert fake.bodies == []
    assert gate.rejections["over_budget"] == 1


async def test_clamping_leaves_each_sequence_its_share_of_the_budget(
    vllm: tuple[HeldVllm, str], proxies: Started
) -> None:
    fake, upstream = vllm
    fake.hold = False
    gate = _gate(
        cap=CapSettings(mode="static", static_cap=8), token_budget=100, over_budget="clamp"
    )
    url = await _start(proxies, upstream, gate)
    async with aiohttp.ClientSession() as client:
        assert (await _post(client, url, {**BODY, "max_tokens": 64, "n": 2}))[0] == 200
    prompt = gate.estimator.estimate(len(b"hello there"))
    sent = json.loads(fake.bodies[0])
    assert sent["n"] == 2
    assert 2 * (prompt + sent["max_tokens"]) <= 100
    assert sent["max_tokens"] == (100 - 2 * prompt) // 2


@pytest.mark.parametrize("written", ["50", 50.0, " 50 "])
async def test_a_max_tokens_vllm_reads_as_a_number_meets_the_budget(
    vllm: tuple[HeldVllm, str], proxies: Started, written: Any
) -> None:
    # Protection: "50" and 50.0 (vLLM reads both as 50) were refused as having no max_tokens.
    fake, upstream = vllm
    fake.hold = False
    gate = _gate(cap=CapSettings(mode="static", static_cap=8), token_budget=100)
    url = await _start(proxies, upstream, gate)
    body = {**BODY, "max_tokens": written}
    async with aiohttp.ClientSession() as client:
        assert (await _post(client, url, body))[0] == 200
    assert json.loads(fake.bodies[0])["max_tokens"] == written  # sent as the client wrote it


@dataclass
class OpenAfterDone:
    """A vLLM whose stream ends (final usage, then [DONE] unless ``done`` is False) but whose
    connection stays open until the test lets it go."""

    done: bool = True
    streams: int = 0

    def __post_init__(self) -> None:
        self.let_go = asyncio.Event()

    async def completions(self, request: web.Request) -> web.StreamResponse:
        payload = await request.json()
        usage = {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}
        if not payload.get("stream"):
            return web.json_response({"choices": [{"index": 0, "text": "ok"}], "usage": usage})
        self.streams += 1
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chunk = {"id": "c", "choices": [{"index": 0, "text": "ok"}], "usage": usage}
        final = {"id": "c", "choices": [], "usage": usage}
        for event in (chunk, final):  # compact, as vLLM writes its events
            await response.write(b"data: " + json.dumps(event, separators=(",", ":")).encode())
            await response.write(b"\n\n")
        if self.done:
            await response.write(DONE)
        await self.let_go.wait()
        await response.write_eof()
        return response


@pytest.mark.parametrize("done", [True, False], ids=["done", "final-usage-only"])
async def test_a_stream_frees_its_slot_once_its_end_is_relayed(
    proxies: Started, done: bool
) -> None:
    # Protection: an upstream that kept its connection open after [DONE] kept the gate's slot
    # held, and the next client was shed.
    fake = OpenAfterDone(done=done)
    app = web.Application()
    app.router.add_post("/v1/completions", fake.completions)
    runner, upstream = await serve(app)
    gate = _gate(max_queue=0)  # one slot, no queue: a held slot sheds the next client
    url = await _start(proxies, upstream, gate)
    try:
        async with aiohttp.ClientSession() as client:
            body = {**BODY, "stream": True}
            async with client.post(url + "/v1/completions", json=body) as stream:
                assert stream.status == 200
                assert await until(lambda: gate.in_flight == 0, limit=10.0)
                status, _, _ = await _post(client, url)
                assert status == 200
                assert gate.rejections["queue_full"] == 0
                fake.let_go.set()
                await stream.read()
        # The second request's slot is freed as it settles, after its client has the answer.
        assert await until(lambda: gate.in_flight == 0)
        assert gate.admitted == 2
    finally:
        fake.let_go.set()
        await runner.cleanup()


def _vllm_latency(total_s: float, finished: float) -> dict[str, ModelFigures]:
    """A scrape's figures of a vLLM that has finished ``finished`` requests in ``total_s``."""
    totals = {"e2e_latency_sum": total_s, "e2e_latency_count": finished}
    return {"m": ModelFigures(engine=True, totals=totals)}


@pytest.mark.parametrize("history", [True, False], ids=["vllm-has-history", "fresh-vllm"])
async def test_a_gate_started_under_load_knows_its_waits_from_vllm_s_latency(
    vllm: tuple[HeldVllm, str], proxies: Started, history: bool
) -> None:
    """A fresh kvtax has served nobody, so it has no service time of its own; vLLM's mean
    request latency (its lifetime, at kvtax's first scrape) stands for it. A request that
    would wait past --gate.max-wait is refused at once, from the first request; against a vLLM
    with no history the wait is unknown, and it queues as before."""
    # Protection: until three requests had completed, the wait estimate did not exist, and
    # early arrivals were refused only once their wait expired (5 s and more under load).
    fake, upstream = vllm
    gate = _gate(max_wait=30.0)
    url = await _start(proxies, upstream, gate)
    gate.on_figures(_vllm_latency(600.0, 10.0) if history else _vllm_latency(0.0, 0.0))
    async with aiohttp.ClientSession() as client:
        first = asyncio.ensure_future(_post(client, url))
        assert await until(lambda: len(fake.bodies) == 1)  # the cap of one is held
        second = asyncio.ensure_future(_post(client, url))
        assert await until(lambda: second.done() or gate.queued == 1)
        if history:  # 60 s a request, one in flight: a 60 s wait, past the 30 s bound
            status, _, body = await second
            assert status == 429
            assert "--gate.max-wait" in body["error"]["message"]
            assert gate.rejections["wait_predicted"] == 1
        else:
            assert not second.done()
            assert gate.rejections["wait_predicted"] == 0
        fake.slots.release()
        fake.slots.release()
        await first
        if not history:
            assert (await second)[0] == 200


@pytest.mark.parametrize("gated", [True, False], ids=["gate-on", "gate-off"])
async def test_a_vllm_that_is_down_is_a_503_to_retry_elsewhere_with_the_gate_on(
    proxies: Started, gated: bool
) -> None:
    """With the gate on, kvtax speaks for the pool: no engine listening (down, restarting, not
    ready) is a 503 with Retry-After and its reason, which a load balancer retries on another
    replica. Without it, the relay answers as nginx does: 502."""
    with refused_port() as port:
        url = await _start(proxies, f"http://127.0.0.1:{port}", _gate() if gated else None)
        async with aiohttp.ClientSession() as client:
            status, headers, body = await _post(client, url)
    if gated:
        assert status == 503
        assert headers["X-Kvtax-Dropped-Reason"] == "vllm_unavailable"
        assert int(headers["Retry-After"]) >= 1
        assert body["error"]["type"] == "upstream_unavailable"
    else:
        assert status == 502
        assert "X-Kvtax-Dropped-Reason" not in headers


@pytest.mark.parametrize("gated", [True, False], ids=["gate-on", "gate-off"])
async def test_vllms_own_queue_cap_503_names_its_reason_and_when_to_retry(
    vllm: tuple[HeldVllm, str], proxies: Started, gated: bool
) -> None:
    """vLLM's own 503 (its --max-num-queued-reqs refused) behind the gate reaches the client
    with vLLM's body, the drop reason vllm_refused and a Retry-After, and is counted beside
    the gate's refusals; without the gate, it passes as vLLM sent it."""
    fake, upstream = vllm
    fake.queue_full = True
    gate = _gate(cap=CapSettings(mode="static", static_cap=4))
    url = await _start(proxies, upstream, gate if gated else None)
    async with aiohttp.ClientSession() as client:
        status, headers, body = await _post(client, url)
    assert status == 503
    assert body["error"]["message"].startswith("The engine is currently busy")
    if gated:
        assert headers["X-Kvtax-Dropped-Reason"] == "vllm_refused"
        assert headers["Retry-After"] == "1"
        assert gate.rejections["vllm_refused"] == 1
        assert gate.in_flight == 0  # its slot went back
    else:
        assert "X-Kvtax-Dropped-Reason" not in headers
        assert "Retry-After" not in headers


async def test_a_request_queued_when_shutdown_begins_gets_a_503_naming_it(
    vllm: tuple[HeldVllm, str], proxies: Started
) -> None:
    """Shutdown empties the gate's queue at once: each queued request gets the shutdown 503,
    with its reason and Retry-After, to go to another replica."""
    fake, upstream = vllm
    gate = _gate()
    url = await _start(proxies, upstream, gate)
    async with aiohttp.ClientSession() as client:
        first = asyncio.ensure_future(_post(client, url))
        assert await until(lambda: len(fake.bodies) == 1)
        queued = asyncio.ensure_future(_post(client, url))
        assert await until(lambda: gate.queued == 1)
        stopping = asyncio.ensure_future(proxies[0].stop(grace=5.0))
        status, headers, _ = await queued
        fake.slots.release()
        assert (await first)[0] == 200
        await stopping
    assert status == 503
    assert headers["X-Kvtax-Dropped-Reason"] == "shutdown"
    assert int(headers["Retry-After"]) >= 1


@pytest.mark.parametrize("fair", [True, False], ids=["fairness-on", "fairness-off"])
async def test_one_tenant_s_burst_does_not_hold_back_another_s_request(
    vllm: tuple[HeldVllm, str], proxies: Started, fair: bool
) -> None:
    """With --gate.fairness-header, the queue serves its keys in turn: tenant b's request,
    queued behind tenant a's burst of three, goes to vLLM right after the one in flight.
    Without it, the queue is first come, first served."""
    fake, upstream = vllm
    gate = _gate(fairness_header=b"x-tenant" if fair else None)
    url = await _start(proxies, upstream, gate)

    async def post(tenant: str, prompt: str) -> int:
        return await _post_status(url, prompt, {"X-Tenant": tenant})

    first = asyncio.ensure_future(post("a", "a0"))
    assert await until(lambda: len(fake.bodies) == 1)
    queued = []
    for tenant, prompt in (("a", "a1"), ("a", "a2"), ("a", "a3"), ("b", "b0")):
        queued.append(asyncio.ensure_future(post(tenant, prompt)))
        assert await until(lambda: gate.queued == len(queued))
    for _ in range(5):
        fake.slots.release()
    assert [await task for task in (first, *queued)] == [200] * 5
    order = [json.loads(body)["prompt"] for body in fake.bodies]
    assert order == (["a0", "b0", "a1", "a2", "a3"] if fair else ["a0", "a1", "a2", "a3", "b0"])


async def test_a_higher_priority_band_is_served_first(
    vllm: tuple[HeldVllm, str], proxies: Started
) -> None:
    """With --gate.priority-header, bands are served strictly: a priority-5 request queued
    last goes to vLLM before every priority-0 one."""
    fake, upstream = vllm
    gate = _gate(priority_header=b"x-priority")
    url = await _start(proxies, upstream, gate)

    async def post(priority: str, prompt: str) -> int:
        return await _post_status(url, prompt, {"X-Priority": priority})

    first = asyncio.ensure_future(post("0", "low0"))
    assert await until(lambda: len(fake.bodies) == 1)
    queued = []
    for priority, prompt in (("0", "low1"), ("0", "low2"), ("5", "high")):
        queued.append(asyncio.ensure_future(post(priority, prompt)))
        assert await until(lambda: gate.queued == len(queued))
    for _ in range(4):
        fake.slots.release()
    assert [await task for task in (first, *queued)] == [200] * 4
    assert [json.loads(body)["prompt"] for body in fake.bodies] == ["low0", "high", "low1", "low2"]


@pytest.mark.parametrize("reserve", [True, False], ids=["reserve-on", "reserve-off"])
async def test_a_reserved_slot_lets_a_quiet_tenant_in_while_a_burst_waits(
    vllm: tuple[HeldVllm, str], proxies: Started, reserve: bool
) -> None:
    """With --gate.fair-reserve, tenant a, holding one request, leaves the last slot of a cap
    of 2 free for tenant b, seen lately and holding none: b's next request goes to vLLM at once,
    beside a's one in flight, while a's burst waits. Without it, a's burst fills the cap and
    b's request queues behind it."""
    fake, upstream = vllm
    gate = _gate(
        cap=CapSettings(mode="static", static_cap=2),
        fairness_header=b"x-tenant",
        fair_reserve=reserve,
    )
    url = await _start(proxies, upstream, gate)

    async def post(tenant: str, prompt: str) -> int:
        return await _post_status(url, prompt, {"X-Tenant": tenant})

    seen = asyncio.ensure_future(post("b", "b0"))  # b is seen, and leaves
    assert await until(lambda: len(fake.bodies) == 1)
    fake.slots.release()
    assert await seen == 200
    burst = [asyncio.ensure_future(post("a", f"a{i}")) for i in range(3)]
    assert await until(lambda: gate.in_flight + gate.queued == 3)
    quiet = asyncio.ensure_future(post("b", "b1"))
    assert await until(lambda: gate.in_flight + gate.queued == 4 and len(fake.bodies) == 3)
    tenants = [json.loads(body)["prompt"][0] for body in fake.bodies]
    assert tenants == (["b", "a", "b"] if reserve else ["b", "a", "a"])
    assert (gate.in_flight, gate.queued) == (2, 2)
    for _ in range(4):
        fake.slots.release()
    assert [await task for task in (*burst, quiet)] == [200] * 4
