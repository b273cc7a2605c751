"""``kvtax plan`` answers the calculators' question from a bare config.json (issue 24, items 1-5).

"How much KV cache per token does my model need, and how many users fit on my GPU?": the KV bytes
per token with no memory given; the weights estimated when there are no safetensors; the p95s
alone; ``--gpu NAME``; and the model as ``vllm serve`` takes it, positional.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvtax.cli.main import main
from kvtax.tools.plan.gpus import find_gpu
from kvtax.tools.plan.params import estimate_weights
from kvtax.tools.plan.sizing import GIB
from tests.unit.plan_configs import (
    DEEPSEEK_V3_FULL,
    LLAMA_31_8B_FULL,
    LLAMA_31_70B_FULL,
    MIXTRAL_8X7B,
)
from tests.unit.test_plan_sizing import GEMMA_2_9B

P95 = ["--prompt-p95", "4000", "--output-p95", "1000"]


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def run_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    code, out, err = run([*argv, "--json"], capsys)
    assert (code, err) == (0, ""), err
    result: dict[str, Any] = json.loads(out)
    return result


def model_dir(root: Path, config: dict[str, Any], name: str = "model") -> Path:
    """A directory holding only a config.json: what `hf download MODEL config.json` gives."""
    directory = root / name
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture
def llama(tmp_path: Path) -> Path:
    return model_dir(tmp_path, LLAMA_31_8B_FULL)


# 1. KV bytes per token from a config.json alone.


def test_a_bare_config_shows_the_kv_bytes_per_token_first(
    llama: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run([str(llama)], capsys)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == "KV bytes per token                     128.0 KiB (131,072 B)"
    assert lines[1] == "  = 2 (K, V) x 32 layers x 8 KV heads x 128 head dim x 2 B (bfloat16)"
    assert "only the per-token size is shown" not in out
    assert "need the memory: give --gpu" in out
    assert out.endswith("\n")


@pytest.mark.parametrize(
    ("config", "kv_bytes", "formula"),
    [
        (DEEPSEEK_V3_FULL, 70_272, "61 layers x 576 (MLA latent) x 2 B (bfloat16)"),
        (MIXTRAL_8X7B, 131_072, "2 (K, V) x 32 layers x 8 KV heads x 128 head dim"),
        (GEMMA_2_9B, 344_064, "2 (K, V) x 42 layers (21 sliding) x 8 KV heads x 256 head dim"),
    ],
    ids=["mla", "moe", "sliding"],
)
def test_the_bytes_per_token_follow_the_attention(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    config: dict[str, Any],
    kv_bytes: int,
    formula: str,
) -> None:
    plan = run_json([str(model_dir(tmp_path, config))], capsys)
    assert plan["kv_bytes_per_token"] == kv_bytes
    assert plan["model"]["kv_bytes_per_token_formula"].startswith(formula)
    assert "sizing" not in plan


def test_the_kv_cache_dtype_changes_the_bytes_per_token(
    llama: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = run_json([str(llama), "--kv-cache-dtype", "fp8"], capsys)
    assert plan["kv_bytes_per_token"] == 65_536
    assert plan["model"]["kv_bytes_per_token_formula"].endswith("x 1 B (fp8)")


# 2. Weights estimated from the config when there are no safetensors.


@pytest.mark.parametrize("as_file", [False, True], ids=["directory", "config.json"])
def test_gpu_memory_without_safetensors_estimates_the_weights(
    llama: Path, capsys: pytest.CaptureFixture[str], *, as_file: bool
) -> None:
    model = llama / "config.json" if as_file else llama
    plan = run_json([str(model), "--gpu-memory-gib", "80", *P95], capsys)
    weights = estimate_weights(LLAMA_31_8B_FULL).bytes
    memory = plan["memory"]
    assert memory["weights_source"] == "estimate"
    assert memory["estimated_parameters"] == 8_030_261_248
    assert memory["weights_bytes"] == weights
    assert plan["sizing"]["pool_bytes_per_gpu"] == int(80 * GIB * 0.9 - weights - 2 * GIB)
    note = next(n for n in plan["notes"] if n.startswith("weights estimated"))
    assert "8.03B parameters" in note
    assert "--weights-gib" in note
    assert "safetensors" in note


def test_the_table_says_the_weights_are_an_estimate(
    llama: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run([str(llama), "--gpu-memory-gib", "80"], capsys)
    assert code == 0
    assert "14.96 GiB, estimated: 8.03B parameters in bfloat16" in out
    assert "note: weights estimated from config.json" in out


def test_safetensors_and_the_flag_still_win_over_the_estimate(
    llama: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (llama / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 16_060_522_496}})
    )
    plan = run_json([str(llama), "--gpu-memory-gib", "80"], capsys)
    assert plan["memory"]["weights_bytes"] == 16_060_522_496
    assert plan["memory"]["weights_source"].endswith("model.safetensors.index.json")
    assert not any(n.startswith("weights estimated") for n in plan["notes"])
    plan = run_json([str(llama), "--gpu-memory-gib", "80", "--weights-gib", "15"], capsys)
    assert plan["memory"]["weights_bytes"] == 15 * GIB


def test_weights_by_hand_are_still_needed_for_a_model_given_by_numbers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = run(
        ["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--gpu", "H100"], capsys
    )
    assert code == 2
    assert err.startswith("kvtax plan: --weights-gib: needed with --gpu or --gpu-memory-gib")


def test_a_model_too_big_for_the_gpu_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    deepseek = model_dir(tmp_path, DEEPSEEK_V3_FULL)
    code, _, err = run([str(deepseek), "--gpu", "H200"], capsys)
    assert code == 2
    assert err.startswith("kvtax plan: --gpu-memory-gib: 139.81 GiB x 0.9 leaves nothing")
    plan = run_json([str(deepseek), "--gpu", "H200", "--tensor-parallel-size", "8"], capsys)
    assert plan["memory"]["weights_bytes"] / GIB == pytest.approx(626.7, abs=0.1)
    assert plan["sizing"]["kv_tokens"] > 0


# 3. The p95s alone.


def test_the_p95s_alone_size_the_deployment(
    llama: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = run_json([str(llama), "--kv-pool-gib", "50", *P95], capsys)
    assert plan["sizing"]["concurrency_at_p95"] == 409_600 // 5000
    assert plan["recommended_flags"]["--max-num-seqs"] == int(409_600 * 0.9 // 5000)
    assert plan["profile"]["prompt_p50"] is None
    code, out, _ = run([str(llama), "--kv-pool-gib", "50", *P95], capsys)
    assert code == 0
    assert "prompt p50 / p95                     - / 4,000" in out


def test_a_missing_p95_is_still_named(llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run([str(llama), "--kv-pool-gib", "50", "--prompt-p95", "4000"], capsys)
    assert code == 2
    assert err.startswith("kvtax plan: --output-p95: is missing")
    assert "the p50s are optional" in err


def test_what_if_asks_for_the_p50s_it_draws_from(
    llama: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run([str(llama), "--kv-pool-gib", "1", *P95, "--what-if", "4"], capsys)
    assert code == 2
    assert err.startswith("kvtax plan: --prompt-p50: needed by --what-if")
    code, _, err = run(
        [str(llama), "--kv-pool-gib", "1", *P95, "--prompt-p50", "100", "--what-if", "4"], capsys
    )
    assert err.startswith("kvtax plan: --output-p50: needed by --what-if")


# 4. --gpu NAME.


def test_gpu_by_name_is_its_memory_in_gib(llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    by_name = run_json([str(llama), "--gpu", "H100 80GB", *P95], capsys)
    by_gib = run_json([str(llama), "--gpu-memory-gib", "79.11", *P95], capsys)
    assert by_name["sizing"] == by_gib["sizing"]
    assert by_name["memory"]["gpu"] == "H100-80GB"
    assert by_name["memory"]["gpu_memory_bytes"] == find_gpu("H100").memory_gib * GIB
    code, out, _ = run([str(llama), "--gpu", "l4"], capsys)
    assert code == 0
    assert "memory per GPU (L4):" in out
    assert "22.03 GiB x 0.9 = 19.83 GiB" in out


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--gpu", "V100"], "--gpu: unknown GPU 'V100' (known: H100-80GB, H100-PCIE, H200,"),
        (["--gpu", "H100", "--gpu-memory-gib", "80"], "--gpu: give --gpu or --gpu-memory-gib"),
        (["--gpu", "RTX 9090", "--kv-pool-gib", "4"], "--gpu: unknown GPU 'RTX 9090'"),
    ],
)
def test_a_bad_gpu_is_one_line_naming_the_flag(
    llama: Path, capsys: pytest.CaptureFixture[str], argv: list[str], words: str
) -> None:
    code, out, err = run([str(llama), *argv], capsys)
    assert (code, out) == (2, "")
    assert err.startswith(f"kvtax plan: {words}")
    assert err.count("\n") == 1


# 5. The model positional, as `vllm serve MODEL` takes it.


def test_the_model_is_positional_as_in_vllm_serve(
    llama: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    positional = run_json([str(llama), "--gpu", "A100-80GB", *P95], capsys)
    flag = run_json(["--model", str(llama), "--gpu", "A100-80GB", *P95], capsys)
    after = run_json(["--gpu", "A100-80GB", *P95, str(llama)], capsys)
    assert positional == flag == after
    both = run_json([str(llama), "--model", str(llama / ".." / llama.name), *P95], capsys)
    assert both["kv_bytes_per_token"] == 131_072


def test_two_different_models_are_refused(
    tmp_path: Path, llama: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir(tmp_path, MIXTRAL_8X7B, "mixtral")
    monkeypatch.chdir(tmp_path)
    code, out, err = run(["model", "--model", "mixtral"], capsys)
    assert (code, out) == (2, "")
    assert err == "kvtax plan: --model: two models: model (MODEL) and mixtral (--model); give one\n"


def test_a_hub_name_gets_a_download_hint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    code, _, err = run(["meta-llama/Llama-3.1-8B-Instruct"], capsys)
    assert code == 2
    assert err == (
        "kvtax plan: --model: no config.json at meta-llama/Llama-3.1-8B-Instruct (plan reads a "
        "local copy: hf download meta-llama/Llama-3.1-8B-Instruct config.json)\n"
    )


# The headline: KV bytes per token, then tokens and requests per GPU.


def test_the_table_leads_with_bytes_tokens_and_requests_per_gpu(
    llama: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run([str(llama), "--gpu", "H100-80GB", *P95], capsys)
    assert code == 0
    labels = [line.split("  ")[0] for line in out.splitlines()[:4]]
    assert labels == [
        "KV bytes per token",
        "",
        "tokens per GPU",
        "requests per GPU at p95 (5,000)",
    ]
    plan = run_json([str(llama), "--gpu", "H100-80GB", *P95], capsys)
    tokens, requests = plan["sizing"]["kv_tokens"], plan["sizing"]["concurrency_at_p95"]
    assert f"tokens per GPU                         {tokens:,} (" in out
    assert f"requests per GPU at p95 (5,000)        {requests}\n" in out


def test_under_tensor_parallelism_the_headline_is_per_replica(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    seventy = model_dir(tmp_path, LLAMA_31_70B_FULL)
    code, out, _ = run([str(seventy), "--gpu", "H100", "--tensor-parallel-size", "4", *P95], capsys)
    assert code == 0
    assert out.splitlines()[2].startswith("tokens per replica  ")
    assert "131.42 GiB (32.85 GiB per GPU), estimated: 70.55B parameters" in out
