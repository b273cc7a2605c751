"""The testbed itself: a real vLLM engine that is healthy, small, and preempts on demand, and the
servers around it (kvtax, Prometheus, Alertmanager) starting, answering and stopping cleanly."""

from __future__ import annotations

import asyncio
import json
import urllib.parse
from pathlib import Path

from kvtax_dev.exposition import labels_of, read_samples, total
from kvtax_dev.ports import refused_port
from kvtax_dev.process import until
from kvtax_dev.testbed import VllmEngine
from kvtax_dev.testbed.load import RequestResult, drive
from kvtax_dev.testbed.promstack import AlertmanagerProcess, PrometheusProcess, prometheus_config
from kvtax_dev.testbed.sidecar import KvtaxProcess

ALERTS = Path(__file__).resolve().parents[2] / "alerts" / "kvtax-alerts.yaml"
# Alertmanager's smallest valid config: everything to one receiver that notifies no one.
SILENT_AM = 'route: {receiver: "null"}\nreceivers: [{name: "null"}]\n'

OVERLOAD_REQUESTS = 32
OVERLOAD_MAX_TOKENS = 300


def _preemptions(engine: VllmEngine) -> float:
    """Preemptions so far, summed over every engine's series."""
    return total(read_samples(engine.metrics_text()), "vllm:num_preemptions_total")


def test_engine_is_healthy(vllm_engine: VllmEngine) -> None:
    assert vllm_engine.healthy()


def test_models_lists_tiny_llama(vllm_engine: VllmEngine) -> None:
    models = json.loads(vllm_engine.get("/v1/models"))
    assert vllm_engine.model_name == "tiny-llama"
    assert [m["id"] for m in models["data"]] == ["tiny-llama"]


def test_cache_config_reports_the_small_pool(vllm_engine: VllmEngine) -> None:
    [labels] = labels_of(read_samples(vllm_engine.metrics_text()), "vllm:cache_config_info")
    assert labels["num_gpu_blocks"] == "16"
    assert int(labels["block_size"]) * int(labels["num_gpu_blocks"]) == (
        vllm_engine.kv_capacity_tokens
    )


def test_overload_preempts(vllm_engine: VllmEngine) -> None:
    # 32 x (41 + 300) tokens want ~10,900 KV tokens from a 2,048-token pool. The engine is held
    # still until every request is in: requests that come slower than the engine finishes them
    # never fill the pool.
    before = _preemptions(vllm_engine)

    async def overload() -> list[RequestResult]:
        heads: set[int] = set()
        with vllm_engine.freezer():
            load = asyncio.create_task(
                drive(
                    vllm_engine.url,
                    vllm_engine.model_name,
                    concurrency=OVERLOAD_REQUESTS,
                    max_tokens=OVERLOAD_MAX_TOKENS,
                    stream=True,
                    include_usage=True,
                    on_head=heads.add,
                )
            )
            assert await until(lambda: len(heads) == OVERLOAD_REQUESTS or load.done(), 60)
        return await load

    results = asyncio.run(overload())
    after = _preemptions(vllm_engine)

    assert [r.error for r in results if not r.ok] == []
    # ignore_eos makes every request generate exactly max_tokens, preempted or not.
    assert {r.completion_tokens for r in results} == {OVERLOAD_MAX_TOKENS}
    assert {r.finish_reason for r in results} == {"length"}
    assert all(r.chunks > 0 for r in results)
    assert after - before > 0


def test_prometheus_scrapes_kvtax_and_every_server_stops_cleanly(tmp_path: Path) -> None:
    # No engine on purpose: kvtax serves /metrics (vllm_up 0) whether or not vLLM is there.
    with refused_port() as down:
        kvtax = KvtaxProcess(f"http://127.0.0.1:{down}", log_path=tmp_path / "kvtax.log")
        am = AlertmanagerProcess(SILENT_AM, log_path=tmp_path / "am.log")
        with kvtax, am:
            address = urllib.parse.urlsplit(kvtax.base_url).netloc
            config = prometheus_config({"kvtax": [address]}, alertmanager_url=am.url)
            prom = PrometheusProcess(config, [ALERTS], log_path=tmp_path / "prom.log")
            with prom:
                up = prom.wait_for(lambda: prom.query('up{job="kvtax"} == 1'), what="kvtax scraped")
                assert [r["metric"]["instance"] for r in up] == [address]
                assert prom.values("kvtax_vllm_up") == {
                    json.dumps(
                        {"__name__": "kvtax_vllm_up", "instance": address, "job": "kvtax"}
                    ): 0.0
                }
                assert [t["health"] for t in prom.targets()] == ["up"]
                # Prometheus asks for OpenMetrics and gzip by default; kvtax answers both (its own
                # count of /metrics answers says which it gave), and Prometheus reads the page.
                negotiated = prom.wait_for(
                    lambda: prom.query(
                        'kvtax_metrics_requests_total{format="openmetrics",encoding="gzip"} > 0'
                    ),
                    what="an OpenMetrics, gzipped scrape",
                )
                assert len(negotiated) == 1
                assert not prom.query('kvtax_metrics_requests_total{format="text"}')
                assert {g["file"] for g in prom.rule_groups()} == {str(ALERTS)}
                am.post_alerts([{"labels": {"alertname": "TestbedSmoke"}}])
                posted = am.wait_for(am.alerts, what="the posted alert")
                assert [a["labels"]["alertname"] for a in posted] == ["TestbedSmoke"]
                assert prom.stop() == 0, prom.log_tail()
            assert (kvtax.stop(), am.stop()) == (0, 0), kvtax.log_tail() + am.log_tail()
