"""``kvtax plan``: static sizing of a vLLM deployment, and ``--what-if`` predictions.

Registered by :mod:`kvtax.cli.main` (``add_plan_parser`` and ``command("plan")(run_plan)``). This
module is the command's surface: its flags and what it prints. :mod:`kvtax.tools.plan.build`
makes the plan, from the inputs :mod:`kvtax.tools.plan.inputs` reads (config.json and
safetensors headers from disk, a /metrics page or Prometheus over HTTP through
:mod:`kvtax.tools.plan.fetch`); the rest of kvtax.tools.plan is pure. Bad input
raises :class:`kvtax.errors.PlanError`, which :func:`kvtax.cli.main.main` prints as one line,
``kvtax plan: <field>: <why>``, exiting 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvtax.tools.plan.build import build_plan
from kvtax.tools.plan.gpus import GPUS
from kvtax.tools.plan.summary import render_table

__all__ = ["add_parser", "run"]

DEFAULT_OVERHEAD_GIB = 2.0
GPU_NAMES = [gpu.name for gpu in GPUS]


def add_parser(sub: Any, help: str) -> None:
    """Add the ``plan`` subcommand to the subparsers object of the ``kvtax`` parser."""
    p = sub.add_parser(
        "plan",
        help=help,
        description="Static sizing from a model's config.json (or flags), the GPU and "
        "the request lengths: KV bytes per token, tokens and requests per GPU at p95, the pool, "
        "recommended vllm serve flags and the effect of an fp8 KV cache. With --what-if, "
        "simulate vLLM V1's scheduler on that traffic for each candidate --max-num-seqs and "
        "predict preemptions, the token tax and relative throughput. See docs/plan.md.",
    )
    p.add_argument(
        "model_dir",
        nargs="?",
        type=Path,
        metavar="MODEL",
        help="A model directory or its config.json, as `vllm serve MODEL` takes it (or --model).",
    )
    m = p.add_argument_group("model (a config.json, or the numbers by hand)")
    m.add_argument(
        "--model",
        type=Path,
        metavar="PATH",
        help="config.json or a model directory, instead of MODEL "
        "(weights are read from its safetensors headers, else estimated from config.json).",
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
    g.add_argument(
        "--gpu",
        metavar="NAME",
        help=f"A GPU by name, for the memory CUDA reports on it: {', '.join(GPU_NAMES)} "
        "(see docs/plan.md).",
    )
    g.add_argument(
        "--gpu-memory-gib",
        type=float,
        help="Memory of one GPU, GiB, as torch.cuda.mem_get_info() reports it (instead of --gpu).",
    )
    g.add_argument(
        "--gpu-memory-utilization", type=float, default=0.9, help="vLLM's setting (default 0.9)."
    )
    g.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="GPUs per replica (default 1)."
    )
    g.add_argument(
        "--weights-gib",
        type=float,
        help="Weight size, GiB (default: read from the model's safetensors, else estimated "
        "from its config.json).",
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
    for name in ("prompt-p95", "output-p95", "prompt-p50", "output-p50"):
        optional = " (optional: --what-if's trace uses it)" if name.endswith("p50") else ""
        lp.add_argument(
            f"--{name}", type=float, help=f"{name.replace('-', ' ')} in tokens{optional}."
        )
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


def run(args: argparse.Namespace) -> int:
    plan = build_plan(args)  # a PlanError reaches kvtax.cli.main, which prints it and exits 2
    if args.json:
        print(json.dumps(plan, indent=2, sort_keys=True))
    else:
        sys.stdout.write(render_table(plan))
    return 0
