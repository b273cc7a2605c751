"""``kvtax plan``: static sizing of a vLLM deployment, and ``--what-if`` predictions.

Registered by :mod:`kvtax.cli` (``add_plan_parser`` and ``command("plan")(run_plan)``). This is
the I/O edge of the package: it reads config.json and safetensors headers from disk, and a
/metrics page or Prometheus over HTTP (:mod:`.fetch`); the rest is pure. Bad input exits 2 with
one line, ``kvtax plan: <field>: <why>``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvtax.engine.normalize import ParseError, normalize
from kvtax.engine.vocabulary import CONCEPTS
from kvtax.figures.derive import kv_capacity_tokens

from . import fetch
from .errors import PlanError
from .modelcfg import KvShape, dtype_bytes, shape_from_config, shape_from_flags
from .profile import (
    LengthProfile,
    arrivals,
    profile_from_histograms,
    profile_from_kvtax_page,
    trace,
)
from .report import plan_dict, render_table
from .simulate import Result, Settings, simulate
from .sizing import GIB, Flags, Sizing, pool_bytes, recommend, size
from .weights import weight_bytes

__all__ = ["add_plan_parser", "run_plan"]

DEFAULT_OVERHEAD_GIB = 2.0


def add_plan_parser(sub: Any) -> None:
    """Add the ``plan`` subcommand to the subparsers object of the ``kvtax`` parser."""
    p = sub.add_parser(
        "plan",
        help="Size KV cache and max_num_seqs before deploying; --what-if predicts the tax.",
        description="Static sizing from a model's config.json (or flags), the GPU memory and "
        "the request lengths: KV bytes per token, the pool, tokens held, concurrency at p95, "
        "recommended vllm serve flags and the effect of an fp8 KV cache. With --what-if, "
        "simulate vLLM V1's scheduler on that traffic for each candidate --max-num-seqs and "
        "predict preemptions, the token tax and relative throughput. See docs/plan.md.",
    )
    m = p.add_argument_group("model (a config.json, or the numbers by hand)")
    m.add_argument(
        "--model",
        type=Path,
        metavar="PATH",
        help="config.json or a model directory "
        "(then weights are read from its safetensors headers).",
    )
    m.add_argument("--layers", type=int, help="Attention layers (instead of --model).")
    m.add_argument("--kv-heads", type=int, help="KV heads per layer (instead of --model).")
    m.add_argument("--head-dim", type=int, help="Head dimension (instead of --model).")
    m.add_argument(
        "--dtype", default="bfloat16", help="Model dtype with --layers (default bfloat16)."
    )
    m.add_argument(
        "--sliding-layers", type=int, default=0, help="Of --layers, how many use a sliding window."
    )
    m.add_argument("--sliding-window", type=int, help="The sliding window, in tokens.")
    m.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="vLLM's --kv-cache-dtype: auto (the "
        "model's dtype), fp8, fp8_e4m3, fp8_e5m2, bfloat16, float16... (default auto).",
    )
    g = p.add_argument_group("memory (the GPU, or the KV pool directly)")
    g.add_argument("--gpu-memory-gib", type=float, help="Memory of one GPU, GiB.")
    g.add_argument(
        "--gpu-memory-utilization", type=float, default=0.9, help="vLLM's setting (default 0.9)."
    )
    g.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="GPUs per replica (default 1)."
    )
    g.add_argument(
        "--weights-gib",
        type=float,
        help="Weight size, GiB (default: read from --model's safetensors).",
    )
    g.add_argument(
        "--overhead-gib",
        type=float,
        default=DEFAULT_OVERHEAD_GIB,
        help=f"Activations and CUDA graphs per GPU, GiB (default {DEFAULT_OVERHEAD_GIB}).",
    )
    g.add_argument(
        "--kv-pool-gib",
        type=float,
        help="The KV pool per GPU, GiB, instead of the above "
        "(what vLLM logs as 'Available KV cache memory', or VLLM_CPU_KVCACHE_SPACE).",
    )
    g.add_argument(
        "--block-size",
        type=int,
        default=16,
        help="KV block size in tokens (default 16; vLLM CPU uses 128).",
    )
    lp = p.add_argument_group("request lengths (by hand, a /metrics page, or Prometheus)")
    for name in ("prompt-p50", "prompt-p95", "output-p50", "output-p95"):
        lp.add_argument(f"--{name}", type=float, help=f"{name.replace('-', ' ')} in tokens.")
    lp.add_argument(
        "--from-metrics", metavar="URL", help="A vLLM or kvtax /metrics URL to read lengths from."
    )
    lp.add_argument(
        "--prometheus",
        metavar="URL",
        help="A Prometheus URL to read vLLM's length histograms from.",
    )
    lp.add_argument(
        "--range", default="1h", help="With --prometheus: the window, PromQL duration (default 1h)."
    )
    lp.add_argument(
        "--end", help="With --prometheus: the window's end, RFC 3339 or unix time (default now)."
    )
    lp.add_argument("--model-name", help="Only this model_name's series (default: all).")
    lp.add_argument(
        "--target-usage",
        type=float,
        default=0.9,
        help="Pool share --max-num-seqs aims at (default 0.9).",
    )
    w = p.add_argument_group("what-if (simulate vLLM V1's scheduler)")
    w.add_argument(
        "--what-if", metavar="N[,N...]", help="Candidate --max-num-seqs values to simulate."
    )
    w.add_argument(
        "--num-blocks",
        type=int,
        help="KV blocks of the pool (default: from the sizing, or the /metrics page).",
    )
    w.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="Token budget per step: vLLM's --max-num-batched-tokens (default 2048, the API "
        "server's default on CPU and most GPUs; 8192 on GPUs of 70 GiB and more).",
    )
    w.add_argument(
        "--requests", type=int, default=2000, help="Requests in the simulated trace (default 2000)."
    )
    w.add_argument(
        "--concurrency",
        type=int,
        help="Closed loop: clients each sending the next request when one ends "
        "(default: the largest candidate).",
    )
    w.add_argument("--rate", type=float, help="Open loop instead: requests per second (Poisson).")
    w.add_argument(
        "--step-ms",
        type=float,
        default=30.0,
        help="With --rate: seconds of one engine step, in ms (default 30).",
    )
    w.add_argument(
        "--identical-requests",
        action="store_true",
        help="Every request has the same tokens (one prompt, greedy decoding): "
        "they share prefix-cache blocks.",
    )
    w.add_argument(
        "--no-prefix-caching", action="store_true", help="The engine runs without prefix caching."
    )
    w.add_argument(
        "--tax-target",
        type=float,
        default=0.05,
        help="Recommend the largest candidate under this tax (default 0.05).",
    )
    w.add_argument("--seed", type=int, default=0, help="Seed of the simulated trace (default 0).")
    p.add_argument("--json", action="store_true", help="Print JSON instead of the table.")


def _shape(args: argparse.Namespace) -> tuple[KvShape | None, dict[str, Any] | None]:
    if args.model is not None:
        path: Path = args.model
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise PlanError("--model", f"no config.json at {file}")
        try:
            config = json.loads(file.read_text())
        except (OSError, ValueError) as exc:
            raise PlanError(str(file), f"not a readable JSON file: {exc}") from exc
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


def _pool(args: argparse.Namespace) -> int | None:
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


def _profile(args: argparse.Namespace, page: dict[str, Any]) -> LengthProfile | None:
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


def _candidates(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise PlanError("--what-if", f"expects integers separated by commas, not {text!r}") from exc
    if not values or any(v <= 0 for v in values):
        raise PlanError("--what-if", f"expects positive integers, not {text!r}")
    return sorted(set(values))


def _what_if(
    args: argparse.Namespace,
    sizing: Sizing | None,
    profile: LengthProfile | None,
    page: dict[str, Any],
) -> list[Result]:
    candidates = _candidates(args.what_if)
    if profile is None:
        raise PlanError(
            "--what-if",
            "needs request lengths: four --prompt/--output flags, --from-metrics or --prometheus",
        )
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


def build_plan(args: argparse.Namespace) -> dict[str, Any]:
    """Everything ``plan`` prints, as a dict. Raises :class:`PlanError` on bad input."""
    if args.gpu_memory_gib is not None and args.gpu_memory_gib <= 0:
        raise PlanError("--gpu-memory-gib", f"must be positive, not {args.gpu_memory_gib:g}")
    if not 0 < args.target_usage <= 1:
        raise PlanError("--target-usage", f"must be in (0, 1], not {args.target_usage}")
    shape, config = _shape(args)
    pool = _pool(args)
    page: dict[str, Any] = {}
    profile = _profile(args, page)
    notes: list[str] = []
    sizing = fp8 = None
    flags: Flags | None = None
    if shape is not None:
        kv_dtype = shape.dtype if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
        width = dtype_bytes(kv_dtype, "--kv-cache-dtype")
        if pool is not None:
            sizing = size(
                shape,
                kv_dtype_bytes=width,
                pool_bytes=pool,
                block_size=args.block_size,
                tensor_parallel=args.tensor_parallel_size,
            )
            if width > 1:
                fp8 = size(
                    shape,
                    kv_dtype_bytes=1,
                    pool_bytes=pool,
                    block_size=args.block_size,
                    tensor_parallel=args.tensor_parallel_size,
                )
            if profile is not None:
                context = (config or {}).get("max_position_embeddings")
                flags = recommend(
                    sizing,
                    p95_length=profile.p95_length,
                    target_usage=args.target_usage,
                    context_limit=context if isinstance(context, int) else None,
                )
        elif args.gpu_memory_gib is None:
            notes.append("no --gpu-memory-gib or --kv-pool-gib: only the per-token size is shown")
        if shape.sliding_layers:
            notes.append(
                "sliding-window layers hold at most the window per sequence: concurrency "
                "counts that, 'tokens held' counts every layer as full"
            )
    what_if = _what_if(args, sizing, profile, page) if args.what_if else []
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
        sizing=sizing,
        fp8=fp8,
        profile=profile,
        flags=flags,
        what_if=what_if,
        tax_target=args.tax_target,
        notes=notes,
    )


def run_plan(args: argparse.Namespace) -> int:
    try:
        plan = build_plan(args)
    except PlanError as exc:
        print(f"kvtax plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan, indent=2, sort_keys=True))
    else:
        sys.stdout.write(render_table(plan))
    return 0
