"""``kvtax plan``'s result: the sizing, the recommended flags and the what-if runs, as one dict.

:func:`build_plan` reads the inputs (:mod:`.inputs`), sizes the pool (:mod:`.sizing`), runs
the scheduler simulation for each ``--what-if`` candidate (:mod:`.simulate`) and hands all of
it to :func:`.summary.plan_dict`. Bad input raises :class:`PlanError`.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtax.errors import PlanError
from kvtax.figures.derive import kv_capacity_tokens
from kvtax.tools.plan.inputs import config_file, read_pool, read_profile, read_shape
from kvtax.tools.plan.modelcfg import MAX_TOKENS, KvShape, context_limit, dtype_bytes, show_number
from kvtax.tools.plan.profile import LengthProfile, arrivals, trace
from kvtax.tools.plan.simtypes import Result, Settings
from kvtax.tools.plan.simulate import simulate
from kvtax.tools.plan.sizing import GIB, Flags, Memory, Sizing, recommend, size
from kvtax.tools.plan.summary import plan_dict

__all__ = ["build_plan"]


def build_plan(args: argparse.Namespace) -> dict[str, Any]:
    """Everything ``plan`` prints, as a dict. Raises :class:`PlanError` on bad input."""
    _check_ranges(args)
    args.model = _model_path(args)
    # Read in this order: a bad flag fails on the first input that reads it.
    shape, config = read_shape(args)
    memory = read_pool(args, config)
    page: dict[str, Any] = {}
    profile = read_profile(args, page)
    notes: list[str] = []
    sized = _Sized()
    if shape is not None:
        sized = _size(args, shape, memory, profile, config)
        notes += _shape_notes(shape, memory)
    what_if = _what_if(args, sized.sizing, profile, page) if args.what_if else []
    if what_if:
        notes.append(
            "what-if is a step model of vLLM V1's scheduler, not a timing model: "
            "see docs/plan.md for what it leaves out"
        )
    if shape is None and not what_if:
        raise PlanError(
            "--model", "give a model (--model, or --layers/--kv-heads/--head-dim) or --what-if"
        )
    return plan_dict(
        shape=shape,
        kv_cache_dtype=sized.kv_dtype,
        memory=memory,
        sizing=sized.sizing,
        fp8=sized.fp8,
        profile=profile,
        flags=sized.flags,
        what_if=what_if,
        tax_target=args.tax_target,
        notes=notes,
    )


# The largest value each float flag may take, and for some the smallest: argparse's float()
# takes "nan", "inf" and "1e400", and a huge or tiny finite value still overflows the sizing or
# the simulated trace. Memory up to 1 PiB; lengths from 1 token to vLLM's int32 max_model_len; a
# rate from one request in 11 days; a step up to an hour.
_MAX_GIB = float(2**20)
_FLOAT_RANGES: dict[str, tuple[float | None, float | None]] = {
    "gpu_memory_gib": (None, _MAX_GIB),
    "gpu_memory_utilization": (None, None),
    "weights_gib": (None, _MAX_GIB),
    "overhead_gib": (None, _MAX_GIB),
    "kv_pool_gib": (None, _MAX_GIB),
    "prompt_p50": (1.0, float(MAX_TOKENS)),
    "prompt_p95": (1.0, float(MAX_TOKENS)),
    "output_p50": (1.0, float(MAX_TOKENS)),
    "output_p95": (1.0, float(MAX_TOKENS)),
    "target_usage": (None, None),
    "rate": (1e-6, 1e9),
    "step_ms": (1e-3, 3_600_000.0),
    "tax_target": (None, None),
}

# The largest value of each integer flag (argparse's int() takes any number of digits); the
# model's own numbers (--layers and friends) are bounded with config.json's, in .modelcfg.
_INT_MAX: dict[str, int] = {
    "tensor_parallel_size": 1_000_000,
    "block_size": MAX_TOKENS,
    "num_blocks": MAX_TOKENS,
    "max_num_batched_tokens": MAX_TOKENS,
    "requests": 10_000_000,
    "concurrency": 10_000_000,
}


def _check_ranges(args: argparse.Namespace) -> None:
    """Refuse out-of-range numbers before anything is read."""
    for name, (low, high) in _FLOAT_RANGES.items():
        value = getattr(args, name, None)
        if value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if not math.isfinite(value):
            raise PlanError(flag, f"must be a finite number, not {value}")
        # Zero and below keep each flag's own message (positive, in (0, 1], ...).
        if (low is not None and 0 < value < low) or (high is not None and value > high):
            shown = f"from {_plain(low)} " if low is not None else ""
            raise PlanError(flag, f"must be {shown}up to {_plain(high)}, not {value:g}")
    for name, high_int in _INT_MAX.items():
        number = getattr(args, name, None)
        if number is not None and number > high_int:
            flag = "--" + name.replace("_", "-")
            raise PlanError(flag, f"must be at most {high_int:,}, not {show_number(number)}")
    if args.gpu_memory_gib is not None and args.gpu_memory_gib <= 0:
        raise PlanError("--gpu-memory-gib", f"must be positive, not {args.gpu_memory_gib:g}")
    if not 0 < args.target_usage <= 1:
        raise PlanError("--target-usage", f"must be in (0, 1], not {args.target_usage}")


def _model_path(args: argparse.Namespace) -> Path | None:
    """The model, positional as ``vllm serve MODEL`` takes it, or ``--model``: not two."""
    given: Path | None = getattr(args, "model_dir", None)
    flag: Path | None = args.model
    if given is not None and flag is not None and os.path.abspath(given) != os.path.abspath(flag):
        raise PlanError(
            "--model",
            f"two models: {_short_path(given)} (MODEL) and {_short_path(flag)} (--model); give one",
        )
    model = given if given is not None else flag
    if model is not None:
        try:
            model.is_dir()  # ENOENT and friends are False; a name too long raises
        except OSError as exc:
            raise PlanError(
                "--model", f"unusable path {_short_path(model)}: {exc.strerror or exc}"
            ) from None
    return model


def _short_path(path: Path) -> str:
    text = str(path)
    return text if len(text) <= 60 else "..." + text[-57:]


def _plain(bound: float | None) -> str:
    """A bound as people write it: 1,048,576 rather than 1.04858e+06; 1e-06 stays."""
    if bound is not None and bound >= 1 and bound.is_integer():
        return f"{int(bound):,}"
    return f"{bound:g}"


@dataclass(frozen=True, slots=True)
class _Sized:
    """The KV cache's dtype, the pool sized at it and at fp8 (when that is smaller), and the
    flags."""

    kv_dtype: str | None = None
    sizing: Sizing | None = None
    fp8: Sizing | None = None
    flags: Flags | None = None


def _size(
    args: argparse.Namespace,
    shape: KvShape,
    memory: Memory | None,
    profile: LengthProfile | None,
    config: dict[str, Any] | None,
) -> _Sized:
    kv_dtype = shape.dtype if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
    # Checked even without a pool, so a bad --kv-cache-dtype never passes silently.
    width = dtype_bytes(kv_dtype, "--kv-cache-dtype")
    if memory is None:
        return _Sized(kv_dtype)
    pool = memory.pool_bytes
    sizing = _size_at(args, shape, width, pool)
    fp8 = _size_at(args, shape, 1, pool) if width > 1 else None
    flags = None
    if profile is not None:
        flags = recommend(
            sizing,
            p95_length=profile.p95_length,
            target_usage=args.target_usage,
            context_limit=context_limit(config or {}, str(config_file(args.model or Path()))),
        )
    return _Sized(kv_dtype, sizing, fp8, flags)


def _size_at(args: argparse.Namespace, shape: KvShape, width: int, pool: int) -> Sizing:
    """The pool of ``pool`` bytes with KV elements of ``width`` bytes."""
    return size(
        shape,
        kv_dtype_bytes=width,
        pool_bytes=pool,
        block_size=args.block_size,
        tensor_parallel=args.tensor_parallel_size,
    )


def _shape_notes(shape: KvShape, memory: Memory | None) -> list[str]:
    """What the table leaves out for this model and these flags, and what it estimated."""
    notes: list[str] = []
    if memory is None:
        notes.append(
            "tokens and requests per GPU need the memory: give --gpu (H100-80GB, A100-40GB, "
            "L4...), --gpu-memory-gib or --kv-pool-gib"
        )
    elif memory.parameters is not None and memory.weights_bytes is not None:
        notes.append(
            f"weights estimated from config.json: {memory.parameters / 1e9:,.2f}B parameters "
            f"in {memory.weights_dtype} = {memory.weights_bytes / GIB:,.2f} GiB; for the exact "
            "size give --weights-gib, or a model directory with its safetensors"
        )
    if shape.sliding_layers:
        notes.append(
            "sliding-window layers hold at most the window per sequence: concurrency "
            "counts that, 'tokens per GPU' counts every layer as full"
        )
    return notes


def _candidates(text: str) -> list[int]:
    """The ``--what-if`` values: positive integers, sorted, each once."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise PlanError("--what-if", f"expects integers separated by commas, not {text!r}") from exc
    if not values or any(not 0 < v <= _INT_MAX["concurrency"] for v in values):
        shown = text if len(text) <= 60 else text[:57] + "..."
        raise PlanError(
            "--what-if",
            f"expects positive integers up to {_INT_MAX['concurrency']:,}, not {shown!r}",
        )
    return sorted(set(values))


def _what_if_pool(
    args: argparse.Namespace, sizing: Sizing | None, page: dict[str, Any]
) -> tuple[int, int]:
    """The simulated pool's blocks and block size: ``--num-blocks``, else the sized pool, else
    the one the /metrics page reports."""
    block_size = args.block_size
    blocks = args.num_blocks
    if blocks is None and sizing is not None:
        blocks = sizing.num_blocks
    if blocks is None and page.get("num_gpu_blocks"):
        capacity = kv_capacity_tokens(page)
        block_size = int(page.get("block_size", block_size))
        blocks = int(capacity // block_size) if capacity else None
    if blocks is None:
        raise PlanError(
            "--num-blocks", "needed by --what-if (or a model and memory to size the pool)"
        )
    return blocks, block_size


def _what_if(
    args: argparse.Namespace,
    sizing: Sizing | None,
    profile: LengthProfile | None,
    page: dict[str, Any],
) -> list[Result]:
    """One simulated run per candidate ``--max-num-seqs``, on one trace of the profile.

    The pool is ``--num-blocks``, else the one sized from the model and memory, else the one
    the /metrics page reports.
    """
    candidates = _candidates(args.what_if)
    if profile is None:
        raise PlanError(
            "--what-if",
            "needs request lengths: the --prompt/--output flags, --from-metrics or --prometheus",
        )
    if not profile.drawable:
        flag = "--prompt-p50" if profile.prompt_p50 is None else "--output-p50"
        raise PlanError(
            flag,
            "needed by --what-if: its trace draws lengths through the p50s and p95s "
            "(sizing alone needs only the p95s)",
        )
    blocks, block_size = _what_if_pool(args, sizing, page)
    reqs = trace(
        profile,
        requests=args.requests,
        seed=args.seed,
        max_length=(blocks - 1) * block_size,
        shared_content=args.identical_requests,
    )
    clients = None
    if args.rate is not None:
        if args.step_ms <= 0:
            raise PlanError("--step-ms", f"must be positive, not {args.step_ms}")
        reqs = arrivals(reqs, per_step=args.rate * args.step_ms / 1000.0, seed=args.seed)
    else:
        clients = args.concurrency if args.concurrency is not None else max(candidates)
    return [
        simulate(
            reqs,
            Settings(
                num_blocks=blocks,
                block_size=block_size,
                max_num_seqs=n,
                max_num_batched_tokens=args.max_num_batched_tokens,
                enable_prefix_caching=not args.no_prefix_caching,
            ),
            clients=clients,
        )
        for n in candidates
    ]
