"""A stream's answer ends with its last event, ``data: [DONE]``, not with vLLM's end of body.

vLLM writes ``[DONE]`` and the body's end (the last chunk) in two writes. Relayed one by one, a
client that closes as it reads ``[DONE]`` (the OpenAI SDK does) can close with the last chunk
unread in its socket: the kernel then resets the connection, and a reset carries no
acknowledgement, so a client that had every byte could count as gone. The proxy ends the
client's body in the same write as ``[DONE]``.

The time limits only guard against hangs: without the protection the client's body never ends
while vLLM holds its own end.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from kvtax.delivery.asks import UsageWish
from kvtax.delivery.ledger import DeliveryLedger, ModelNames
from kvtax.delivery.sse import StreamRewriter
from kvtax.serve.proxy import Proxy, ProxySettings
from kvtax_dev.fakevllm.aio import serve
from kvtax_dev.fakevllm.events import DONE
from kvtax_dev.process import until

HANG_GUARD = 20.0  # seconds; see the module docstring
EVENT = b'data: {"choices":[{"index":0,"text":"ok"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}\n\n'  # noqa: E501
LAST_CHUNK = b"0\r\n\r\n"


@dataclass
class HeldEndVllm:
    """A vLLM that streams one event and ``[DONE]``, then holds its end of body until
    ``release`` is set, and then sends ``after`` before it."""

    release: asyncio.Event = field(default_factory=asyncio.Event)
    after: bytes = b""
    breaks: bool = False  # it breaks its connection off instead of ending its body
    peers: set[int] = field(default_factory=set)  # the proxy's connections, by port

    async def completions(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.peers.add(request.transport.get_extra_info("peername")[1])  # type: ignore[union-attr]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(EVENT + DONE)
        await self.release.wait()
        if self.after:
            await response.write(self.after)
        if self.breaks:
            assert request.transport is not None
            request.transport.abort()
            return response
        await response.write_eof()
        return response


@pytest.fixture
async def held() -> AsyncIterator[tuple[HeldEndVllm, Proxy, int]]:
    fake = HeldEndVllm()
    app = web.Application()
    app.router.add_post("/v1/completions", fake.completions)
    runner, url = await serve(app)
    names = ModelNames()
    names.update(["m"])
    proxy = Proxy(ProxySettings(upstream=url), DeliveryLedger(names))
    port = await proxy.start("127.0.0.1", 0)
    yield fake, proxy, port
    fake.release.set()
    await proxy.stop()
    await runner.cleanup()


def _request() -> bytes:
    body = json.dumps({"model": "m", "prompt": "p", "max_tokens": 1, "stream": True}).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: kvtax\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def _read_answer(reader: asyncio.StreamReader) -> bytes:
    """One chunked answer's bytes, head to last chunk."""
    got = b""
    while not got.endswith(b"\r\n" + LAST_CHUNK):
        more = await reader.read(65536)
        assert more, got
        got += more
    return got


async def test_the_clients_body_ends_with_done_while_vllm_still_holds_its_end(
    held: tuple[HeldEndVllm, Proxy, int],
) -> None:
    # Protection: the body's end goes with [DONE]. Without it the last chunk waits for vLLM's
    # end, which this vLLM holds, and the read below runs into the guard.
    fake, proxy, port = held
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_request())
    answer = await asyncio.wait_for(_read_answer(reader), HANG_GUARD)
    assert not fake.release.is_set()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert body.endswith(DONE + b"\r\n" + LAST_CHUNK)
    assert await until(lambda: _outcomes(proxy) == {"completed": 1})
    # vLLM's connection waits for vLLM's end, out of the pool.
    assert (proxy.upstream.ending, proxy.upstream.pooled) == (1, 0)
    fake.release.set()
    assert await until(lambda: proxy.upstream.pooled == 1)
    # The client's connection carries the next request, and vLLM's pooled one takes it.
    writer.write(_request())
    again = await asyncio.wait_for(_read_answer(reader), HANG_GUARD)
    assert again.startswith(b"HTTP/1.1 200")
    writer.close()
    await writer.wait_closed()
    assert await until(lambda: _outcomes(proxy) == {"completed": 2})
    assert len(fake.peers) == 1
    assert proxy.ledger.totals()["m"].delivered == 2


async def test_what_vllm_sends_after_the_ended_body_is_not_the_clients(
    held: tuple[HeldEndVllm, Proxy, int],
) -> None:
    # Protection: reads after the ended body are dropped. Relayed, they would follow the last
    # chunk and be read as the start of the connection's next answer.
    fake, proxy, port = held
    fake.after = b'data: {"choices":[{"index":0,"text":"late"}]}\n\n'
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_request())
    first = await asyncio.wait_for(_read_answer(reader), HANG_GUARD)
    fake.release.set()  # the late event comes in a read of its own, after the body ended
    writer.write(_request())
    second = await asyncio.wait_for(_read_answer(reader), HANG_GUARD)
    writer.close()
    await writer.wait_closed()
    assert b"late" not in first
    assert second.startswith(b"HTTP/1.1 200"), second
    assert await until(lambda: _outcomes(proxy) == {"completed": 2})


async def test_a_vllm_that_breaks_off_after_done_costs_its_connection_not_the_answer(
    held: tuple[HeldEndVllm, Proxy, int],
) -> None:
    # Protection: vLLM's tail is read by a sink of its own, which closes a connection that
    # breaks instead of pooling it; the client, which had its whole answer, completed.
    fake, proxy, port = held
    fake.breaks = True
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_request())
    await asyncio.wait_for(_read_answer(reader), HANG_GUARD)
    assert await until(lambda: _outcomes(proxy) == {"completed": 1})
    fake.release.set()
    assert await until(lambda: proxy.upstream.ending == 0)
    assert proxy.upstream.pooled == 0
    writer.close()
    await writer.wait_closed()


def test_the_rewriter_ends_only_after_dones_blank_line_however_the_reads_split() -> None:
    stream = EVENT + DONE
    for cut in range(1, len(stream)):
        rewriter = StreamRewriter(UsageWish(include_usage=True, continuous=True))
        out = rewriter.feed(stream[:cut]).payload
        assert not rewriter.ended, cut
        out += rewriter.feed(stream[cut:]).payload
        assert rewriter.ended, cut
        assert out == stream, cut


def _outcomes(proxy: Proxy) -> dict[str, float]:
    counts = proxy.ledger.counts()
    return {k: v for book in counts.values() for k, v in book.outcomes.items() if v}
