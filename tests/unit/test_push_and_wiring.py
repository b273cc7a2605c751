"""The push endpoint on kvtax's web port, and the parts wired by serve.wiring.build."""

from __future__ import annotations

import io
import logging
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.exposition import generate_latest

from kvtax.delivery.intake import MAX_COUNT, PushError, parse_push
from kvtax.delivery.ledger import RequestRecord
from kvtax.figures.window import served_requests
from kvtax.serve.config import load_config
from kvtax.serve.sources.push import MAX_GATEWAY_PAGE, PUSH_PATH, GatewayPoller, push_handler
from kvtax.serve.web.port import WebPort
from kvtax.serve.wiring import Stack, build

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm"


def _delivery(**flags: Any) -> tuple[WebPort, Stack]:
    config = load_config(
        {"proxy.listen_address": "off", "scrape.interval": "1s", "window": "60s", **flags},
        env={},
        file=None,
    )
    stack = build(config)
    return stack.web, stack


async def test_push_rejects_a_wrong_token(aiohttp_client: Any) -> None:
    port, delivery = _delivery(**{"push.token": "s3cret"})
    client: TestClient[Any, Any] = await aiohttp_client(port.app())
    body = {"model": "tiny-llama", "delivered_tokens": 5}
    for auth in ("", "Bearer wrong", "s3cret", "Basic s3cret", "Bearer s3cret2", "Bearers3cret"):
        resp = await client.post(PUSH_PATH, json=body, headers={"Authorization": auth})
        assert resp.status == 401, auth
        assert (await resp.json())["error"]["message"] == "missing or wrong bearer token"
        assert resp.headers["WWW-Authenticate"] == 'Bearer realm="kvtax"'
    assert delivery.ledger.models() == []
    resp = await client.post(PUSH_PATH, json=body, headers={"Authorization": "Bearer s3cret"})
    assert resp.status == 200
    assert (await resp.json()) == {"accepted": 1}
    # No scrape yet, so vLLM's model names are unknown: the push counts under "other".
    assert delivery.ledger.totals()["other"].delivered == 5


async def test_the_bearer_scheme_is_accepted_in_any_case(aiohttp_client: Any) -> None:
    port, delivery = _delivery(**{"push.token": "s3cret"})
    client: TestClient[Any, Any] = await aiohttp_client(port.app())
    body = {"model": "tiny-llama", "delivered_tokens": 1}
    for auth in ("bearer s3cret", "BEARER s3cret", "bEaReR  s3cret"):
        resp = await client.post(PUSH_PATH, json=body, headers={"Authorization": auth})
        assert resp.status == 200, auth
    assert delivery.ledger.totals()["other"].delivered == 3


async def test_push_is_refused_until_a_token_is_configured(aiohttp_client: Any) -> None:
    port, delivery = _delivery()
    client: TestClient[Any, Any] = await aiohttp_client(port.app())
    body = {"model": "tiny-llama", "delivered_tokens": 1_000_000}
    for auth in ("", "Bearer anything"):
        resp = await client.post(PUSH_PATH, json=body, headers={"Authorization": auth})
        assert resp.status == 403
        message = (await resp.json())["error"]["message"]
        assert message.startswith("push is off: start kvtax with --push.token-file")
    assert delivery.ledger.models() == []


async def test_an_empty_token_is_no_token(aiohttp_client: Any) -> None:
    _, delivery = _delivery()
    app = web.Application()
    app.router.add_post(PUSH_PATH, push_handler(delivery.ledger, ""))
    client: TestClient[Any, Any] = await aiohttp_client(app)
    body = {"model": "tiny-llama", "delivered_tokens": 1}
    for auth in ("", "Basic eA==", "Bearer "):
        resp = await client.post(PUSH_PATH, json=body, headers={"Authorization": auth})
        assert resp.status == 403, auth
    assert delivery.ledger.models() == []


async def test_unauthenticated_push_must_be_allowed_explicitly(aiohttp_client: Any) -> None:
    port, delivery = _delivery(**{"push.allow_unauthenticated": "true"})
    client: TestClient[Any, Any] = await aiohttp_client(port.app())
    resp = await client.post(PUSH_PATH, json={"model": "tiny-llama", "delivered_tokens": 4})
    assert resp.status == 200
    assert delivery.ledger.totals()["other"].delivered == 4


async def test_push_rejects_malformed_json_with_a_clear_message(aiohttp_client: Any) -> None:
    port, delivery = _delivery(**{"push.allow_unauthenticated": "true"})
    client: TestClient[Any, Any] = await aiohttp_client(port.app())
    resp = await client.post(PUSH_PATH, data=b'{"model": "m", ')
    assert resp.status == 400
    assert "not valid JSON" in (await resp.json())["error"]["message"]
    resp = await client.post(PUSH_PATH, json=[{"model": "m"}])
    assert resp.status == 400
    assert (await resp.json())["error"]["message"] == "report 0: delivered_tokens is required"
    resp = await client.post(PUSH_PATH, data=io.BytesIO(b"x" * (2 * 1024 * 1024)))
    assert resp.status == 413
    assert delivery.ledger.models() == []


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('{"model": "m", "delivered_tokens": 1.7e308}', "delivered_tokens must be at most 1e+09"),
        ('{"model": "m", "delivered_tokens": 1000000001}', "delivered_tokens must be at most"),
        ('{"model": "m", "delivered_tokens": 1, "prompt_tokens": 1e10}', "prompt_tokens must be"),
        ('{"model": "m", "delivered_tokens": 1, "requests": {"completed": 2e9}}', "completed"),
        ('{"model": "m", "delivered_tokens": 1%s}' % ("0" * 400), "must be at most"),
        ('{"model": "m", "delivered_tokens": 1%s}' % ("0" * 5000), "number too long"),
        ('{"model": "m", "delivered_tokens": Infinity}', "must be a number, got Infinity"),
        ("[" * 100_000, "nested too deeply"),
    ],
)
def test_push_values_are_bounded_and_the_message_names_the_field(body: str, message: str) -> None:
    with pytest.raises(PushError, match=re.escape(message)):
        parse_push(body.encode())


def test_the_largest_honest_count_is_accepted() -> None:
    [(_, counts)] = parse_push(b'{"model": "m", "delivered_tokens": %d}' % MAX_COUNT)
    assert counts.delivered_tokens == MAX_COUNT


async def test_huge_pushes_cannot_make_the_counter_infinite(aiohttp_client: Any) -> None:
    port, delivery = _delivery(**{"push.token": "s3cret"})
    client: TestClient[Any, Any] = await aiohttp_client(port.app())
    auth = {"Authorization": "Bearer s3cret"}
    for _ in range(2):
        body = {"model": "m", "delivered_tokens": 1.7e308}
        resp = await client.post(PUSH_PATH, json=body, headers=auth)
        assert resp.status == 400
        assert "delivered_tokens must be at most" in (await resp.json())["error"]["message"]
    assert delivery.ledger.models() == []


def test_scrapes_feed_the_join_and_metrics_render() -> None:
    port, delivery = _delivery()
    idle = delivery.scrape.ingest((FIXTURES / "0.32-idle.prom").read_text(), timestamp=1000.0)
    assert served_requests(idle) == 0
    text = (FIXTURES / "0.32-preempting.prom").read_text()
    snap = delivery.scrape.ingest(text, timestamp=1001.0)
    assert served_requests(snap) > 0
    model = next(iter(snap.models))
    delivery.ledger.settle(RequestRecord(model, "completed", delivered_tokens=9, prompt_tokens=2))
    delivery.scrape.ingest(text, timestamp=1006.0)
    page = generate_latest(port.registry).decode()
    assert f'kvtax_delivered_tokens_total{{model_name="{model}",source="proxy"}} 9.0' in page
    # 9 tokens over the 6 s window; vLLM served 8 requests in it, the ledger saw 1.
    assert f'kvtax_goodput_tokens_per_second{{model_name="{model}"}} 1.5' in page
    served = served_requests(snap) - served_requests(idle)
    assert f'kvtax_join_coverage_ratio{{model_name="{model}"}} {1 / served}' in page
    assert "kvtax_client_ttft_seconds_bucket" in page
    # One report: the scrape's own series, the proxy's gauges and the self-watch beside them.
    for name in ("kvtax_vllm_up", "kvtax_proxy_requests_in_flight", "kvtax_event_loop_lag_seconds"):
        assert f"\n{name} " in page, name


class _StreamsInFlight:
    """Stands in for the proxy's credit_in_flight: each call credits one more token."""

    def __init__(self, stack: Stack, model: str) -> None:
        self.stack, self.model, self.calls = stack, model, 0

    def __call__(self) -> None:
        self.calls += 1
        self.stack.ledger.credit(self.model, 1)


def test_a_get_of_metrics_changes_nothing_and_the_scrape_credits_running_streams() -> None:
    config = load_config({"proxy.listen_address": "off", "window": "60s"}, env={}, file=None)
    stack = build(config)
    text = (FIXTURES / "0.32-preempting.prom").read_text()
    stack.scrape.ingest(text, timestamp=1000.0)
    model = next(iter(stack.window.models()))
    streams = _StreamsInFlight(stack, model)
    feed = stack.scrape.feed
    assert feed is not None
    stack.scrape.feed = replace(feed, credit=streams)  # in place of proxy.credit_in_flight
    stack.scrape.ingest(text, timestamp=1005.0)
    assert streams.calls == 1
    before = stack.ledger.totals()
    pages = [generate_latest(stack.web.registry).decode() for _ in range(2)]
    # The process's own CPU and memory move between two reads; kvtax's figures must not.
    first, second = ([line for line in p.splitlines() if "kvtax_" in line] for p in pages)
    assert first == second
    assert streams.calls == 1
    assert stack.ledger.totals() == before
    assert f'kvtax_delivered_tokens_total{{model_name="{model}",source="proxy"}} 1.0' in pages[0]


def test_the_window_sees_the_ledger_after_the_credit_of_the_same_scrape() -> None:
    config = load_config({"proxy.listen_address": "off", "window": "60s"}, env={}, file=None)
    stack = build(config)
    text = (FIXTURES / "0.32-preempting.prom").read_text()
    stack.scrape.ingest(text, timestamp=1000.0)
    model = next(iter(stack.window.models()))
    feed = stack.scrape.feed
    assert feed is not None
    stack.scrape.feed = replace(feed, credit=_StreamsInFlight(stack, model))
    stack.scrape.ingest(text, timestamp=1005.0)
    assert stack.window.points(model)[-1].ledger.delivered == 1.0


def test_gateway_poller_adds_increases_only() -> None:
    _, delivery = _delivery()
    delivery.names.update(["m"])
    poller = GatewayPoller(
        delivery.ledger,
        url="http://127.0.0.1:1/metrics",
        metric="litellm_output_tokens_metric_total",
        model_label="model",
        selector=(),
        interval=1.0,
        timeout=0.5,
    )
    page = "# TYPE litellm_output_tokens_metric counter\n"
    poller.fold(page + 'litellm_output_tokens_metric_total{model="m"} 100\n')
    poller.fold(page + 'litellm_output_tokens_metric_total{model="m"} 130\n')
    poller.fold(page + 'litellm_output_tokens_metric_total{model="m"} 4\n')  # gateway restarted
    assert delivery.ledger.totals()["m"].delivered == 134


GATEWAY_PAGE = (
    "# TYPE litellm_output_tokens_metric counter\n"
    'litellm_output_tokens_metric_total{model="m"} 500\n'
)


async def _poll_once(
    server: TestServer, path: str, caplog: pytest.LogCaptureFixture
) -> tuple[Stack, GatewayPoller]:
    _, delivery = _delivery()
    delivery.names.update(["m"])
    url = str(server.make_url(path)).replace("http://", "http://user:PASSWORD@")
    poller = GatewayPoller(
        delivery.ledger,
        url=url + "?key=QUERY-SECRET",
        metric="litellm_output_tokens_metric_total",
        model_label="model",
        selector=(),
        interval=1.0,
        timeout=5.0,
    )
    try:
        with caplog.at_level(logging.WARNING, logger="kvtax.serve.sources.push"):
            await poller.poll_once()
    finally:
        await poller.stop()
    for secret in ("PASSWORD", "QUERY-SECRET", "SIGNATURE-SECRET"):
        assert secret not in caplog.text
    return delivery, poller


async def _gateway(aiohttp_server: Any) -> TestServer:
    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPFound("/elsewhere?sig=SIGNATURE-SECRET")

    async def page(request: web.Request) -> web.Response:
        return web.Response(text=GATEWAY_PAGE)

    async def huge(request: web.Request) -> web.Response:
        return web.Response(text=GATEWAY_PAGE + "# padding\n" * (MAX_GATEWAY_PAGE // 10))

    app = web.Application()
    for path, handler in (("/redirect", redirect), ("/elsewhere", page), ("/huge", huge)):
        app.router.add_get(path, handler)
    server: TestServer = await aiohttp_server(app)
    return server


async def test_the_gateway_poller_reads_a_page(
    aiohttp_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    delivery, poller = await _poll_once(await _gateway(aiohttp_server), "/elsewhere", caplog)
    assert delivery.ledger.totals()["m"].delivered == 500
    assert poller.errors == 0


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        (
            "/redirect",
            "it answered 302, a redirect to /elsewhere; kvtax does not follow redirects, "
            "so set --gateway.url to the final URL",
        ),
        ("/missing", "it answered 404"),
        ("/huge", f"body exceeds {MAX_GATEWAY_PAGE} bytes"),
    ],
)
async def test_the_gateway_poller_refuses_a_redirect_an_error_and_a_huge_page(
    aiohttp_server: Any, caplog: pytest.LogCaptureFixture, path: str, reason: str
) -> None:
    delivery, poller = await _poll_once(await _gateway(aiohttp_server), path, caplog)
    assert delivery.ledger.models() == []
    assert poller.errors == 1
    [record] = caplog.records
    assert record.getMessage().endswith(f"/{path.strip('/')} failed: {reason}")
