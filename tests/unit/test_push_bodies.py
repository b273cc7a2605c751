"""Push bodies that arrive in several writes, as real senders' bodies do, over a raw socket.

A body is read to its end with a bound: a report split across TCP writes or sent with chunked
transfer encoding is accepted whole, and a body over the limit gets 413 whether or not it
announced its length.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from kvtax.serve.config import load_config
from kvtax.serve.sources import MAX_PUSH_BODY, PUSH_PATH
from kvtax.serve.wiring import Stack, build

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
    sidecar = delivery.sidecar
    client: TestClient[Any, Any] = await aiohttp_client(sidecar.web_app())
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
