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

from . import fetch
from .errors import PlanError
from .files import read_json
from .modelcfg import KvShape, shape_from_config, shape_from_flags
from .profile import LengthProfile, profile_from_histograms, profile_from_kvtax_page
from .sizing import GIB, pool_bytes
from .weights import weight_bytes

__all__ = ["config_file", "read_pool", "read_profile", "read_shape"]


def read_shape(args: argparse.Namespace) -> tuple[KvShape | None, dict[str, Any] | None]:
    """The KV shape from ``--model`` (with its config.json) or ``--layers`` and friends."""
    if args.model is not None:
        file = config_file(args.model)
        if not file.is_file():
            raise PlanError("--model", f"no config.json at {file}")
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


def read_pool(args: argparse.Namespace) -> int | None:
    """The KV pool per GPU in bytes: ``--kv-pool-gib``, or what the GPU memory leaves."""
    if args.kv_pool_gib is not None:
        if args.kv_pool_gib <= 0:
            raise PlanError("--kv-pool-gib", f"must be positive, not {args.kv_pool_gib:g}")
        return int(args.kv_pool_gib * GIB)
    if args.gpu_memory_gib is None:
        return None
    weights = args.weights_gib * GIB if args.weights_gib is not None else None
    if weights is None and args.model is not None and args.model.is_dir():
        found = weight_bytes(args.model)
        weights = float(found) if found is not None else None
    if weights is None:
        raise PlanError(
            "--weights-gib",
            "needed with --gpu-memory-gib (or a --model directory with safetensors)",
        )
    return pool_bytes(
        gpu_memory=args.gpu_memory_gib * GIB,
        utilization=args.gpu_memory_utilization,
        tensor_parallel=args.tensor_parallel_size,
        weights=weights,
        overhead=args.overhead_gib * GIB,
    )


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
    for flag, value in zip(
        ("--prompt-p50", "--prompt-p95", "--output-p50", "--output-p95"), hand, strict=True
    ):
        if value is None:
            raise PlanError(
                flag, "is missing: give all four lengths, --from-metrics or --prometheus"
            )
    return LengthProfile(*hand)
