"""bench.gate's servers: the engine of each arm, its counters between two moments, kvtax's
recommendation, and the GIE saturation proxy."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import requests

from kvtax_dev import dev_env, repo_root
from kvtax_dev.exposition import read_samples, total
from kvtax_dev.process import ChildProcess, http_ok
from kvtax_dev.testbed import VllmEngine
from kvtax_dev.testbed.engine import ensure_vllm_venv, free_port
from kvtax_dev.testbed.prefill_model import (
    PREFILL_HEAVY_NAME,
    SERVE_ARGS,
    ensure_prefill_heavy_model,
)

# The engine each arm needs: the testbed's (shared), or one restarted with a vLLM cap.
SHARED, SEQS, QUEUED = "shared", "max-num-seqs", "max-num-queued-reqs"
ENGINE_OF = {
    "vllm-max-num-seqs": SEQS,
    "vllm-max-num-queued-reqs": QUEUED,
}
DEFAULT_MAX_NUM_SEQS = 64


# -- engines, kvtax and the GIE proxy ---------------------------------------------------------


def make_engine(args: argparse.Namespace, kind: str, recommended: int | None) -> VllmEngine:
    venv = ensure_vllm_venv()
    model_dir = ensure_prefill_heavy_model(venv)
    extra = [*SERVE_ARGS, *args.engine_arg]
    max_num_seqs = DEFAULT_MAX_NUM_SEQS
    if kind == SEQS:
        assert recommended is not None
        max_num_seqs = recommended
    elif kind == QUEUED:
        assert recommended is not None
        extra += ["--max-num-queued-reqs", str(recommended)]
    return VllmEngine(
        model_dir=model_dir,
        model_name=PREFILL_HEAVY_NAME,
        num_gpu_blocks=args.blocks,
        max_model_len=args.max_model_len,
        max_num_seqs=max_num_seqs,
        extra_args=extra,
        # Compiled, as vLLM serves by default and as bench/engine/prefill_ratio.py measured the
        # prefill/decode ratio this bench relies on.
        eager=False,
    )


def engine_note(kind: str, recommended: int | None) -> str:
    if kind == SEQS:
        return f"--max-num-seqs {recommended}"
    if kind == QUEUED:
        return f"--max-num-queued-reqs {recommended}"
    return ""


def engine_counters(engine: VllmEngine) -> tuple[float, float]:
    samples = read_samples(engine.metrics_text())
    return (
        total(samples, "vllm:num_preemptions_total"),
        total(samples, "vllm:prefix_cache_hits_total"),
    )


def _sum(page: dict[str, float], name: str) -> float:
    return sum(v for k, v in page.items() if k == name or k.startswith(name + "{"))


def tax_between(before: dict[str, float], after: dict[str, float]) -> tuple[float | None, str]:
    """R / (Pc + G + R) over the arm from kvtax's counters; R measured by kvtax's plugin when
    the engine has it, else kvtax's estimate."""
    pc = _sum(after, "kvtax_engine_prompt_computed_tokens_total") - _sum(
        before, "kvtax_engine_prompt_computed_tokens_total"
    )
    g = _sum(after, "kvtax_engine_generation_tokens_total") - _sum(
        before, "kvtax_engine_generation_tokens_total"
    )
    for method in ("measured", "estimated"):
        name = f"kvtax_recomputed_tokens_{method}_total"
        if any(k == name or k.startswith(name + "{") for k in after):
            r = _sum(after, name) - _sum(before, name)
            work = pc + g + r
            return (r / work if work > 0 else 0.0), method
    return None, "none"


def rejections_between(before: str, after: str) -> dict[str, float]:
    """kvtax's gate rejections over the arm, by their ``reason`` label, whatever reasons the
    running kvtax has (none is assumed)."""
    old = read_samples(before).get("kvtax_gate_rejections_total", {})
    out: dict[str, float] = {}
    for labels, value in read_samples(after).get("kvtax_gate_rejections_total", {}).items():
        reason = dict(labels).get("reason", "")
        out[reason] = out.get(reason, 0.0) + value - old.get(labels, 0.0)
    return out


def recommended_of(page: dict[str, float]) -> int | None:
    found = [v for k, v in page.items() if k.startswith("kvtax_recommended_max_num_seqs")]
    return int(min(found)) if found else None


@contextlib.contextmanager
def gie_proxy(upstream: str, engine: VllmEngine, args: argparse.Namespace) -> Iterator[str]:
    """bench.gate.gie in its own process, in front of ``upstream``; yields its URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [
        sys.executable,
        "-m",
        "bench.gate.gie",
        f"--upstream={upstream}",
        f"--metrics={engine.url}/metrics",
        f"--port={port}",
        f"--poll={args.gie_poll}",
    ]
    if args.gie_stale is not None:
        argv.append(f"--stale={args.gie_stale}")
    # This checkout's bench and kvtax_dev, whatever the working directory.
    env = dev_env(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(repo_root()), env["PYTHONPATH"]])
    child = ChildProcess(
        "bench.gate.gie",
        argv,
        log_path=Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-gate-gie-{port}.log",
        ready=lambda: http_ok(f"{url}/healthz"),
        env=env,
        startup_timeout=30.0,
    )
    child.start()
    try:
        yield url
    finally:
        child.stop()


def gie_stats(url: str) -> dict[str, Any]:
    with contextlib.suppress(requests.RequestException, ValueError):
        resp = requests.get(f"{url}/gie/stats", timeout=5)
        if resp.ok:
            stats: dict[str, Any] = resp.json()
            return stats
    return {}
