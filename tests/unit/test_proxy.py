"""In-process tests of the proxy against a fake vLLM: relay fidelity, accounting and faults."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvtax.delivery.ledger import DeliveryLedger, ModelNames
from kvtax.expose.publish import ledger_samples
from kvtax.expose.samples import Sample
from kvtax.serve.proxy import Proxy, ProxySettings
from kvtax_dev.fakevllm.aio import STALL, STALL_TIMEOUT, FakeVllm, serve
from kvtax_dev.ports import refused_port
from kvtax_dev.process import until

Start = Callable[..., Coroutine[Any, Any, tuple[str, Proxy]]]


@pytest.fixture
async def fake() -> AsyncIterator[tuple[FakeVllm, str]]:
    vllm = FakeVllm()
    runner, url = await serve(vllm.app())
    yield vllm, url
    await runner.cleanup()


@pytest.fixture
async def start_proxy() -> AsyncIterator[Start]:
    started: list[Proxy] = []

    async def start(upstream: str, **settings: Any) -> tuple[str, Proxy]:
        names = ModelNames()
        names.update(["m"])
        proxy = Proxy(ProxySettings(upstream=upstream, **settings), DeliveryLedger(names))
        port = await proxy.start("127.0.0.1", 0)
        started.append(proxy)
        return f"http://127.0.0.1:{port}", proxy

    yield start
    for proxy in started:
        await proxy.stop()


def _outcomes(proxy: Proxy, model: str = "m") -> dict[str, float]:
    return {
        s.labels[1]: s.value
        for s in ledger_samples(proxy.ledger.counts())
        if isinstance(s, Sample) and s.metric == "kvtax_requests_total" and s.labels[0] == model
    }


def _delivered(proxy: Proxy) -> float:
    return proxy.ledger.totals()["m"].delivered


STREAM_OPTIONS: list[dict[str, Any] | None] = [
    None,
    {"include_usage": True},
    {"include_usage": True, "continuous_usage_stats": True},
    {"include_usage": False, "continuous_usage_stats": True},
]


@pytest.mark.parametrize("options", STREAM_OPTIONS)
@pytest.mark.parametrize("per_chunk", [1, 3])
async def test_stream_is_byte_identical_to_direct(
    fake: tuple[FakeVllm, str], start_proxy: Start, options: dict[str, Any] | None, per_chunk: int
) -> None:
    vllm, upstream = fake
    vllm.tokens, vllm.per_chunk = 7, per_chunk
    url, proxy = await start_proxy(upstream)
    body: dict[str, Any] = {"model": "m", "prompt": "hi", "stream": True}
    if options is not None:
        body["stream_options"] = options
    async with aiohttp.ClientSession() as client:
        async with client.post(upstream + "/v1/completions", json=body) as resp:
            direct = await resp.read()
        async with client.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            relayed = await resp.read()
    assert relayed == direct
    # vLLM was asked for usage on every chunk, whatever the client asked.
    assert vllm.requests[-1]["stream_options"]["continuous_usage_stats"] is True
    assert _delivered(proxy) == 7
    assert _outcomes(proxy)["completed"] == 1
    assert proxy.ledger.totals()["m"].prompt == 3


async def test_non_streamed_counts_usage(fake: tuple[FakeVllm, str], start_proxy: Start) -> None:
    vllm, upstream = fake
    vllm.tokens = 11
    url, proxy = await start_proxy(upstream)
    async with aiohttp.ClientSession() as client:
        body = {"model": "m", "prompt": "hi", "max_tokens": 11}
        async with client.post(
            url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer k-1"}
        ) as resp:
            answer = await resp.json()
    assert answer["usage"]["completion_tokens"] == 11
    assert "stream_options" not in vllm.requests[-1]
    assert vllm.headers[-1]["Authorization"] == "Bearer k-1"
    assert _delivered(proxy) == 11
    assert _outcomes(proxy)["completed"] == 1


async def test_other_paths_pass_through(fake: tuple[FakeVllm, str], start_proxy: Start) -> None:
    _, upstream = fake
    url, proxy = await start_proxy(upstream)
    async with aiohttp.ClientSession() as client, client.get(url + "/v1/models") as resp:
        assert resp.status == 200
        assert resp.headers["X-Upstream"] == "yes"
        assert (await resp.json())["data"][0]["id"] == "m"
        async with client.get(url + "/nope") as missing:
            assert missing.status == 404
    assert proxy.ledger.models() == []


async def test_request_bodies_and_statuses_pass_through(
    fake: tuple[FakeVllm, str], start_proxy: Start
) -> None:
    _, upstream = fake
    url, _ = await start_proxy(upstream)
    async with (
        aiohttp.ClientSession() as client,
        client.post(url + "/tokenize", data=b"abc", headers={"Authorization": "Bearer t"}) as resp,
    ):
        assert resp.status == 201
        assert await resp.read() == b"cba"
        assert resp.headers["X-Auth-Seen"] == "Bearer t"


async def test_client_that_stalls_then_leaves_has_undelivered_tokens(
    fake: tuple[FakeVllm, str], start_proxy: Start
) -> None:
    vllm, upstream = fake
    # About 6 MB of stream: far more than the socket buffers between proxy and client hold.
    vllm.tokens, vllm.filler = 4000, 1500
    url, proxy = await start_proxy(upstream)

    def small_socket(addr_info: Any) -> socket.socket:
        family, kind, proto, _, _ = addr_info
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        return sock

    connector = aiohttp.TCPConnector(socket_factory=small_socket)
    async with aiohttp.ClientSession(connector=connector, read_bufsize=4096) as client:
        body = {"model": "m", "prompt": "hi", "stream": True}
        resp = await client.post(url + "/v1/completions", json=body)
        await resp.content.readuntil(b"\n\n")
        await asyncio.sleep(0.3)
        resp.close()
    assert await until(lambda: proxy.in_flight == 0)
    totals = proxy.ledger.totals()["m"]
    assert _outcomes(proxy)["client_disconnected"] == 1
    assert totals.undelivered > 0
    assert totals.delivered + totals.undelivered <= 4000


async def test_upstream_5xx_reaches_client_untouched(
    fake: tuple[FakeVllm, str], start_proxy: Start
) -> None:
    vllm, upstream = fake
    vllm.status = 500
    url, proxy = await start_proxy(upstream)
    async with aiohttp.ClientSession() as client:
        body = {"model": "m", "prompt": "hi", "stream": True}
        async with client.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 500
            error = await resp.json()
    assert error["error"]["message"] == "boom"
    assert _outcomes(proxy)["upstream_error"] == 1


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
async def test_a_4xx_from_vllm_reaches_the_client_untouched_as_upstream_4xx(
    fake: tuple[FakeVllm, str], start_proxy: Start, stream: bool
) -> None:
    vllm, upstream = fake
    vllm.status = 400
    url, proxy = await start_proxy(upstream)
    body = {"model": "made-up", "prompt": "hi", "stream": stream}
    async with aiohttp.ClientSession() as client:
        async with client.post(upstream + "/v1/completions", json=body) as resp:
            direct = await resp.read()
        async with client.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 400
            relayed = await resp.read()
    assert relayed == direct  # vLLM's own error body, not one of kvtax's
    assert json.loads(relayed)["error"]["type"] == "BadRequestError"
    # vLLM refused the name, so it is not learned: the request counts under "other".
    assert proxy.ledger.models() == ["other"]
    assert _outcomes(proxy, "other")["upstream_4xx"] == 1
    assert _outcomes(proxy, "other")["upstream_error"] == 0
    assert proxy.ledger.totals()["other"].delivered == 0


async def test_unreachable_upstream_is_a_502_json_error(start_proxy: Start) -> None:
    with refused_port() as down:
        url, proxy = await start_proxy(f"http://127.0.0.1:{down}")
        async with aiohttp.ClientSession() as client:
            async with client.post(url + "/v1/completions", json={"model": "m"}) as resp:
                assert resp.status == 502
                error = await resp.json()
            async with client.get(url + "/v1/models") as resp:
                assert resp.status == 502
    assert error["error"]["type"] == "upstream_unavailable"
    assert "unreachable" in error["error"]["message"]
    assert _outcomes(proxy)["upstream_error"] == 1
    assert proxy.ledger.totals()["m"].joined_requests == 0


async def test_upstream_timeout_is_a_504_json_error(
    fake: tuple[FakeVllm, str], start_proxy: Start
) -> None:
    vllm, upstream = fake
    vllm.hang = 5.0
    url, proxy = await start_proxy(upstream, timeout=0.2)
    async with aiohttp.ClientSession() as client:
        body = {"model": "m", "prompt": "hi", "stream": True}
        async with client.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 504
            error = await resp.json()
    assert error["error"]["type"] == "upstream_timeout"
    assert _outcomes(proxy)["upstream_error"] == 1


async def test_stream_that_times_out_midway_ends_with_an_error_event(start_proxy: Start) -> None:
    # vLLM's 200 head comes at once, then nothing: the stream is under way when the read
    # timeout cuts it, so the client's answer is an error event, not a 504.
    runner, upstream = await serve(FakeVllm(tokens=3, delay=STALL).app(), handler_cancellation=True)
    try:
        url, proxy = await start_proxy(upstream, timeout=STALL_TIMEOUT)
        async with aiohttp.ClientSession() as client:
            body = {"model": "m", "prompt": "hi", "stream": True}
            async with client.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                text = (await resp.read()).decode()
    finally:
        await runner.cleanup()
    last = json.loads(text.strip().split("\n\n")[-1].removeprefix("data: "))
    assert last["error"]["type"] == "upstream_error"
    assert _outcomes(proxy)["upstream_error"] == 1


async def test_oversized_body_is_rejected_with_413(
    fake: tuple[FakeVllm, str], start_proxy: Start
) -> None:
    vllm, upstream = fake
    url, proxy = await start_proxy(upstream, max_body=1000)
    async with aiohttp.ClientSession() as client:
        body = json.dumps({"model": "m", "prompt": "x" * 5000})
        async with client.post(url + "/v1/completions", data=body) as resp:
            assert resp.status == 413
            assert int(resp.request_info.headers["Content-Length"]) == len(body)
            error = await resp.json()
    assert "1000 bytes" in error["error"]["message"]
    assert vllm.requests == []
    # The body was never read, so its model is unknown.
    assert _outcomes(proxy, "other")["too_large"] == 1


async def test_a_pass_through_body_has_no_limit_of_kvtax_s_own(
    fake: tuple[FakeVllm, str], start_proxy: Start
) -> None:
    # --proxy.max-body bounds what an accounted request holds whole; any other path's body is
    # streamed to vLLM, which answers it (here /tokenize echoes it reversed).
    _, upstream = fake
    url, _ = await start_proxy(upstream, max_body=1000)
    body = b"y" * 5000 + b"z"
    async with (
        aiohttp.ClientSession() as client,
        client.post(url + "/tokenize", data=body, headers={"Authorization": "t"}) as resp,
    ):
        assert resp.status == 201
        assert await resp.read() == body[::-1]


async def test_oversized_body_without_a_length_is_too_large(
    fake: tuple[FakeVllm, str], start_proxy: Start
) -> None:
    # Chunked: no Content-Length to refuse up front; the proxy stops reading past the limit.
    vllm, upstream = fake
    url, proxy = await start_proxy(upstream, max_body=1000)

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"model": "m", "prompt": "'
        for _ in range(10):
            yield b"x" * 500
        yield b'"}'

    async with (
        aiohttp.ClientSession() as client,
        client.post(url + "/v1/completions", data=chunks()) as resp,
    ):
        assert resp.status == 413
        assert "Content-Length" not in resp.request_info.headers
        error = await resp.json()
    assert "--proxy.max-body" in error["error"]["message"]
    assert vllm.requests == []
    assert _outcomes(proxy, "other")["too_large"] == 1
    assert _outcomes(proxy, "other")["upstream_4xx"] == 0


async def test_unknown_model_is_counted_as_other(
    fake: tuple[FakeVllm, str], start_proxy: Start
) -> None:
    _, upstream = fake
    url, proxy = await start_proxy(upstream)
    async with aiohttp.ClientSession() as client:
        for i in range(3):
            body = {"model": f"made-up-{i}", "prompt": "hi"}
            async with client.post(url + "/v1/completions", json=body) as resp:
                await resp.read()
    # Each settles once its client's acknowledgements of the answer are in.
    assert await until(lambda: proxy.in_flight == 0)
    # The fake answers 200 for any name, so vLLM "serves" them: each is learned. A 4xx would not.
    assert set(proxy.ledger.models()) == {"made-up-0", "made-up-1", "made-up-2"}
    names = ModelNames()
    ledger = DeliveryLedger(names)
    proxy.ledger = ledger
    async with (
        aiohttp.ClientSession() as client,
        client.post(url + "/v1/completions", data=b"not json") as resp,
    ):
        await resp.read()
    assert ledger.models() == ["other"]


async def test_client_disconnect_closes_upstream_and_counts_undelivered(
    fake: tuple[FakeVllm, str], start_proxy: Start
) -> None:
    vllm, upstream = fake
    vllm.tokens, vllm.delay = 10**6, 0.002
    url, proxy = await start_proxy(upstream)
    async with aiohttp.ClientSession() as client:
        body = {"model": "m", "prompt": "hi", "stream": True}
        resp = await client.post(url + "/v1/completions", json=body)
        await resp.content.readuntil(b"\n\n")
        resp.close()
    assert await until(lambda: proxy.in_flight == 0 and vllm.active == 0)
    assert _outcomes(proxy)["client_disconnected"] == 1
    assert _delivered(proxy) >= 1


async def test_a_thousand_disconnects_leave_nothing_behind(
    fake: tuple[FakeVllm, str], start_proxy: Start
) -> None:
    vllm, upstream = fake
    vllm.tokens, vllm.delay = 10**6, 0.001
    url, proxy = await start_proxy(upstream)
    baseline = len(asyncio.all_tasks())
    async with aiohttp.ClientSession() as client:
        body = {"model": "m", "prompt": "hi", "stream": True}
        for _ in range(1000):
            resp = await client.post(url + "/v1/completions", json=body)
            await resp.content.readuntil(b"\n\n")
            resp.close()
    assert await until(lambda: proxy.in_flight == 0 and vllm.active == 0)
    assert await until(lambda: len(asyncio.all_tasks()) <= baseline)
    assert _outcomes(proxy)["client_disconnected"] == 1000
    assert len(asyncio.all_tasks()) <= baseline
    assert vllm.active == 0


async def test_shutdown_lets_short_streams_finish_and_ends_long_ones_cleanly(
    fake: tuple[FakeVllm, str], start_proxy: Start
) -> None:
    vllm, upstream = fake
    vllm.tokens, vllm.delay = 50, 0.1  # five seconds of stream: longer than the grace
    url, proxy = await start_proxy(upstream)
    async with aiohttp.ClientSession() as client:
        body = {"model": "m", "prompt": "hi", "stream": True}
        async with client.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            await resp.content.readline()  # the stream is live
            stopping = asyncio.create_task(proxy.stop(grace=0.3))
            text = (await resp.read()).decode()
            await stopping
        # No new connection is accepted once shutdown began.
        with pytest.raises(aiohttp.ClientConnectionError):
            await client.post(url + "/v1/completions", json=body)
    last = json.loads(text.strip().split("\n\n")[-1].removeprefix("data: "))
    assert last["error"]["type"] == "server_shutdown"
    assert _outcomes(proxy)["shutdown"] == 1
    assert proxy.in_flight == 0
    # The tokens that reached the client before the cut count as delivered, the rest not.
    totals = proxy.ledger.totals()["m"]
    assert 0 < totals.delivered < 50


async def test_shutdown_waits_for_a_stream_that_fits_the_grace(
    fake: tuple[FakeVllm, str], start_proxy: Start
) -> None:
    vllm, upstream = fake
    vllm.tokens, vllm.delay = 5, 0.05
    url, proxy = await start_proxy(upstream)
    async with aiohttp.ClientSession() as client:
        body = {"model": "m", "prompt": "hi", "stream": True}
        async with client.post(url + "/v1/completions", json=body) as resp:
            await resp.content.readline()
            stopping = asyncio.create_task(proxy.stop(grace=30.0))
            text = (await resp.read()).decode()
            await stopping
    assert text.rstrip().endswith("data: [DONE]")
    assert _outcomes(proxy)["completed"] == 1
    assert _outcomes(proxy)["shutdown"] == 0
    assert _delivered(proxy) == 5


async def test_tokens_count_as_delivered_while_the_stream_runs(
    fake: tuple[FakeVllm, str], start_proxy: Start
) -> None:
    vllm, upstream = fake
    vllm.tokens, vllm.delay = 20, 0.05
    url, proxy = await start_proxy(upstream)
    async with aiohttp.ClientSession() as client:
        body = {"model": "m", "prompt": "hi", "stream": True}
        async with client.post(url + "/v1/completions", json=body) as resp:
            for _ in range(10):
                await resp.content.readline()
            proxy.credit_in_flight()  # what every scrape of kvtax or of vLLM does first
            mid_stream = proxy.ledger.totals()["m"].delivered
            await resp.read()
    assert await until(lambda: proxy.in_flight == 0)  # settled, its acknowledgements in
    # Counted while the client received them, not all at once when the stream ended ...
    assert 0 < mid_stream < 20
    assert _outcomes(proxy)["completed"] == 1
    # ... and never twice.
    assert _delivered(proxy) == 20


async def test_streams_open_counts_running_streams_only(
    fake: tuple[FakeVllm, str], start_proxy: Start
) -> None:
    vllm, upstream = fake
    vllm.tokens, vllm.delay = 10, 0.05
    url, proxy = await start_proxy(upstream)
    async with aiohttp.ClientSession() as client:
        whole = {"model": "m", "prompt": "hi"}
        async with client.post(url + "/v1/completions", json=whole) as resp:
            await resp.read()
        assert proxy.streams_open == 0
        body = {"model": "m", "prompt": "hi", "stream": True}
        async with client.post(url + "/v1/completions", json=body) as resp:
            await resp.content.readline()
            assert (proxy.streams_open, proxy.in_flight) == (1, 1)
            await resp.read()
    assert await until(lambda: proxy.in_flight == 0)
    assert proxy.streams_open == 0


async def test_a_client_that_read_to_the_end_then_hung_up_completed(
    fake: tuple[FakeVllm, str], start_proxy: Start, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client got every byte, [DONE] included, and closed before our end-of-stream.

    That race cannot be timed from outside, so the proxy's final write_eof is made to fail the
    way it does when the peer is gone.
    """
    vllm, upstream = fake
    vllm.tokens = 6
    url, proxy = await start_proxy(upstream)
    proxy_port = int(url.rsplit(":", 1)[1])
    real_write_eof = web.StreamResponse.write_eof

    async def write_eof(self: web.StreamResponse, data: bytes = b"") -> None:
        request = self._req  # which server is writing: the proxy or the fake vLLM
        if request is not None and request.url.port == proxy_port:
            raise ConnectionResetError("peer closed after reading the whole stream")
        await real_write_eof(self, data)

    monkeypatch.setattr(web.StreamResponse, "write_eof", write_eof)
    async with aiohttp.ClientSession() as client:
        body = {"model": "m", "prompt": "hi", "stream": True}
        async with client.post(url + "/v1/completions", json=body) as resp:
            received = b""
            while b"[DONE]" not in received:
                received += await resp.content.readany()
    assert await until(lambda: proxy.in_flight == 0)
    assert _outcomes(proxy)["completed"] == 1
    assert _outcomes(proxy)["client_disconnected"] == 0
    assert _delivered(proxy) == 6
