"""Push bodies that arrive in several writes, as real senders' bodies do, over a raw socket.

A body is read to its end with a bound: a report split across TCP writes or sent with chunked
transfer encoding is accepted whole, and a body over the limit gets 413 whether or not it
announced its length. A compressed body is refused (415, or the token's 401/403 first) and
never inflated, not even a byte of it.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from kvtax.serve.config import load_config
from kvtax.serve.sources.push import MAX_PUSH_BODY, PUSH_PATH
from kvtax.serve.wiring import Stack, build
from kvtax_dev.fakevllm.aio import listen
from tests.unit.gzipbomb import Inflation, bomb

TOKEN = "s3cret-token"
PIECES = 4


def _padded(report: dict[str, Any], size: int) -> bytes:
    # The padding goes first: a body cut anywhere short of its end is then invalid JSON.
    text = json.dumps(report).encode()
    return b" " * (size - len(text)) + text


def _request(length: int | None) -> bytes:
    framing = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    head = (
        f"POST {PUSH_PATH} HTTP/1.1\r\nHost: kvtax\r\nConnection: close\r\n"
        f"Authorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\n{framing}\r\n\r\n"
    )
    return head.encode()


async def _send_in_pieces(port: int, body: bytes, *, chunked: bool) -> tuple[int, bytes]:
    """POST ``body`` in PIECES writes with a pause after each; return (status, response body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    step = -(-len(body) // PIECES)
    try:
        writer.write(_request(None if chunked else len(body)))
        for start in range(0, len(body), step):
            piece = body[start : start + step]
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            await writer.drain()
            await asyncio.sleep(0.02)
        if chunked:
            writer.write(b"0\r\n\r\n")
        await writer.drain()
    except ConnectionError:
        pass  # the server may answer 413 and close before the sender is done
    response = await reader.read()
    writer.close()
    head, _, payload = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), payload


async def _serve(aiohttp_client: Any) -> tuple[int, Stack]:
    config = load_config(
        {"proxy.listen_address": "off", "scrape.interval": "1s", "push.token": TOKEN},
        env={},
        file=None,
    )
    delivery = build(config)
    client: TestClient[Any, Any] = await aiohttp_client(delivery.web.app())
    port = client.port
    assert port is not None
    return port, delivery


@pytest.mark.parametrize("size", [1_000, 200_000, 1_000_000, MAX_PUSH_BODY])
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_a_valid_report_that_arrives_in_several_writes_is_accepted_whole(
    aiohttp_client: Any, size: int, chunked: bool
) -> None:
    port, delivery = await _serve(aiohttp_client)
    body = _padded({"model": "m", "delivered_tokens": 7}, size)
    status, payload = await _send_in_pieces(port, body, chunked=chunked)
    assert (status, json.loads(payload)) == (200, {"accepted": 1})
    assert delivery.ledger.totals()["other"].delivered == 7


@pytest.mark.parametrize("size", [1_000, 200_000, 1_000_000])
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_an_invalid_report_in_several_writes_is_refused_naming_its_field(
    aiohttp_client: Any, size: int, chunked: bool
) -> None:
    port, delivery = await _serve(aiohttp_client)
    body = _padded({"model": "m", "delivered_tokens": -1}, size)
    status, payload = await _send_in_pieces(port, body, chunked=chunked)
    assert status == 400
    message = json.loads(payload)["error"]["message"]
    assert message == "report 0: delivered_tokens must not be negative, got -1"
    assert delivery.ledger.models() == []


@pytest.mark.parametrize("size", [MAX_PUSH_BODY + 1, 3_000_000, 10_000_000])
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_a_body_over_the_limit_gets_413_with_or_without_its_length(
    aiohttp_client: Any, size: int, chunked: bool
) -> None:
    port, delivery = await _serve(aiohttp_client)
    body = _padded({"model": "m", "delivered_tokens": 7}, size)
    status, payload = await _send_in_pieces(port, body, chunked=chunked)
    assert status == 413
    assert json.loads(payload)["error"]["message"] == f"body exceeds {MAX_PUSH_BODY} bytes"
    assert delivery.ledger.models() == []


# -- compressed bodies ----------------------------------------------------------------------
# On the web port's own server (WebPort.runner, as `kvtax serve` runs it), over a raw
# socket: no client library compresses or inflates anything on the test's side.


@pytest.fixture
async def web_port() -> AsyncIterator[Callable[..., Awaitable[tuple[int, Stack]]]]:
    runners: list[web.AppRunner] = []

    async def start(**flags: str) -> tuple[int, Stack]:
        config = load_config(
            {"proxy.listen_address": "off", "scrape.interval": "1s", **flags}, env={}, file=None
        )
        delivery = build(config)
        runner = delivery.web.runner()
        runners.append(runner)
        url = await listen(runner)
        return int(url.rsplit(":", 1)[1]), delivery

    yield start
    for runner in runners:
        await runner.cleanup()


async def _post(port: int, headers: dict[str, str], body: bytes) -> tuple[int, bytes, bytes]:
    """POST ``body`` to the push route with ``headers``: (status, response head, body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    fields = {"Host": "kvtax", "Connection": "close", "Content-Length": str(len(body)), **headers}
    head = f"POST {PUSH_PATH} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in fields.items())
    try:
        writer.write(head.encode() + b"\r\n" + body)
        await writer.drain()
    except ConnectionError:
        pass  # answered and closed before the whole body was sent
    response = await reader.read()
    writer.close()
    head_bytes, _, payload = response.partition(b"\r\n\r\n")
    return int(head_bytes.split()[1]), head_bytes, payload


BOMB = 256 * 1024**2  # ~256 KiB of gzip on the wire


@pytest.mark.parametrize(
    ("flags", "auth", "status"),
    [
        ({"push.token": TOKEN}, "Bearer wrong", 401),
        ({"push.token": TOKEN}, "", 401),
        ({}, f"Bearer {TOKEN}", 403),  # push is off: no token configured
        ({"push.token": TOKEN}, f"Bearer {TOKEN}", 415),
        ({"push.allow_unauthenticated": "true"}, "", 415),
    ],
    ids=["wrong-token", "no-token", "push-off", "good-token", "unauthenticated-allowed"],
)
async def test_a_gzip_bomb_is_refused_without_inflating_a_byte(
    web_port: Any,
    monkeypatch: pytest.MonkeyPatch,
    flags: dict[str, str],
    auth: str,
    status: int,
) -> None:
    # Protection: aiohttp's server inflates a gzip body as it arrives, before any handler could
    # refuse it, and reads on what a handler left unread after a 401 or a 413: a 1 MiB bomb
    # cost 2.5 s of the event loop the proxy relays on, for each request.
    port, delivery = await web_port(**flags)
    inflation = Inflation(monkeypatch)
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    if auth:
        headers["Authorization"] = auth
    got, _, _ = await _post(port, headers, bomb(BOMB))
    assert got == status
    await asyncio.sleep(0.05)  # whatever the server still does with the body, it does now
    assert (inflation.calls, inflation.bytes) == (0, 0)
    assert delivery.ledger.models() == []


@pytest.mark.parametrize("coding", ["gzip", "deflate", "br", "zstd", "GZIP", "identity, gzip"])
async def test_a_compressed_report_is_a_415_naming_what_to_send(
    web_port: Any, monkeypatch: pytest.MonkeyPatch, coding: str
) -> None:
    port, delivery = await web_port(**{"push.token": TOKEN})
    inflation = Inflation(monkeypatch)
    report = json.dumps({"model": "m", "delivered_tokens": 7}).encode()
    body = zlib.compress(report) if coding == "deflate" else gzip.compress(report)
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Encoding": coding}
    status, head, payload = await _post(port, headers, body)
    assert status == 415
    assert b"\r\nAccept-Encoding: identity" in head
    assert "send the report as plain JSON" in json.loads(payload)["error"]["message"]
    assert inflation.bytes == 0
    assert delivery.ledger.models() == []


@pytest.mark.parametrize("coding", [None, "identity", "Identity"])
async def test_a_plain_report_is_accepted_on_the_web_ports_server(
    web_port: Any, coding: str | None
) -> None:
    port, delivery = await web_port(**{"push.token": TOKEN})
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    if coding is not None:
        headers["Content-Encoding"] = coding
    status, _, payload = await _post(port, headers, b'{"model": "m", "delivered_tokens": 7}')
    assert (status, json.loads(payload)) == (200, {"accepted": 1})
    assert delivery.ledger.totals()["other"].delivered == 7
