"""``kvtax plan`` on hostile numbers and files: one line naming the field, exit 2, no traceback.

A config.json holding ``num_hidden_layers`` of 10^400 used to reach the sizing's float division
and raise OverflowError; a config nested deeper than Python's parser goes raised RecursionError.
Every number plan reads (config.json keys, the checkpoint index, safetensors offsets and the
flags) is now checked for being finite and within a sane bound before any arithmetic.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from kvtax.cli.main import main
from kvtax.errors import PlanError
from kvtax.tools.plan import files
from kvtax.tools.plan.modelcfg import MAX_CONFIG_INT, shape_from_config
from kvtax.tools.plan.weights import MAX_MODEL_BYTES, header_bytes, weight_bytes
from tests.unit.test_plan_sizing import DEEPSEEK_V3, GEMMA_2_9B, JAMBA, LLAMA_31_8B

HUGE = 10**400
SIZING = ["--kv-pool-gib", "10", "--prompt-p50", "100", "--prompt-p95", "200"]
SIZING += ["--output-p50", "100", "--output-p95", "300"]


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_line(code: int, out: str, err: str, prefix: str) -> None:
    assert code == 2
    assert out == ""
    assert err.startswith(f"kvtax plan: {prefix}"), err
    assert err.count("\n") == 1
    assert len(err) < 300


def test_a_config_with_10_to_the_400_layers_is_one_line_naming_file_and_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**LLAMA_31_8B, "num_hidden_layers": HUGE}))
    code, out, err = run(["--model", str(tmp_path), *SIZING], capsys)
    one_line(code, out, err, f"{config}: num_hidden_layers must be a positive integer up to")
    assert "100,000, not an integer of 401 digits" in err


@pytest.mark.parametrize(
    ("base", "key", "raw", "words"),
    [
        (LLAMA_31_8B, "num_attention_heads", "1e400", "num_attention_heads must be"),
        (LLAMA_31_8B, "num_key_value_heads", "NaN", "num_key_value_heads must be"),
        (LLAMA_31_8B, "hidden_size", "Infinity", "hidden_size must be"),
        (LLAMA_31_8B, "head_dim", str(HUGE), "head_dim must be"),
        (LLAMA_31_8B, "num_hidden_layers", str(MAX_CONFIG_INT["num_hidden_layers"] + 1), "up to"),
        (LLAMA_31_8B, "hidden_size", "4", "hidden_size 4 is smaller than num_attention_heads"),
        (LLAMA_31_8B, "block_types", "5", "block_types must be a list or a string"),
        (LLAMA_31_8B, "max_position_embeddings", "-1", "max_position_embeddings must be"),
        (GEMMA_2_9B, "sliding_window", str(HUGE), "sliding_window must be"),
        (DEEPSEEK_V3, "kv_lora_rank", "1e400", "kv_lora_rank must be"),
        (DEEPSEEK_V3, "qk_rope_head_dim", str(HUGE), "qk_rope_head_dim must be"),
        (JAMBA, "attn_layer_period", "0", "attn_layer_period must be"),
        (JAMBA, "attn_layer_period", "1e400", "attn_layer_period must be"),
        (JAMBA, "attn_layer_offset", '"four"', "attn_layer_offset must be an integer from 0"),
    ],
)
def test_every_config_number_is_checked_before_any_arithmetic(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    *,
    base: dict[str, Any],
    key: str,
    raw: str,
    words: str,
) -> None:
    document = {k: v for k, v in base.items() if not (key == "hidden_size" and k == "head_dim")}
    text = json.dumps({**document, key: "PLACEHOLDER"}).replace('"PLACEHOLDER"', raw)
    config = tmp_path / "config.json"
    config.write_text(text)
    code, out, err = run(["--model", str(config), *SIZING], capsys)
    one_line(code, out, err, f"{config}: ")
    assert words in err


def test_text_config_keys_are_named_with_their_path() -> None:
    with pytest.raises(PlanError) as caught:
        shape_from_config({"text_config": {**LLAMA_31_8B, "num_hidden_layers": HUGE}})
    assert caught.value.field == "config.json"
    assert caught.value.message.startswith("text_config.num_hidden_layers must be")


@pytest.mark.parametrize(
    "text",
    [
        "[" * 100_000 + "]" * 100_000,
        '{"a": ' * 100_000 + "1" + "}" * 100_000,
        '{"num_hidden_layers": ' + "9" * 5000 + "}",
    ],
    ids=["deep-array", "deep-object", "5000-digit-integer"],
)
def test_a_config_python_cannot_parse_is_one_line_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str
) -> None:
    config = tmp_path / "config.json"
    config.write_text(text)
    code, out, err = run(["--model", str(tmp_path), *SIZING], capsys)
    one_line(code, out, err, f"{config}: not a readable JSON file: ")


def test_a_config_larger_than_the_limit_is_refused_unread(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(files, "MAX_JSON_BYTES", 2**20)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**LLAMA_31_8B, "padding": "x" * 2**20}))
    code, out, err = run(["--model", str(tmp_path), *SIZING], capsys)
    one_line(code, out, err, f"{config}: larger than 1 MiB")


@pytest.mark.parametrize(
    ("flag", "value", "words"),
    [
        ("--kv-pool-gib", "inf", "must be a finite number, not inf"),
        ("--kv-pool-gib", "1e300", "must be up to 1,048,576, not 1e+300"),
        ("--gpu-memory-gib", "1e308", "must be up to 1,048,576"),
        ("--gpu-memory-utilization", "nan", "must be a finite number, not nan"),
        ("--prompt-p95", "1e300", "must be from 1 up to 2,147,483,647"),
        ("--output-p50", "1e-320", "must be from 1 up to"),
        ("--rate", "1e-320", "must be from 1e-06 up to 1,000,000,000"),
        ("--step-ms", "inf", "must be a finite number"),
        ("--tax-target", "nan", "must be a finite number"),
        ("--tensor-parallel-size", str(HUGE), "must be at most 1,000,000, not an integer of 401"),
        ("--requests", str(HUGE), "must be at most 10,000,000"),
        ("--num-blocks", str(HUGE), "must be at most 2,147,483,647"),
        ("--what-if", str(HUGE), "expects positive integers up to 10,000,000"),
        ("--layers", str(HUGE), "must be a positive integer up to 100,000"),
        ("--head-dim", str(HUGE), "must be a positive integer up to 1,000,000"),
    ],
)
def test_out_of_range_flags_are_one_line_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str, words: str
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_31_8B))
    argv = ["--model", str(tmp_path), *SIZING, "--what-if", "4", "--requests", "20"]
    if flag in ("--requests", "--num-blocks"):
        # Without --what-if: before the bound, a simulation of 10^400 requests never ended.
        argv = ["--model", str(tmp_path), *SIZING]
    if flag in ("--layers", "--head-dim"):
        argv = ["--layers", "32", "--kv-heads", "8", "--head-dim", "128", *SIZING]
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    else:
        argv += [flag, value]
    code, out, err = run(argv, capsys)
    one_line(code, out, err, f"{flag}: {words}")


@pytest.mark.parametrize(
    ("index", "words"),
    [
        ('{"metadata": {"total_size": 1e400}}', "metadata.total_size must be a byte count"),
        ('{"metadata": {"total_size": NaN}}', "metadata.total_size must be a byte count"),
        ('{"metadata": {"total_size": -5}}', "metadata.total_size must be a byte count"),
        ("[" * 100_000 + "]" * 100_000, "not a readable JSON file: nested too deeply"),
    ],
)
def test_a_bad_checkpoint_index_is_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], index: str, words: str
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_31_8B))
    (tmp_path / "model.safetensors.index.json").write_text(index)
    code, out, err = run(["--model", str(tmp_path), "--gpu-memory-gib", "80"], capsys)
    one_line(code, out, err, f"{tmp_path / 'model.safetensors.index.json'}: {words}")


def _header(header: str) -> bytes:
    head = header.encode()
    return struct.pack("<Q", len(head)) + head


@pytest.mark.parametrize(
    ("header", "words"),
    [
        ('{"w": {"data_offsets": [0, 1e400]}}', "has data_offsets 0, inf"),
        ('{"w": {"data_offsets": [0, ' + str(HUGE) + "]}}", "an integer of 401 digits"),
        ('{"w": {"data_offsets": ["0", "4"]}}', "not two byte offsets"),
        ('{"w": {"data_offsets": [8, 4]}}', "not two byte offsets"),
        ("[" * 100_000 + "]" * 100_000, "safetensors header is not JSON: nested too deeply"),
    ],
)
def test_bad_safetensors_offsets_are_named(header: str, words: str) -> None:
    with pytest.raises(PlanError) as caught:
        header_bytes(_header(header), "x.safetensors")
    assert caught.value.field == "x.safetensors"
    assert words in caught.value.message
    assert "\n" not in str(caught.value)


def test_offsets_at_the_bound_still_count(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(_header(json.dumps({"w": {"data_offsets": [0, MAX_MODEL_BYTES]}})))
    assert weight_bytes(tmp_path) == MAX_MODEL_BYTES


@pytest.mark.parametrize(
    "argv",
    [["a" * 5000], ["--model", "a/" * 3000], ["b" * 300, "--kv-pool-gib", "1"]],
    ids=["positional", "flag", "one-long-component"],
)
def test_a_path_no_file_system_takes_is_one_line(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    # Path.is_dir() raised OSError (ENAMETOOLONG) through the whole command.
    code, out, err = run(argv, capsys)
    one_line(code, out, err, "--model: unusable path ...")
    assert "File name too long" in err
