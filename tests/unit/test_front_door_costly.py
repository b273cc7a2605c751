"""The front door under costly bodies, drains and stalled readers: issue 43, through the real port.

Each test's first comment names the finding it reproduces and what the proxy did without the
protection. The upstream is :class:`~kvtax_dev.fakevllm.upstream.RawUpstream`; clients are raw
sockets. Nothing is timed: a body's cost is asserted as what was decoded of it and how much kvtax
grew (a process of its own, its peak RSS); the pipeline bound as the bytes kvtax read of bodies
that wait; delivery as tokens against what the client's socket holds. ``/healthz`` latency while a
body is read is a figure of ``bench.relay.frontdoor --bodies``.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import psutil
import pytest

from kvtax.delivery.dialects.base import DECODE_LIMIT
from kvtax.gate.cap import CapSettings
from kvtax.gate.footprint import OverBudget
from kvtax.serve.proxy import prepare as prepare_module
from kvtax.serve.proxy.gatekeeper import Gate, GateSettings
from kvtax_dev.fakevllm.client import (
    STREAM,
    chat_messages,
    costly_bodies,
    post,
    raw_request,
    read_reply,
)
from kvtax_dev.fakevllm.front import Front, StartFront
from kvtax_dev.fakevllm.raw import GUARD, WAIT, Link, Seen
from kvtax_dev.fakevllm.vllmlike import VllmLike
from kvtax_dev.process import until

ROOT = Path(__file__).resolve().parents[2]
MiB = 1024**2


# == 1. a body costs a scan of its bytes ===========================================================
SHAPES = costly_bodies(8 * MiB)


class _Decoding:
    """What kvtax decoded and encoded, in bytes, by every parser it uses (the test's own
    upstream, in the same process, reads the body too: its calls are not kvtax's)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.decoded: list[int] = []
        self.encoded: list[int] = []
        for module, name in ((orjson, "loads"), (json, "loads")):
            monkeypatch.setattr(module, name, self._decoding(getattr(module, name)))
        monkeypatch.setattr(orjson, "dumps", self._encoding(orjson.dumps))

    def _decoding(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def decode(data: Any, *args: Any, **kwargs: Any) -> Any:
            if _by_kvtax():
                self.decoded.append(len(data))
            return real(data, *args, **kwargs)

        return decode

    def _encoding(self, real: Callable[..., bytes]) -> Callable[..., bytes]:
        def encode(*args: Any, **kwargs: Any) -> bytes:
            out = real(*args, **kwargs)
            if _by_kvtax():
                self.encoded.append(len(out))
            return out

        return encode


def _by_kvtax() -> bool:
    """The parser's caller (two frames up: past the wrapper) is kvtax's."""
    return str(sys._getframe(2).f_globals.get("__name__", "")).startswith("kvtax.")


@pytest.mark.parametrize(("name", "path", "body"), SHAPES, ids=[name for name, *_ in SHAPES])
# (An unread field is the control: it held before the fix too.)
async def test_a_large_body_is_scanned_never_decoded(
    front_door: StartFront,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    path: str,
    body: bytes,
) -> None:
    # Finding 1: prepare decoded every message and the prompt list whole, and so did the gate's
    # sizing; a NaN sent the whole body to json.loads and back through json.dumps. A 60 MiB
    # body held the event loop, every stream of the pod with it, for 1.5 to 9.5 s.
    # The gate on, clamping: it sizes the prompt and writes a limit into the body.
    cap = CapSettings(mode="static", static_cap=8)
    gate = Gate(GateSettings(cap=cap, token_budget=10**9, over_budget="clamp"))
    front = await front_door(gate=gate)
    decoding = _Decoding(monkeypatch)
    assert prepare_module.__dict__["orjson"] is orjson  # the module prepare decodes with
    headers = [("Content-Type", "application/json")]
    reply = await front.exchange(raw_request("POST", path, body, headers=headers))
    assert reply.status == 200, reply.body[:200]
    [seen] = front.upstream.seen
    assert bytes(seen.body).startswith(body[:-1])  # the client's bytes, fields set after them
    # Nothing decoded or encoded past the bound of a prompt field, and in all less than two:
    # the body's millions of values were scanned, never turned into Python objects.
    assert max(decoding.decoded, default=0) <= DECODE_LIMIT
    assert sum(decoding.decoded) <= 2 * DECODE_LIMIT
    assert max(decoding.encoded, default=0) <= DECODE_LIMIT


def _hwm_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


async def test_kvtax_grows_by_at_most_twice_a_large_body_of_smallchat_messages(
    front_door: StartFront,
) -> None:
    # Finding 1: 2 M small chat messages (60 MiB) grew kvtax by 1.31 GiB: each decoded into
    # Python objects, twice. The proxy runs in a process of its own (bench.relay.proxy_child, kvtax
    # serve's defaults) so that only its memory is measured: the peak RSS while the body passes.
    upstream = (await front_door()).upstream
    child = subprocess.Popen(
        [sys.executable, "-m", "bench.relay.proxy_child", f"--upstream={upstream.url}"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": f"{ROOT / 'exporter'}:{ROOT}"},
    )
    body = chat_messages(16 * MiB // 37)
    request = post("/v1/chat/completions", json.loads(chat_messages(1)))
    try:
        assert child.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), WAIT)
        port = int(line.split()[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request)  # warms the relay up (buffers, the upstream pool)
        assert (await read_reply(reader)).status == 200
        before = psutil.Process(child.pid).memory_info().rss
        Path(f"/proc/{child.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
        headers = [("Content-Type", "application/json")]
        writer.write(raw_request("POST", "/v1/chat/completions", body, headers=headers))
        reply = await asyncio.wait_for(read_reply(reader), WAIT)
        peak = _hwm_bytes(child.pid)
        writer.close()
    finally:
        child.terminate()
        await asyncio.to_thread(child.wait, WAIT)
        if child.stdout is not None:
            child.stdout.close()
    assert reply.status == 200
    growth = peak - before
    assert growth <= 2 * len(body), (
        f"kvtax grew by {growth / MiB:.1f} MiB for {len(body) / MiB:.1f}"
    )


# == 2. pipelined accounted bodies ===============================================================
def _held_behind(front: Front) -> int:
    """Body bytes kvtax read of requests waiting behind the one each connection answers."""
    return sum(
        exchange.size for conn in front.proxy._clients for exchange in list(conn.pipeline)[1:]
    )


async def test_pipelined_accounted_bodies_wait_unread_behind_a_stream(
    front_door: StartFront,
) -> None:
    # Finding 2: behind a slow stream, 8 pipelined POST /v1/completions of 56 MiB each were
    # read whole while the stream ran: +449 MiB, up to 9 x --proxy.max-body per connection.
    release = asyncio.Event()

    async def held(writes: int) -> None:
        if writes == 1:
            await release.wait()

    front = await front_door(VllmLike(tokens=3, after_write=held))
    reader, writer = await front.connect()
    writer.write(post("/v1/completions", STREAM))
    await until(lambda: bool(front.upstream.seen))
    big = b'{"model":"m","prompt":"' + b"x" * (8 * MiB) + b'"}'
    headers = [("Content-Type", "application/json")]
    queued = raw_request("POST", "/v1/completions", big, headers=headers)
    for _ in range(8):
        writer.write(queued)  # 64 MiB behind the stream: more than both kernels' buffers hold
    settings = front.proxy.settings.server
    bound = settings.body_buffer + 256 * 1024  # what waits, and one read past it
    reached = await until(lambda: _held_behind(front) >= settings.body_buffer, GUARD)
    await asyncio.sleep(0.2)  # a proxy that went on reading would read on meanwhile
    held_behind = _held_behind(front)
    release.set()
    assert reached
    assert held_behind <= bound, f"kvtax read {held_behind / MiB:.1f} MiB of waiting bodies"
    first = await asyncio.wait_for(read_reply(reader), WAIT)
    assert first.status == 200
    for _ in range(8):  # each is read and answered in its turn
        assert (await asyncio.wait_for(read_reply(reader), WAIT)).status == 200


# == 3. a rolling restart ========================================================================
@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", b'{"model":"m","messages":[{"role":"user","content":"'),
        ("/v1/audio/transcriptions", b"--b\r\nContent-Disposition: form-data; name=file\r\n\r\n"),
    ],
    ids=["accounted", "pass-through"],
)
async def test_a_body_arriving_at_shutdown_is_read_answered_and_relayed(
    front_door: StartFront, path: str, body: bytes
) -> None:
    # Finding 3: with SIGTERM 1 s into an 8 MiB upload, kvtax stopped reading the body: the
    # pass-through upload got a 503 at the grace's end and vLLM a cut body; the accounted one no
    # answer at all, then a reset.
    front = await front_door()
    if path.startswith("/v1/chat"):
        whole = body + b"x" * (8 * MiB) + b'"}]}'
        kind = "application/json"
    else:
        whole = body + b"x" * (8 * MiB) + b"\r\n--b--\r\n"
        kind = "multipart/form-data; boundary=b"
    head = raw_request(
        "POST", path, headers=[("Content-Type", kind), ("Content-Length", str(len(whole)))]
    )
    reader, writer = await front.connect()
    writer.write(head + whole[:MiB])
    await writer.drain()
    await until(lambda: front.proxy.in_flight == 1 or bool(front.upstream.seen))
    stopping = asyncio.ensure_future(front.proxy.stop(grace=WAIT))
    await asyncio.sleep(0)  # the drain has begun
    for start in range(MiB, len(whole), 256 * 1024):
        writer.write(whole[start : start + 256 * 1024])
        await writer.drain()
    reply = await asyncio.wait_for(read_reply(reader), WAIT)
    await asyncio.wait_for(stopping, WAIT)
    assert reply.status == 200, reply.body[:200]
    assert (reply.header("Connection") or "").lower() == "close"
    [seen] = front.upstream.seen
    assert len(seen.body) >= len(whole)  # vLLM had all of it (and, accounted, kvtax's fields)
    assert bytes(seen.body).startswith(whole[:-1] if path.startswith("/v1/chat") else whole)


# == 4. a reader that stalls, then leaves ========================================================
def _stalled_client(port: int, request: bytes, rcvbuf: int) -> tuple[socket.socket, bytes]:
    """A blocking client with a small receive buffer: it sends ``request`` and reads the
    response head only (and whatever came with it, returned)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", port))
    sock.sendall(request)
    got = b""
    while b"\r\n\r\n" not in got:
        got += sock.recv(4096)
    return sock, got.split(b"\r\n\r\n", 1)[1]


def _held_by(sock: socket.socket) -> bytes:
    """What the client's kernel received (and acknowledged) and the client never read."""
    return sock.recv(8 * MiB, socket.MSG_PEEK | socket.MSG_DONTWAIT)


def _reset(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()  # a reset: what is still queued for it is dropped


def _relayed(front: Front) -> bool:
    """kvtax handed the whole stream, its end included, to the client's socket (or settled)."""
    return all(
        r.facts.counter is not None and r.facts.counter.done for r in front.proxy.shared.streams
    )


@pytest.mark.parametrize("leaves", [True, False], ids=["resets", "stays-stalled"])
async def test_a_reader_that_stalls_is_counted_what_its_tcp_stack_acknowledged(
    front_door: StartFront, leaves: bool
) -> None:
    # Finding 4: a client that read only the head of a 1,000-token stream, then reset, was
    # counted 1,000 delivered, outcome completed: the whole stream (about 240 KB) fit kvtax's
    # kernel send buffer, so the relay never saw the client fall behind.
    tokens = 1000
    settings = {} if leaves else {"send_timeout": 1.0}
    vllm_done = asyncio.Event()

    async def answer(seen: Seen, link: Link) -> None:
        await VllmLike(tokens=tokens, filler=200)(seen, link)
        vllm_done.set()

    front = await front_door(answer, **settings)
    request = post("/v1/completions", STREAM)
    sock, after_head = await asyncio.to_thread(_stalled_client, front.port, request, 16 * 1024)
    try:
        await asyncio.wait_for(vllm_done.wait(), WAIT)
        assert await until(lambda: _relayed(front))
        await asyncio.sleep(0.2)  # the client's last acknowledgements go out
        held = after_head + await asyncio.to_thread(_held_by, sock)
        if leaves:
            _reset(sock)
        outcomes = await front.settled(1, limit=WAIT)
    finally:
        if sock.fileno() >= 0:
            sock.close()
    has = held.count(b"}\n\n")  # the token events the client's stack took whole
    assert 0 < has < tokens
    assert outcomes == {"client_disconnected": 1}
    assert has - 1 <= front.delivered() <= has


# == 5. each API's own output limit ================================================================
@pytest.mark.parametrize("over", ["reject", "clamp"])
async def test_a_completion_without_max_tokens_is_budgeted_at_vllm_s_16(
    front_door: StartFront, over: OverBudget
) -> None:
    # Finding 5: with --gate.token-budget=64, /v1/completions without max_tokens got a 400,
    # though vLLM gives it 16 tokens; in clamp mode it went with max_tokens: 63, and vLLM made 63.
    gate = Gate(
        GateSettings(
            cap=CapSettings(mode="static", static_cap=8), token_budget=64, over_budget=over
        )
    )
    front = await front_door(gate=gate)
    reply = await front.exchange(post("/v1/completions", {"model": "m", "prompt": "hi"}))
    assert reply.status == 200
    [seen] = front.upstream.seen
    assert "max_tokens" not in seen.json()  # vLLM's own default stands
    # A prompt that leaves less than 16 tokens of the budget: 16 is what is over it.
    prompt = "word " * 30  # about 53 tokens at 0.35 a byte
    reply = await front.exchange(post("/v1/completions", {"model": "m", "prompt": prompt}))
    if over == "reject":
        assert reply.status == 400
        assert len(front.upstream.seen) == 1
    else:
        assert reply.status == 200
        assert 0 < front.upstream.seen[-1].json()["max_tokens"] < 16
