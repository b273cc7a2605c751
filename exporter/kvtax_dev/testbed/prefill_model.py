"""Builds the prefill-heavy random-weight Llama: an engine where recompute costs what it costs.

The tiny testbed model (:mod:`kvtax_dev.testbed.model`) prefills so cheaply on the CPU
engine that a preemption's recompute costs next to nothing. This model is large enough that
re-prefilling a long prompt costs many decode steps, as it does on a GPU: hidden 512,
intermediate 1536, 8 layers, 8 heads, 2 KV heads (head_dim 64), stored and served in float32.
This machine's CPU has AVX2 but no AVX-512 or AMX, so bf16 matrix work is emulated and slow
in both phases; float32 keeps the prefill/decode ratio GPU-like. bench/engine/prefill_ratio.py
measures that ratio (bench/results/prefill-ratio.md).

Serve it with ``VllmEngine(model_dir=prefill_heavy_dir(), extra_args=SERVE_ARGS, ...)``: the
later ``--dtype float32`` overrides the engine's default ``--dtype bfloat16``.

Like model.py, the heavy imports happen only inside the vLLM venv.

Usage: ``python -m kvtax_dev.testbed.prefill_model DIR`` prints DIR once the model is complete.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvtax_dev.testbed.model import ModelShape, is_complete, make_tiny_model

PREFILL_HEAVY_SHAPE = ModelShape(
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    dtype="float32",
)
PREFILL_HEAVY_NAME = "prefill-llama"
# Appended to VllmEngine's command: argparse keeps the last --dtype.
SERVE_ARGS: tuple[str, ...] = ("--dtype", "float32")


def prefill_heavy_dir() -> Path:
    """Where the model is cached: beside the tiny model in the testbed cache."""
    from kvtax_dev.testbed.engine import cache_dir

    return cache_dir() / PREFILL_HEAVY_NAME


def ensure_prefill_heavy_model(venv: Path, directory: Path | None = None) -> Path:
    """Build the prefill-heavy model with the venv's python (idempotent); return its dir."""
    from kvtax_dev.testbed.engine import EngineStartError, _progress, _venv_env

    directory = directory if directory is not None else prefill_heavy_dir()
    if is_complete(directory, PREFILL_HEAVY_SHAPE):
        return directory
    _progress(f"making prefill-heavy model in {directory}...")
    proc = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "kvtax_dev.testbed.prefill_model", str(directory)],
        env=_venv_env(venv),
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise EngineStartError(f"building the prefill-heavy model failed:\n{proc.stderr[-4000:]}")
    return directory


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: ``python -m kvtax_dev.testbed.prefill_model DIR``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m kvtax_dev.testbed.prefill_model DIR", file=sys.stderr)
        return 2
    print(make_tiny_model(Path(args[0]), PREFILL_HEAVY_SHAPE))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
