"""Every generation API of a real vLLM 0.32 engine, through kvtax, driven by the clients people
use: counted as the clients were told, joined with the engine, gated in each API's own terms.

The official ``anthropic`` SDK (Messages, streamed and not) and ``openai`` SDK (Responses,
streamed and not, and streamed chat as the control) call kvtax's proxy; generate, batch chat and
SageMaker's /invocations (a chat body and a completions body), which no SDK wraps, go as the
raw requests their users send. What each client was told it received is what kvtax must count,
summed and per API; vLLM's own generation counter must agree; Prometheus, evaluating kvtax's
rules over the same pages, must raise no alert. Sent half around kvtax, the same traffic shows
as coverage of one half. A client that leaves mid-stream settles once, counted by its API's
rule. The gate refuses every API alike, and each SDK raises its own error on the refusal.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import pytest

from kvtax.mixin.rules import TEST_PROFILE
from kvtax.mixin.rules.render import alerts_yaml, recording_yaml
from kvtax_dev.exposition import read_samples, total
from kvtax_dev.testbed import VllmEngine
from kvtax_dev.testbed.promstack import PrometheusProcess, prometheus_config
from kvtax_dev.testbed.sidecar import KvtaxProcess, series_key

pytestmark = pytest.mark.e2e

M = "tiny-llama"
TOKENS = 24
HELLO: list[anthropic.types.MessageParam] = [{"role": "user", "content": "tell me a story"}]
CHAT = [{"role": "user", "content": "tell me a story"}]
# A machine busy with the suite's other lanes keeps a few requests from meeting a tight
# objective; these rules page on the error budget, and this test is about counting.
PROFILE = replace(TEST_PROFILE, slo_ttft_seconds=10.0, slo_itl_seconds=5.0)
SLO_FLAGS = ("--slo.ttft=10s", "--slo.itl=5s")


def _address(url: str) -> str:
    return urllib.parse.urlsplit(url).netloc


@dataclass
class Told:
    """What the clients were told they received, per API."""

    tokens: dict[str, int] = field(default_factory=dict)
    requests: int = 0

    def add(self, api: str, tokens: int) -> None:
        self.tokens[api] = self.tokens.get(api, 0) + tokens
        self.requests += 1

    @property
    def total(self) -> int:
        return sum(self.tokens.values())


async def _raw(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """A request no SDK wraps: its answer's usage (a stream's final usage chunk, asked for)."""
    async with session.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        raw = await resp.read()
    if not body.get("stream"):
        whole: dict[str, Any] = json.loads(raw)["usage"]
        return whole
    finals = [
        json.loads(line[6:])
        for line in raw.split(b"\n")
        if line.startswith(b"data: {") and b'"usage":{' in line
    ]
    assert finals, raw[-400:]
    usage: dict[str, Any] = finals[-1]["usage"]
    return usage


async def _mixed(base: Callable[[int], str]) -> Told:
    """One request of each kind, the i-th sent to ``base(i)``; what each client was told."""
    told = Told()
    kinds: list[Callable[[str, aiohttp.ClientSession], Awaitable[tuple[str, int]]]] = [
        _messages_create,
        _messages_stream,
        _responses_create,
        _responses_stream,
        _chat_stream,
        _generate_stream,
        _generate_whole,
        _chat_batch,
        _invocations_chat,
        _invocations_completions,
    ]
    async with aiohttp.ClientSession() as session:
        for i, kind in enumerate(kinds):
            api, tokens = await kind(base(i), session)
            told.add(api, tokens)
    return told


async def _messages_create(url: str, _: aiohttp.ClientSession) -> tuple[str, int]:
    async with anthropic.AsyncAnthropic(base_url=url, api_key="x", max_retries=0) as client:
        message = await client.messages.create(model=M, max_tokens=TOKENS, messages=HELLO)
    return "messages", message.usage.output_tokens


async def _messages_stream(url: str, _: aiohttp.ClientSession) -> tuple[str, int]:
    async with (
        anthropic.AsyncAnthropic(base_url=url, api_key="x", max_retries=0) as client,
        client.messages.stream(model=M, max_tokens=TOKENS, messages=HELLO) as stream,
    ):
        final = await stream.get_final_message()
    return "messages", final.usage.output_tokens


def _openai(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)


async def _responses_create(url: str, _: aiohttp.ClientSession) -> tuple[str, int]:
    async with _openai(url) as client:
        response = await client.responses.create(
            model=M, input="tell me a story", max_output_tokens=TOKENS
        )
    assert response.usage is not None
    return "responses", response.usage.output_tokens


async def _responses_stream(url: str, _: aiohttp.ClientSession) -> tuple[str, int]:
    tokens = -1
    async with _openai(url) as client:
        events = await client.responses.create(
            model=M, input="tell me a story", max_output_tokens=TOKENS, stream=True
        )
        async for event in events:
            if event.type == "response.completed":
                assert event.response.usage is not None
                tokens = event.response.usage.output_tokens
    assert tokens >= 0, "no response.completed event"
    return "responses", tokens


async def _chat_stream(url: str, _: aiohttp.ClientSession) -> tuple[str, int]:
    tokens = -1
    async with _openai(url) as client:
        chunks = await client.chat.completions.create(
            model=M,
            messages=[{"role": "user", "content": "tell me a story"}],
            max_tokens=TOKENS,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in chunks:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
    return "chat", tokens


async def _generate_stream(url: str, session: aiohttp.ClientSession) -> tuple[str, int]:
    body = {
        "model": M,
        "token_ids": [5, 6, 7, 8, 9],
        "sampling_params": {"max_tokens": TOKENS},
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    usage = await _raw(session, url + "/inference/v1/generate", body)
    return "generate", int(usage["completion_tokens"])


async def _generate_whole(url: str, session: aiohttp.ClientSession) -> tuple[str, int]:
    body = {"model": M, "token_ids": [5, 6, 7], "sampling_params": {"max_tokens": TOKENS}}
    usage = await _raw(session, url + "/inference/v1/generate", body)
    return "generate", int(usage["completion_tokens"])


async def _chat_batch(url: str, session: aiohttp.ClientSession) -> tuple[str, int]:
    body = {"model": M, "max_tokens": TOKENS, "messages": [CHAT, CHAT]}
    usage = await _raw(session, url + "/v1/chat/completions/batch", body)
    return "chat_batch", int(usage["completion_tokens"])


async def _invocations_chat(url: str, session: aiohttp.ClientSession) -> tuple[str, int]:
    body = {
        "model": M,
        "messages": CHAT,
        "max_tokens": TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    usage = await _raw(session, url + "/invocations", body)
    return "invocations", int(usage["completion_tokens"])


async def _invocations_completions(url: str, session: aiohttp.ClientSession) -> tuple[str, int]:
    body = {"model": M, "prompt": "tell me a story", "max_tokens": TOKENS}
    usage = await _raw(session, url + "/invocations", body)
    return "invocations", int(usage["completion_tokens"])


def _generated(engine: VllmEngine) -> float:
    return total(read_samples(engine.metrics_text()), "vllm:generation_tokens_total")


@dataclass
class Stack:
    engine: VllmEngine
    kvtax: KvtaxProcess
    prom: PrometheusProcess


@pytest.fixture
def stack(vllm_engine: VllmEngine, tmp_path: Path) -> Iterator[Stack]:
    rules = [tmp_path / "kvtax-recording.yaml", tmp_path / "kvtax-alerts.yaml"]
    rules[0].write_text(recording_yaml(PROFILE))
    rules[1].write_text(alerts_yaml(PROFILE))
    with KvtaxProcess(
        vllm_engine.url,
        proxy=True,
        window="60s",
        extra_args=SLO_FLAGS,
        log_path=tmp_path / "kvtax.log",
    ) as kvtax:
        config = prometheus_config(
            {"vllm": [_address(vllm_engine.url)], "kvtax": [_address(kvtax.base_url)]},
            interval="1s",
        )
        with PrometheusProcess(config, rules, log_path=tmp_path / "prom.log") as prom:
            prom.wait_for(
                lambda: prom.query('kvtax_vllm_up == 1 and on () up{job="vllm"} == 1'),
                what="kvtax reading vLLM",
            )
            yield Stack(vllm_engine, kvtax, prom)


def _api_series(page: dict[str, float], name: str) -> dict[str, float]:
    prefix = name + "{"
    out: dict[str, float] = {}
    for key, value in page.items():
        if key.startswith(prefix) and f'model_name="{M}"' in key:
            api = key.split('api="', 1)[1].split('"', 1)[0]
            out[api] = out.get(api, 0.0) + value
    return out


def test_every_api_is_counted_as_its_clients_were_told_and_joins_the_engine(
    stack: Stack,
) -> None:
    kvtax = stack.kvtax
    assert kvtax.proxy_url is not None
    proxy = kvtax.proxy_url
    before = _generated(stack.engine)
    told = asyncio.run(_mixed(lambda _: proxy))
    assert _generated(stack.engine) - before == told.total  # vLLM's counter agrees
    delivered = series_key("kvtax_delivered_tokens_total", {"model_name": M, "source": "proxy"})
    coverage = series_key("kvtax_join_coverage_ratio", {"model_name": M})
    joined = series_key("kvtax_join_delivered_tokens_total", {"model_name": M})
    page = kvtax.wait_for(
        lambda m: m.get(delivered) == told.total and m.get(joined) == told.total,
        what=f"{told.total} tokens delivered and joined with the engine's page",
    )
    assert _api_series(page, "kvtax_api_delivered_tokens_total") == told.tokens
    outcomes = _api_series(page, "kvtax_api_requests_total")
    assert sum(outcomes.values()) == told.requests
    assert page[coverage] == 1.0
    # The engine's generation over kvtax's own window equals what the join delivered: a yield
    # of 1, both read from the same pages.
    engine_now = series_key("kvtax_engine_generation_tokens_total", {"model_name": M})
    assert page[engine_now] >= told.total
    # Prometheus has evaluated kvtax's rules over these pages since the traffic: no alert.
    since = time.time()
    stack.prom.wait_for(
        lambda: stack.prom.evaluated_since(since), what="every rule group evaluated after it"
    )
    firing = [a for a in stack.prom.alerts() if a.get("state") == "firing"]
    assert firing == [], firing


def test_the_same_traffic_half_around_kvtax_shows_as_half_coverage(
    vllm_engine: VllmEngine,
) -> None:
    with KvtaxProcess(vllm_engine.url, proxy=True, window="120s") as kvtax:
        kvtax.wait_for(lambda m: m.get("kvtax_vllm_up") == 1.0, what="first scrape")
        proxy = kvtax.proxy_url
        assert proxy is not None
        told = asyncio.run(_mixed(lambda i: proxy if i % 2 == 0 else vllm_engine.url))
        assert told.requests == 10
        coverage = series_key("kvtax_join_coverage_ratio", {"model_name": M})
        page = kvtax.wait_for(
            lambda m: m.get(coverage) == pytest.approx(0.5), what="coverage of one half"
        )
    assert page[coverage] == pytest.approx(0.5)


# -- a client that leaves ----------------------------------------------------------------------
LEAVE = {
    "messages": (
        "/v1/messages",
        {"model": M, "max_tokens": 900, "stream": True, "messages": CHAT},
        b"event: content_block_delta\n",
    ),
    "responses": (
        "/v1/responses",
        {"model": M, "max_output_tokens": 900, "stream": True, "input": "tell me a story"},
        b".delta\ndata: ",
    ),
    "generate": (
        "/inference/v1/generate",
        {
            "model": M,
            "token_ids": [5, 6, 7],
            "sampling_params": {"max_tokens": 900, "ignore_eos": True},
            "stream": True,
        },
        b'"token_ids":[',
    ),
}


@pytest.mark.parametrize("api", sorted(LEAVE))
def test_a_client_that_leaves_mid_stream_settles_once_by_its_api_s_rule(
    vllm_engine: VllmEngine, api: str
) -> None:
    path, body, marker = LEAVE[api]
    with KvtaxProcess(vllm_engine.url, proxy=True, window="120s") as kvtax:
        kvtax.wait_for(lambda m: m.get("kvtax_vllm_up") == 1.0, what="first scrape")
        assert kvtax.proxy_url is not None
        before = _generated(vllm_engine)

        requests_key = series_key(
            "kvtax_api_requests_total",
            {"model_name": M, "api": api, "outcome": "client_disconnected"},
        )

        async def leave() -> bytes:
            async with aiohttp.ClientSession() as session:

                async def five_events() -> tuple[aiohttp.ClientResponse, bytes]:
                    resp = await session.post(f"{kvtax.proxy_url}{path}", json=body)
                    read = b""
                    while read.count(marker) < 5:
                        read += await resp.content.readany()
                    return resp, read

                # The engine computes in slices until five events are in, and stays stopped
                # while the client leaves and kvtax settles it: however fast it would have
                # run, the request is still in vLLM when kvtax closes its side.
                with vllm_engine.freezer() as freezer:
                    reading = asyncio.ensure_future(five_events())
                    assert await freezer.run_until(reading.done), "no five events"
                    resp, read = reading.result()
                    resp.close()
                    await asyncio.to_thread(
                        kvtax.wait_for, lambda m: m.get(requests_key) == 1.0, what="one disconnect"
                    )
                return read

        read = asyncio.run(leave())
        vllm_engine.wait_idle()  # vLLM aborted it: nothing runs
        generated = _generated(vllm_engine) - before
        page = kvtax.wait_for(lambda m: m.get(requests_key) == 1.0, what="one disconnect")
    delivered = _api_series(page, "kvtax_api_delivered_tokens_total")[api]
    assert generated < 900  # vLLM stopped well before the end
    if api == "generate":
        # Exact: the ids the client's TCP stack acknowledged, at least those it read.
        ids = sum(
            len(json.loads(line[6:])["choices"][0]["token_ids"])
            for line in read.split(b"\n")
            if line.startswith(b"data: {") and line.endswith(b"}")
        )
        assert ids <= delivered <= generated
    else:
        # The rule: one token per content event acknowledged; a floor of what was generated.
        assert read.count(marker) <= delivered <= generated
    outcomes = _api_series(page, "kvtax_api_requests_total")
    assert outcomes[api] == 1.0  # settled once, and only as client_disconnected


# -- the gate ----------------------------------------------------------------------------------
GATE_FLAGS = (
    "--gate.mode=static",
    "--gate.static-cap=1",
    "--gate.max-queue=1",
    "--gate.token-budget=300",
)


def test_the_gate_gives_every_api_the_same_verdict_each_in_its_own_shape(
    vllm_engine: VllmEngine,
) -> None:
    with KvtaxProcess(vllm_engine.url, proxy=True, extra_args=GATE_FLAGS) as kvtax:
        kvtax.wait_for(lambda m: m.get("kvtax_vllm_up") == 1.0, what="first scrape")
        assert kvtax.proxy_url is not None
        asyncio.run(_gate_verdicts(kvtax, vllm_engine))


async def _gate_verdicts(kvtax: KvtaxProcess, engine: VllmEngine) -> None:
    url = kvtax.proxy_url
    assert url is not None
    claude = anthropic.AsyncAnthropic(base_url=url, api_key="x", max_retries=0)
    oai = _openai(url)
    over = 1000  # past the budget of 300 tokens
    with pytest.raises(anthropic.BadRequestError, match="token-budget"):
        await claude.messages.create(model=M, max_tokens=over, messages=HELLO)
    with pytest.raises(openai.BadRequestError, match="token-budget"):
        await oai.responses.create(model=M, input="hi", max_output_tokens=over)
    with pytest.raises(openai.BadRequestError, match="token-budget"):
        await oai.chat.completions.create(
            model=M, messages=[{"role": "user", "content": "hi"}], max_tokens=over
        )
    async with aiohttp.ClientSession() as session:
        body = {"model": M, "token_ids": [5], "sampling_params": {"max_tokens": over}}
        async with session.post(url + "/inference/v1/generate", json=body) as resp:
            assert resp.status == 400
            assert "token-budget" in (await resp.json())["error"]["message"]
        # The cap of one held by a long stream, the queue of one by another: everything else
        # is shed at once. The engine is stopped once the stream's first event is out, so the
        # stream holds the cap however fast the engine would have finished it.
        hold = {"model": M, "prompt": "x", "max_tokens": 200, "stream": True, "ignore_eos": True}

        async def first_event() -> aiohttp.ClientResponse:
            resp = await session.post(url + "/v1/completions", json=hold)
            await resp.content.readuntil(b"\n\n")
            return resp

        with engine.freezer() as freezer:
            starting = asyncio.ensure_future(first_event())
            assert await freezer.run_until(starting.done), "no first event"
            held = starting.result()
            await _shed_while_held(kvtax, session, claude=claude, oai=oai, held=held, hold=hold)
    await claude.close()
    await oai.close()


async def _shed_while_held(
    kvtax: KvtaxProcess,
    session: aiohttp.ClientSession,
    *,
    claude: anthropic.AsyncAnthropic,
    oai: openai.AsyncOpenAI,
    held: aiohttp.ClientResponse,
    hold: dict[str, Any],
) -> None:
    """With the cap held by ``held`` and the engine stopped: the queue of one filled, every
    API's next request is shed, each in its API's shape."""
    url = kvtax.proxy_url
    assert url is not None
    queued = asyncio.ensure_future(session.post(url + "/v1/completions", json=hold))
    depth = "kvtax_gate_queue_depth"
    await asyncio.to_thread(kvtax.wait_for, lambda m: m.get(depth) == 1.0, what="one queued")
    with pytest.raises(anthropic.RateLimitError):
        await claude.messages.create(model=M, max_tokens=8, messages=HELLO)
    with pytest.raises(openai.RateLimitError):
        await oai.responses.create(model=M, input="hi", max_output_tokens=8)
    for path, payload in (
        (
            "/inference/v1/generate",
            {"model": M, "token_ids": [5], "sampling_params": {"max_tokens": 8}},
        ),
        ("/v1/chat/completions/batch", {"model": M, "max_tokens": 8, "messages": [CHAT]}),
        ("/invocations", {"model": M, "prompt": "x", "max_tokens": 8}),
    ):
        async with session.post(url + path, json=payload) as resp:
            assert resp.status == 429, path
            assert resp.headers["Retry-After"].isdigit()
            assert (await resp.json())["error"]["type"] == "rate_limit_exceeded"
    held.close()
    queued.cancel()
