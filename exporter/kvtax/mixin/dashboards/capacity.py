"""The Capacity dashboard: KV capacity, request lengths, the recommendation and headroom.

Headroom is counted two ways: typical (p50-length) requests that fit in the free part of the
pool now, and sequences the recommendation still allows beyond those running. Pure: no I/O.
"""

from __future__ import annotations

from kvtax.mixin.dashboards.common import (
    POD,
    SEQS,
    TOKENS,
    capacity_tokens,
    kv_usage_ratio,
    length_p50,
    length_p95,
    recommended,
    running,
    waiting,
)
from kvtax.mixin.dashboards.model import Board, Panel, Row, Target, Threshold
from kvtax.mixin.dashboards.queries import by, histogram_quantile, kvtax, vllm

__all__ = ["CAPACITY"]

# Typical requests that still fit in the free part of the pool right now.
_headroom_free = by(POD, "max", f"floor((1 - {kv_usage_ratio}) * {capacity_tokens} / {length_p50})")
# Sequences the recommendation still allows beyond those running (negative: over-admitted).
_headroom_seqs = by(POD, "max", f"{recommended} - {running}")

CAPACITY = Board(
    "Capacity",
    "How much the KV pool holds, how long requests are, and how many more fit: the numbers "
    "behind the recommended max_num_seqs.",
    rows=(
        Row(
            "Now",
            (
                Panel(
                    "KV capacity",
                    "stat",
                    (Target(by(POD, "max", capacity_tokens), "{{model_name}} {{pod}}"),),
                    TOKENS,
                    "Tokens the KV pool holds (num_gpu_blocks x block_size, from vLLM's "
                    "cache_config_info). Fixed for the life of the engine.",
                    "KvtaxKvCacheNearFull",
                    width=6,
                    height=5,
                    base_color="blue",
                ),
                Panel(
                    "p95 request length",
                    "stat",
                    (Target(by(POD, "max", length_p95), "{{model_name}} {{pod}}"),),
                    TOKENS,
                    "p95 prompt + p95 generation over kvtax's window: the size the "
                    "recommendation plans for (an upper bound on a real p95 request).",
                    "KvtaxOverAdmitted",
                    width=6,
                    height=5,
                    base_color="blue",
                ),
                Panel(
                    "Recommended max_num_seqs",
                    "stat",
                    (Target(by(POD, "min", recommended), "{{model_name}} {{pod}}"),),
                    SEQS,
                    "floor(KV capacity x target usage / p95 request length): the most sequences "
                    "that can run to completion without preemption at today's lengths. Set it "
                    "as --max-num-seqs, or on vLLM 0.33+ as --max-num-active-seqs with "
                    "--max-num-seqs left at its default (keeps CUDA-graph capacity).",
                    "KvtaxOverAdmitted",
                    width=6,
                    height=5,
                    base_color="blue",
                ),
                Panel(
                    "Headroom",
                    "stat",
                    (Target(_headroom_free, "{{model_name}} {{pod}}"),),
                    "short",
                    "How many more typical (p50-length) requests fit in the free part of the KV "
                    "pool right now. Zero or less: new work preempts running work.",
                    "KvtaxKvCacheNearFull",
                    width=6,
                    height=5,
                    base_color="red",
                    thresholds=(Threshold(1, "orange"), Threshold(4, "green")),
                ),
            ),
        ),
        Row(
            "Over time",
            (
                Panel(
                    "KV capacity against use and demand",
                    "timeseries",
                    (
                        Target(by(POD, "max", capacity_tokens), "capacity {{pod}}", dashed=True),
                        Target(
                            by(POD, "max", f"{kv_usage_ratio} * {capacity_tokens}"),
                            "in use {{pod}}",
                        ),
                        Target(
                            by(POD, "max", f"({running} + {waiting}) * {length_p95}"),
                            "demand at p95 {{pod}}",
                        ),
                    ),
                    TOKENS,
                    "Capacity (dashed) against tokens in use and against demand: running plus "
                    "waiting requests at p95 length. Demand above capacity means preemption.",
                    "KvtaxKvCacheNearFull",
                    min=0,
                ),
                Panel(
                    "Request length",
                    "timeseries",
                    (
                        Target(by(POD, "max", length_p50), "p50 {{pod}}"),
                        Target(by(POD, "max", length_p95), "p95 {{pod}}"),
                        Target(
                            histogram_quantile(0.95, vllm("request_prompt_tokens", part="_bucket")),
                            "prompt p95 (vLLM) {{model_name}}",
                            dashed=True,
                        ),
                        Target(
                            histogram_quantile(
                                0.95, vllm("request_generation_tokens", part="_bucket")
                            ),
                            "generation p95 (vLLM) {{model_name}}",
                            dashed=True,
                        ),
                    ),
                    TOKENS,
                    "Request length (prompt + generation) p50 and p95 over kvtax's window, with "
                    "vLLM's prompt and generation p95 (dashed) over the panel's interval. Longer "
                    "requests mean fewer fit: the recommendation falls as p95 rises.",
                    "KvtaxOverAdmitted",
                    min=0,
                ),
                Panel(
                    "Recommended max_num_seqs against running",
                    "timeseries",
                    (
                        Target(by(POD, "min", recommended), "recommended {{pod}}"),
                        Target(
                            by(POD, "max", kvtax("kvtax_configured_max_num_seqs")),
                            "configured {{pod}}",
                            dashed=True,
                        ),
                        Target(by(POD, "max", running), "running {{pod}}"),
                    ),
                    SEQS,
                    "Running sequences against the recommendation and the configured limit "
                    "(--max-num-seqs, or --max-num-active-seqs on vLLM 0.33+). Running above "
                    "recommended is where the pool runs out mid-decode.",
                    "KvtaxOverAdmitted",
                    min=0,
                ),
                Panel(
                    "Headroom over time",
                    "timeseries",
                    (
                        Target(_headroom_free, "typical requests that fit {{pod}}"),
                        Target(_headroom_seqs, "recommended - running {{pod}}", dashed=True),
                    ),
                    "short",
                    "Solid: p50-length requests that fit in the free KV now. Dashed: sequences "
                    "the recommendation still allows beyond those running; below zero the "
                    "engine runs more than it can finish without preemption.",
                    "KvtaxOverAdmitted",
                ),
            ),
        ),
    ),
    tags=("vllm", "capacity"),
)
