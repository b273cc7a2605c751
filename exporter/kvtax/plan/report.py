"""What ``kvtax plan`` prints: one plain dict (``--json``) and a table for people made from it.

Pure: the dict is built from the sizing, profile and simulation values, and the table is built
from the dict, so the two cannot disagree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .modelcfg import KvShape
from .profile import LengthProfile
from .simtypes import Result
from .sizing import GIB, Flags, Sizing

__all__ = ["best_under", "plan_dict", "render_table", "what_if_rows"]


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


def plan_dict(
    *,
    shape: KvShape | None,
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
        out["model"] = _shape(shape)
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
        out["recommended_flags"] = {
            "--max-num-seqs": flags.max_num_seqs,
            "--max-model-len": flags.max_model_len,
            "--max-num-queued-reqs": flags.max_num_queued_reqs,
            "reasons": flags.reasons,
        }
    if what_if:
        first = what_if[0]
        out["what_if"] = {
            "num_blocks": first.settings.num_blocks,
            "block_size": first.settings.block_size,
            "max_num_batched_tokens": first.settings.max_num_batched_tokens,
            "requests": first.requests,
            "tax_target": tax_target,
            "recommended_max_num_seqs": best_under(what_if, tax_target),
            "candidates": what_if_rows(what_if),
        }
    out["notes"] = list(notes)
    return out


def _gib(n: float) -> str:
    return f"{n / GIB:,.2f} GiB"


def _kib(n: float) -> str:
    return f"{n / 1024:,.1f} KiB"


def render_table(plan: dict[str, Any]) -> str:
    """The plan as the text table ``kvtax plan`` prints: one section per key the plan holds."""
    lines = [
        *_model_lines(plan),
        *_sizing_lines(plan),
        *_profile_lines(plan),
        *_flags_lines(plan),
        *_what_if_lines(plan),
    ]
    lines += [f"note: {note}" for note in plan.get("notes", [])]
    return "\n".join(lines) + "\n"


def _row(label: str, value: object) -> str:
    return f"  {label:<34} {value}"


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


def _sizing_lines(plan: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    for key, title in (("sizing", "KV cache"), ("fp8_kv_cache", "with --kv-cache-dtype fp8")):
        if key not in plan:
            continue
        s = plan[key]
        lines.append(f"{title}:")
        per_token = s["kv_bytes_per_token"]
        lines.append(_row("KV bytes per token", f"{_kib(per_token)} ({per_token:,} B)"))
        lines.append(_row("pool per GPU", _gib(s["pool_bytes_per_gpu"])))
        held = f"{s['kv_tokens']:,} ({s['num_blocks']:,} blocks of {s['block_size']})"
        lines.append(_row("tokens held", held))
        if "concurrency_at_p95" in s:
            p95 = plan["profile"]["p95_length"]
            lines.append(
                _row(f"concurrent requests at p95 ({p95:,})", f"{s['concurrency_at_p95']:,}")
            )
    return lines


def _profile_lines(plan: dict[str, Any]) -> list[str]:
    if "profile" not in plan:
        return []
    p = plan["profile"]
    return [
        f"request lengths ({p['source']}):",
        _row("prompt p50 / p95", f"{p['prompt_p50']:,.0f} / {p['prompt_p95']:,.0f}"),
        _row("output p50 / p95", f"{p['output_p50']:,.0f} / {p['output_p95']:,.0f}"),
    ]


def _flags_lines(plan: dict[str, Any]) -> list[str]:
    if "recommended_flags" not in plan:
        return []
    f = plan["recommended_flags"]
    lines = [
        "recommended vllm serve flags:",
        f"  --max-num-seqs {f['--max-num-seqs']} --max-model-len {f['--max-model-len']} "
        f"--max-num-queued-reqs {f['--max-num-queued-reqs']}",
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
    return lines
