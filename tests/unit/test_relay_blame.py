"""Who broke an exchange: a client that hung up must never be counted as vLLM breaking off.

aiohttp's server raises ``aiohttp.ClientConnectionResetError`` from a write to a client that has
left, and that class is an ``aiohttp.ClientError`` as well as a ``ConnectionResetError``. The
relay reads vLLM and writes the client in one loop; these tests put a failing write against a
healthy vLLM, and a failing read against a healthy client, and check which side is blamed.
Without the separation the first case was settled as ``upstream_error`` (seen on a loaded
machine in tests/e2e/test_delivery_e2e.py::test_client_disconnect_aborts_the_request).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from kvtax.delivery.sse import HoldBudget, UsageWish
from kvtax.serve.exchange import Exchange, outcome_of
from kvtax.serve.relay import Relay, UpstreamFailed, upstream_chunks


def _event(i: int) -> bytes:
    chunk = {
        "id": "c",
        "object": "text_completion",
        "model": "m",
        "choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}],
    }
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


class _Content:
    """vLLM's body: ``events`` chunks, then ``fail`` (an exception) or a clean end."""

    def __init__(self, events: int, fail: BaseException | None = None) -> None:
        self.events, self.fail = events, fail

    async def _chunks(self) -> AsyncIterator[bytes]:
        for i in range(self.events):
            yield _event(i)
        if self.fail is not None:
            raise self.fail
        yield b"data: [DONE]\n\n"

    def iter_any(self) -> AsyncIterator[bytes]:
        return self._chunks()


class _Upstream:
    status = 200
    content_length = None

    def __init__(self, content: _Content) -> None:
        self.content = content


class _Response:
    """The client's side: its ``writes_before_reset``-th write finds the client gone."""

    def __init__(self, writes_before_reset: int | None) -> None:
        self.left, self.writes = writes_before_reset, 0

    async def prepare(self, request: Any) -> None:
        return None

    async def write(self, data: bytes) -> None:
        self.writes += 1
        if self.left is not None and self.writes > self.left:
            raise aiohttp.ClientConnectionResetError("Cannot write to closing transport")

    async def write_eof(self) -> None:
        return None


class _Request:
    transport = None


def _relay() -> Relay:
    return Relay(
        held=HoldBudget(64 * 1024), clock=lambda: 0.0, stall=(5.0, 0.05), phase=lambda: "serving"
    )


async def test_a_client_that_hung_up_mid_stream_is_not_blamed_on_vllm() -> None:
    ex = Exchange(started=0.0, model="m", status=200)
    with pytest.raises(ConnectionResetError):
        await _relay().stream(
            _Request(),
            _Response(writes_before_reset=2),
            _Upstream(_Content(10)),
            ex,  # type: ignore[arg-type]
            UsageWish(include_usage=False, continuous=False),
        )
    # The proxy marks client_gone where it catches ConnectionResetError (Proxy._respond).
    ex.client_gone = True
    assert not ex.upstream_broke
    assert outcome_of(ex, "serving") == "client_disconnected"


async def test_a_client_that_hung_up_mid_body_is_not_blamed_on_vllm() -> None:
    ex = Exchange(started=0.0, model="m", status=200)
    with pytest.raises(ConnectionResetError):
        await _relay().body(
            _Request(),
            _Response(writes_before_reset=1),
            _Upstream(_Content(5)),
            ex,  # type: ignore[arg-type]
        )
    assert not ex.upstream_broke


async def test_vllm_breaking_off_mid_stream_is_still_vllm_s_doing() -> None:
    ex = Exchange(started=0.0, model="m", status=200)
    content = _Content(3, fail=aiohttp.ClientPayloadError("vLLM went away"))
    await _relay().stream(
        _Request(),
        _Response(writes_before_reset=None),
        _Upstream(content),
        ex,  # type: ignore[arg-type]
        UsageWish(include_usage=False, continuous=False),
    )
    assert ex.upstream_broke
    assert outcome_of(ex, "serving") == "upstream_error"


async def test_upstream_chunks_names_a_read_failure_and_keeps_its_cause() -> None:
    cause = TimeoutError()
    chunks = upstream_chunks(_Content(1, fail=cause))  # type: ignore[arg-type]
    assert await chunks.__anext__()
    with pytest.raises(UpstreamFailed) as failed:
        await chunks.__anext__()
    assert failed.value.cause is cause
