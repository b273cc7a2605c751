"""``kvtax plan``'s inputs: the model's KV shape, the KV pool and the request lengths, from flags.

This is where plan reads: config.json and safetensors headers from disk, and a /metrics page
or Prometheus over HTTP (through :mod:`.fetch`). Each reader turns the parsed flags into one
value, or None when the flags do not ask for it, and raises :class:`PlanError` naming the flag
that is wrong.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvtax.engine.normalize import ParseError, normalize
from kvtax.engine.vocabulary import CONCEPTS
from kvtax.errors import PlanError
from kvtax.tools.plan import fetch
from kvtax.tools.plan.files import read_json
from kvtax.tools.plan.gpus import find_gpu
from kvtax.tools.plan.modelcfg import KvShape, shape_from_config, shape_from_flags
from kvtax.tools.plan.params import WeightEstimate, estimate_weights
from kvtax.tools.plan.profile import LengthProfile, profile_from_histograms, profile_from_kvtax_page
from kvtax.tools.plan.sizing import GIB, Memory, pool_bytes
from kvtax.tools.plan.weights import INDEX_NAME, weight_bytes

__all__ = ["config_file", "read_pool", "read_profile", "read_shape"]


def read_shape(args: argparse.Namespace) -> tuple[KvShape | None, dict[str, Any] | None]:
    """The KV shape from ``--model`` (with its config.json) or ``--layers`` and friends."""
    if args.model is not None:
        file = config_file(args.model)
        if not file.is_file():
            hint = ""
            if not args.model.exists() and len(args.model.parts) == 2:  # org/name, from the Hub
                hint = f" (plan reads a local copy: hf download {args.model} config.json)"
            raise PlanError("--model", f"no config.json at {file}{hint}")
        config = read_json(file)
        if not isinstance(config, dict):
            raise PlanError(str(file), "is not a JSON object")
        return shape_from_config(config, source=str(file)), config
    given = [args.layers, args.kv_heads, args.head_dim]
    if all(v is None for v in given):
        return None, None
    if any(v is None for v in given):
        raise PlanError(
            "--layers", "give --layers, --kv-heads and --head-dim together (or --model)"
        )
    shape = shape_from_flags(
        layers=args.layers,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        dtype=args.dtype,
        sliding_layers=args.sliding_layers,
        sliding_window=args.sliding_window,
    )
    return shape, None


def config_file(model: Path) -> Path:
    """The config.json ``--model`` names: the file itself, or the one in the directory."""
    return model / "config.json" if model.is_dir() else model


def read_pool(args: argparse.Namespace, config: dict[str, Any] | None) -> Memory | None:
    """The KV pool per GPU: ``--kv-pool-gib``, or what the GPU memory leaves (``--gpu`` or
    ``--gpu-memory-gib``) once the weights and the overhead are taken. The weights are
    ``--weights-gib``, else the model directory's safetensors, else estimated from ``config``."""
    gpu = find_gpu(args.gpu) if args.gpu is not None else None
    if gpu is not None and args.gpu_memory_gib is not None:
        raise PlanError("--gpu", "give --gpu or --gpu-memory-gib, not both")
    if args.kv_pool_gib is not None:
        if args.kv_pool_gib <= 0:
            raise PlanError("--kv-pool-gib", f"must be positive, not {args.kv_pool_gib:g}")
        return Memory(pool_bytes=int(args.kv_pool_gib * GIB))
    memory_gib = gpu.memory_gib if gpu is not None else args.gpu_memory_gib
    if memory_gib is None:
        return None
    weights, source, estimate = _weights(args, config)
    overhead = args.overhead_gib * GIB
    pool = pool_bytes(
        gpu_memory=memory_gib * GIB,
        utilization=args.gpu_memory_utilization,
        tensor_parallel=args.tensor_parallel_size,
        weights=weights,
        overhead=overhead,
    )
    return Memory(
        pool_bytes=pool,
        gpu=gpu.name if gpu is not None else None,
        gpu_memory_bytes=memory_gib * GIB,
        utilization=args.gpu_memory_utilization,
        tensor_parallel=args.tensor_parallel_size,
        weights_bytes=weights,
        weights_source=source,
        overhead_bytes=overhead,
        parameters=estimate.parameters if estimate is not None else None,
        weights_dtype=estimate.dtype if estimate is not None else None,
    )


def _weights(
    args: argparse.Namespace, config: dict[str, Any] | None
) -> tuple[float, str, WeightEstimate | None]:
    """The weight bytes, where they came from, and the estimate when they are one."""
    if args.weights_gib is not None:
        return args.weights_gib * GIB, "--weights-gib", None
    if args.model is not None and args.model.is_dir():
        found = weight_bytes(args.model)
        if found is not None:
            index = args.model / INDEX_NAME
            source = str(index) if index.is_file() else f"the safetensors headers in {args.model}"
            return float(found), source, None
    if config is None:
        raise PlanError(
            "--weights-gib",
            "needed with --gpu or --gpu-memory-gib when the model is given by --layers "
            "(with --model, a safetensors checkpoint or config.json gives them)",
        )
    estimate = estimate_weights(config, str(config_file(args.model or Path())))
    return float(estimate.bytes), "estimate", estimate


def read_profile(args: argparse.Namespace, page: dict[str, Any]) -> LengthProfile | None:
    """The request lengths from Prometheus, a /metrics page or the four length flags.

    From vLLM's own /metrics page, the model's engine info (``num_gpu_blocks``, ``block_size``)
    is copied into ``page`` too: ``--what-if`` sizes its pool from it.
    """
    hand = [args.prompt_p50, args.prompt_p95, args.output_p50, args.output_p95]
    prompt_name = CONCEPTS["request_prompt_tokens"].names[0]
    output_name = CONCEPTS["request_generation_tokens"].names[0]
    if args.prometheus:
        sel = f'model_name="{args.model_name}"' if args.model_name else ""
        hists = [
            fetch.prometheus_histogram(
                args.prometheus,
                name,
                window=args.range,
                end=args.end,
                selector=sel,
                field="--prometheus",
            )
            for name in (prompt_name, output_name)
        ]
        return profile_from_histograms(hists[0], hists[1], f"{args.prometheus} over {args.range}")
    if args.from_metrics:
        text = fetch.get_text(args.from_metrics, "--from-metrics")
        if prompt_name in text:  # vLLM's own page
            try:
                snap = normalize(text, timestamp=0.0)
            except ParseError as exc:
                raise PlanError("--from-metrics", f"not a Prometheus exposition: {exc}") from exc
            models = {k: v for k, v in snap.models.items() if args.model_name in (None, k)}
            for name, model in models.items():
                h = model.histograms
                if "request_prompt_tokens" in h and "request_generation_tokens" in h:
                    page.update(model.info)
                    return profile_from_histograms(
                        h["request_prompt_tokens"],
                        h["request_generation_tokens"],
                        f"{args.from_metrics} ({name})",
                    )
            raise PlanError("--from-metrics", "no request-length histograms for that model")
        return profile_from_kvtax_page(
            text,
            args.from_metrics,
            prompt_p50=args.prompt_p50,
            prompt_p95=args.prompt_p95,
            model=args.model_name,
        )
    if all(v is None for v in hand):
        return None
    # Sizing needs the p95s; the p50s only shape --what-if's trace (checked there).
    for flag, value in (("--prompt-p95", args.prompt_p95), ("--output-p95", args.output_p95)):
        if value is None:
            raise PlanError(
                flag,
                "is missing: give --prompt-p95 and --output-p95 (the p50s are optional), "
                "--from-metrics or --prometheus",
            )
    return LengthProfile(*hand)
