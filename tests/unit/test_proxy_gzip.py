"""Gzip request bodies through the proxy: passed to vLLM byte for byte, never inflated.

vLLM's FastAPI app installs no middleware that decodes a request body (CORS, its API key,
X-Request-Id, scaling, WebSocket metrics, response logging: vllm/entrypoints/serve/middleware),
and Starlette does not decode one either, so vLLM answers a gzip body with a 400 of its own.
The proxy does the same as a plain relay: the body and its Content-Encoding reach vLLM as the
client sent them, the request counts as one whose model kvtax could not read (``other``), and a
body past ``--proxy.max-body`` gets 413 at once. Nothing is inflated, however large the bomb.

The upstream here is a raw socket server, so that nothing on vLLM's side inflates either, and
the client writes raw bytes.
"""

from __future__ import annotations

import asyncio
import gzip
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from kvtax.delivery.ledger import DeliveryLedger, ModelNames
from kvtax.expose.publish import ledger_samples
from kvtax.expose.samples import Sample
from kvtax.serve.proxy import Proxy, ProxySettings
from tests.unit.gzipbomb import Inflation, bomb

MAX_BODY = 64 * 1024
ERROR = json.dumps({"error": {"message": "invalid JSON", "type": "BadRequestError"}}).encode()


@dataclass
class RawUpstream:
    """Records each request's head and body as bytes; answers a vLLM-style 400."""

    heads: list[bytes] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)
    url: str = ""
    server: asyncio.Server | None = None

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = int(self.server.sockets[0].getsockname()[1])
        self.url = f"http://127.0.0.1:{port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                self.heads.append(head)
                self.bodies.append(await reader.readexactly(length))
                writer.write(
                    b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(ERROR), ERROR)
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def upstream() -> AsyncIterator[RawUpstream]:
    up = RawUpstream()
    await up.start()
    yield up
    assert up.server is not None
    up.server.close()


@pytest.fixture
async def proxy(upstream: RawUpstream) -> AsyncIterator[tuple[int, Proxy]]:
    names = ModelNames()
    names.update(["m"])
    relay = Proxy(ProxySettings(upstream=upstream.url, max_body=MAX_BODY), DeliveryLedger(names))
    port = await relay.start("127.0.0.1", 0)
    yield port, relay
    await relay.stop()


async def _post(port: int, path: str, body: bytes, *, chunked: bool = False) -> bytes:
    """POST a gzip ``body``; the response head and body, as bytes. Sending stops once the
    proxy answered (a 413 comes before the body is done)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {len(body)}"
    head = (
        f"POST {path} HTTP/1.1\r\nHost: kvtax\r\nConnection: close\r\n"
        f"Content-Type: application/json\r\nContent-Encoding: gzip\r\n{framing}\r\n\r\n"
    )
    answer = asyncio.ensure_future(reader.readuntil(b"\r\n\r\n"))
    try:
        writer.write(head.encode())
        step = 16 * 1024
        for start in range(0, len(body), step):
            await asyncio.sleep(0)
            if answer.done():
                break
            piece = body[start : start + step]
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            await writer.drain()
        else:
            if chunked:
                writer.write(b"0\r\n\r\n")
            await writer.drain()
    except ConnectionError:
        pass  # answered and closed before the whole body was sent
    response_head = await answer
    try:
        rest = await reader.read()
    except ConnectionError:
        rest = b""
    writer.close()
    return response_head + rest


def _outcomes(relay: Proxy) -> dict[tuple[str, str], float]:
    return {
        (s.labels[0], s.labels[1]): s.value
        for s in ledger_samples(relay.ledger.counts())
        if isinstance(s, Sample) and s.metric == "kvtax_requests_total" and s.value
    }


async def _settled(relay: Proxy) -> dict[tuple[str, str], float]:
    for _ in range(200):
        if _outcomes(relay) and relay.in_flight == 0:
            break
        await asyncio.sleep(0.01)
    return _outcomes(relay)


REQUEST = json.dumps(
    {"model": "m", "prompt": "hi", "stream": True, "stream_options": {"include_usage": True}}
).encode()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
async def test_a_gzip_body_reaches_vllm_byte_for_byte_with_its_encoding(
    upstream: RawUpstream,
    proxy: tuple[int, Proxy],
    monkeypatch: pytest.MonkeyPatch,
    path: str,
) -> None:
    port, relay = proxy
    inflation = Inflation(monkeypatch)
    body = gzip.compress(REQUEST)
    response = await _post(port, path, body)
    head, _, payload = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400")
    assert payload == ERROR  # vLLM's own answer, as it gave it
    assert upstream.bodies == [body]  # not inflated, not rewritten (no usage asked for)
    assert b"\r\ncontent-encoding: gzip\r\n" in upstream.heads[0].lower()
    assert (inflation.calls, inflation.bytes) == (0, 0)
    if path != "/tokenize":
        # Its model could not be read: counted under "other", as vLLM's refusal.
        assert await _settled(relay) == {("other", "upstream_4xx"): 1.0}


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_a_gzip_bomb_past_the_body_limit_is_413_and_never_inflated(
    upstream: RawUpstream,
    proxy: tuple[int, Proxy],
    monkeypatch: pytest.MonkeyPatch,
    chunked: bool,
) -> None:
    # Protection: the old relay inflated the whole bomb after its 413 (2.5 s of the event
    # loop for 1 MiB of gzip, 1 GiB inflated).
    port, relay = proxy
    inflation = Inflation(monkeypatch)
    body = bomb(256 * 1024**2)  # ~256 KiB of gzip, 4 x the body limit
    assert len(body) > MAX_BODY
    response = await _post(port, "/v1/chat/completions", body, chunked=chunked)
    assert response.startswith(b"HTTP/1.1 413")
    assert upstream.bodies == []
    assert await _settled(relay) == {("other", "too_large"): 1.0}
    assert (inflation.calls, inflation.bytes) == (0, 0)
