"""The same request shapes sent straight to a vLLM-like upstream and through kvtax's proxy.

The fake (:class:`kvtax_dev.fakevllm.aio.FakeVllm`) reads requests the way vLLM's request models
do (pydantic in lax mode), serves one model under two names (``--served-model-name tiny
tiny-chat``: ``tiny`` is what its metrics say) and answers a request without ``model`` with
its default. For every shape the client must get the same status, the same body bytes and the
same end-to-end headers both ways, and kvtax's delivered counter must grow by exactly the
tokens the client received, under the engine's model name. The client never says which relay
is in place: only HTTP on loopback is used, so the matrix holds for any relay.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvtax.delivery.ledger import DeliveryLedger, ModelNames
from kvtax.serve.proxy import Proxy, ProxySettings
from kvtax.serve.sources.models import ModelsPoller
from kvtax.serve.workers.pool import WorkerPool
from kvtax_dev.fakevllm.aio import FakeVllm, serve
from kvtax_dev.process import until

ENGINE = "tiny"  # the first served name: vLLM's metrics say model_name="tiny"
ALIAS = "tiny-chat"
TOKENS = 4
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
# Headers that belong to one hop (and Date, which is the second the answer was written).
_HOP = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "content-length",
    "date",
    "te",
    "trailer",
    "upgrade",
}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
MESSAGES = [{"role": "user", "content": "hi"}]


def _stream(**more: Any) -> dict[str, Any]:
    return {"model": ENGINE, "prompt": "hi", "stream": True, **more}


def _no_model(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != "model"}


SHAPES: list[tuple[str, str, dict[str, Any]]] = [
    ("stream-true", COMPLETIONS, _stream()),
    ("stream-string-true", COMPLETIONS, _stream(stream="true")),
    ("stream-1", COMPLETIONS, _stream(stream=1)),
    ("stream-yes", COMPLETIONS, _stream(stream="yes")),
    ("include-true", COMPLETIONS, _stream(stream_options={"include_usage": True})),
    ("include-false", COMPLETIONS, _stream(stream_options={"include_usage": False})),
    ("include-string-true", COMPLETIONS, _stream(stream_options={"include_usage": "true"})),
    (
        "include-and-continuous",
        COMPLETIONS,
        _stream(stream_options={"include_usage": True, "continuous_usage_stats": True}),
    ),
    (
        "lax-everything",
        COMPLETIONS,
        _stream(stream="1", stream_options={"include_usage": "yes", "continuous_usage_stats": 1}),
    ),
    (
        "continuous-without-include",
        COMPLETIONS,
        _stream(stream_options={"continuous_usage_stats": "true"}),
    ),
    ("no-model-stream", COMPLETIONS, _no_model(_stream())),
    ("empty-model-stream", COMPLETIONS, _stream(model="")),
    ("alias-stream", COMPLETIONS, _stream(model=ALIAS, stream="true")),
    ("n-3", COMPLETIONS, _stream(n=3)),
    ("n-string-2-include", COMPLETIONS, _stream(n="2", stream_options={"include_usage": "true"})),
    ("prompt-list", COMPLETIONS, _stream(prompt=["a", "b"])),
    ("prompt-list-n-2-whole", COMPLETIONS, {"model": ENGINE, "prompt": ["a", "b", "c"], "n": 2}),
    ("chat-stream", CHAT, {"model": ALIAS, "messages": MESSAGES, "stream": "true"}),
    (
        "chat-tool-calls",
        CHAT,
        {
            "messages": MESSAGES,
            "tools": TOOLS,
            "stream": 1,
            "stream_options": {"include_usage": "true"},
        },
    ),
    ("chat-ids-asked", CHAT, {"messages": MESSAGES, "stream": True, "return_token_ids": True}),
    (
        "chat-no-reasoning",
        CHAT,
        {"messages": MESSAGES, "stream": True, "include_reasoning": "false"},
    ),
    ("ids-asked", COMPLETIONS, _stream(return_token_ids="true")),
    (
        "ids-and-include",
        COMPLETIONS,
        _stream(return_token_ids=1, stream_options={"include_usage": True}),
    ),
    ("echo", COMPLETIONS, _stream(echo=True)),
    ("chat-whole", CHAT, {"model": ENGINE, "messages": MESSAGES}),
    ("chat-whole-tools-alias", CHAT, {"model": ALIAS, "messages": MESSAGES, "tools": TOOLS}),
    ("whole-no-model", COMPLETIONS, {"prompt": "hi", "max_tokens": "4"}),
    ("stream-string-false", COMPLETIONS, _stream(stream="false")),
    ("400-stream-maybe", COMPLETIONS, _stream(stream="maybe")),
    (
        "400-options-without-stream",
        COMPLETIONS,
        {"model": ENGINE, "prompt": "hi", "stream_options": {"include_usage": True}},
    ),
    ("400-include-maybe", COMPLETIONS, _stream(stream_options={"include_usage": "maybe"})),
    ("400-options-not-an-object", COMPLETIONS, _stream(stream_options="yes")),
    ("400-model-not-a-string", COMPLETIONS, _stream(model=7)),
    ("404-unknown-model", COMPLETIONS, _stream(model="nope")),
    ("500-stream", COMPLETIONS, _stream(prompt="boom")),
    ("500-whole", CHAT, {"model": ENGINE, "messages": MESSAGES, "prompt": "boom"}),
]


@dataclass
class Answer:
    status: int
    headers: list[tuple[str, str]]
    body: bytes


@dataclass
class Rig:
    vllm: FakeVllm
    upstream: str
    proxy: Proxy
    url: str
    # With workers, the pool that relays (``proxy`` is then only the one-process relay's
    # settings, never started).
    pool: WorkerPool | None = None

    @property
    def ledger(self) -> DeliveryLedger:
        return self.pool.ledger if self.pool is not None else self.proxy.ledger

    async def idle(self) -> bool:
        """Every request settled in the ledger."""
        if self.pool is not None:
            pool = self.pool
            return await until(lambda: pool.unsettled == 0)
        return await until(lambda: self.proxy.in_flight == 0)

    async def schemes(self) -> dict[str, int]:
        if self.pool is not None:
            await self.pool.report()
            return self.pool.cost.schemes
        return self.proxy.cost.schemes


Start = Callable[..., Any]


@pytest.fixture
async def start() -> AsyncIterator[Start]:
    started: list[tuple[web.AppRunner, Proxy | WorkerPool]] = []

    async def start(version: str | None = None, *, workers: int = 1, **knobs: Any) -> Rig:
        vllm = FakeVllm(tokens=TOKENS, served=(ENGINE, ALIAS), fail={"boom": 500}, **knobs)
        runner, upstream = await serve(vllm.app())
        names = ModelNames()  # no scrape yet: /v1/models alone says what is served
        poller = ModelsPoller(names, url=upstream, configured=(), interval=300.0, timeout=10.0)
        async with aiohttp.ClientSession() as session:
            await poller.read(session)
        settings, ledger = ProxySettings(upstream=upstream), DeliveryLedger(names)
        proxy = Proxy(settings, ledger, vllm_version=lambda: version)
        if workers > 1:
            pool = WorkerPool(settings, ledger, count=workers, version=lambda: version)
            port = await pool.start("127.0.0.1", 0)
            started.append((runner, pool))
            return Rig(vllm, upstream, proxy, f"http://127.0.0.1:{port}", pool)
        proxy_port = await proxy.start("127.0.0.1", 0)
        started.append((runner, proxy))
        return Rig(vllm, upstream, proxy, f"http://127.0.0.1:{proxy_port}")

    yield start
    for runner, relay in started:
        await relay.stop()
        await runner.cleanup()


async def _send(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Answer:
    async with session.post(url, data=json.dumps(body).encode(), headers=_JSON) as resp:
        raw = await resp.read()
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in resp.raw_headers]
        return Answer(resp.status, headers, raw)


_JSON = {"Content-Type": "application/json"}


def _end_to_end(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return sorted((k.lower(), v) for k, v in headers if k.lower() not in _HOP)


def _tokens_received(answer: Answer) -> int:
    """The completion tokens in what the client got, read from its bytes: each fake token is
    one ``ab"c}{`` of text or one ``{"usage":{`` of tool-call arguments; a whole answer says
    its usage."""
    if answer.status >= 300:
        return 0
    body = answer.body
    if answer.headers and _header(answer, "content-encoding") == "gzip":
        body = zlib.decompress(body, 31)
    if not _header(answer, "content-type").startswith("text/event-stream"):
        return int(json.loads(body)["usage"]["completion_tokens"])
    total = 0
    for event in body.split(b"\n\n"):
        data = event.removeprefix(b"data:").strip()
        if not data.startswith(b"{"):
            continue
        for choice in json.loads(data)["choices"]:
            delta = choice.get("delta", {})
            text = choice.get("text") or delta.get("content") or ""
            calls = delta.get("tool_calls") or []
            total += text.count('ab"c}{')
            total += sum(c["function"]["arguments"].count('{"usage":{') for c in calls)
    return total


def _header(answer: Answer, name: str) -> str:
    return next((v for k, v in answer.headers if k.lower() == name), "")


def _delivered(ledger: DeliveryLedger) -> dict[str, float]:
    return {label: t.delivered for label, t in ledger.totals().items()}


def _ttft_count(ledger: DeliveryLedger) -> float:
    counts = ledger.counts()
    return sum(book.ttft.buckets[-1][1] for book in counts.values())


# The streams each scheme counts, under a vLLM whose version gives token ids (0.32) and one whose
# version kvtax does not know (no /version yet): continuous usage, the fallback, for all.
# A client's continuous_usage_stats, even without include_usage (vLLM ignores it then), makes
# kvtax's include_usage turn continuous usage on: vLLM pays for it anyway, so it is what counts.
IDS_FALLBACK = {
    "include-and-continuous",
    "lax-everything",
    "continuous-without-include",
    "chat-no-reasoning",
    "echo",
}


def _counted_streams(version: str | None) -> dict[str, int]:
    streams = [
        name
        for name, _, body in SHAPES
        if name[0] not in "45" and str(body.get("stream")) in {"True", "true", "1", "yes"}
    ]
    if version is None:
        return {"token_ids": 0, "usage": len(streams), "final_usage": 0, "events": 0}
    fallback = sum(1 for name in streams if name in IDS_FALLBACK)
    return {"token_ids": len(streams) - fallback, "usage": fallback, "final_usage": 0, "events": 0}


@pytest.mark.parametrize("version", ["0.32.0", None], ids=["token-ids", "usage"])
@pytest.mark.parametrize("tight", [False, True], ids=["data-space", "data-no-space"])
@pytest.mark.parametrize("per_chunk", [1, 3])
async def test_every_request_shape_gets_the_same_bytes_and_is_counted_under_the_engine_name(
    start: Start, tight: bool, per_chunk: int, version: str | None
) -> None:
    # Under both schemes: the same bytes as vLLM sends the client (no ids, no usage it did not
    # ask for), the exact count, and each stream counted by the scheme its shape calls for.
    await _matrix(await start(version, tight=tight, per_chunk=per_chunk), version)


@pytest.mark.parametrize("version", ["0.32.0", None], ids=["token-ids", "usage"])
async def test_the_matrix_through_two_proxy_workers_is_exact_in_the_one_ledger(
    start: Start, version: str | None
) -> None:
    # --proxy.workers=2: each shape relayed by whichever worker the kernel gave the connection,
    # each counted once in the parent's ledger, under the engine's name the parent learned.
    await _matrix(await start(version, workers=2, per_chunk=3), version)


async def _matrix(rig: Rig, version: str | None) -> None:
    assert len(SHAPES) >= 17
    expected_total = 0
    # Through workers, a connection per request: the kernel spreads them over both.
    connector = aiohttp.TCPConnector(force_close=rig.pool is not None)
    async with aiohttp.ClientSession(auto_decompress=False, connector=connector) as session:
        for name, path, body in SHAPES:
            direct = await _send(session, rig.upstream + path, body)
            before, ttft_before = _delivered(rig.ledger), _ttft_count(rig.ledger)
            relayed = await _send(session, rig.url + path, body)
            assert await rig.idle()
            assert relayed.status == direct.status, name
            assert relayed.body == direct.body, name
            assert _end_to_end(relayed.headers) == _end_to_end(direct.headers), name
            received = _tokens_received(relayed)
            after = _delivered(rig.ledger)
            grew = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
            assert grew == ({ENGINE: received} if received else {}), name
            expected_total += received
            streamed = relayed.status < 300 and _header(relayed, "content-type").startswith(
                "text/event-stream"
            )
            # A stream (however `stream` was spelt) records its client-side TTFT.
            assert _ttft_count(rig.ledger) == ttft_before + (1 if streamed else 0), name
    assert expected_total > 0
    totals = rig.ledger.totals()
    assert totals[ENGINE].delivered == expected_total
    assert ALIAS not in totals  # the alias has no engine series: never a label of its own
    counts = rig.ledger.counts()
    assert counts[ENGINE].usage_missing == 0
    assert counts[ENGINE].outcomes["completed"] == sum(
        1 for name, _, _ in SHAPES if name[0] not in "45"
    )
    assert await rig.schemes() == _counted_streams(version)
    # What kvtax added to what vLLM was asked, shape by shape (each shape went direct, then
    # through kvtax): ids only by the token_ids scheme.
    requests = rig.vllm.requests
    added_ids = [
        bool(relayed.get("return_token_ids")) and not direct.get("return_token_ids")
        for direct, relayed in zip(requests[0::2], requests[1::2], strict=True)
    ]
    assert any(added_ids) is (version is not None)


async def test_a_vllm_that_sends_no_ids_is_asked_for_usage_from_then_on(start: Start) -> None:
    # Protection: a vLLM that ignores return_token_ids (its version said it has them) would have
    # every later stream counted one token an event, where vLLM merges several into one.
    rig: Rig = await start("0.32.0", per_chunk=3, drop_ids=True)
    async with aiohttp.ClientSession() as session:
        for _ in range(3):
            await _send(session, rig.url + COMPLETIONS, _stream())
    assert await until(lambda: rig.proxy.in_flight == 0)
    assert rig.proxy.cost.schemes == {"token_ids": 0, "usage": 2, "final_usage": 0, "events": 1}
    assert [bool(r.get("return_token_ids")) for r in rig.vllm.requests] == [True, False, False]
    # Completed streams are exact whatever the scheme: the final usage chunk has the total.
    assert rig.proxy.ledger.totals()[ENGINE].delivered == 3 * TOKENS


async def test_an_upstream_that_gzips_when_allowed_is_asked_for_identity(start: Start) -> None:
    # Protection: kvtax dropped the client's Accept-Encoding, which means "any coding": an
    # upstream that gzips then did, and kvtax counted 0 tokens while the usage it had asked for
    # reached the client in every chunk.
    rig: Rig = await start(gzip="on")
    body = _stream(stream="true")
    async with aiohttp.ClientSession(auto_decompress=False) as session:
        direct = await _send(session, rig.upstream + COMPLETIONS, body)
        relayed = await _send(session, rig.url + COMPLETIONS, body)
    assert await until(lambda: rig.proxy.in_flight == 0)
    assert _header(direct, "content-encoding") == "gzip"  # the client accepts gzip
    assert rig.vllm.headers[-1]["Accept-Encoding"] == "identity"
    assert _header(relayed, "content-encoding") == ""
    assert relayed.body == zlib.decompress(direct.body, 31)
    assert b'"usage"' not in relayed.body
    assert rig.proxy.ledger.totals()[ENGINE].delivered == TOKENS


@pytest.mark.parametrize("asked", [True, False], ids=["asked-for-usage", "asked-for-none"])
async def test_a_stream_gzipped_anyway_is_inflated_trimmed_and_counted(
    start: Start, asked: bool
) -> None:
    # Protection: a stream gzipped against kvtax's identity passed unread, counted 0 tokens,
    # and handed a client that asked for no usage the usage kvtax had asked for.
    rig: Rig = await start(gzip="always")
    options = {"include_usage": True, "continuous_usage_stats": True} if asked else {}
    body = _stream(stream_options=options) if asked else _stream()
    async with aiohttp.ClientSession(auto_decompress=False) as session:
        direct = await _send(session, rig.upstream + COMPLETIONS, body)
        relayed = await _send(session, rig.url + COMPLETIONS, body)
    assert await until(lambda: rig.proxy.in_flight == 0)
    assert relayed.status == 200
    assert _header(relayed, "content-encoding") == ""  # inflated for the client
    assert relayed.body == zlib.decompress(direct.body, 31)  # exactly vLLM's stream, plain
    assert (b'"usage"' in relayed.body) is asked
    counts = rig.proxy.ledger.counts()[ENGINE]
    assert counts.delivered["proxy"] == TOKENS
    assert counts.usage_missing == 0
    assert rig.proxy.encoded_streams == 0


async def test_a_gzip_stream_labelled_deflate_inflates_too(start: Start) -> None:
    rig: Rig = await start(gzip="always", coding="deflate")
    async with aiohttp.ClientSession(auto_decompress=False) as session:
        relayed = await _send(session, rig.url + COMPLETIONS, _stream())
    assert await until(lambda: rig.proxy.in_flight == 0)
    assert relayed.status == 200  # zlib reads a gzip or a zlib header, whichever comes
    assert rig.proxy.ledger.counts()[ENGINE].delivered["proxy"] == TOKENS


async def test_a_gzip_stream_zlib_cannot_read_ends_with_an_error_event(start: Start) -> None:
    # Bytes zlib cannot read end the stream as a break does: an error event and a clean end,
    # never a hang, and vLLM's connection is dropped (it aborts the request).
    rig: Rig = await start(gzip="always", corrupt=True)
    async with aiohttp.ClientSession(auto_decompress=False) as session:
        relayed = await _send(session, rig.url + COMPLETIONS, _stream())
    assert await until(lambda: rig.proxy.in_flight == 0)
    assert relayed.status == 200  # its head went out before the bad bytes came
    events = [e for e in relayed.body.split(b"\n\n") if e]
    assert b"upstream_error" in events[-1]
    counts = rig.proxy.ledger.counts()[ENGINE]
    assert counts.outcomes["upstream_error"] == 1


@pytest.mark.parametrize("asked", [True, False], ids=["asked-for-usage", "asked-for-none"])
async def test_a_stream_in_a_coding_kvtax_cannot_read_never_hands_unasked_usage(
    start: Start, asked: bool
) -> None:
    rig: Rig = await start(gzip="always", coding="br")
    options = {"include_usage": True, "continuous_usage_stats": True} if asked else {}
    body = _stream(stream_options=options) if asked else _stream()
    async with aiohttp.ClientSession(auto_decompress=False) as session:
        direct = await _send(session, rig.upstream + COMPLETIONS, body)
        relayed = await _send(session, rig.url + COMPLETIONS, body)
    assert await until(lambda: rig.proxy.in_flight == 0)
    assert rig.proxy.encoded_streams == 1
    counts = rig.proxy.ledger.counts()[ENGINE]
    assert counts.delivered.get("proxy", 0.0) == 0
    if asked:  # kvtax added nothing: vLLM's own bytes, unread, counted without usage
        assert relayed.status == 200
        assert _header(relayed, "content-encoding") == "br"
        assert relayed.body == direct.body
        assert counts.usage_missing == 1
    else:  # it would carry usage the client did not ask for: a 502 naming the coding instead
        assert relayed.status == 502
        error = json.loads(relayed.body)["error"]
        assert "Content-Encoding br" in error["message"]
        assert error["type"] == "upstream_error"
