"""Who broke an exchange: a client that hung up must never be counted as vLLM breaking off.

The relay's sinks take vLLM's body read by read. vLLM breaking off reaches a sink as
:meth:`broke`; a client that hangs up reaches the proxy as its connection's loss, which cancels
the request. These tests drive the sinks with a client that goes away and with a vLLM that
breaks off, and check which side is blamed. Blaming vLLM for a client that left was seen on a
loaded machine in tests/e2e/test_delivery_e2e.py::test_client_disconnect_aborts_the_request.
"""

from __future__ import annotations

import asyncio
import json
from typing import cast

from kvtax.delivery.asks import UsageWish
from kvtax.delivery.cost import RelayCost
from kvtax.delivery.dialects import COMPLETIONS
from kvtax.delivery.sse import Fingerprint, HoldBudget
from kvtax.delivery.timing import StreamTiming
from kvtax.delivery.usage import usage_tokens
from kvtax.serve.proxy.acks import AckTracker
from kvtax.serve.proxy.client import UpstreamBroke
from kvtax.serve.proxy.flow import FlowControl
from kvtax.serve.proxy.head import RequestHead
from kvtax.serve.proxy.outcome import Facts, outcome_of
from kvtax.serve.proxy.relay import BodySink, RelaySettings, StreamSink
from kvtax.serve.proxy.request import noted
from kvtax.serve.proxy.server import Exchange


def _event(i: int) -> bytes:
    chunk = {
        "id": "c",
        "object": "text_completion",
        "model": "m",
        "choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}],
        "usage": {"prompt_tokens": 3, "completion_tokens": i + 1, "total_tokens": i + 4},
    }
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


class _Client:
    """The client's side of a relay, as its transport: what was written, and whether it left."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        if not self.closed:
            self.written.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def _exchange(client: _Client) -> Exchange:
    head = RequestHead.of(b"POST", b"/v1/completions", b"1.1", [(b"Host", b"x")], keep_alive=True)
    assert head is not None
    transport = cast(asyncio.Transport, client)
    flow = FlowControl(transport, send_timeout=60.0, on_resume=lambda: None)
    return Exchange(
        head,
        transport,
        flow,
        limit=None,
        body_buffer=256 * 1024,
        draining=False,
        stop_reading=lambda: None,
    )


def _settings() -> RelaySettings:
    return RelaySettings(
        held=HoldBudget(64 * 1024),
        clock=lambda: 0.0,
        stall_factor=5.0,
        stall_min=0.05,
        phase=lambda: "serving",
        cost=RelayCost(),
        fingerprints=Fingerprint(),
    )


def _stream(client: _Client, ex: Facts) -> StreamSink:
    """A stream's sink as the request's owner makes it, its counting parts noted in ``ex``."""
    wish = UsageWish(include_usage=False, continuous=False)
    ex.counter = counter = COMPLETIONS.counter(wish, "usage")
    ex.timing = timing = StreamTiming(ex.started, 5.0, 0.05)
    ex.acks = acks = AckTracker(None)
    return StreamSink(
        _exchange(client),
        "chunked",
        b"",
        counter=counter,
        timing=timing,
        acks=acks,
        relay=_settings(),
        dialect=COMPLETIONS,
    )


def _body(client: _Client, ex: Facts) -> BodySink:
    ex.acks = acks = AckTracker(None)
    return BodySink(
        _exchange(client),
        "length",
        b"",
        acks=acks,
        scan=usage_tokens,
        clock=lambda: 0.0,
        cost=RelayCost(),
    )


async def test_a_client_that_hung_up_mid_stream_is_not_blamed_on_vllm() -> None:
    ex = Facts(started=0.0, model="m", status=200)
    client = _Client()
    sink = _stream(client, ex)
    for i in range(3):
        sink.feed(_event(i), 0.0)
    client.closed = True  # the client left; its connection cancels the request
    ex.client_gone = True
    noted(ex, sink)  # the request's owner, as the cancelled request settles
    assert not ex.upstream_broke
    assert not sink.done.done()
    assert outcome_of(ex, "serving") == "client_disconnected"


async def test_a_client_that_hung_up_mid_body_is_not_blamed_on_vllm() -> None:
    ex = Facts(started=0.0, model="m", status=200)
    client = _Client()
    sink = _body(client, ex)
    sink.feed(b'{"id":"c","choices":[', 0.0)
    client.closed = True
    ex.client_gone = True
    noted(ex, sink)
    assert not ex.upstream_broke
    assert outcome_of(ex, "serving") == "client_disconnected"


async def test_vllm_breaking_off_mid_stream_is_vllm_s_doing_and_ends_the_stream_cleanly() -> None:
    ex = Facts(started=0.0, model="m", status=200)
    client = _Client()
    sink = _stream(client, ex)
    for i in range(3):
        sink.feed(_event(i), 0.0)
    sink.broke(UpstreamBroke("vLLM went away"))
    noted(ex, sink)
    assert ex.upstream_broke
    assert sink.done.done()
    sent = b"".join(client.written)
    assert b"vLLM's stream broke off" in sent
    assert sent.endswith(b"0\r\n\r\n")  # the chunked body ends cleanly: headers are long gone
    assert not client.closed
    assert outcome_of(ex, "serving") == "upstream_error"


async def test_a_stream_that_timed_out_says_so() -> None:
    ex = Facts(started=0.0, model="m", status=200)
    client = _Client()
    sink = _stream(client, ex)
    sink.feed(_event(0), 0.0)
    sink.broke(TimeoutError())
    assert b"vLLM's stream timed out" in b"".join(client.written)


async def test_vllm_breaking_off_mid_body_breaks_the_client_connection() -> None:
    # A body cut short must never look complete: the client's connection is closed mid-body.
    ex = Facts(started=0.0, model="m", status=200)
    client = _Client()
    sink = _body(client, ex)
    sink.feed(b'{"id":"c","choices":[', 0.0)
    sink.broke(UpstreamBroke("vLLM went away"))
    noted(ex, sink)
    assert client.closed
    assert ex.upstream_broke
    assert not ex.wrote_all
    assert outcome_of(ex, "serving") == "upstream_error"
