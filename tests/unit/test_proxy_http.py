"""The proxy's HTTP/1.x on the wire, driven through raw sockets so that every byte is the test's.

HTTP/1.0 clients, keep-alive, pipelining, ``Expect: 100-continue``, hop-by-hop headers, clients
that half-close, and request bodies that come in pieces or chunked. Each test fails on a relay
that mishandles the behaviour it names; none times anything, the waits only guard against hangs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from kvtax.delivery.ledger import DeliveryLedger, ModelNames
from kvtax.expose.publish import ledger_samples
from kvtax.expose.samples import Sample
from kvtax.serve.proxy import Proxy, ProxySettings
from kvtax_dev.fakevllm.aio import FakeVllm, serve

# The raw-socket client helpers live with the front door's rig; re-exported for the modules
# that import them from here (test_proxy_parser).
from kvtax_dev.fakevllm.client import (
    CHAT,
    STREAM,
    WHOLE,
    Reply,
    closed,
    events,
    post,
    raw_request,
    read_head,
    read_reply,
)
from kvtax_dev.fakevllm.raw import WAIT
from kvtax_dev.process import until

__all__ = [
    "CHAT",
    "STREAM",
    "WAIT",
    "WHOLE",
    "Reply",
    "Start",
    "closed",
    "events",
    "post",
    "raw_request",
    "read_head",
    "read_reply",
]


# -- the rig -----------------------------------------------------------------------------------
@dataclass
class Rig:
    """A FakeVllm behind a Proxy, with every request head vLLM saw, raw."""

    vllm: FakeVllm
    proxy: Proxy
    port: int
    upstream_port: int
    seen: list[tuple[str, list[tuple[str, str]]]]
    writers: list[asyncio.StreamWriter] = field(default_factory=list)

    async def connect(
        self, port: int | None = None
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port or self.port)
        self.writers.append(writer)
        return reader, writer

    async def exchange(self, request: bytes, port: int | None = None) -> Reply:
        """One request on a fresh connection and its response."""
        reader, writer = await self.connect(port)
        writer.write(request)
        await writer.drain()
        return await read_reply(reader)

    def headers_seen(self, index: int = -1) -> dict[str, str]:
        """The headers of one request vLLM got, names lowered; a repeated name fails."""
        raw = self.seen[index][1]
        out = {k.lower(): v for k, v in raw}
        assert len(out) == len(raw), raw
        return out


Start = Callable[..., Coroutine[Any, Any, Rig]]


@pytest.fixture
async def start() -> AsyncIterator[Start]:
    rigs: list[Rig] = []
    runners: list[web.AppRunner] = []

    async def start(**settings: Any) -> Rig:
        vllm = FakeVllm()
        seen: list[tuple[str, list[tuple[str, str]]]] = []

        @web.middleware
        async def record(
            request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
        ) -> web.StreamResponse:
            raw = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.raw_headers]
            seen.append((request.path, raw))
            return await handler(request)

        app = vllm.app()
        app.middlewares.append(record)
        runner, upstream = await serve(app)
        runners.append(runner)
        upstream_port = int(runner.addresses[0][1])
        names = ModelNames()
        names.update(["m"])
        proxy = Proxy(ProxySettings(upstream=upstream, **settings), DeliveryLedger(names))
        port = await proxy.start("127.0.0.1", 0)
        rig = Rig(vllm, proxy, port, upstream_port, seen)
        rigs.append(rig)
        return rig

    yield start
    for rig in rigs:
        for writer in rig.writers:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
        await rig.proxy.stop()
    for runner in runners:
        await runner.cleanup()


def _outcomes(proxy: Proxy, model: str = "m") -> dict[str, float]:
    return {
        s.labels[1]: s.value
        for s in ledger_samples(proxy.ledger.counts())
        if isinstance(s, Sample) and s.metric == "kvtax_requests_total" and s.labels[0] == model
    }


def _delivered(proxy: Proxy) -> float:
    return proxy.ledger.totals()["m"].delivered


def _assert_stream(reply: Reply, tokens: int = 5) -> None:
    assert reply.status == 200
    assert (reply.header("Content-Type") or "").startswith("text/event-stream")
    got = events(reply.body)
    assert got[-1] == b"data: [DONE]"
    assert len(got) == tokens + 1
    assert all(json.loads(e.removeprefix(b"data: "))["model"] == "m" for e in got[:-1])


# -- 1. HTTP/1.0 -------------------------------------------------------------------------------
async def test_http10_stream_is_raw_sse_to_the_close(start: Start) -> None:
    rig = await start()
    request = post("/v1/completions", STREAM, version="1.0")
    direct = await rig.exchange(request, rig.upstream_port)
    reader, writer = await rig.connect()
    writer.write(request)
    reply = await read_reply(reader)
    # HTTP/1.0 has no chunked coding: the body is the events themselves, ended by the close.
    assert not reply.chunked
    assert reply.header("Transfer-Encoding") is None
    assert reply.header("Content-Length") is None
    assert reply.body.startswith(b"data: {")
    assert reply.body.endswith(b"data: [DONE]\n\n")
    assert reply.body == direct.body
    _assert_stream(reply)
    assert await until(lambda: rig.proxy.in_flight == 0)
    assert _outcomes(rig.proxy)["completed"] == 1
    assert _delivered(rig.proxy) == 5


async def test_http10_whole_answer_has_a_length_and_the_connection_closes(start: Start) -> None:
    rig = await start()
    reader, writer = await rig.connect()
    writer.write(post("/v1/completions", WHOLE, version="1.0"))
    reply = await read_reply(reader)
    assert reply.status == 200
    assert reply.header("Transfer-Encoding") is None
    assert reply.header("Content-Length") == str(len(reply.body))
    assert reply.json()["usage"]["completion_tokens"] == 5
    assert await closed(reader)
    assert await until(lambda: rig.proxy.in_flight == 0)
    assert _outcomes(rig.proxy)["completed"] == 1
    assert _delivered(rig.proxy) == 5


async def test_http10_pass_through_get(start: Start) -> None:
    rig = await start()
    reader, writer = await rig.connect()
    writer.write(raw_request("GET", "/v1/models", version="1.0"))
    reply = await read_reply(reader)
    assert reply.status == 200
    assert reply.header("Transfer-Encoding") is None
    assert reply.header("X-Upstream") == "yes"
    assert reply.json()["data"][0]["id"] == "m"
    assert await closed(reader)
    assert rig.proxy.ledger.models() == []


# -- 2, 3. keep-alive and pipelining -------------------------------------------------------------
async def test_keep_alive_serves_two_requests_on_one_connection(start: Start) -> None:
    rig = await start()
    reader, writer = await rig.connect()
    writer.write(post("/v1/completions", STREAM))
    first = await read_reply(reader)
    assert first.header("Connection") != "close"
    writer.write(post("/v1/completions", WHOLE))
    second = await read_reply(reader)
    _assert_stream(first)
    assert first.chunked
    assert second.status == 200
    assert second.json()["usage"]["completion_tokens"] == 5
    assert await until(lambda: rig.proxy.in_flight == 0)
    assert _outcomes(rig.proxy)["completed"] == 2
    assert _delivered(rig.proxy) == 10
    assert len(rig.vllm.requests) == 2


async def test_pipelined_requests_are_answered_whole_and_in_order(start: Start) -> None:
    rig = await start()
    # The stream is the slowest to answer, so answers written as they come would be out of order.
    rig.vllm.delay = 0.05
    reader, writer = await rig.connect()
    writer.write(
        post("/v1/completions", STREAM)
        + post("/v1/chat/completions", CHAT)
        + raw_request("GET", "/v1/models")
    )
    stream, chat, models = [await read_reply(reader) for _ in range(3)]
    _assert_stream(stream)
    assert chat.status == 200
    assert chat.json()["usage"]["completion_tokens"] == 5
    assert models.status == 200
    assert models.header("X-Upstream") == "yes"
    assert models.json()["data"][0]["id"] == "m"
    assert [path for path, _ in rig.seen] == [
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
    ]
    assert rig.vllm.requests[1]["messages"] == CHAT["messages"]
    assert await until(lambda: rig.proxy.in_flight == 0)
    assert _outcomes(rig.proxy)["completed"] == 2
    assert _delivered(rig.proxy) == 10
    # The connection is still good for a fourth.
    writer.write(raw_request("GET", "/v1/models"))
    assert (await read_reply(reader)).status == 200


# -- 4. Expect: 100-continue ---------------------------------------------------------------------
async def test_expect_100_continue_then_the_body(start: Start) -> None:
    rig = await start()
    body = json.dumps(STREAM).encode()
    head = [("Content-Length", str(len(body))), ("Expect", "100-continue")]
    reader, writer = await rig.connect()
    writer.write(raw_request("POST", "/v1/completions", headers=head))
    interim = await read_reply(reader)
    assert (interim.version, interim.status) == ("HTTP/1.1", 100)
    writer.write(body)
    reply = await read_reply(reader)
    _assert_stream(reply)
    assert rig.vllm.requests[-1]["prompt"] == "x"
    assert await until(lambda: rig.proxy.in_flight == 0)
    assert _outcomes(rig.proxy)["completed"] == 1


async def _oversized_expecting(start: Start) -> tuple[Rig, list[Reply]]:
    """A head announcing a body over --proxy.max-body, with Expect; the replies up to the final
    one. The body is never sent."""
    rig = await start(max_body=1000)
    head = [("Content-Length", "5000"), ("Expect", "100-continue")]
    reader, writer = await rig.connect()
    writer.write(raw_request("POST", "/v1/completions", headers=head))
    replies = [await read_reply(reader)]
    while replies[-1].status < 200:
        replies.append(await read_reply(reader))
    return rig, replies


async def test_expect_100_continue_over_the_limit_is_413_without_the_body(start: Start) -> None:
    rig, replies = await _oversized_expecting(start)
    final = replies[-1]
    assert final.status == 413
    assert "1000 bytes" in final.json()["error"]["message"]
    assert rig.vllm.requests == []
    assert await until(lambda: rig.proxy.in_flight == 0)
    assert _outcomes(rig.proxy, "other")["too_large"] == 1


async def test_expect_100_continue_over_the_limit_gets_no_100_first(start: Start) -> None:
    _, replies = await _oversized_expecting(start)
    assert [r.status for r in replies] == [413]


# -- 5. hop-by-hop headers -----------------------------------------------------------------------
HOP_HEADERS = [
    ("Connection", "keep-alive, X-Drop-Me"),
    ("X-Drop-Me", "1"),
    ("Keep-Alive", "timeout=5"),
    ("TE", "trailers"),
    ("Proxy-Authorization", "Basic abc"),
    ("Upgrade", "foo"),
    ("X-Keep", "1"),
    ("Authorization", "Bearer t"),
]


@pytest.mark.parametrize(
    ("method", "path", "payload"),
    [
        ("POST", "/v1/completions", STREAM),
        ("POST", "/v1/completions", WHOLE),
        ("GET", "/v1/models", None),
    ],
    ids=["stream", "whole", "pass-through"],
)
async def test_hop_by_hop_headers_stop_at_the_proxy(
    start: Start, method: str, path: str, payload: dict[str, Any] | None
) -> None:
    rig = await start()
    body = json.dumps(payload).encode() if payload else b""
    reply = await rig.exchange(raw_request(method, path, body, headers=HOP_HEADERS))
    assert reply.status == 200
    seen = rig.headers_seen()
    assert seen["x-keep"] == "1"
    assert seen["authorization"] == "Bearer t"
    for name in ("keep-alive", "te", "proxy-authorization", "upgrade"):
        assert name not in seen, name
    # The proxy may say keep-alive to vLLM on its own account, never forward the client's list.
    assert "x-drop-me" not in seen.get("connection", "").lower()


@pytest.mark.parametrize(
    ("method", "path", "payload"),
    [("POST", "/v1/completions", STREAM), ("GET", "/v1/models", None)],
    ids=["accounted", "pass-through"],
)
async def test_a_header_named_in_connection_stops_at_the_proxy(
    start: Start, method: str, path: str, payload: dict[str, Any] | None
) -> None:
    rig = await start()
    body = json.dumps(payload).encode() if payload else b""
    reply = await rig.exchange(raw_request(method, path, body, headers=HOP_HEADERS))
    assert reply.status == 200
    assert "x-drop-me" not in rig.headers_seen()


# -- 6. half-close -------------------------------------------------------------------------------
async def test_half_close_mid_stream_is_the_client_leaving(start: Start) -> None:
    rig = await start()
    rig.vllm.tokens, rig.vllm.delay = 300, 0.1  # thirty seconds of stream
    reader, writer = await rig.connect()
    writer.write(post("/v1/completions", STREAM))
    head = await asyncio.wait_for(read_head(reader), WAIT)
    assert head.status == 200
    await asyncio.wait_for(reader.readuntil(b"\n\n"), WAIT)  # the first event: the stream is live
    assert rig.vllm.active == 1
    writer.write_eof()
    # Like nginx's 499: vLLM's side is closed at once, far sooner than the stream would end.
    assert await until(lambda: rig.vllm.active == 0 and rig.proxy.in_flight == 0, limit=10.0)
    rest = await asyncio.wait_for(reader.read(), WAIT)  # and the client's side is closed
    assert b"[DONE]" not in rest
    assert _outcomes(rig.proxy)["client_disconnected"] == 1
    assert _outcomes(rig.proxy)["completed"] == 0
    assert _delivered(rig.proxy) < 300


async def test_half_close_after_a_whole_request_is_all_or_nothing(start: Start) -> None:
    """A client that sends its whole request, then FIN, as ``nc -N`` does.

    Half-closing is the client leaving (see above), so kvtax may drop such a request (the
    aiohttp relay does: the client gets no byte, vLLM is not left generating) or answer it. It
    must never do half of either: a partial answer, a connection left open, or a ledger that
    disagrees with what the client got.
    """
    rig = await start()
    reader, writer = await rig.connect()
    writer.write(post("/v1/completions", WHOLE))
    writer.write_eof()
    got = await asyncio.wait_for(reader.read(), WAIT)  # to the close: nothing more can come
    assert await until(lambda: rig.proxy.in_flight == 0 and rig.vllm.active == 0)
    outcomes = _outcomes(rig.proxy)
    if got:
        fed = asyncio.StreamReader()
        fed.feed_data(got)
        fed.feed_eof()
        reply = await read_reply(fed)
        assert await fed.read() == b""  # one whole answer, nothing after it
        assert reply.status == 200
        assert reply.json()["usage"]["completion_tokens"] == 5
        assert (outcomes["completed"], outcomes["client_disconnected"]) == (1, 0)
        assert _delivered(rig.proxy) == 5
    else:
        assert (outcomes["completed"], outcomes["client_disconnected"]) == (0, 1)
        assert _delivered(rig.proxy) == 0


# -- 7. bodies in pieces -------------------------------------------------------------------------
LONG = {"model": "m", "prompt": "y" * 3000, "stream": True}


async def test_a_body_in_several_writes_reaches_vllm_whole(start: Start) -> None:
    rig = await start()
    body = json.dumps(LONG).encode()
    half = len(body) // 2
    reader, writer = await rig.connect()
    writer.write(
        raw_request("POST", "/v1/completions", headers=[("Content-Length", str(len(body)))])
    )
    await writer.drain()
    await asyncio.sleep(0.2)
    writer.write(body[:half])
    await writer.drain()
    await asyncio.sleep(0.2)
    writer.write(body[half:])
    reply = await read_reply(reader)
    _assert_stream(reply)
    assert rig.vllm.requests[-1]["prompt"] == LONG["prompt"]
    assert await until(lambda: rig.proxy.in_flight == 0)
    assert _outcomes(rig.proxy)["completed"] == 1


@pytest.mark.parametrize("size_end", [b" ", b"\t", b" ;a=b"], ids=["space", "tab", "bws-ext"])
async def test_whitespace_after_a_chunk_s_size_is_read_as_rfc_9112_allows(
    start: Start, size_end: bytes
) -> None:
    # RFC 9112 7.1.1: BWS before a chunk extension's ";" (and nginx reads a size with spaces
    # after it). llhttp refused both until kvtax set its lenient_spaces_after_chunk_size; the
    # body is framed anew for vLLM, so vLLM never sees the whitespace.
    rig = await start()
    body = json.dumps(WHOLE).encode()
    reader, writer = await rig.connect()
    writer.write(raw_request("POST", "/v1/completions", headers=[("Transfer-Encoding", "chunked")]))
    writer.write(b"%x%b\r\n%b\r\n0\r\n\r\n" % (len(body), size_end, body))
    reply = await read_reply(reader)
    assert reply.status == 200
    assert rig.vllm.requests[-1] == WHOLE


async def test_a_chunked_body_reaches_vllm_whole(start: Start) -> None:
    rig = await start()
    body = json.dumps(LONG).encode()
    pieces = [body[i : i + 700] for i in range(0, len(body), 700)]
    reader, writer = await rig.connect()
    writer.write(raw_request("POST", "/v1/completions", headers=[("Transfer-Encoding", "chunked")]))
    for piece in pieces:
        writer.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)
    writer.write(b"0\r\n\r\n")
    reply = await read_reply(reader)
    _assert_stream(reply)
    assert rig.vllm.requests[-1]["prompt"] == LONG["prompt"]
    assert await until(lambda: rig.proxy.in_flight == 0)
    assert _outcomes(rig.proxy)["completed"] == 1
    assert _delivered(rig.proxy) == 5
