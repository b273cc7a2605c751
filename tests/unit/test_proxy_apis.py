"""Every generation API vLLM serves, through the real proxy port: counted, joined and gated.

Each API is its own dialect: Anthropic's Messages and OpenAI's Responses (named events, usage at
their end only), tokens-in/tokens-out generate (ids in every event), batch chat (several
conversations in one answer) and SageMaker's /invocations (a chat or a completions body). A
completed answer is counted exactly on each; a stream its client leaves is counted by its API's
rule; the gate answers each in its API's own error shape, which its official SDK raises as its
own exception.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import anthropic
import openai
import pytest

from kvtax.delivery.ledger import DeliveryLedger, ModelNames
from kvtax.expose.publish import api_samples, ledger_samples
from kvtax.expose.samples import Sample
from kvtax.gate.cap import CapSettings
from kvtax.serve.proxy import Gate, GateSettings, Proxy, ProxySettings
from kvtax_dev.fakevllm.aio import FakeVllm, serve
from kvtax_dev.process import until

MESSAGE: list[anthropic.types.MessageParam] = [{"role": "user", "content": "hi"}]


@dataclass(frozen=True)
class Api:
    """One way to ask for ``tokens`` tokens: the path, the body, and the sequences it makes."""

    name: str
    path: str
    body: dict[str, Any]
    sequences: int = 1

    def with_body(self, **more: Any) -> dict[str, Any]:
        return {**self.body, **more}


APIS = [
    Api("messages", "/v1/messages", {"model": "m", "max_tokens": 50, "messages": MESSAGE}),
    Api("responses", "/v1/responses", {"model": "m", "max_output_tokens": 50, "input": "hi"}),
    Api(
        "generate",
        "/inference/v1/generate",
        {"model": "m", "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 50, "n": 2}},
        sequences=2,
    ),
    Api("invocations-chat", "/invocations", {"model": "m", "messages": MESSAGE}),
    Api("invocations-completions", "/invocations", {"model": "m", "prompt": "hi"}),
]
BATCH = Api(
    "chat_batch",
    "/v1/chat/completions/batch",
    {"model": "m", "max_tokens": 50, "messages": [MESSAGE, MESSAGE, MESSAGE]},
    sequences=3,
)


@dataclass
class Rig:
    vllm: FakeVllm
    proxy: Proxy
    url: str
    upstream: str


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    vllm = FakeVllm(tokens=6, per_chunk=2)
    runner, upstream = await serve(vllm.app(), handler_cancellation=True)
    names = ModelNames()
    names.update(["m"])
    proxy = Proxy(ProxySettings(upstream=upstream), DeliveryLedger(names))
    port = await proxy.start("127.0.0.1", 0)
    yield Rig(vllm, proxy, f"http://127.0.0.1:{port}", upstream)
    await proxy.stop()
    await runner.cleanup()


def _outcomes(proxy: Proxy) -> dict[str, float]:
    return {
        s.labels[1]: s.value
        for s in ledger_samples(proxy.ledger.counts())
        if isinstance(s, Sample) and s.metric == "kvtax_requests_total" and s.value
    }


async def _post(url: str, body: dict[str, Any]) -> bytes:
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.read()


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
@pytest.mark.parametrize("api", [*APIS, BATCH], ids=lambda api: api.name)
async def test_a_completed_answer_is_counted_exactly_on_every_api(
    rig: Rig, api: Api, stream: bool
) -> None:
    if stream and api is BATCH:
        pytest.skip("vLLM serves no batch stream")
    await _post(rig.url + api.path, api.with_body(stream=stream))
    assert await until(lambda: rig.proxy.in_flight == 0)
    assert _outcomes(rig.proxy) == {"completed": 1}
    totals = rig.proxy.ledger.totals()["m"]
    assert totals.delivered == rig.vllm.tokens * api.sequences
    assert totals.joined_requests == 1
    assert rig.proxy.ledger.counts()["m"].usage_missing == 0


@pytest.mark.parametrize("api", APIS[:2], ids=lambda api: api.name)
async def test_a_named_event_stream_reaches_the_client_byte_for_byte(rig: Rig, api: Api) -> None:
    body = api.with_body(stream=True)
    direct = await _post(rig.upstream + api.path, body)
    relayed = await _post(rig.url + api.path, body)
    assert relayed == direct
    assert rig.vllm.requests[-1] == body  # nothing asked of vLLM: nothing to cut


async def test_a_generate_stream_gets_the_final_usage_only_if_its_client_asked(
    rig: Rig,
) -> None:
    api = APIS[2]
    relayed = await _post(rig.url + api.path, api.with_body(stream=True))
    asked = rig.vllm.requests[-1]
    assert asked["stream_options"] == {"include_usage": True}  # kvtax asked for the total
    assert b'"usage":{' not in relayed  # and cut it: the client did not
    assert relayed.endswith(b"data: [DONE]\n\n")
    ids = sum(len(json.loads(line[6:])["choices"][0]["token_ids"]) for line in _data(relayed))
    assert ids == rig.vllm.tokens * 2  # every id the API answers with, as vLLM sent it
    wanted = await _post(
        rig.url + api.path, api.with_body(stream=True, stream_options={"include_usage": True})
    )
    assert b'"usage":{"prompt_tokens":3' in wanted


def _data(body: bytes) -> list[bytes]:
    return [
        line
        for line in body.split(b"\n")
        if line.startswith(b"data: {") and b'"choices":[{' in line
    ]


@pytest.mark.parametrize(
    ("api", "credited"),
    [(APIS[0], 4), (APIS[1], 4), (APIS[2], 8)],
    ids=["messages", "responses", "generate"],
)
async def test_a_client_that_leaves_mid_stream_is_counted_by_its_api_s_rule(
    rig: Rig, api: Api, credited: int
) -> None:
    # Messages and Responses carry no count per event: each content event counts one token, a
    # floor (here each holds 2, so the client read 8). Generate counts its ids exactly.
    rig.vllm.tokens, rig.vllm.pause_after = 100, 4
    marker = b'"token_ids":[' if api.name == "generate" else b".delta\n"
    if api.name == "messages":
        marker = b"event: content_block_delta\n"
    async with aiohttp.ClientSession() as session:
        resp = await session.post(rig.url + api.path, json=api.with_body(stream=True))
        read = b""
        while read.count(marker) < 4:
            read += await resp.content.readany()
        resp.close()
    assert await until(lambda: rig.proxy.in_flight == 0 and rig.vllm.active == 0)
    assert _outcomes(rig.proxy) == {"client_disconnected": 1}
    assert rig.proxy.ledger.totals()["m"].delivered == credited


async def test_the_official_sdks_get_what_kvtax_counts(rig: Rig) -> None:
    claude = anthropic.AsyncAnthropic(base_url=rig.url, api_key="x", max_retries=0)
    oai = openai.AsyncOpenAI(base_url=rig.url + "/v1", api_key="x", max_retries=0)
    reported = 0
    message = await claude.messages.create(model="m", max_tokens=50, messages=MESSAGE)
    reported += message.usage.output_tokens
    async with claude.messages.stream(model="m", max_tokens=50, messages=MESSAGE) as stream:
        final = await stream.get_final_message()
    reported += final.usage.output_tokens
    response = await oai.responses.create(model="m", input="hi", max_output_tokens=50)
    assert response.usage is not None
    reported += response.usage.output_tokens
    events = await oai.responses.create(model="m", input="hi", max_output_tokens=50, stream=True)
    async for event in events:
        if event.type == "response.completed":
            assert event.response.usage is not None
            reported += event.response.usage.output_tokens
    await claude.close()
    await oai.close()
    assert reported == 4 * rig.vllm.tokens
    assert await until(lambda: rig.proxy.in_flight == 0)
    assert rig.proxy.ledger.totals()["m"].delivered == reported
    assert _outcomes(rig.proxy) == {"completed": 4}


# -- the gate, on every API -------------------------------------------------------------------
@pytest.fixture
async def gated() -> AsyncIterator[Rig]:
    vllm = FakeVllm(tokens=3, hang=30.0)  # every admitted request holds its slot
    runner, upstream = await serve(vllm.app(), handler_cancellation=True)
    names = ModelNames()
    names.update(["m"])
    cap = CapSettings(mode="static", static_cap=1)
    gate = Gate(GateSettings(cap=cap, max_queue=0, token_budget=100, over_budget="reject"))
    proxy = Proxy(ProxySettings(upstream=upstream), DeliveryLedger(names), gate=gate)
    port = await proxy.start("127.0.0.1", 0)
    yield Rig(vllm, proxy, f"http://127.0.0.1:{port}", upstream)
    await proxy.stop()
    await runner.cleanup()


def _limit(api: Api, tokens: int) -> dict[str, Any]:
    """The fields that ask ``api`` for at most ``tokens`` tokens per sequence."""
    if api.name == "responses":
        return {"max_output_tokens": tokens}
    if api.name == "generate":
        return {"sampling_params": {"max_tokens": tokens}}
    return {"max_tokens": tokens}


async def _fill(rig: Rig) -> asyncio.Task[Any]:
    """One request admitted and held by vLLM: the cap of 1 is full from here on."""
    session = aiohttp.ClientSession()
    body = {"model": "m", "prompt": "x", "max_tokens": 5}

    async def hold() -> None:
        async with session:
            await session.post(rig.url + "/v1/completions", json=body)

    task = asyncio.ensure_future(hold())
    assert await until(lambda: len(rig.vllm.requests) == 1)
    return task


@pytest.mark.parametrize("api", [*APIS, BATCH], ids=lambda api: api.name)
async def test_the_gate_refuses_every_api_in_its_own_error_shape(gated: Rig, api: Api) -> None:
    async with aiohttp.ClientSession() as session:
        over = api.with_body(**_limit(api, 500))  # past the budget of 100 tokens
        async with session.post(gated.url + api.path, json=over) as resp:
            assert resp.status == 400
            refused = await resp.json()
        holder = await _fill(gated)
        within = api.with_body(**_limit(api, 5))
        async with session.post(gated.url + api.path, json=within) as resp:
            assert resp.status == 429
            assert resp.headers["Retry-After"].isdigit()
            shed = await resp.json()
        holder.cancel()
    for answer in (refused, shed):
        if api.name == "messages":
            assert answer["type"] == "error"
            assert set(answer["error"]) == {"type", "message"}
        else:
            assert set(answer["error"]) == {"message", "type", "param", "code"}
    assert "--gate.token-budget" in json.dumps(refused)
    if api.name == "messages":
        assert (refused["error"]["type"], shed["error"]["type"]) == (
            "invalid_request_error",
            "rate_limit_error",
        )


async def test_each_sdk_raises_its_own_errors_on_the_gate_s_answers(gated: Rig) -> None:
    claude = anthropic.AsyncAnthropic(base_url=gated.url, api_key="x", max_retries=0)
    oai = openai.AsyncOpenAI(base_url=gated.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="token-budget"):
        await claude.messages.create(model="m", max_tokens=500, messages=MESSAGE)
    with pytest.raises(openai.BadRequestError, match="token-budget"):
        await oai.responses.create(model="m", input="hi", max_output_tokens=500)
    holder = await _fill(gated)
    with pytest.raises(anthropic.RateLimitError):
        await claude.messages.create(model="m", max_tokens=5, messages=MESSAGE)
    with pytest.raises(openai.RateLimitError):
        await oai.responses.create(model="m", input="hi", max_output_tokens=5)
    holder.cancel()
    await claude.close()
    await oai.close()


async def test_the_proxy_s_counts_split_by_api_add_up_to_its_own(rig: Rig) -> None:
    for api in [*APIS, BATCH]:
        await _post(rig.url + api.path, api.with_body(stream=api is not BATCH))
    assert await until(lambda: rig.proxy.in_flight == 0)
    by_api = rig.proxy.ledger.api_counts()
    tokens = rig.vllm.tokens
    assert {api: counts.delivered for (_, api), counts in by_api.items()} == {
        "messages": tokens,
        "responses": tokens,
        "generate": 2 * tokens,
        "invocations": 2 * tokens,  # one chat body and one completions body
        "chat_batch": 3 * tokens,
    }
    assert sum(c.delivered for c in by_api.values()) == rig.proxy.ledger.totals()["m"].delivered
    assert all(c.outcomes["completed"] >= 1 and c.undelivered == 0 for c in by_api.values())
    published = {
        (s.labels[1], s.value)
        for s in api_samples(by_api)
        if s.metric == "kvtax_api_delivered_tokens_total"
    }
    assert ("messages", tokens) in published
