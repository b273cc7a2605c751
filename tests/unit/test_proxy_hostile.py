"""The proxy against upstreams and clients that misbehave: bodies in several writes, streams
that break, clients that hang up the moment they read ``[DONE]``, usage that never comes.

Each test names the protection it checks; each fails when that protection is removed.
"""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvtax.delivery.ledger import DeliveryLedger, ModelNames
from kvtax.expose.publish import ledger_samples
from kvtax.expose.samples import Sample
from kvtax.serve.proxy import Proxy, ProxySettings
from kvtax.serve.workers.pool import WorkerPool
from kvtax_dev.fakevllm.aio import serve
from kvtax_dev.fakevllm.events import DONE, done

Script = Callable[[web.Request, dict[str, Any]], Awaitable[web.StreamResponse]]


class Upstream:
    """A vLLM stand-in whose answer to each request is a script the test sets."""

    def __init__(self) -> None:
        self.script: Script | None = None
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 1024**2)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self.runner, self.url = await serve(app)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw) if raw.startswith(b"{") else {}
        assert self.script is not None
        return await self.script(request, body)


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    up = Upstream()
    await up.start()
    yield up
    assert up.runner is not None
    await up.runner.cleanup()


@pytest.fixture
async def proxy(upstream: Upstream) -> AsyncIterator[tuple[str, Proxy]]:
    names = ModelNames()
    names.update(["m"])
    relay = Proxy(ProxySettings(upstream=upstream.url), DeliveryLedger(names))
    port = await relay.start("127.0.0.1", 0)
    yield f"http://127.0.0.1:{port}", relay
    await relay.stop()


# The relay a hostile test counts through: the proxy in this process, or two proxy workers
# reporting to one ledger (--proxy.workers=2).
Relay = Proxy | WorkerPool


@pytest.fixture(params=[1, 2], ids=["one-process", "two-workers"])
async def endpoint(
    upstream: Upstream, request: pytest.FixtureRequest
) -> AsyncIterator[tuple[str, Relay]]:
    names = ModelNames()
    names.update(["m"])
    settings, ledger = ProxySettings(upstream=upstream.url), DeliveryLedger(names)
    relay: Relay = (
        WorkerPool(settings, ledger, count=request.param)
        if request.param > 1
        else Proxy(settings, ledger)
    )
    port = await relay.start("127.0.0.1", 0)
    yield f"http://127.0.0.1:{port}", relay
    await relay.stop()


def _pending(relay: Relay) -> int:
    return relay.unsettled if isinstance(relay, WorkerPool) else relay.in_flight


def _outcomes(proxy: Relay) -> dict[str, float]:
    return {
        s.labels[1]: s.value
        for s in ledger_samples(proxy.ledger.counts())
        if isinstance(s, Sample)
        and s.metric == "kvtax_requests_total"
        and s.labels[0] == "m"
        and s.value
    }


def _counter(proxy: Relay, metric: str) -> float:
    return sum(
        s.value
        for s in ledger_samples(proxy.ledger.counts())
        if isinstance(s, Sample) and s.metric == metric and s.labels[0] == "m"
    )


async def _settled(proxy: Relay, n: int) -> dict[str, float]:
    """The outcomes once ``n`` requests have settled (handlers end after clients do)."""
    for _ in range(500):
        if sum(_outcomes(proxy).values()) >= n and _pending(proxy) == 0:
            break
        await asyncio.sleep(0.01)
    return _outcomes(proxy)


def completion_body(size: int, tokens: int) -> bytes:
    """A vLLM-shaped non-streamed completion of about ``size`` bytes, usage last."""
    head = {"id": "cmpl-1", "object": "text_completion", "model": "m"}
    usage = {"prompt_tokens": 3, "total_tokens": 3 + tokens, "completion_tokens": tokens}
    skeleton: dict[str, Any] = {
        **head,
        "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
    }
    filler = max(0, size - len(json.dumps({**skeleton, "usage": usage})))
    skeleton["choices"][0]["text"] = "x" * filler
    return json.dumps({**skeleton, "usage": usage}, separators=(",", ":")).encode()


def in_pieces(body: bytes, status: int, *, sized: bool, pieces: int = 3) -> Script:
    """Answer with ``body`` written in several writes, 20 ms apart."""

    async def script(request: web.Request, _: dict[str, Any]) -> web.StreamResponse:
        response = web.StreamResponse(status=status, headers={"Content-Type": "application/json"})
        if sized:
            response.content_length = len(body)
        await response.prepare(request)
        step = -(-len(body) // pieces)
        for i in range(0, len(body), step):
            await response.write(body[i : i + step])
            await asyncio.sleep(0.02)
        await response.write_eof()
        return response

    return script


SIZES = {"1KB": 1024, "200KB": 200 * 1024, "1MB": 1024**2, "3MB": 3 * 1024**2}


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("sized", [True, False], ids=["content-length", "chunked"])
@pytest.mark.parametrize("status", [200, 400, 500])
async def test_a_body_in_several_writes_reaches_the_client_whole(
    upstream: Upstream, proxy: tuple[str, Proxy], size: str, sized: bool, status: int
) -> None:
    # Protection: the body is read to its end, not with one read() of what has arrived.
    body = completion_body(SIZES[size], tokens=17)
    upstream.script = in_pieces(body, status, sized=sized)
    url, relay = proxy
    async with (
        aiohttp.ClientSession() as client,
        client.post(url + "/v1/completions", json={"model": "m"}) as resp,
    ):
        got = await resp.read()
        assert resp.status == status
    assert got == body
    expected = {200: "completed", 400: "upstream_4xx", 500: "upstream_error"}[status]
    assert await _settled(relay, 1) == {expected: 1}
    assert relay.ledger.totals()["m"].delivered == (17 if status == 200 else 0)


@pytest.mark.parametrize("sized", [True, False], ids=["content-length", "chunked"])
async def test_a_body_vllm_breaks_off_never_looks_complete(
    upstream: Upstream, endpoint: tuple[str, Relay], sized: bool
) -> None:
    # Protection: when vLLM's body breaks off, the client's connection is broken too, so a
    # cut body can never arrive as a complete 200.
    body = completion_body(200 * 1024, tokens=9)

    async def half_then_gone(request: web.Request, _: dict[str, Any]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.content_length = len(body) if sized else None
        await response.prepare(request)
        await response.write(body[: len(body) // 2])
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.abort()
        return response

    upstream.script = half_then_gone
    url, relay = endpoint
    async with (
        aiohttp.ClientSession() as client,
        client.post(url + "/v1/completions", json={"model": "m"}) as resp,
    ):
        assert resp.status == 200  # the headers were already on their way
        with pytest.raises(aiohttp.ClientPayloadError):
            await resp.read()
    assert await _settled(relay, 1) == {"upstream_error": 1}
    assert relay.ledger.totals()["m"].delivered == 0


def sse(tokens: int, *, linger: float = 0.05, framing: bytes = b"\n\n") -> Script:
    """vLLM's stream with usage on every chunk; after ``[DONE]`` it lingers before ending, the
    window in which a client that read ``[DONE]`` hangs up."""

    async def script(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        wants_usage = (body.get("stream_options") or {}).get("continuous_usage_stats")
        for sent in range(1, tokens + 1):
            chunk: dict[str, Any] = {
                "id": "c",
                "choices": [
                    {"index": 0, "text": "t", "finish_reason": "length" if sent == tokens else None}
                ],
            }
            if wants_usage:
                chunk["usage"] = {"prompt_tokens": 2, "completion_tokens": sent}
            line = b"data: " + json.dumps(chunk, separators=(",", ":")).encode()
            await response.write(line + framing)
        if wants_usage:
            final = {
                "id": "c",
                "choices": [],
                "usage": {"prompt_tokens": 2, "completion_tokens": tokens},
            }
            await response.write(
                b"data: " + json.dumps(final, separators=(",", ":")).encode() + framing
            )
        await response.write(done(end=framing))
        await asyncio.sleep(linger)
        await response.write_eof()
        return response

    return script


async def _read_to_done_and_hang_up(session: aiohttp.ClientSession, url: str) -> int:
    """Read a stream until ``[DONE]``, then close at once; return the tokens received."""
    body = {"model": "m", "stream": True, "stream_options": {"include_usage": True}}
    seen = 0
    resp = await session.post(url + "/v1/completions", json=body)
    buffer = b""
    async for data in resp.content.iter_any():
        buffer += data
        if b"data: [DONE]" in buffer:
            break
    for line in buffer.split(b"\n"):
        if line.startswith(b"data: {") and b'"choices":[]' in line:
            seen = json.loads(line[6:])["usage"]["completion_tokens"]
    resp.close()  # drops the connection at once: no reading to the end
    return seen


async def test_thousands_of_clients_that_hang_up_at_done_all_completed(
    upstream: Upstream, endpoint: tuple[str, Relay]
) -> None:
    # Protection: a client that received everything is counted as having received
    # everything, even when it hangs up before kvtax finishes the response: the outcome is
    # decided from a last reading of its acknowledgements.
    upstream.script = sse(tokens=20, linger=0.05)
    url, relay = endpoint
    streams, limit = 2000, asyncio.Semaphore(100)
    connector = aiohttp.TCPConnector(limit=0, force_close=True)

    async def one(session: aiohttp.ClientSession) -> int:
        async with limit:
            return await _read_to_done_and_hang_up(session, url)

    async with aiohttp.ClientSession(connector=connector) as session:
        received = await asyncio.gather(*(one(session) for _ in range(streams)))
    assert sum(received) == streams * 20
    assert await _settled(relay, streams) == {"completed": streams}
    assert relay.ledger.totals()["m"].delivered == streams * 20
    assert relay.ledger.totals()["m"].undelivered == 0


async def test_a_stream_without_usage_is_counted_as_such(
    upstream: Upstream, endpoint: tuple[str, Relay]
) -> None:
    # Protection: an upstream that ignores stream_options leaves a signal, not a silent 0.
    async def no_usage(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"id":"c","choices":[{"index":0,"text":"a"}]}\n\n')
        await response.write(DONE)
        return response

    upstream.script = no_usage
    url, relay = endpoint
    async with (
        aiohttp.ClientSession() as client,
        client.post(url + "/v1/completions", json={"model": "m", "stream": True}) as r,
    ):
        await r.read()
    assert await _settled(relay, 1) == {"completed": 1}
    assert _counter(relay, "kvtax_requests_without_usage_total") == 1


async def test_a_stream_framed_with_single_newlines_is_still_counted(
    upstream: Upstream, endpoint: tuple[str, Relay]
) -> None:
    # Protection: events are read line by line, so single-newline framing still counts.
    upstream.script = sse(tokens=6, linger=0, framing=b"\n")
    url, relay = endpoint
    body = {"model": "m", "stream": True}
    async with (
        aiohttp.ClientSession() as client,
        client.post(url + "/v1/completions", json=body) as resp,
    ):
        got = await resp.read()
    assert b'"usage"' not in got  # the client did not ask for usage
    assert got.count(b"\n") == 7  # six chunks and [DONE], each on its own line
    assert await _settled(relay, 1) == {"completed": 1}
    assert relay.ledger.totals()["m"].delivered == 6
    assert _counter(relay, "kvtax_requests_without_usage_total") == 0


async def test_a_non_streamed_answer_without_usage_is_counted_as_such(
    upstream: Upstream, endpoint: tuple[str, Relay]
) -> None:
    async def no_usage(request: web.Request, _: dict[str, Any]) -> web.StreamResponse:
        return web.json_response({"id": "c", "choices": [{"index": 0, "text": "a"}]})

    upstream.script = no_usage
    url, relay = endpoint
    async with (
        aiohttp.ClientSession() as client,
        client.post(url + "/v1/completions", json={"model": "m"}) as resp,
    ):
        await resp.read()
    assert await _settled(relay, 1) == {"completed": 1}
    assert _counter(relay, "kvtax_requests_without_usage_total") == 1


async def test_a_chunked_body_to_a_pass_through_path_is_streamed_whole(
    upstream: Upstream, proxy: tuple[str, Proxy]
) -> None:
    # Protection: a body with no Content-Length reaches vLLM whole, however large (no limit of
    # kvtax's own on a pass-through path: vLLM's transcription endpoint takes 25 MB uploads).
    async def echo(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        raw = await request.read()
        return web.Response(text=f"{len(raw)} {raw.count(b'x')}")

    upstream.script = echo
    url, _relay = proxy

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(5):
            yield b"x" * (1024**2)

    async with aiohttp.ClientSession() as client:
        async with client.post(url + "/tokenize", data=chunks()) as big:
            assert big.status == 200
            assert await big.text() == f"{5 * 1024**2} {5 * 1024**2}"
        async with client.post(url + "/tokenize", data=b"small") as small:
            assert small.status == 200


async def test_an_accounted_body_past_the_limit_is_a_413(
    upstream: Upstream, endpoint: tuple[str, Relay]
) -> None:
    # Protection: an accounted body is held whole to be read, so it has a bound
    # (--proxy.max-body); past it the rest is never read.
    upstream.script = in_pieces(completion_body(1024, 1), 200, sized=True)
    url, relay = endpoint
    body = json.dumps({"model": "m", "prompt": "y" * relay.settings.max_body}).encode()
    async with (
        aiohttp.ClientSession() as client,
        client.post(url + "/v1/completions", data=io.BytesIO(body)) as r,
    ):
        assert r.status == 413


async def test_a_stream_vllm_breaks_off_counts_what_the_waiting_client_got(
    upstream: Upstream, endpoint: tuple[str, Relay]
) -> None:
    # Protection: the client is still connected when the error event and the end of stream
    # go out, so every token written reaches it, acknowledged yet or not.
    async def three_then_gone(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for sent in (1, 2, 3):
            chunk = {
                "id": "c",
                "choices": [{"index": 0, "text": "t", "finish_reason": None}],
                "usage": {"prompt_tokens": 2, "completion_tokens": sent},
            }
            await response.write(b"data: " + json.dumps(chunk, separators=(",", ":")).encode())
            await response.write(b"\n\n")
        assert request.transport is not None
        request.transport.abort()
        return response

    upstream.script = three_then_gone
    url, relay = endpoint
    async with (
        aiohttp.ClientSession() as client,
        client.post(url + "/v1/completions", json={"model": "m", "stream": True}) as r,
    ):
        got = await r.read()
    assert b'"type":"upstream_error"' in got
    assert await _settled(relay, 1) == {"upstream_error": 1}
    assert relay.ledger.totals()["m"].delivered == 3


async def test_a_stream_request_orjson_cannot_read_is_still_rewritten(
    upstream: Upstream, endpoint: tuple[str, Relay]
) -> None:
    # An integer past 64 bits is valid JSON; the request must still ask vLLM for usage, and
    # vLLM must get the client's exact integer (orjson would have read it as a float).
    seen: list[dict[str, Any]] = []
    answer = sse(tokens=2, linger=0)

    async def script(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        seen.append(body)
        return await answer(request, body)

    upstream.script = script
    url, relay = endpoint
    body = b'{"model":"m","stream":true,"seed":123456789012345678901234567890}'
    async with (
        aiohttp.ClientSession() as client,
        client.post(url + "/v1/completions", data=body) as resp,
    ):
        await resp.read()
    assert await _settled(relay, 1) == {"completed": 1}
    assert relay.ledger.totals()["m"].delivered == 2
    [sent] = seen
    assert sent["seed"] == 123456789012345678901234567890
    assert sent["stream_options"]["include_usage"] is True


async def test_idle_upstream_connections_are_dropped_before_vllm_drops_them(
    proxy: tuple[str, Proxy],
) -> None:
    # Protection: vLLM (uvicorn) closes an idle keep-alive connection after 5 s; a pooled
    # connection kept longer can be reused just as vLLM closes it, and that request got a 502
    # (the soak reproduced 14 in 240). aiohttp kept idle connections 15 s by default.
    _, relay = proxy
    assert relay.upstream.idle < 5.0


@pytest.mark.parametrize("sized", [True, False], ids=["content-length", "chunked"])
async def test_a_whole_answer_still_running_when_the_grace_period_ends_is_cut_as_shutdown(
    upstream: Upstream, proxy: tuple[str, Proxy], sized: bool
) -> None:
    # Protection: shutdown ends every request the grace period does not cover, not only
    # streams; a non-streamed answer was left running (aiohttp then waits up to 60 s for it).
    # It is cut so that vLLM frees its KV, the client's connection breaks so the body never
    # looks complete, and the proxy's one shutdown state makes the outcome "shutdown".
    body = completion_body(100 * 1024, tokens=9)
    upstream.script = in_pieces(body, 200, sized=sized, pieces=500)  # 500 writes, 20 ms apart
    url, relay = proxy
    async with aiohttp.ClientSession() as client:
        resp = await client.post(url + "/v1/completions", json={"model": "m"})
        assert resp.status == 200
        await resp.content.readany()  # the answer is under way
        stopping = asyncio.create_task(relay.stop(grace=0.1))
        with pytest.raises(aiohttp.ClientPayloadError):
            await resp.read()
        resp.close()
        await stopping
    assert await _settled(relay, 1) == {"shutdown": 1}
    assert relay.ledger.totals()["m"].delivered == 0
    assert relay.ledger.totals()["m"].undelivered == 0  # its usage, at the end, never came


def _closes_first_then(
    script: Script, closes: int = 1, after: float = 0.0
) -> tuple[Script, list[int]]:
    """A script that drops the connection unanswered ``closes`` times, ``after`` seconds from
    reading the request, then runs ``script``; the list counts the requests vLLM saw."""
    seen: list[int] = []

    async def wrapped(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        seen.append(1)
        if len(seen) <= closes:
            await asyncio.sleep(after)
            assert request.transport is not None
            request.transport.close()  # as uvicorn closing a keep-alive connection
            await asyncio.sleep(1)  # the handler never answers
        return await script(request, body)

    return wrapped, seen


async def test_a_connection_vllm_closes_unanswered_is_tried_once_more(
    upstream: Upstream, proxy: tuple[str, Proxy]
) -> None:
    # Protection: vLLM can close a pooled keep-alive connection just as the proxy reuses it;
    # without a second try the client gets a 502 that kvtax caused.
    url, relay = proxy
    upstream.script, seen = _closes_first_then(sse(3))
    body = {"model": "m", "prompt": "x", "stream": True}
    async with (
        aiohttp.ClientSession() as session,
        session.post(url + "/v1/completions", json=body) as resp,
    ):
        assert resp.status == 200
        text = await resp.text()
    assert "[DONE]" in text
    assert len(seen) == 2
    assert relay.upstream_retries == 1
    assert await _settled(relay, 1) == {"completed": 1}


async def test_a_second_unanswered_close_is_a_502_and_never_a_third_send(
    upstream: Upstream, proxy: tuple[str, Proxy]
) -> None:
    # One retry only: a vLLM that keeps dropping the request must not get it again and again.
    url, relay = proxy
    upstream.script, seen = _closes_first_then(sse(3), closes=2)
    async with aiohttp.ClientSession() as session:
        body = {"model": "m", "prompt": "x", "stream": True}
        async with session.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 502
    assert len(seen) == 2
    assert relay.upstream_retries == 1


async def test_an_answered_request_and_a_refused_connect_are_never_sent_twice(
    upstream: Upstream, proxy: tuple[str, Proxy]
) -> None:
    url, relay = proxy
    seen: list[int] = []

    async def error(request: web.Request, _: dict[str, Any]) -> web.StreamResponse:
        seen.append(1)
        return web.json_response({"error": "busy"}, status=503)

    upstream.script = error
    async with aiohttp.ClientSession() as session:
        body = {"model": "m", "prompt": "x"}
        async with session.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 503
        assert upstream.runner is not None
        await upstream.runner.cleanup()  # vLLM down: connects are refused
        async with session.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 502
    assert seen == [1]
    assert relay.upstream_retries == 0


async def test_a_request_that_breaks_off_after_vllm_ran_it_is_never_sent_twice(
    upstream: Upstream, proxy: tuple[str, Proxy]
) -> None:
    # Protection: only a break soon after sending is a stale pooled connection. vLLM sends a
    # non-streamed answer's status line when the generation ends, so a later break met a vLLM
    # that had the request and ran it; it was sent again, and run twice.
    url, relay = proxy
    relay.upstream.stale_within = 0.05
    upstream.script, seen = _closes_first_then(sse(3), after=0.3)  # later than the bound
    async with aiohttp.ClientSession() as session:
        body = {"model": "m", "prompt": "x"}
        async with session.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 502
    assert len(seen) == 1
    assert relay.upstream_retries == 0
    assert await _settled(relay, 1) == {"upstream_error": 1}
    assert relay.ledger.counts()["m"].joined_requests == 1  # vLLM had it
