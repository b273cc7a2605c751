"""Makes a LoRA adapter with random weights for the tiny testbed model.

vLLM serves a LoRA adapter under its own name (``--lora-modules NAME=DIR``) on the base model's
engine; kvtax must count its tokens under the base model. No adapter can be downloaded here, so
this writes one in PEFT's layout: ``adapter_config.json`` and ``adapter_model.safetensors`` with
rank-:data:`RANK` A and B matrices on the attention's q and v projections of every layer. The
output changes (the weights are random), the scheduling and the metrics are what they would be.

Runs only in the vLLM venv (torch and safetensors are imported inside :func:`make_adapter`).
Usage: ``python -m kvtax_dev.testbed.lora MODEL_DIR OUT_DIR`` prints OUT_DIR when done.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RANK = 8
TARGETS = ("q_proj", "v_proj")


def make_adapter(model_dir: Path, out: Path, *, seed: int = 0) -> Path:
    import torch
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    hidden = int(config["hidden_size"])
    head_dim = int(config.get("head_dim") or hidden // int(config["num_attention_heads"]))
    outputs = {
        "q_proj": int(config["num_attention_heads"]) * head_dim,
        "v_proj": int(config["num_key_value_heads"]) * head_dim,
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(int(config["num_hidden_layers"])):
        for module in TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            a = torch.randn(RANK, hidden, generator=generator) * 0.01
            b = torch.randn(outputs[module], RANK, generator=generator) * 0.01
            tensors[f"{prefix}.lora_A.weight"] = a.to(torch.bfloat16).contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b.to(torch.bfloat16).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": RANK,
        "lora_alpha": 2 * RANK,
        "lora_dropout": 0.0,
        "target_modules": list(TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m kvtax_dev.testbed.lora MODEL_DIR OUT_DIR")
    print(make_adapter(Path(sys.argv[1]), Path(sys.argv[2])))


def ensure_adapter(venv: Path, model_dir: Path, out: Path) -> Path:
    """Make the adapter into ``out`` with the engine venv's python; skipped when it is there."""
    import subprocess

    from kvtax_dev.testbed.engine import EngineStartError, _venv_env

    if (out / "adapter_model.safetensors").exists() and (out / "adapter_config.json").exists():
        return out
    proc = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "kvtax_dev.testbed.lora", str(model_dir), str(out)],
        env=_venv_env(venv),
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise EngineStartError(f"making the LoRA adapter failed:\n{proc.stderr[-4000:]}")
    return out
