"""The gate's fair shares on the prefill-heavy engine: a bursting tenant beside a steady one.

Tenant A sends at ``--burst`` times the sustained rate, tenant B a steady ``--steady`` times it,
both open loop (Poisson arrivals, nothing retried), for ``--duration`` seconds, through a fresh
``kvtax serve --gate.mode=MODE`` (``--gate-mode``, adaptive unless told) each run. Four runs
on one engine:

- ``b-alone``: B's arrivals only, as the reference of what B gets from this engine;
- ``reserve``: both tenants, with ``--gate.fairness-header=x-tenant --gate.fair-reserve=true``:
  the keys round-robin, and a key with requests in flight leaves a slot free for the other
  while that one has none;
- ``fair``: both tenants, with ``--gate.fairness-header=x-tenant``: the queue serves the keys
  round-robin;
- ``unfair``: both tenants, the same gate without the header: one FIFO queue.

The target (issue 44): with fairness on, B's SLO goodput is at least 90 % of B alone. SLO
goodput counts the completion tokens of requests that completed with a first token within
``--slo-ttft`` and no gap between chunks over ``--slo-gap``, received in the window, per second.
B's requests and A's draw their sizes from the same workload, from separate seeds.

    flock /tmp/kvtax-e2e.lock .venv/bin/python -m bench.gate.fair --rate 0.861 \\
        --out bench/results/gate-fair.md
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from bench import record
from bench.gate.arrivals import WORKLOADS, Spec, open_loop_plan
from bench.gate.client import open_loop
from bench.gate.engines import SHARED, make_engine
from bench.gate.gate import STALL_S
from bench.gate.gate import parser as gate_parser
from bench.gate.stats import Record, Summary, summarize
from kvtax_dev.testbed import VllmEngine
from kvtax_dev.testbed.engine import BLOCK_SIZE_TOKENS
from kvtax_dev.testbed.prefill_model import PREFILL_HEAVY_NAME
from kvtax_dev.testbed.sidecar import KvtaxProcess

TENANT_HEADER = "x-tenant"
# B's figure with fairness on, against B alone, that the issue asks for.
TARGET = 0.9
RUNS = ("b-alone", "reserve", "fair", "unfair")
# The runs with fairness on, each held to the target.
FAIR_RUNS = ("reserve", "fair")


def progress(message: str) -> None:
    print(f"bench.gate.fair: {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Tenant:
    name: str
    multiple: float  # of the sustained rate
    seed: int


def tenant_specs(tenants: Sequence[Tenant], rate: float, duration: float) -> list[Spec]:
    """Every tenant's arrivals in one schedule, by time; a spec's index says whose it is
    (A's from 0, B's from 100,000), so that the records can be told apart afterwards."""
    workload = WORKLOADS["long"]
    specs: list[Spec] = []
    for n, tenant in enumerate(tenants):
        for spec in open_loop_plan(tenant.multiple * rate, duration, workload, tenant.seed):
            specs.append(replace(spec, index=n * 100_000 + spec.index))
    return sorted(specs, key=lambda s: s.at)


def tenant_of(index: int, tenants: Sequence[Tenant]) -> str:
    return tenants[index // 100_000].name


@dataclass
class RunResult:
    run: str
    tenants: dict[str, Summary]
    rejections: dict[str, float]


def run(
    name: str,
    engine: VllmEngine,
    tenants: Sequence[Tenant],
    args: argparse.Namespace,
) -> RunResult:
    """One run through a fresh kvtax gate; B alone when ``tenants`` is B only."""
    progress(f"{name}: {', '.join(f'{t.name} at {t.multiple:g}x' for t in tenants)}...")
    engine.wait_idle(timeout=300)
    flags = [
        f"--gate.mode={args.gate_mode}",
        f"--gate.block-size={BLOCK_SIZE_TOKENS}",
        f"--gate.max-model-len={args.max_model_len}",
        f"--gate.max-queue={args.gate_max_queue}",
        f"--gate.max-wait={args.gate_max_wait}",
    ]
    if name != "unfair":
        flags.append(f"--gate.fairness-header={TENANT_HEADER}")
    if name == "reserve":
        flags.append("--gate.fair-reserve=true")
    specs = tenant_specs(tenants, args.rate, args.duration)

    def headers(spec: Spec) -> Mapping[str, str]:
        return {TENANT_HEADER: tenant_of(spec.index, tenants)}

    with KvtaxProcess(
        engine.url, proxy=True, scrape_interval="1s", window="60s", extra_args=flags
    ) as kvtax:
        kvtax.wait_for(lambda m: m.get("kvtax_vllm_up") == 1.0, what="first scrape")
        assert kvtax.proxy_url is not None
        records, cutoff = asyncio.run(
            open_loop(
                kvtax.proxy_url,
                specs,
                f"fair/{name}/{args.seed}",
                PREFILL_HEAVY_NAME,
                duration=args.duration,
                drain=args.drain,
                headers=headers,
            )
        )
        time.sleep(2.5)  # two more scrapes: the gate's counters hold the whole run
        page = kvtax.metrics()
    by_tenant: dict[str, list[Record]] = {}
    for seen in records:
        by_tenant.setdefault(tenant_of(seen.index, tenants), []).append(seen)
    summaries = {
        tenant: summarize(
            rs,
            window=args.duration,
            cutoff=cutoff,
            slo_ttft=args.slo_ttft,
            slo_gap=args.slo_gap,
            stall=STALL_S,
        )
        for tenant, rs in sorted(by_tenant.items())
    }
    for tenant, s in summaries.items():
        progress(
            f"{name}: tenant {tenant}: {s.offered} offered, {s.admitted} admitted, "
            f"{s.slo_met} met the SLO, SLO goodput {s.slo_goodput_tps:.1f} tok/s"
        )
    rejections = {
        key.split('"')[1]: value
        for key, value in page.items()
        if key.startswith("kvtax_gate_rejections_total{")
    }
    return RunResult(name, summaries, rejections)


def render(results: Sequence[RunResult], args: argparse.Namespace, started: str) -> str:
    by_run = {r.run: r for r in results}
    alone = by_run["b-alone"].tenants["b"].slo_goodput_tps
    lines = [
        "# The gate's fair shares: a bursting tenant beside a steady one (bench/gate/fair.py)",
        "",
        f"Run on {started} UTC. Engine: the prefill-heavy random Llama of bench/gate/gate.py, KV "
        f"pool {args.blocks * BLOCK_SIZE_TOKENS:,} tokens, `--max-model-len "
        f"{args.max_model_len}`. Sustained rate {args.rate:.3f} requests/s (given). Tenant A "
        f"at {args.burst:g}x it, tenant B at {args.steady:g}x, open loop for "
        f"{args.duration:g} s, long workload (800-1500-token prompts, 64-256 output tokens). "
        f"Gate: `--gate.mode={args.gate_mode} --gate.max-queue={args.gate_max_queue} "
        f"--gate.max-wait={args.gate_max_wait}`, with `--gate.fairness-header={TENANT_HEADER}` "
        "except in the unfair run, and `--gate.fair-reserve=true` in the reserve run. "
        "SLO: first token within "
        f"{args.slo_ttft:g} s and no gap over {args.slo_gap:g} s.",
        "",
        "```",
        "flock /tmp/kvtax-e2e.lock .venv/bin/python -m bench.gate.fair " + " ".join(args.argv),
        "```",
        "",
        _table(results, alone),
        "",
    ]
    for name in (n for n in FAIR_RUNS if n in by_run):
        fair = by_run[name].tenants["b"].slo_goodput_tps
        verdict = "met" if alone and fair >= TARGET * alone else "missed"
        lines.append(
            f"Target, {name} run: B's SLO goodput >= {TARGET:.0%} of B alone: **{verdict}** "
            f"({fair:.1f} against {alone:.1f} tok/s)."
        )
    lines += [
        "",
        "Gate rejections by reason: "
        + "; ".join(
            f"{r.run}: " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(r.rejections.items()) if v)
            for r in results
        ),
    ]
    return "\n".join(lines) + "\n"


def _table(results: Sequence[RunResult], alone: float) -> str:
    """Each run's tenants: what they offered, what got in, and B's share of B alone."""
    header = ["run", "tenant", "offered", "admitted", "429", "met SLO", "SLO goodput tok/s"]
    header += ["TTFT p50 / p99 s", "of B alone"]
    rows = []
    for r in results:
        for tenant, s in r.tenants.items():
            share = f"{100 * s.slo_goodput_tps / alone:.0f} %" if tenant == "b" and alone else ""
            counts = [s.offered, s.admitted, s.refused_429, s.slo_met]
            ttft = f"{_s(s.ttft_p50)} / {_s(s.ttft_p99)}"
            rows.append([r.run, tenant, *map(str, counts), f"{s.slo_goodput_tps:.1f}", ttft, share])
    return record.table(header, rows)


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench.gate.fair",
        description="The gate's fair shares: tenant A bursting beside a steady tenant B, "
        "with fairness on, off, and B alone.",
    )
    p.add_argument("--rate", type=float, required=True, help="Sustained rate, requests/s.")
    p.add_argument("--burst", type=float, default=4.0, help="A's multiple (default 4).")
    p.add_argument("--steady", type=float, default=0.3, help="B's multiple (default 0.3).")
    p.add_argument("--duration", type=float, default=60.0, help="Seconds of arrivals.")
    p.add_argument("--drain", type=float, default=30.0, help="Seconds to finish after.")
    p.add_argument("--seed", type=int, default=25, help="A's seed; B's is seed + 1.")
    p.add_argument("--runs", default=",".join(RUNS), help=f"Runs (default {','.join(RUNS)}).")
    p.add_argument("--slo-ttft", type=float, default=2.0, help="SLO first token, seconds.")
    p.add_argument("--slo-gap", type=float, default=0.5, help="SLO gap, seconds.")
    p.add_argument("--blocks", type=int, default=32, help="KV pool, blocks of 128 tokens.")
    p.add_argument("--max-model-len", type=int, default=2048, help="vLLM --max-model-len.")
    p.add_argument(
        "--gate-mode",
        default="adaptive",
        choices=("adaptive", "auto", "budget"),
        help="--gate.mode of every run (default adaptive).",
    )
    p.add_argument("--gate-max-queue", type=int, default=8, help="--gate.max-queue.")
    p.add_argument("--gate-max-wait", default="5s", help="--gate.max-wait.")
    p.add_argument("--out", type=Path, help="Markdown to write (and .json beside it).")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    args.argv = argv
    runs = [r for r in args.runs.split(",") if r]
    if set(runs) - set(RUNS) or "b-alone" not in runs:
        print(
            f"bench.gate.fair: --runs takes {', '.join(RUNS)}, b-alone among them", file=sys.stderr
        )
        return 2
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M")
    engine_args = gate_parser().parse_args(
        [f"--blocks={args.blocks}", f"--max-model-len={args.max_model_len}"]
    )
    a, b = Tenant("a", args.burst, args.seed), Tenant("b", args.steady, args.seed + 1)
    progress("starting the engine...")
    results = []
    with make_engine(engine_args, SHARED, None) as engine:
        for name in runs:
            tenants = [b] if name == "b-alone" else [a, b]
            results.append(run(name, engine, tenants, args))
    text = render(results, args, started)
    print(text)
    if args.out is not None:
        raw = {r.run: {t: asdict(s) for t, s in r.tenants.items()} for r in results}
        record.save(args.out, text, raw)
    return 0


if __name__ == "__main__":
    sys.exit(main())
