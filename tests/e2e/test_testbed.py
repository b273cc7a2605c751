"""The testbed itself: a real vLLM engine that is healthy, small, and preempts on demand."""

from __future__ import annotations

import asyncio
import json

from kvtax_dev.exposition import labels_of, read_samples, total
from kvtax_dev.testbed import VllmEngine
from kvtax_dev.testbed.load import drive

OVERLOAD_REQUESTS = 64
OVERLOAD_MAX_TOKENS = 500


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
    # 64 x (41 + 500) tokens want ~34,600 KV tokens from a 2,048-token pool.
    before = _preemptions(vllm_engine)
    results = asyncio.run(
        drive(
            vllm_engine.url,
            vllm_engine.model_name,
            concurrency=OVERLOAD_REQUESTS,
            max_tokens=OVERLOAD_MAX_TOKENS,
            stream=True,
            include_usage=True,
        )
    )
    after = _preemptions(vllm_engine)

    assert [r.error for r in results if not r.ok] == []
    # ignore_eos makes every request generate exactly max_tokens, preempted or not.
    assert {r.completion_tokens for r in results} == {OVERLOAD_MAX_TOKENS}
    assert {r.finish_reason for r in results} == {"length"}
    assert all(r.chunks > 0 for r in results)
    assert after - before > 0
