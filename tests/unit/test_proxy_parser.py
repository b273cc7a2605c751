"""The proxy port's own HTTP parser against hostile requests and a broken vLLM.

Each protection named in SECURITY.md for the relay's parser has a test here that fails without
it: request smuggling (Content-Length with Transfer-Encoding), upgrades, heads too long in one
line or in all, a pipelining client that never reads, a connection that never completes a
request, and a vLLM whose answer is not HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest

from kvtax.serve.proxy.server import ServerSettings
from tests.unit.test_proxy_http import STREAM, WHOLE, Start, closed, post, raw_request, read_reply

pytest_plugins = ["tests.unit.test_proxy_http"]


async def test_content_length_with_transfer_encoding_is_refused_not_smuggled(
    start: Start,
) -> None:
    rig = await start()
    body = json.dumps(WHOLE).encode()
    smuggled = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    chunked = b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body)
    request = raw_request(
        "POST",
        "/v1/completions",
        chunked + smuggled,
        headers=[("Content-Length", str(len(chunked))), ("Transfer-Encoding", "chunked")],
    )
    reader, writer = await rig.connect()
    writer.write(request)
    reply = await read_reply(reader)
    assert reply.status == 400
    assert await closed(reader)
    assert rig.seen == []  # vLLM saw neither request


async def test_an_upgrade_is_refused(start: Start) -> None:
    rig = await start()
    reply = await rig.exchange(
        raw_request("GET", "/v1/realtime", headers=[("Connection", "Upgrade"), ("Upgrade", "x")])
    )
    assert reply.status == 400
    assert rig.seen == []


@pytest.mark.parametrize(
    "headers",
    [
        [("X-Long", "a" * 9000)],  # one line over 8,190 bytes
        [(f"X-H{i}", "a" * 8000) for i in range(10)],  # each line fits, the head does not
    ],
    ids=["one long line", "a long head"],
)
async def test_a_head_past_the_limits_is_a_400(
    start: Start, headers: list[tuple[str, str]]
) -> None:
    rig = await start()
    reply = await rig.exchange(raw_request("GET", "/v1/models", headers=headers))
    assert reply.status == 400
    assert "exceeds" in reply.json()["error"]["message"]
    assert rig.seen == []


async def test_a_client_that_pipelines_without_reading_is_stopped_being_read(
    start: Start,
) -> None:
    # Without the bound, every pipelined request would be read, parsed and held at once.
    rig = await start()
    rig.vllm.hang = 1.0  # the first answer takes a while: the rest queue behind it
    reader, writer = await rig.connect()
    for _ in range(40):  # one request per read
        writer.write(post("/v1/completions", WHOLE))
        await writer.drain()
        await asyncio.sleep(0.005)
    [conn] = list(rig.proxy._clients)
    assert conn.read_paused
    assert len(conn.pipeline) <= ServerSettings().max_pipelined + 1
    rig.vllm.hang = 0.0
    replies = [await read_reply(reader) for _ in range(40)]  # reading resumes as they drain
    assert {r.status for r in replies} == {200}


async def test_a_connection_that_completes_no_request_is_closed(
    start: Start,
) -> None:
    rig = await start(keepalive=0.2)
    reader, writer = await rig.connect()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
    assert await closed(reader)
    assert rig.seen == []


async def test_a_head_sent_a_byte_at_a_time_cannot_hold_the_connection(
    start: Start,
) -> None:
    # Protection: the reads of a head do not restart the wait for it (a slowloris client that
    # sends one byte now and then would otherwise keep its connection for good).
    rig = await start(keepalive=0.3)
    reader, writer = await rig.connect()
    head = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200

    async def drip() -> None:
        for byte in head:
            writer.write(bytes([byte]))
            await asyncio.sleep(0.02)

    dripping = asyncio.ensure_future(drip())
    try:
        assert await closed(reader)  # well before the 200 bytes (4 s) were all sent
        assert not dripping.done()
    finally:
        dripping.cancel()
    assert rig.seen == []


async def test_a_body_that_keeps_arriving_slowly_is_not_cut(
    start: Start,
) -> None:
    # A body's reads each restart the wait (nginx's client_body_timeout): an upload slower than
    # the wait as a whole, with no pause as long, reaches vLLM.
    keepalive = 2.0
    rig = await start(keepalive=keepalive)
    body = json.dumps({**WHOLE, "pad": " " * 3000}).encode()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
    loop = asyncio.get_running_loop()
    # The client and the proxy share this process, which a busy machine can stall for longer
    # than the 2 s wait between two 10 ms gaps; the wait then runs out as it should. A try cut
    # where this process saw such a gap is tried again; one cut without it fails, as every try
    # does without the protection.
    for _ in range(3):
        reader, writer = await rig.connect()
        writer.write(head)
        # 10 bytes every 10 ms: about 3 s for the whole body, longer than the wait as a whole,
        # each read far inside it (a loaded machine only stretches the whole).
        longest, last = 0.0, loop.time()
        for i in range(0, len(body), 10):
            writer.write(body[i : i + 10])
            await asyncio.sleep(0.01)
            longest, last = max(longest, loop.time() - last), loop.time()
        try:
            reply = await read_reply(reader)
        except (ConnectionError, asyncio.IncompleteReadError):
            assert longest >= keepalive / 2, f"cut, though no gap here was over {longest:.2f} s"
            writer.close()
            continue
        assert reply.status == 200
        assert len(rig.seen) == 1
        return
    pytest.fail("this process stalled for half the wait or more in every try")


async def test_a_vllm_whose_answer_is_not_http_is_vllm_s_error(start: Start) -> None:
    rig = await start()

    async def not_http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
            await writer.drain()
            with contextlib.suppress(ConnectionError):
                await reader.read()
        finally:
            writer.close()

    server = await asyncio.start_server(not_http, "127.0.0.1", 0)
    port = int(server.sockets[0].getsockname()[1])
    try:
        rig.proxy.upstream.port = port
        reply = await rig.exchange(post("/v1/completions", STREAM))
        assert reply.status == 502
        error = reply.json()["error"]
        # vLLM answered: the message names its answer, not its address.
        assert error["type"] == "upstream_error"
        assert "not HTTP" in error["message"]
        assert "unreachable" not in error["message"]
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize(
    ("answer", "named"),
    [
        (b"HTTP/1.1 200 OK\r\nX-A: 1\r\n folded\r\nContent-Length: 2\r\n\r\nok", "not HTTP"),
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"2\r\nok\r\n0\r\n\r\n",
            "not HTTP",
        ),
    ],
    ids=["obs-fold", "both-framings"],
)
async def test_a_malformed_answer_from_vllm_is_named_as_one(
    start: Start, answer: bytes, named: str
) -> None:
    # Protection: both were 502s saying "vLLM is unreachable", which sends an operator to
    # vLLM's address and port instead of its answer.
    rig = await start()
    server = await _raw_upstream(answer)
    try:
        rig.proxy.upstream.port = server.sockets[0].getsockname()[1]
        reply = await rig.exchange(raw_request("GET", "/version"))
        assert reply.status == 502
        error = reply.json()["error"]
        assert (error["type"], named in error["message"]) == ("upstream_error", True), error
    finally:
        server.close()
        await server.wait_closed()


async def _raw_upstream(answer: bytes) -> asyncio.Server:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(answer)
            await writer.drain()
        finally:
            writer.close()

    return await asyncio.start_server(serve, "127.0.0.1", 0)


async def test_a_body_that_runs_to_vllm_s_close_reaches_the_client_whole(start: Start) -> None:
    # Without the rule, the close that ends such a body looked like vLLM breaking off, and the
    # client's connection was broken before the body could look complete.
    rig = await start()
    server = await _raw_upstream(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nhello")
    try:
        rig.proxy.upstream.port = server.sockets[0].getsockname()[1]
        reply = await rig.exchange(raw_request("GET", "/version"))
        assert (reply.status, reply.body) == (200, b"hello")
    finally:
        server.close()
        await server.wait_closed()


async def test_a_client_still_sending_a_refused_body_reads_its_413(start: Start) -> None:
    # Protection: the proxy closed on the client's unread bytes, which resets the connection;
    # a client still sending its body then lost the 413 (seen with a 20 MiB upload). It now
    # ends its side after the answer and drops what still comes (nginx's lingering close).
    rig = await start(max_body=1000)
    reader, writer = await rig.connect()
    size = 8 * 1024**2
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % size)

    async def send() -> None:
        with contextlib.suppress(ConnectionError):
            for _ in range(size // 65536):
                writer.write(b"x" * 65536)
                await writer.drain()

    sending = asyncio.ensure_future(send())
    try:
        reply = await read_reply(reader)
        assert reply.status == 413
        assert await closed(reader)
    finally:
        sending.cancel()
    assert rig.seen == []
