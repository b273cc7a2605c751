"""A fleet's shapes on one sidecar: LoRA adapters joined to their base model, and several
engines (data parallel) in one server, on recorded and hand-built pages."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client.exposition import generate_latest

from kvtax.delivery.adapters import (
    AdapterError,
    adapter_pairs,
    adapters_from_models,
    merge_adapters,
)
from kvtax.delivery.ledger import OTHER, DeliveryCounts, DeliveryLedger, ModelNames, RequestRecord
from kvtax.engine.normalize import normalize
from kvtax.errors import ConfigError
from kvtax.expose.publish import adapter_samples, model_samples
from kvtax.figures.derive import EngineSettings, derive_all
from kvtax.figures.window import Window
from kvtax.serve.config import load_config
from kvtax.serve.sources.models import ModelsPoller
from kvtax.serve.wiring import build

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm"
BASE, ADAPTER = "tiny-llama", "tiny-lora"


def _models_page() -> dict[str, Any]:
    page: dict[str, Any] = json.loads((FIXTURES / "0.32-lora-models.json").read_text())
    return page


# -- /v1/models --------------------------------------------------------------------------------


def test_a_recorded_model_list_maps_the_adapter_to_its_parent() -> None:
    assert adapters_from_models(_models_page()) == {ADAPTER: BASE}


def test_a_model_list_without_parent_fields_names_no_adapter() -> None:
    # vLLM before parent existed, or a server that is not vLLM: no adapters, no error.
    old = {"object": "list", "data": [{"id": BASE}, {"id": "x", "parent": None}, "junk", {}]}
    assert adapters_from_models(old) == {}


@pytest.mark.parametrize("document", [[], {"data": {}}, {"models": []}, "text", None])
def test_a_body_that_is_not_a_model_list_is_refused(document: object) -> None:
    with pytest.raises(AdapterError, match="'data' list"):
        adapters_from_models(document)


def test_the_adapter_map_is_bounded() -> None:
    many = {"data": [{"id": f"a{i}", "parent": BASE} for i in range(1000)]}
    assert len(adapters_from_models(many, limit=10)) == 10


def test_configured_adapters_win_over_discovered_ones() -> None:
    merged = merge_adapters((("a", "configured-base"),), {"a": "listed-base", "b": "base"})
    assert merged == {"a": "configured-base", "b": "base"}


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("", ()),
        ("b=base, a = base ,", (("a", "base"), ("b", "base"))),
        ({"a": "base"}, (("a", "base"),)),
    ],
)
def test_adapter_pairs_parse(value: object, expected: tuple[tuple[str, str], ...]) -> None:
    assert adapter_pairs(value) == expected


@pytest.mark.parametrize("value", ["a", "a=", "=b", "a=a"])
def test_a_bad_adapter_setting_names_the_key(value: str) -> None:
    with pytest.raises(ConfigError, match=r"delivery\.adapters"):
        load_config({"delivery.adapters": value}, env={}, file=None)


# -- the ledger --------------------------------------------------------------------------------


def _ledger(adapters: dict[str, str] | None = None) -> DeliveryLedger:
    names = ModelNames()
    names.update([BASE])
    names.set_adapters(adapters if adapters is not None else {ADAPTER: BASE})
    return DeliveryLedger(names)


def test_adapter_tokens_count_under_the_base_model_and_per_adapter() -> None:
    ledger = _ledger()
    ledger.settle(RequestRecord(BASE, "completed", delivered_tokens=10, prompt_tokens=4))
    ledger.settle(RequestRecord(ADAPTER, "completed", delivered_tokens=7, prompt_tokens=4))
    ledger.credit(ADAPTER, 2)  # a stream still running
    ledger.add(ADAPTER, DeliveryCounts(delivered_tokens=5), "push")
    assert ledger.models() == [BASE]  # no label of its own, and none lost to "other"
    assert ledger.totals()[BASE].delivered == 10 + 7 + 2 + 5
    assert ledger.adapter_counts() == {(BASE, ADAPTER): 7 + 2 + 5}
    assert ledger.counts()[BASE].outcomes["completed"] == 2
    samples = list(adapter_samples(ledger.adapter_counts()))
    assert [(s.metric, s.labels, s.value) for s in samples] == [
        ("kvtax_adapter_delivered_tokens_total", (BASE, ADAPTER), 14.0)
    ]


def test_an_adapter_learned_before_the_map_arrived_stops_being_a_label() -> None:
    names = ModelNames()
    names.update([BASE])
    names.learn(ADAPTER)  # vLLM answered 2xx for it before /v1/models was read
    assert names.label(ADAPTER) == ADAPTER
    names.set_adapters({ADAPTER: BASE})
    assert names.label(ADAPTER) == BASE
    assert ADAPTER not in names
    names.learn(ADAPTER)  # later 2xx answers do not make it a label again
    assert names.label(ADAPTER) == BASE


def test_an_adapter_of_an_unserved_base_counts_as_other() -> None:
    ledger = _ledger({ADAPTER: "not-served"})
    ledger.settle(RequestRecord(ADAPTER, "completed", delivered_tokens=3))
    assert ledger.models() == [OTHER]
    assert ledger.adapter_counts() == {(OTHER, ADAPTER): 3}


def test_the_join_credits_adapter_tokens_to_the_base_engine() -> None:
    """Through the whole sidecar: a scrape, adapter requests, a scrape, the published page."""
    config = load_config(
        {
            "proxy.listen_address": "off",
            "window": "60s",
            "delivery.adapters": f"{ADAPTER}={BASE}",
            "delivery.models_refresh": "0",
        },
        env={},
        file=None,
    )
    stack = build(config)
    assert stack.models is None  # polling off; the configured map holds anyway
    text = (FIXTURES / "0.32-preempting.prom").read_text()
    stack.scrape.ingest(text, timestamp=1000.0)
    stack.ledger.settle(RequestRecord(ADAPTER, "completed", delivered_tokens=30))
    stack.ledger.settle(RequestRecord(BASE, "completed", delivered_tokens=30))
    stack.scrape.ingest(text, timestamp=1006.0)
    page = generate_latest(stack.web.registry).decode()
    assert f'kvtax_delivered_tokens_total{{model_name="{BASE}",source="proxy"}} 60.0' in page
    assert (
        f'kvtax_adapter_delivered_tokens_total{{adapter="{ADAPTER}",model_name="{BASE}"}} 30.0'
    ) in page
    # Goodput over the 6 s window holds both requests' tokens: 60 / 6.
    assert f'kvtax_goodput_tokens_per_second{{model_name="{BASE}"}} 10.0' in page
    assert f'model_name="{ADAPTER}"' not in page
    assert 'model_name="other"' not in page


# -- the poller of /v1/models ------------------------------------------------------------------


class _Models:
    """A /v1/models that answers the recorded page, an error status, or garbage."""

    def __init__(self) -> None:
        self.status = 200
        self.body = json.dumps(_models_page()).encode()

    async def handle(self, request: web.Request) -> web.Response:
        return web.Response(status=self.status, body=self.body, content_type="application/json")


async def test_the_poller_learns_adapters_and_keeps_them_when_vllm_fails() -> None:
    upstream = _Models()
    app = web.Application()
    app.router.add_get("/v1/models", upstream.handle)
    names = ModelNames()
    names.update([BASE])
    async with TestServer(app) as server:
        poller = ModelsPoller(
            names,
            url=str(server.make_url("")),
            configured=(("cfg-lora", BASE),),
            interval=300.0,
            timeout=2.0,
        )
        assert names.adapters == {"cfg-lora": BASE}  # before vLLM answers
        await poller.poll_once()
        assert names.adapters == {"cfg-lora": BASE, ADAPTER: BASE}
        for status, body in ((500, b"{}"), (200, b"<html>"), (200, b'{"data": 1}')):
            upstream.status, upstream.body = status, body
            await poller.poll_once()
            assert names.adapters == {"cfg-lora": BASE, ADAPTER: BASE}
        assert poller.errors == 3
        await poller.stop()
    # vLLM gone altogether: no crash, the map stays.
    await poller.poll_once()
    assert poller.errors == 4
    assert names.label(ADAPTER) == BASE
    await poller.stop()


# -- several engines in one server (data parallel) ---------------------------------------------


def _two_engines(text: str, usage_of_engine_1: float) -> str:
    """The page with every engine="0" vllm: series repeated as engine="1" (the same work), and
    engine 1's KV usage set apart."""
    lines = []
    for line in text.splitlines():
        lines.append(line)
        if line.startswith("vllm:") and 'engine="0"' in line:
            copy = line.replace('engine="0"', 'engine="1"')
            if copy.startswith("vllm:kv_cache_usage_perc{"):
                copy = re.sub(r" \S+$", f" {usage_of_engine_1}", copy)
            lines.append(copy)
    return "\n".join(lines) + "\n"


def _figures(pages: list[str]) -> Any:
    window = Window(window_seconds=100)
    for t, page in enumerate(pages):
        window.observe(normalize(page, timestamp=1000.0 + 10 * t), {})
    return derive_all(window, EngineSettings(configured_max_num_seqs=64))[BASE]


def test_two_engines_sum_counters_but_not_usage_or_capacity() -> None:
    idle, busy = ((FIXTURES / f"0.32-{n}.prom").read_text() for n in ("idle", "preempting"))
    one = _figures([idle, busy])
    two = _figures([_two_engines(idle, 0.0), _two_engines(busy, 0.25)])
    single_usage = normalize(busy, timestamp=0.0).models[BASE].values["kv_usage"]
    # Usage is per engine: the fullest one, never 1.0 + 0.25.
    assert two.kv_usage == max(single_usage, 0.25)
    # Work counters add across engines.
    for key in ("generation_tokens", "prompt_computed", "preemptions"):
        assert two.totals[key] == pytest.approx(2 * one.totals[key]), key
    assert two.tax == one.tax  # twice the recompute over twice the work
    # Capacity is one engine's pool: max_num_seqs and the KV pool are per engine, so is the
    # recommendation (the same request lengths, so the same answer).
    assert one.kv_capacity_tokens == 2048
    assert two.kv_capacity_tokens == 2048
    assert two.recommended_max_num_seqs == one.recommended_max_num_seqs
    assert two.over_admission_ratio == one.over_admission_ratio
    published = {(s.metric, s.labels): s.value for s in model_samples({BASE: two}, 64)}
    assert published[("kvtax_kv_capacity_tokens", (BASE,))] == 2048
    assert published[("kvtax_kv_cache_usage_ratio", (BASE,))] == max(single_usage, 0.25)


def test_the_recorded_lora_page_carries_only_the_base_model() -> None:
    """vLLM counted the adapter's request under the base model: the join must do the same."""
    page = (FIXTURES / "0.32-lora.prom").read_text()
    snap = normalize(page, timestamp=0.0)
    assert set(snap.models) == {BASE}
    assert snap.models[BASE].values["generation_tokens"] == 32  # 16 adapter + 16 base
    assert ADAPTER in page  # only in vllm:lora_requests_info, which has no model_name
