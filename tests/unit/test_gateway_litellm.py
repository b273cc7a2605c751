"""The gateway source against a real LiteLLM page: ``tests/fixtures/litellm/1.108-metrics.prom``
is LiteLLM 1.108.7's ``/metrics/`` as captured by ``bench/gate/litellm.py`` (process and GC
families left out), after requests for the alias ``chat-small`` routed to
``hosted_vllm/tiny-llama`` on the real vLLM engine."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import aiohttp
import pytest

from kvtax.delivery.intake import gateway_totals
from kvtax.serve.config import load_config
from kvtax.serve.sources.push import GatewayPoller
from kvtax.serve.wiring import build

PAGE = (
    Path(__file__).resolve().parents[1] / "fixtures" / "litellm" / "1.108-metrics.prom"
).read_text()


def _by_label(label: str) -> dict[str, float]:
    """The output-token counter per ``label`` value, read with a regex, not kvtax's parser."""
    totals: dict[str, float] = {}
    for line in PAGE.splitlines():
        if line.startswith("litellm_output_tokens_metric_total{"):
            value = re.search(rf'[{{,]{label}="([^"]*)"', line)
            assert value is not None, line
            totals[value[1]] = totals.get(value[1], 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def test_the_defaults_read_litellm_under_the_engine_model_name() -> None:
    config = load_config({"proxy.listen_address": "off"}, env={}, file=None)
    engine_names = _by_label("model")
    # LiteLLM's "model" label is the deployment's model without the provider prefix: the name
    # vLLM serves. "requested_model" is the client's alias, which vLLM never sees.
    assert set(engine_names) == {"tiny-llama"}
    assert engine_names["tiny-llama"] > 0
    assert set(_by_label("requested_model")) == {"chat-small"}
    assert (
        gateway_totals(
            PAGE, config.gateway_metric, config.gateway_model_label, config.gateway_selector
        )
        == engine_names
    )


def test_the_poller_folds_the_real_page_into_the_ledger() -> None:
    config = load_config({"proxy.listen_address": "off"}, env={}, file=None)
    stack = build(config)
    stack.names.update(["tiny-llama"])
    poller = GatewayPoller(
        stack.ledger,
        url="http://127.0.0.1:1/metrics/",
        metric=config.gateway_metric,
        model_label=config.gateway_model_label,
        selector=config.gateway_selector,
        interval=1.0,
        timeout=0.5,
    )
    poller.fold(PAGE)
    assert stack.ledger.totals()["tiny-llama"].delivered == _by_label("model")["tiny-llama"]


def test_the_gateway_url_keeps_its_trailing_slash() -> None:
    # LiteLLM serves /metrics/ and redirects /metrics there; kvtax follows no redirect, so the
    # slash must survive. The engine's URL is a base that kvtax appends paths to: no slash.
    config = load_config(
        {
            "proxy.listen_address": "off",
            "vllm.url": "http://127.0.0.1:8000/",
            "gateway.url": "http://127.0.0.1:4000/metrics/",
        },
        env={},
        file=None,
    )
    assert config.gateway_url == "http://127.0.0.1:4000/metrics/"
    assert config.vllm_url == "http://127.0.0.1:8000"


class _TimingOut(GatewayPoller):
    async def read(self, session: aiohttp.ClientSession) -> None:
        raise TimeoutError


async def test_a_timeout_is_logged_by_name(caplog: pytest.LogCaptureFixture) -> None:
    stack = build(load_config({"proxy.listen_address": "off"}, env={}, file=None))
    poller = _TimingOut(
        stack.ledger,
        url="http://127.0.0.1:1/metrics/",
        metric="litellm_output_tokens_metric_total",
        model_label="model",
        selector=(),
        interval=1.0,
        timeout=0.5,
    )
    try:
        with caplog.at_level(logging.WARNING, logger="kvtax.serve.sources.push"):
            await poller.poll_once()
    finally:
        await poller.stop()
    [record] = caplog.records
    assert record.getMessage().endswith("/metrics/ failed: TimeoutError")
