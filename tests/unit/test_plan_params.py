"""``kvtax plan``'s weight estimate from config.json, and its GPU presets.

The estimate is checked against the parameter counts the model cards publish, on the configs
those cards ship (tests/unit/plan_configs.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvtax.cli.main import main
from kvtax.errors import PlanError
from kvtax.tools.plan.gpus import GPUS, find_gpu
from kvtax.tools.plan.params import estimate_weights
from tests.unit.plan_configs import DEEPSEEK_V3_FULL, LLAMA_31_8B_FULL, MIXTRAL_8X7B, PUBLISHED

HUGE = 10**400


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_the_estimate_is_within_3_percent_of_the_published_count(name: str) -> None:
    config, published = PUBLISHED[name]
    estimate = estimate_weights(config)
    assert estimate.parameters == pytest.approx(published, rel=0.03)


def test_the_estimates_are_the_exact_counts_of_the_architectures() -> None:
    # Llama 3.1 8B and Mixtral 8x7B to the parameter, as their safetensors sum; DeepSeek-V3's
    # main model without its multi-token-prediction layer.
    counts = {name: estimate_weights(config).parameters for name, (config, _) in PUBLISHED.items()}
    assert counts["Llama-3.1-8B"] == 8_030_261_248
    assert counts["Mixtral-8x7B"] == 46_702_792_704
    assert counts["Llama-3.1-70B"] == 70_553_706_496
    assert round(counts["DeepSeek-V3"] / 1e9) == 671


def test_bytes_are_the_count_times_the_dtype() -> None:
    llama = estimate_weights(LLAMA_31_8B_FULL)
    assert llama.bytes == 2 * llama.parameters
    assert llama.dtype == "bfloat16"
    fp32 = estimate_weights({**LLAMA_31_8B_FULL, "torch_dtype": "float32"})
    assert fp32.bytes == 4 * fp32.parameters


def test_an_fp8_checkpoint_keeps_its_embeddings_in_the_model_dtype() -> None:
    deepseek = estimate_weights(DEEPSEEK_V3_FULL)
    embeddings = 2 * 129280 * 7168
    assert deepseek.bytes == pytest.approx(deepseek.parameters + embeddings, rel=1e-4)
    assert deepseek.dtype.startswith("fp8")
    four_bit = estimate_weights(
        {**LLAMA_31_8B_FULL, "quantization_config": {"quant_method": "awq", "bits": 4}}
    )
    assert four_bit.bytes < 0.35 * 2 * four_bit.parameters


def test_tied_embeddings_count_once() -> None:
    untied = estimate_weights(LLAMA_31_8B_FULL).parameters
    tied = estimate_weights({**LLAMA_31_8B_FULL, "tie_word_embeddings": True}).parameters
    assert untied - tied == 128256 * 4096


def test_deepseeks_dense_layers_and_shared_experts_are_counted() -> None:
    base = estimate_weights(DEEPSEEK_V3_FULL).parameters
    all_moe = estimate_weights({**DEEPSEEK_V3_FULL, "first_k_dense_replace": 0}).parameters
    moe_layer = 3 * 7168 * 2048 * (256 + 1) + 7168 * 256
    assert all_moe - base == 3 * (moe_layer - 3 * 7168 * 18432)
    no_shared = estimate_weights({**DEEPSEEK_V3_FULL, "n_shared_experts": 0}).parameters
    assert base - no_shared == 58 * 3 * 7168 * 2048


def test_qwen_moe_shared_expert_and_sparse_step() -> None:
    qwen = {
        "model_type": "qwen2_moe",
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "num_experts": 60,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "vocab_size": 151936,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "tie_word_embeddings": False,
    }
    # Qwen1.5-MoE-A2.7B: 14.3B parameters.
    assert estimate_weights(qwen).parameters == pytest.approx(14.3e9, rel=0.03)
    every_other = estimate_weights({**qwen, "decoder_sparse_step": 2}).parameters
    assert every_other < estimate_weights(qwen).parameters


def test_a_multimodal_config_counts_its_language_model() -> None:
    wrapped = {"model_type": "llava", "text_config": LLAMA_31_8B_FULL}
    assert estimate_weights(wrapped).parameters == estimate_weights(LLAMA_31_8B_FULL).parameters


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"vocab_size": None}, "vocab_size is missing: the weights cannot be estimated"),
        ({"intermediate_size": None}, "intermediate_size is missing"),
        ({"vocab_size": HUGE}, "vocab_size must be a positive integer up to 100,000,000"),
        ({"intermediate_size": 1.5}, "intermediate_size must be a positive integer"),
        ({"num_local_experts": HUGE}, "num_local_experts must be an integer from 0 up to"),
        ({"num_local_experts": -1}, "num_local_experts must be an integer from 0"),
        ({"torch_dtype": "int7"}, "torch_dtype: unknown dtype"),
    ],
)
def test_a_number_the_estimate_needs_is_named(change: dict[str, Any], words: str) -> None:
    config = {**MIXTRAL_8X7B, **change}
    with pytest.raises(PlanError) as caught:
        estimate_weights({k: v for k, v in config.items() if v is not None}, "m/config.json")
    assert caught.value.field is not None
    assert caught.value.field.startswith("m/config.json")
    assert words in str(caught.value)


def test_an_estimate_above_a_pebibyte_is_refused() -> None:
    giant = {
        **DEEPSEEK_V3_FULL,
        "hidden_size": 10**8,
        "moe_intermediate_size": 10**8,
        "n_routed_experts": 10**6,
    }
    with pytest.raises(PlanError, match="exceed 1 PiB"):
        estimate_weights(giant)


@pytest.mark.parametrize(
    ("spelling", "name"),
    [
        ("H100-80GB", "H100-80GB"),
        ("h100 80gb", "H100-80GB"),
        ("H100_SXM", "H100-80GB"),
        ("H100 PCIe", "H100-PCIE"),
        ("H200 141GB", "H200"),
        ("a100-80gb", "A100-80GB"),
        ("A100-40GB", "A100-40GB"),
        ("L40S 48GB", "L40S"),
        ("L4 24GB", "L4"),
        ("A10G 24GB", "A10G"),
        ("b200", "B200"),
        ("MI300X 192GB", "MI300X"),
    ],
)
def test_gpu_names_as_people_write_them(spelling: str, name: str) -> None:
    assert find_gpu(spelling).name == name


def test_gpu_presets_are_what_cuda_reports_below_the_label() -> None:
    for gpu in GPUS:
        # Below the marketing GB read as GiB, above 85 % of it.
        label = next(int(n) for n in (180, 192, 141, 80, 48, 40, 24) if f"{n}GB" in gpu.description)
        assert 0.85 * label < gpu.memory_gib < label, gpu
    assert find_gpu("H100").memory_gib == pytest.approx(79.1, abs=0.05)


def test_an_unknown_gpu_lists_the_known_names() -> None:
    with pytest.raises(PlanError) as caught:
        find_gpu("V100" + "x" * 500)
    assert caught.value.field == "--gpu"
    assert all(gpu.name in caught.value.message for gpu in GPUS)
    assert "--gpu-memory-gib" in caught.value.message
    assert len(str(caught.value)) < 300


def test_a_hostile_config_key_of_the_estimate_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "config.json"
    text = json.dumps({**DEEPSEEK_V3_FULL, "n_routed_experts": "X"}).replace('"X"', "1e400")
    config.write_text(text)
    code = main(["plan", str(tmp_path), "--gpu", "H200"])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err.startswith(f"kvtax plan: {config}: n_routed_experts must be")
    assert err.count("\n") == 1
