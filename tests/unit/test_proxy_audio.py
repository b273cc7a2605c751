"""The speech-to-text APIs through the real proxy port: an upload read as it passes, counted.

vLLM answers ``/v1/audio/transcriptions`` and ``/translations`` from a multipart upload; the CPU
build here has no audio model, so the upstream is the fake, which reads the form as vLLM's server
does and replays the stream vLLM's own generator wrote (tests/fixtures/vllm/apis/, made by
scripts/record-audio-stream.py: nine tokens, one with no text and no chunk of its own). The
client is the official OpenAI SDK where it covers the call.
"""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from kvtax.delivery.ledger import DeliveryLedger, ModelNames
from kvtax.expose.publish import api_samples, ledger_samples
from kvtax.expose.samples import Sample
from kvtax.gate.cap import CapSettings
from kvtax.serve.proxy import Gate, GateSettings, Proxy, ProxySettings
from kvtax_dev.fakevllm.aio import SPEECH, FakeVllm, serve
from kvtax_dev.process import until

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm" / "apis"
AUDIO = b"RIFF" + bytes(range(256)) * 4096  # 1 MiB of "audio": never decoded by anyone here
# The recorded stream's tokens, by vLLM's own usage (one of them sent no chunk).
TOKENS = SPEECH["transcription"][-1]["usage"]["completion_tokens"]
PATHS = ["/v1/audio/transcriptions", "/v1/audio/translations"]


@dataclass
class Rig:
    vllm: FakeVllm
    proxy: Proxy
    url: str
    upstream: str


async def _rig(gate: Gate | None = None) -> tuple[Rig, Any]:
    vllm = FakeVllm()
    runner, upstream = await serve(vllm.app(), handler_cancellation=True)
    names = ModelNames()
    names.update(["m"])
    proxy = Proxy(ProxySettings(upstream=upstream), DeliveryLedger(names), gate=gate)
    port = await proxy.start("127.0.0.1", 0)
    return Rig(vllm, proxy, f"http://127.0.0.1:{port}", upstream), runner


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    made, runner = await _rig()
    yield made
    await made.proxy.stop()
    await runner.cleanup()


def _form(fields: dict[str, str], *, file_first: bool = False) -> aiohttp.FormData:
    form = aiohttp.FormData()
    if file_first:
        form.add_field("file", io.BytesIO(AUDIO), filename="a.wav", content_type="audio/wav")
    for key, value in fields.items():
        form.add_field(key, value)
    if not file_first:
        form.add_field("file", io.BytesIO(AUDIO), filename="a.wav", content_type="audio/wav")
    return form


async def _upload(url: str, fields: dict[str, str], **kwargs: Any) -> tuple[int, bytes]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, data=_form(fields, **kwargs)) as resp,
    ):
        return resp.status, await resp.read()


def _outcomes(proxy: Proxy) -> dict[str, float]:
    return {
        s.labels[1]: s.value
        for s in ledger_samples(proxy.ledger.counts())
        if isinstance(s, Sample) and s.metric == "kvtax_requests_total" and s.value
    }


def _events(body: bytes) -> list[dict[str, Any]]:
    return [json.loads(e[6:]) for e in body.split(b"\n\n") if e.startswith(b"data: {")]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("file_first", [False, True], ids=["fields-first", "file-first"])
async def test_a_streamed_upload_is_counted_by_vllm_s_usage_and_cut_to_what_was_asked(
    rig: Rig, path: str, file_first: bool
) -> None:
    """kvtax adds the usage options to the form (after the client's fields, wherever the file
    is), counts the stream by every chunk's usage (the token with no chunk included), and the
    client gets the stream as vLLM would have sent it without them."""
    status, body = await _upload(
        rig.url + path, {"model": "m", "stream": "true"}, file_first=file_first
    )
    assert status == 200
    events = _events(body)
    assert all("usage" not in event for event in events)  # none asked for, none received
    assert len(events) == TOKENS - 1  # one chunk per token with text
    seen = rig.vllm.requests[-1]
    assert seen["stream_include_usage"] == seen["stream_continuous_usage_stats"] == "true"
    assert seen["file_bytes"] == str(len(AUDIO))  # the upload reached vLLM whole
    assert await until(lambda: rig.proxy.in_flight == 0)
    assert _outcomes(rig.proxy) == {"completed": 1}
    assert rig.proxy.ledger.totals()["m"].delivered == TOKENS
    api = "translation" if path.endswith("translations") else "transcription"
    delivered = {
        s.labels[1]: s.value
        for s in api_samples(rig.proxy.ledger.api_counts())
        if isinstance(s, Sample) and s.metric == "kvtax_api_delivered_tokens_total" and s.value
    }
    assert delivered == {api: TOKENS}


async def test_a_client_that_asks_for_usage_gets_vllm_s_own_bytes(rig: Rig) -> None:
    """Asked for by the client, the usage passes; the stream is vLLM's own, byte for byte."""
    fields = {"model": "m", "stream": "true", "stream_include_usage": "true"}
    fields["stream_continuous_usage_stats"] = "true"
    direct = await _upload(rig.upstream + PATHS[0], fields)
    relayed = await _upload(rig.url + PATHS[0], fields)
    assert relayed == direct
    assert rig.vllm.requests[-1] == rig.vllm.requests[-2]  # nothing added: nothing to cut


async def test_an_upload_that_does_not_stream_goes_as_it_came(rig: Rig) -> None:
    """vLLM refuses stream options without a stream: kvtax adds none, and the answer, whose
    usage is the audio's duration, is counted as an answer without token usage."""
    status, body = await _upload(rig.url + PATHS[0], {"model": "m"})
    assert status == 200
    assert json.loads(body)["text"].startswith("Hello there")
    assert "stream_include_usage" not in rig.vllm.requests[-1]
    assert await until(lambda: rig.proxy.in_flight == 0)
    assert _outcomes(rig.proxy) == {"completed": 1}
    assert rig.proxy.ledger.counts()["m"].usage_missing == 1


async def test_the_openai_sdk_streams_a_transcription_through_kvtax(rig: Rig) -> None:
    """The SDK's own multipart upload, streamed: what it yields is what kvtax counted."""
    client = openai.AsyncOpenAI(base_url=rig.url + "/v1", api_key="x", max_retries=0)
    stream = await client.audio.transcriptions.create(
        model="m", file=("a.wav", AUDIO, "audio/wav"), stream=True
    )
    chunks = [chunk async for chunk in stream]
    await client.close()
    assert len(chunks) == TOKENS - 1
    assert await until(lambda: rig.proxy.in_flight == 0)
    assert rig.proxy.ledger.totals()["m"].delivered == TOKENS


async def test_a_client_that_leaves_a_transcription_is_counted_what_it_acknowledged(
    rig: Rig,
) -> None:
    """Counted by every chunk's usage: exactly the tokens of the chunks that reached it."""
    rig.vllm.pause_after = 4  # four chunks, then silence: the client has those and leaves
    async with aiohttp.ClientSession() as session:
        resp = await session.post(rig.url + PATHS[0], data=_form({"model": "m", "stream": "true"}))
        read = b""
        while read.count(b"\n\n") < 4:
            read += await resp.content.readany()
        resp.close()
    assert await until(lambda: rig.proxy.in_flight == 0)
    assert _outcomes(rig.proxy) == {"client_disconnected": 1}
    # The fourth chunk's usage: five tokens (the second and third chunks are two apart).
    assert (
        rig.proxy.ledger.totals()["m"].delivered
        == SPEECH["transcription"][3]["usage"]["completion_tokens"]
    )


@pytest.mark.parametrize("over", ["reject", "clamp"])
async def test_the_gate_reads_the_upload_s_limit_and_answers_in_openai_s_shape(
    over: str,
) -> None:
    """Over the token budget: 400 in reject mode; in clamp mode the lowered limit is written
    into the form as a field of its own, after the client's, and vLLM reads it."""
    gate = Gate(
        GateSettings(
            cap=CapSettings(mode="static", static_cap=4),
            token_budget=300,
            over_budget="clamp" if over == "clamp" else "reject",
        )
    )
    made, runner = await _rig(gate)
    try:
        fields = {"model": "m", "stream": "true", "max_completion_tokens": "1000"}
        status, body = await _upload(made.url + PATHS[0], fields)
        if over == "reject":
            assert status == 400
            assert "token-budget" in json.loads(body)["error"]["message"]
            assert made.vllm.requests == []
        else:
            assert status == 200
            assert 0 < int(made.vllm.requests[-1]["max_completion_tokens"]) <= 300
    finally:
        await made.proxy.stop()
        await runner.cleanup()
