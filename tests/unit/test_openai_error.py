"""The one OpenAI-style error body, and every place kvtax answers with it.

OpenAI's clients parse ``{"error": {"message", "type", "param", "code"}}``. kvtax answers on
its own in three places: the proxy's 4xx/5xx, the push endpoint's refusals, and the error event
that ends a stream vLLM did not finish. Each is read here as a client reads it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvtax.delivery.ledger import DeliveryLedger, ModelNames
from kvtax.delivery.openai import error_body, sse_error_event
from kvtax.serve.proxy import Proxy, ProxySettings
from kvtax.serve.sources.push import PUSH_PATH, push_handler
from kvtax_dev.fakevllm.aio import STALL, STALL_TIMEOUT, FakeVllm, serve
from kvtax_dev.ports import refused_port

RUNTIME = Path(__file__).resolve().parents[2] / "exporter" / "kvtax"
FIELDS = {"message", "type", "param", "code"}


def assert_openai_shaped(parsed: Any, status: int, kind: str) -> None:
    assert set(parsed) == {"error"}
    error = parsed["error"]
    assert set(error) == FIELDS
    assert isinstance(error["message"], str)
    assert error["message"]
    assert error["type"] == kind
    assert error["param"] is None
    assert error["code"] == status


def test_the_body_has_the_fields_openai_clients_read() -> None:
    body = error_body(413, "body exceeds 10 bytes", "invalid_request_error")
    assert_openai_shaped(body, 413, "invalid_request_error")
    assert body["error"]["message"] == "body exceeds 10 bytes"


def test_the_stream_event_is_one_data_line_carrying_the_same_body() -> None:
    event = sse_error_event(502, "vLLM's stream broke off", "upstream_error")
    assert event.startswith(b"data: ")
    assert event.endswith(b"\n\n")
    assert event.count(b"\n") == 2  # one event: a client's SSE parser sees it whole
    parsed = json.loads(event.removeprefix(b"data: "))
    assert parsed == error_body(502, "vLLM's stream broke off", "upstream_error")


def test_the_shape_is_spelled_in_one_module_only() -> None:
    spelled = [
        p.relative_to(RUNTIME).as_posix()
        for p in RUNTIME.rglob("*.py")
        if '"param": None' in p.read_text()
    ]
    assert spelled == ["delivery/openai.py"]


@pytest.fixture
async def proxy_url() -> Any:
    vllm = FakeVllm(tokens=3, delay=STALL)
    runner, upstream = await serve(vllm.app(), handler_cancellation=True)
    proxy = Proxy(
        ProxySettings(upstream=upstream, max_body=1000, timeout=STALL_TIMEOUT),
        DeliveryLedger(ModelNames()),
    )
    proxy_port = await proxy.start("127.0.0.1", 0)
    yield f"http://127.0.0.1:{proxy_port}"
    await proxy.stop()
    await runner.cleanup()


async def test_the_proxy_answers_its_own_errors_in_the_shape(proxy_url: str) -> None:
    async with aiohttp.ClientSession() as client:
        async with client.post(proxy_url + "/v1/completions", data="x" * 2000) as resp:
            assert resp.status == 413
            assert_openai_shaped(await resp.json(), 413, "invalid_request_error")
        # vLLM writes its head, then goes silent for longer than the proxy waits between reads.
        body = {"model": "m", "prompt": "hi", "stream": True}
        async with client.post(proxy_url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            events = (await resp.read()).strip().split(b"\n\n")
    assert_openai_shaped(json.loads(events[-1].removeprefix(b"data: ")), 502, "upstream_error")


async def test_the_proxy_answers_an_unreachable_vllm_in_the_shape() -> None:
    with refused_port() as down:
        proxy = Proxy(
            ProxySettings(upstream=f"http://127.0.0.1:{down}"), DeliveryLedger(ModelNames())
        )
        port = await proxy.start("127.0.0.1", 0)
        try:
            async with (
                aiohttp.ClientSession() as client,
                client.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": "m"}) as resp,
            ):
                assert resp.status == 502
                assert_openai_shaped(await resp.json(), 502, "upstream_unavailable")
        finally:
            await proxy.stop()


@pytest.mark.parametrize(
    ("token", "header", "status", "kind"),
    [
        (None, "", 403, "permission_error"),
        ("s3cret", "Bearer wrong", 401, "authentication_error"),
        ("s3cret", "Bearer s3cret", 400, "invalid_request_error"),
    ],
)
async def test_the_push_endpoint_refuses_in_the_shape(
    aiohttp_client: Any, token: str | None, header: str, status: int, kind: str
) -> None:
    app = web.Application()
    app.router.add_post(PUSH_PATH, push_handler(DeliveryLedger(ModelNames()), token))
    client = await aiohttp_client(app)
    resp = await client.post(PUSH_PATH, data=b"not json", headers={"Authorization": header})
    assert resp.status == status
    assert_openai_shaped(await resp.json(), status, kind)
