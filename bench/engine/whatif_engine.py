"""Measure the real vLLM CPU engine's preemptions and tax at several ``--max-num-seqs``.

The ground truth ``bench/engine/whatif.py`` compares ``kvtax plan --what-if`` with. For each setting
it starts a fresh engine (16 blocks x 128 = 2,048 KV tokens, the testbed's pool, kvtax's plugin
loaded), sends the overload of 64 concurrent streamed requests of 41 prompt + 500 output tokens
straight to vLLM, waits until the engine is idle and its counters stop moving, and records the
increase of vLLM's counters and the plugin's. Each setting is one engine lifetime, so run each under
the shared lock on its own::

    for n in 64 16 4; do
        flock /tmp/kvtax-e2e.lock .venv/bin/python -m bench.engine.whatif_engine --max-num-seqs $n \
            --repeat 2 --out bench/results/whatif-engine.json
    done

Two kinds of overload run on each engine (``--modes``): ``identical`` is the testbed's load
(temperature 0 on one prompt, so every request decodes the same tokens and their blocks are shared
in the prefix cache), and ``distinct`` samples at temperature 1 with a seed per request, so every
output differs and a victim can only find its own blocks. Results are merged into ``--out`` keyed
by setting and mode (a rerun replaces that setting's runs of that mode).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from bench import record
from kvtax import plugin
from kvtax_dev.testbed import VllmEngine
from kvtax_dev.testbed.load import PROMPT, PROMPT_TOKENS, RequestResult, drive

MODEL = "tiny-llama"
CLIENTS = 64
MAX_TOKENS = 500
SETTLE_TIMEOUT_S = 300.0

_SERIES = {
    "generation": "vllm:generation_tokens_total",
    "prompt": "vllm:prompt_tokens_total",
    "preemptions": "vllm:num_preemptions_total",
    "recomputed": plugin.family_name("recomputed_tokens") + "_total",
    "queried": plugin.family_name("preempted_queried_tokens") + "_total",
    "hits": plugin.family_name("preempted_hit_tokens") + "_total",
    "resumes": plugin.family_name("preempted_resumes") + "_total",
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
}


def read(engine: VllmEngine) -> dict[str, float]:
    wanted = {v: k for k, v in _SERIES.items()}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(engine.metrics_text()):
        for s in family.samples:
            key = wanted.get(s.name)
            if key is not None and s.labels.get("model_name") == MODEL:
                out[key] = out.get(key, 0.0) + s.value
    return out


def settle(engine: VllmEngine) -> dict[str, float]:
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    seen: list[dict[str, float]] = []
    while time.monotonic() < deadline:
        raw = read(engine)
        idle = raw.get("running") == 0 and raw.get("waiting") == 0
        seen = [*seen[-2:], raw] if idle else []
        if len(seen) == 3 and seen[0] == seen[1] == seen[2]:
            return raw
        time.sleep(0.5)
    raise SystemExit(f"engine did not settle within {SETTLE_TIMEOUT_S:.0f} s")


def _engine_settings(log: str) -> dict[str, Any]:
    """What the engine says at startup about its pool and its batch budget."""
    out: dict[str, Any] = {}
    for key, pattern in (
        ("kv_cache_tokens", r"KV cache size: ([\d,]+) tokens"),
        ("max_num_batched_tokens", r"max_num_batched_tokens=(\d+)"),
        ("enable_prefix_caching", r"enable_prefix_caching=(\w+)"),
        ("async_scheduling", r"async_scheduling=(\w+)"),
        ("enable_chunked_prefill", r"enable_chunked_prefill=(\w+)"),
    ):
        found = re.search(pattern, log)
        if found:
            out[key] = found.group(1).replace(",", "")
    return out


async def _sampled(url: str, index: int) -> tuple[bool, str]:
    """One streamed request sampled at temperature 1 with its own seed: its own tokens."""
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 1.0,
        "seed": index,
        "stream": True,
    }
    parts: list[str] = []
    timeout = aiohttp.ClientTimeout(total=1200)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.post(url + "/v1/completions", json=body) as resp,
    ):
        async for raw in resp.content:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                for choice in json.loads(line[5:]).get("choices") or []:
                    parts.append(choice.get("text") or "")
        return resp.status == 200, "".join(parts)


async def _distinct(url: str, seed: int) -> list[tuple[bool, str]]:
    return list(await asyncio.gather(*(_sampled(url, seed + i) for i in range(CLIENTS))))


def _identical(url: str, seed: int) -> list[tuple[bool, str]]:
    results: list[RequestResult] = asyncio.run(
        drive(
            url,
            MODEL,
            concurrency=CLIENTS,
            max_tokens=MAX_TOKENS,
            stream=True,
            include_usage=True,
            seed=seed,
        )
    )
    return [(r.ok, r.text) for r in results]


LOADS: dict[str, Callable[[str, int], list[tuple[bool, str]]]] = {
    "identical": _identical,
    "distinct": lambda url, seed: asyncio.run(_distinct(url, seed)),
}


def measure(max_num_seqs: int, repeat: int, modes: list[str]) -> dict[str, Any]:
    log_path = Path(tempfile.gettempdir()) / f"kvtax-whatif-{max_num_seqs}.log"
    out: dict[str, Any] = {"max_num_seqs": max_num_seqs}
    with VllmEngine(max_num_seqs=max_num_seqs, log_path=log_path) as engine:
        for mode in modes:
            out[f"{mode}_runs"] = _runs(engine, max_num_seqs, repeat, mode)
        out["engine"] = _engine_settings(log_path.read_text(errors="replace"))
    return out


def _runs(engine: VllmEngine, max_num_seqs: int, repeat: int, mode: str) -> list[dict[str, Any]]:
    runs = []
    for i in range(repeat):
        before = settle(engine)
        began = time.monotonic()
        results = LOADS[mode](engine.url, 1000 * i)
        wall = time.monotonic() - began
        after = settle(engine)
        delta = {
            k: after[k] - before.get(k, 0.0)
            for k in after
            if k in _SERIES and k not in ("running", "waiting")
        }
        texts = {text for ok, text in results if ok}
        g, p, r = delta["generation"], delta["prompt"], delta["recomputed"]
        runs.append(
            {
                **delta,
                "failed": sum(not ok for ok, _ in results),
                "distinct_outputs": len(texts),
                "wall_s": round(wall, 2),
                "tax": r / (p + g + r),
                "preemptions_per_request": delta["preemptions"] / CLIENTS,
            }
        )
        print(f"max_num_seqs={max_num_seqs} {mode} run {i}: {runs[-1]}", flush=True)
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-num-seqs", type=int, required=True, help="The setting to measure.")
    parser.add_argument("--repeat", type=int, default=2, help="Overloads per engine (default 2).")
    parser.add_argument("--out", type=Path, required=True, help="JSON file to merge results into.")
    parser.add_argument(
        "--modes", default="identical,distinct", help="Loads to run (default identical,distinct)."
    )
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(LOADS)
    if unknown:
        parser.error(f"--modes: unknown {sorted(unknown)}; known: {sorted(LOADS)}")
    result = measure(args.max_num_seqs, args.repeat, modes)
    # Read the file again only now: other settings may have been written meanwhile.
    data = json.loads(args.out.read_text()) if args.out.exists() else {}
    data.setdefault(
        "load", {"clients": CLIENTS, "prompt_tokens": PROMPT_TOKENS, "max_tokens": MAX_TOKENS}
    )
    data.setdefault("settings", {}).setdefault(str(args.max_num_seqs), {}).update(result)
    record.save(args.out, None, data)  # bench.engine.whatif renders them
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
