"""Delivered tokens against a real vLLM 0.32 CPU engine: exact counts, faithful streams,
disconnects that abort, and traffic that bypasses the proxy.

Each test runs its own ``kvtax serve`` (proxy on) so its ledger and join window start clean;
the session's engine is shared, so engine figures are compared as deltas.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
import requests

from kvtax_dev.process import HANG_GUARD_S
from kvtax_dev.testbed import VllmEngine
from kvtax_dev.testbed.sidecar import KvtaxProcess, parse_metrics, series_key

M = "tiny-llama"
PROMPT = "The quick brown fox jumps over the lazy dog and keeps on running"


@pytest.fixture
def kvtax(vllm_engine: VllmEngine) -> Iterator[KvtaxProcess]:
    with KvtaxProcess(vllm_engine.url, proxy=True, scrape_interval="1s", window="120s") as proc:
        proc.wait_for(lambda m: m.get("kvtax_vllm_up") == 1.0, what="first scrape")
        yield proc


def _vllm(engine: VllmEngine) -> dict[str, float]:
    """vLLM's own counters and gauges for the model, summed over engines."""
    page = parse_metrics(engine.metrics_text())
    out: dict[str, float] = {}
    for key, value in page.items():
        name = key.split("{", 1)[0]
        if 'finished_reason="' in key:
            name += "/" + key.split('finished_reason="', 1)[1].split('"', 1)[0]
        if f'model_name="{M}"' in key:
            out[name] = out.get(name, 0.0) + value
    return out


def _body(kind: str, stream: bool, max_tokens: int, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": M,
        "max_tokens": max_tokens,
        "temperature": 0,
        "seed": 7,
        "stream": stream,
        **extra,
    }
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        body["prompt"] = PROMPT
    return body


def _path(kind: str) -> str:
    return "/v1/chat/completions" if kind == "chat" else "/v1/completions"


async def _stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> list[Any]:
    """Every event of a stream, parsed ("[DONE]" kept as a string)."""
    events: list[Any] = []
    async with session.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        raw = (await resp.read()).decode()
    for block in raw.split("\n\n"):
        if block.startswith("data: "):
            data = block.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def _completion_tokens(
    session: aiohttp.ClientSession, base: str, kind: str, stream: bool, max_tokens: int
) -> int:
    if stream:
        body = _body(kind, True, max_tokens, stream_options={"include_usage": True})
        events = await _stream(session, base + _path(kind), body)
        usage = [e["usage"] for e in events if isinstance(e, dict) and e.get("usage")]
        assert len(usage) == 1
        return int(usage[0]["completion_tokens"])
    async with session.post(base + _path(kind), json=_body(kind, False, max_tokens)) as resp:
        assert resp.status == 200
        return int((await resp.json())["usage"]["completion_tokens"])


def test_delivered_tokens_equal_client_usage_and_join_is_complete(kvtax: KvtaxProcess) -> None:
    _delivered_equals_usage(kvtax)


def test_two_proxy_workers_deliver_exactly_the_clients_usage(vllm_engine: VllmEngine) -> None:
    """``--proxy.workers=2`` in front of the real engine: streamed and whole answers of both
    APIs, on a connection each (the kernel spreads them over both workers), counted once in
    kvtax's one ledger, equal to the usage the engine reported to each client, and the join
    complete."""
    with KvtaxProcess(
        vllm_engine.url,
        proxy=True,
        scrape_interval="1s",
        window="120s",
        extra_args=["--proxy.workers=2"],
    ) as proc:
        proc.wait_for(
            lambda m: m.get("kvtax_vllm_up") == 1.0 and m.get("kvtax_proxy_workers") == 2.0,
            what="first scrape, two workers",
        )
        _delivered_equals_usage(proc, spread=True)


def _delivered_equals_usage(kvtax: KvtaxProcess, *, spread: bool = False) -> None:
    assert kvtax.proxy_url is not None
    base = kvtax.proxy_url
    plan = [
        (kind, stream, 8 + 5 * i)
        for i, (kind, stream) in enumerate(
            [(k, s) for k in ("completion", "chat") for s in (True, False)] * 3
        )
    ]

    async def run() -> list[int]:
        connector = aiohttp.TCPConnector(force_close=spread)
        async with aiohttp.ClientSession(connector=connector) as session:
            return await asyncio.gather(
                *(_completion_tokens(session, base, k, s, n) for k, s, n in plan)
            )

    received = sum(asyncio.run(run()))
    assert received > 0
    delivered = series_key("kvtax_delivered_tokens_total", {"model_name": M, "source": "proxy"})
    completed = series_key("kvtax_requests_total", {"model_name": M, "outcome": "completed"})
    # With workers, a record reaches kvtax's ledger a turn of the worker's loop after its
    # client's end: waited for, not assumed.
    page = kvtax.wait_for(lambda m: m.get(completed) == len(plan), what="every request settled")
    assert page[delivered] == received
    assert page[completed] == len(plan)
    coverage = series_key("kvtax_join_coverage_ratio", {"model_name": M})
    goodput = series_key("kvtax_goodput_tokens_per_second", {"model_name": M})
    page = kvtax.wait_for(
        lambda m: m.get(coverage) == 1.0 and m.get(goodput, 0.0) > 0, what="goodput, coverage 1"
    )
    assert page[coverage] == 1.0
    assert page[goodput] > 0


def _shape(events: list[Any]) -> tuple[list[Any], str, Any, int]:
    """Field names of every chunk, the concatenated text, the finish reason and usage chunks."""
    fields: list[Any] = []
    text, finish, usage_chunks = "", None, 0
    for e in events:
        if e == "[DONE]":
            fields.append(e)
            continue
        choice_fields = sorted(
            (k, sorted(c.get("delta", {}))) for c in e["choices"] for k in sorted(c)
        )
        fields.append((sorted(e), choice_fields))
        for c in e["choices"]:
            text += c.get("text") or c.get("delta", {}).get("content") or ""
            finish = c.get("finish_reason") or finish
        if not e["choices"] and e.get("usage"):
            usage_chunks += 1
    return fields, text, finish, usage_chunks


def _chunk_kinds(fields: list[Any]) -> list[Any]:
    # Chunk boundaries depend on timing, so compare the distinct chunk shapes in order of
    # first appearance, plus the last two (terminal chunk, usage chunk or [DONE]).
    seen: list[Any] = []
    for f in fields:
        if f not in seen:
            seen.append(f)
    return [seen, fields[-3:]]


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize(
    "options",
    [None, {"include_usage": True}, {"include_usage": True, "continuous_usage_stats": True}],
)
def test_stream_through_proxy_matches_direct(
    vllm_engine: VllmEngine, kvtax: KvtaxProcess, kind: str, options: dict[str, Any] | None
) -> None:
    assert kvtax.proxy_url is not None
    extra = {"stream_options": options} if options else {}
    body = _body(kind, True, 40, **extra)

    async def both() -> tuple[list[Any], list[Any]]:
        async with aiohttp.ClientSession() as session:
            direct = await _stream(session, vllm_engine.url + _path(kind), body)
            proxied = await _stream(session, kvtax.proxy_url + _path(kind), body)  # type: ignore[operator]
            return direct, proxied

    direct, proxied = asyncio.run(both())
    d_fields, d_text, d_finish, d_usage = _shape(direct)
    p_fields, p_text, p_finish, p_usage = _shape(proxied)
    assert p_text == d_text
    assert p_finish == d_finish
    assert p_usage == d_usage == (1 if options else 0)
    assert _chunk_kinds(p_fields) == _chunk_kinds(d_fields)
    if not (options or {}).get("continuous_usage_stats"):
        assert all(e == "[DONE]" or not e["choices"] or "usage" not in e for e in proxied)


def test_client_disconnect_aborts_the_request(vllm_engine: VllmEngine, kvtax: KvtaxProcess) -> None:
    assert kvtax.proxy_url is not None
    proxy_url = kvtax.proxy_url
    # Below max_model_len (1024) minus the prompt, so the request can run to its end.
    max_tokens = 900
    disconnected = series_key(
        "kvtax_requests_total", {"model_name": M, "outcome": "client_disconnected"}
    )
    completed = series_key("kvtax_requests_total", {"model_name": M, "outcome": "completed"})
    page = kvtax.metrics()
    left_before, completed_before = page.get(disconnected, 0.0), page.get(completed, 0.0)

    def small_socket(addr_info: Any) -> socket.socket:
        family, kind, proto, _, _ = addr_info
        sock = socket.socket(family, kind, proto)
        # A small receive buffer (which also turns off autotuning) stands for a slow client.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        return sock

    def generated_since(before: dict[str, float]) -> float:
        now = _vllm(vllm_engine)
        return now["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]

    async def read_a_little_back_up_then_leave(before: dict[str, float]) -> None:
        # Big chunks (logprobs) and a client that stops reading: the bytes back up into the
        # proxy, which stops reading vLLM, while vLLM keeps generating. Then the client leaves.
        # The engine computes only in slices (kvtax_dev.testbed.freeze) up to half the
        # request, and is stopped while the client leaves and kvtax settles it: a running
        # engine can finish all 900 tokens while this process is descheduled, and the test
        # needs the client to leave mid-stream.
        body = _body("completion", True, max_tokens, ignore_eos=True, logprobs=5)
        connector = aiohttp.TCPConnector(socket_factory=small_socket)
        async with aiohttp.ClientSession(connector=connector, read_bufsize=1024) as session:

            async def first_events() -> aiohttp.ClientResponse:
                resp = await session.post(proxy_url + "/v1/completions", json=body)
                for _ in range(3):
                    await resp.content.readuntil(b"\n\n")
                return resp

            with vllm_engine.freezer() as freezer:
                reading = asyncio.create_task(first_events())
                assert await freezer.run_until(reading.done), "no first events"
                resp = reading.result()
                assert await freezer.run_until(
                    lambda: generated_since(before) >= max_tokens // 2, slice_s=0.05, settle_s=0
                )
                resp.close()
                # kvtax sees its client leave while its answer is backed up, and vLLM, stopped,
                # still has the request.
                await asyncio.to_thread(
                    kvtax.wait_for,
                    lambda m: m.get(disconnected, 0.0) - left_before == 1,
                    what="the request settled as a disconnect",
                )

    # The first request with logprobs compiles vLLM's sampler for them (2 s of CPU here):
    # done now, outside the slices.
    warm = requests.post(
        vllm_engine.url + "/v1/completions",
        json=_body("completion", False, 2, logprobs=5),
        timeout=HANG_GUARD_S,
    )
    warm.raise_for_status()
    finished = "vllm:request_success_total/length"
    before = _vllm(vllm_engine)
    asyncio.run(read_a_little_back_up_then_leave(before))
    let_go = time.monotonic()
    # Wait (bounded only against hangs) for vLLM to drop the request from its batch.
    deadline = let_go + HANG_GUARD_S
    while _vllm(vllm_engine).get("vllm:num_requests_running", 1.0) > 0:
        assert time.monotonic() < deadline, "vLLM kept running the abandoned request"
        time.sleep(0.02)
    abort_latency = time.monotonic() - let_go
    settled = _vllm(vllm_engine)
    time.sleep(1.5)
    later = _vllm(vllm_engine)
    generated = settled["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    # The generation counter stopped rising, well short of what the request asked for.
    assert later["vllm:generation_tokens_total"] == settled["vllm:generation_tokens_total"]
    assert max_tokens // 2 <= generated < max_tokens
    # The request did not finish by length (shared/vllm-facts.md: 0.32 may count an abort
    # under no finished_reason at all, or, when aborted with output queued, as "abort").
    assert settled.get(finished, 0.0) == before.get(finished, 0.0)
    aborts = settled.get("vllm:request_success_total/abort", 0.0) - before.get(
        "vllm:request_success_total/abort", 0.0
    )
    print(
        f"abort: vLLM dropped the request {abort_latency:.3f}s after the engine was let go; "
        f"{generated:.0f} of {max_tokens} tokens generated; finished_reason=abort +{aborts:.0f}"
    )

    undelivered = series_key("kvtax_undelivered_tokens_total", {"model_name": M, "source": "proxy"})
    page = kvtax.wait_for(lambda m: m.get(undelivered, 0.0) > 0, what="undelivered tokens")
    # The one request settled once, as a disconnect.
    assert page.get(disconnected, 0.0) - left_before == 1
    assert page.get(completed, 0.0) == completed_before
    # The join sees them: the window's waste exceeds its tax by U / (Pc + G + R).
    page = kvtax.wait_for(
        lambda m: (
            _window_ratio(m, "kvtax_waste_ratio") > _window_ratio(m, "kvtax_preemption_tax_ratio")
        ),
        what="join sees undelivered tokens",
    )
    waste = _window_ratio(page, "kvtax_waste_ratio")
    assert waste > _window_ratio(page, "kvtax_preemption_tax_ratio")


def test_a_reader_that_stalls_then_resets_is_counted_what_its_stack_acknowledged(
    vllm_engine: VllmEngine, kvtax: KvtaxProcess
) -> None:
    """A client that reads only the head of a 300-token stream, lets vLLM finish it, then
    resets, is counted the tokens its TCP stack took (the ids of the events its socket holds
    whole, within one event), outcome client_disconnected: the stream fit kvtax's kernel send
    buffer whole, so only the client's acknowledgements tell how much of it arrived."""
    assert kvtax.proxy_url is not None
    host, port = kvtax.proxy_url.removeprefix("http://").rsplit(":", 1)
    max_tokens = 300
    delivered = series_key("kvtax_delivered_tokens_total", {"model_name": M, "source": "proxy"})
    disconnected = series_key(
        "kvtax_requests_total", {"model_name": M, "outcome": "client_disconnected"}
    )
    page = kvtax.metrics()
    delivered_before, left_before = page.get(delivered, 0.0), page.get(disconnected, 0.0)
    finished = "vllm:request_success_total/length"
    finished_before = _vllm(vllm_engine).get(finished, 0.0)

    # The client asks for each event's ids: an event may carry several tokens (vLLM merges the
    # deltas of a stream its front end is behind on), so only the ids say what the stack holds.
    body = json.dumps(
        _body("completion", True, max_tokens, ignore_eos=True, return_token_ids=True)
    ).encode()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # A small receive buffer (no autotuning): the client's stack takes a few KiB, then its
    # window shuts, and the rest of the stream waits in kvtax's socket.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    try:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: kvtax\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
        )
        got = b""
        while b"\r\n\r\n" not in got:
            got += sock.recv(256)
        deadline = time.monotonic() + HANG_GUARD_S
        while _vllm(vllm_engine).get(finished, 0.0) == finished_before:
            assert time.monotonic() < deadline, "vLLM never finished the stream"
            time.sleep(0.05)
        # Once the client's stack advertises a zero window, kvtax can send it nothing more and
        # the ACK that closed the window covered every byte the stack holds: the peek below is
        # then what kvtax's count of acknowledged bytes must match, however slow kvtax is.
        while _advertised_window(sock) > 0:
            assert time.monotonic() < deadline, "the client's receive window never closed"
            time.sleep(0.05)
        head, held = got.split(b"\r\n\r\n", 1)
        held += sock.recv(1 << 20, socket.MSG_PEEK)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    finally:
        sock.close()  # with SO_LINGER 0: a reset
    chunked = b"transfer-encoding: chunked" in head.lower()
    per_event = _whole_event_tokens(_dechunked(held) if chunked else held)
    has = sum(per_event)
    page = kvtax.wait_for(
        lambda m: m.get(disconnected, 0.0) - left_before == 1, what="settled as a disconnect"
    )
    counted = page.get(delivered, 0.0) - delivered_before
    print(
        f"stalled reader: its stack took {len(per_event)} whole events, {has} tokens; "
        f"kvtax counted {counted:.0f}"
    )
    assert 0 < has < max_tokens
    # kvtax counts a write the client took part of by its share of bytes: within one event of
    # what the stack holds whole. That event may be the one it holds in part, which the client
    # cannot count; the largest it holds whole stands for it, twice over above.
    largest = max(per_event)
    assert has - largest <= counted <= has + 2 * largest


def _dechunked(raw: bytes) -> bytes:
    """The body bytes of as many chunks of a chunked body as ``raw`` holds, the last in part."""
    body, at = b"", 0
    while (line_end := raw.find(b"\r\n", at)) >= 0:
        size = int(raw[at:line_end].split(b";", 1)[0], 16)
        if size == 0:
            break
        start = line_end + 2
        body += raw[start : start + size]
        at = start + size + 2
    return body


def _whole_event_tokens(body: bytes) -> list[int]:
    """The tokens of each whole token event of an SSE body (by its ``token_ids``), in order."""
    counts = []
    for event in body.split(b"\n\n")[:-1]:  # the last piece is an event not yet whole
        data = event.removeprefix(b"data: ")
        if data == b"[DONE]":
            continue
        ids = json.loads(data)["choices"][0].get("token_ids") or []
        if ids:
            counts.append(len(ids))
    return counts


# struct tcp_info (linux/tcp.h): tcpi_rcv_wnd, the window this socket last advertised, is a u32
# at byte 232 since Linux 6.2.
_RCV_WND_AT = 232


def _advertised_window(sock: socket.socket) -> int:
    """The receive window the socket's stack last advertised to its peer, in bytes."""
    raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _RCV_WND_AT + 4)
    if len(raw) < _RCV_WND_AT + 4:
        pytest.skip("this kernel's TCP_INFO has no tcpi_rcv_wnd (Linux 6.2 added it)")
    (window,) = struct.unpack_from("=I", raw, _RCV_WND_AT)
    return int(window)


def _window_ratio(page: dict[str, float], name: str) -> float:
    """The one series of a window ratio for the model, whatever method it names (-1 if none)."""
    found = [
        v for key, v in page.items() if key.startswith(name + "{") and f'model_name="{M}"' in key
    ]
    assert len(found) <= 1, found
    return found[0] if found else -1.0


def test_traffic_bypassing_the_proxy_lowers_join_coverage(
    vllm_engine: VllmEngine, kvtax: KvtaxProcess
) -> None:
    assert kvtax.proxy_url is not None

    async def send() -> None:
        async with aiohttp.ClientSession() as session:
            for base in (kvtax.proxy_url, vllm_engine.url, kvtax.proxy_url, vllm_engine.url):
                await _completion_tokens(session, base, "completion", False, 8)  # type: ignore[arg-type]

    asyncio.run(send())
    coverage = series_key("kvtax_join_coverage_ratio", {"model_name": M})
    # A scrape can land between the four requests (coverage 2/3 after three of them): wait
    # for the state the test means, every request seen, rather than the first value below 1.
    page = kvtax.wait_for(
        lambda m: m.get(coverage) == pytest.approx(0.5), what="coverage of one half"
    )
    assert page[coverage] == pytest.approx(0.5)
