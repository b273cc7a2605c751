"""``kvtax plan``'s static sizing on configs written here, against hand-computed figures."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from kvtax.errors import PlanError
from kvtax.tools.plan.modelcfg import shape_from_config, shape_from_flags
from kvtax.tools.plan.sizing import GIB, pool_bytes, recommend, size
from kvtax.tools.plan.weights import header_bytes, weight_bytes

KIB = 1024

# The fields of meta-llama's config.json that decide the KV shape (Llama 3.1).
LLAMA_31_8B: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
}
LLAMA_31_70B: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 8192,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
}
# DeepSeek-V3: MLA caches one latent of kv_lora_rank + qk_rope_head_dim per layer and token.
DEEPSEEK_V3: dict[str, Any] = {
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "torch_dtype": "bfloat16",
}
# Gemma 2 9B: local (4,096-token window) and global layers alternate.
GEMMA_2_9B: dict[str, Any] = {
    "model_type": "gemma2",
    "hidden_size": 3584,
    "num_hidden_layers": 42,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 256,
    "sliding_window": 4096,
    "torch_dtype": "bfloat16",
}
JAMBA: dict[str, Any] = {
    "model_type": "jamba",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "attn_layer_period": 8,
    "attn_layer_offset": 4,
    "torch_dtype": "bfloat16",
}


def fp16_kib_per_token(config: dict[str, Any]) -> float:
    shape = shape_from_config(config)
    return size(shape, kv_dtype_bytes=2, pool_bytes=GIB, block_size=16).bytes_per_token / KIB


def test_llama_31_8b_in_fp16_is_128_kib_per_token() -> None:
    assert fp16_kib_per_token(LLAMA_31_8B) == 128


def test_llama_31_70b_in_fp16_is_320_kib_per_token() -> None:
    assert fp16_kib_per_token(LLAMA_31_70B) == 320


def test_a_50_gib_pool_holds_409600_tokens_and_68_requests_of_6k() -> None:
    shape = shape_from_config(LLAMA_31_8B)
    sizing = size(shape, kv_dtype_bytes=2, pool_bytes=50 * GIB, block_size=16)
    assert sizing.kv_tokens == 409_600
    assert sizing.num_blocks == 25_600
    assert sizing.concurrency(6000) == 68


def test_fp8_halves_the_bytes_and_doubles_the_tokens() -> None:
    shape = shape_from_config(LLAMA_31_8B)
    fp8 = size(shape, kv_dtype_bytes=1, pool_bytes=50 * GIB, block_size=16)
    assert fp8.bytes_per_token == 64 * KIB
    assert fp8.kv_tokens == 819_200
    assert fp8.concurrency(6000) == 136


def test_deepseek_mla_caches_one_latent_per_layer() -> None:
    shape = shape_from_config(DEEPSEEK_V3)
    assert shape.mla
    # (512 + 64) elements x 61 layers x 2 bytes; no factor 2 for K and V.
    sizing = size(shape, kv_dtype_bytes=2, pool_bytes=40 * GIB, block_size=64, tensor_parallel=8)
    assert sizing.bytes_per_token == 576 * 61 * 2 == 70_272
    # The latent is replicated on every tensor-parallel rank, not split.
    assert sizing.rank_bytes_per_token == 70_272
    assert sizing.kv_tokens == 40 * GIB // 70_272 // 64 * 64 == 611_136


def test_gqa_kv_splits_across_tensor_parallel_ranks_down_to_one_head_each() -> None:
    shape = shape_from_config(LLAMA_31_70B)
    assert (
        size(
            shape, kv_dtype_bytes=2, pool_bytes=GIB, block_size=16, tensor_parallel=4
        ).rank_bytes_per_token
        == 80 * KIB
    )
    # 16 ranks, 8 KV heads: each head is on two ranks, so a rank holds 1/8, not 1/16.
    assert (
        size(
            shape, kv_dtype_bytes=2, pool_bytes=GIB, block_size=16, tensor_parallel=16
        ).rank_bytes_per_token
        == 40 * KIB
    )


def test_gemma2_sliding_layers_stop_growing_at_the_window() -> None:
    shape = shape_from_config(GEMMA_2_9B)
    assert (shape.full_layers, shape.sliding_layers, shape.sliding_window) == (21, 21, 4096)
    per_layer = 2 * 8 * 256 * 2  # bytes per token and layer: K and V, 8 heads of 256, bf16
    sizing = size(shape, kv_dtype_bytes=2, pool_bytes=20 * GIB, block_size=16)
    assert sizing.bytes_per_token == 42 * per_layer
    # An 8,192-token sequence: 21 layers hold 8,192 tokens, 21 hold the last 4,096.
    assert sizing.sequence_bytes(8192) == 21 * per_layer * (8192 + 4096) == 2_113_929_216
    assert sizing.concurrency(8192) == 20 * GIB // 2_113_929_216 == 10
    # Below the window a sliding layer costs what a full one does.
    assert sizing.sequence_bytes(2048) == 42 * per_layer * 2048


def test_mistral_style_window_on_every_layer() -> None:
    config = {**LLAMA_31_8B, "model_type": "mistral", "sliding_window": 4096}
    shape = shape_from_config(config)
    assert (shape.full_layers, shape.sliding_layers) == (0, 32)
    # Qwen2-style configs carry a window but switch it off.
    off = shape_from_config({**config, "use_sliding_window": False})
    assert (off.full_layers, off.sliding_layers) == (32, 0)


def test_explicit_layer_types_are_counted() -> None:
    types = ["sliding_attention"] * 5 + ["full_attention"]
    shape = shape_from_config(
        {**LLAMA_31_8B, "num_hidden_layers": 6, "layer_types": types, "sliding_window": 1024}
    )
    assert (shape.full_layers, shape.sliding_layers, shape.sliding_window) == (1, 5, 1024)


def test_hybrid_with_mamba_layers_is_refused_naming_them() -> None:
    with pytest.raises(PlanError) as err:
        shape_from_config(JAMBA)
    assert "28 of 32 layers are 'mamba'" in str(err.value)
    assert "unsupported" in str(err.value)


def test_linear_attention_layers_are_refused_naming_them() -> None:
    types = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    with pytest.raises(PlanError, match="'linear_attention'"):
        shape_from_config({**LLAMA_31_8B, "num_hidden_layers": 4, "layer_types": types})


def test_state_space_model_is_refused() -> None:
    with pytest.raises(PlanError, match="state-space"):
        shape_from_config({"model_type": "mamba", "num_hidden_layers": 64})


def test_mqa_and_mha_defaults() -> None:
    falcon = {
        "model_type": "falcon",
        "hidden_size": 4544,
        "num_hidden_layers": 32,
        "num_attention_heads": 71,
        "multi_query": True,
    }
    assert shape_from_config(falcon).per_layer == 2 * 1 * 64
    mha = {k: v for k, v in LLAMA_31_8B.items() if k != "num_key_value_heads"}
    assert shape_from_config(mha).kv_heads == 32


def test_multimodal_configs_use_their_text_config() -> None:
    wrapped = {"model_type": "llava", "text_config": LLAMA_31_8B}
    assert fp16_kib_per_token(wrapped) == 128


@pytest.mark.parametrize(
    ("config", "field", "words"),
    [
        ({**LLAMA_31_8B, "num_hidden_layers": None}, "config.json", "num_hidden_layers is missing"),
        ({**LLAMA_31_8B, "num_key_value_heads": -8}, "config.json", "num_key_value_heads"),
        ({**LLAMA_31_8B, "torch_dtype": "float7"}, "config.json: torch_dtype", "unknown dtype"),
    ],
)
def test_bad_configs_name_the_key(config: dict[str, Any], field: str, words: str) -> None:
    with pytest.raises(PlanError) as err:
        shape_from_config(config)
    assert err.value.field == field
    assert words in str(err.value)
    assert "\n" not in str(err.value)


def test_flags_give_the_same_shape_as_the_config() -> None:
    flags = shape_from_flags(layers=80, kv_heads=8, head_dim=128, dtype="float16")
    assert flags.elements_per_token() == shape_from_config(LLAMA_31_70B).elements_per_token()
    with pytest.raises(PlanError, match="--kv-heads"):
        shape_from_flags(layers=80, kv_heads=0, head_dim=128, dtype="float16")


def test_pool_is_memory_times_utilization_less_weights_per_rank_and_overhead() -> None:
    pool = pool_bytes(
        gpu_memory=80 * GIB, utilization=0.9, tensor_parallel=1, weights=16 * GIB, overhead=2 * GIB
    )
    assert pool == 54 * GIB
    tp = pool_bytes(
        gpu_memory=80 * GIB, utilization=0.9, tensor_parallel=4, weights=140 * GIB, overhead=2 * GIB
    )
    assert tp == 35 * GIB
    with pytest.raises(PlanError, match="--gpu-memory-gib"):
        pool_bytes(gpu_memory=-1.0, utilization=0.9, tensor_parallel=1, weights=0, overhead=0)
    with pytest.raises(PlanError, match="leaves nothing"):
        pool_bytes(
            gpu_memory=24 * GIB,
            utilization=0.9,
            tensor_parallel=1,
            weights=140 * GIB,
            overhead=2 * GIB,
        )


def test_recommended_flags() -> None:
    sizing = size(
        shape_from_config(LLAMA_31_8B), kv_dtype_bytes=2, pool_bytes=50 * GIB, block_size=16
    )
    flags = recommend(sizing, p95_length=6000, target_usage=0.9, context_limit=131072)
    assert flags.max_num_seqs == 409_600 * 9 // 10 // 6000 == 61
    assert flags.max_model_len == 131072
    assert flags.max_num_queued_reqs == 122
    small = recommend(sizing, p95_length=6000, target_usage=0.9, context_limit=None)
    assert small.max_model_len == 409_600


def _safetensors(path: Path, tensors: dict[str, int]) -> None:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    at = 0
    for name, nbytes in tensors.items():
        header[name] = {"dtype": "BF16", "shape": [nbytes // 2], "data_offsets": [at, at + nbytes]}
        at += nbytes
    head = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + b"\0" * at)


def test_weights_come_from_the_headers_alone(tmp_path: Path) -> None:
    _safetensors(tmp_path / "model-00001-of-00002.safetensors", {"a": 1000, "b": 24})
    _safetensors(tmp_path / "model-00002-of-00002.safetensors", {"c": 2048})
    assert weight_bytes(tmp_path) == 3072
    # The index's total wins when there is one: the files need not even be readable.
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 16_060_522_496}, "weight_map": {}})
    )
    assert weight_bytes(tmp_path) == 16_060_522_496


def test_no_safetensors_means_unknown_and_garbage_is_named(tmp_path: Path) -> None:
    assert weight_bytes(tmp_path) is None
    (tmp_path / "broken.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(PlanError, match=r"broken\.safetensors"):
        weight_bytes(tmp_path)
    with pytest.raises(PlanError, match="shorter"):
        header_bytes(b"abc", "x")
