"""The gate where preemption hurts: open-loop overload, beside vLLM's caps and GIE's rule.

Issue 25. The engine is the testbed's prefill-heavy random Llama (float32; one 1,000-token
prefill costs ~34 decode steps, bench/results/prefill-ratio.md) on a KV pool of ``--blocks``
blocks of 128 tokens (default 32: 4,096 tokens), ``--max-model-len`` 2,048. Requests are
streamed completions of random token ids (``--workload long``: 800-1,500 prompt tokens,
64-256 output tokens with ``ignore_eos``; ``mixed``: half of them 32-128-token prompts).

1. **The sustained rate.** Closed loop, straight to vLLM, at the concurrency the pool holds
   without preemption (requests of the workload's largest size that fit: 2 by default), for
   ``--rate-duration`` seconds: completions per second. ``--rate R`` skips it.
2. **Open-loop overload.** For each ``--load`` multiple, Poisson arrivals at load x rate for
   ``--duration`` seconds (``--seed``; the same arrival times and sizes in every arm). A 429 or
   503 is recorded (with its time to refusal and Retry-After) and not retried. After the window
   the requests in flight get ``--drain`` more seconds, then are cancelled. ``--loop closed``
   runs load x that concurrency closed-loop clients instead, which retry a refusal after its
   Retry-After (1 s without one, at most 5 s).
3. **Arms** (``--arms``, default all seven), each through a fresh ``kvtax serve`` proxy:
   ``no-gate``; ``vllm-max-num-seqs`` and ``vllm-max-num-queued-reqs`` at kvtax's
   ``kvtax_recommended_max_num_seqs`` (read after the first no-gate arm, or ``--recommended``),
   each on its own restarted engine; ``gie-saturation``, GIE's saturation rule in a bench proxy
   in front of kvtax's (bench/gate/gie.py); ``kvtax-budget``, ``kvtax-auto``,
   ``kvtax-adaptive``: kvtax's gate in that mode, once per ``--orders`` entry (the mixed
   workload compares ``fifo`` with ``shortest``). Arms without a vLLM flag share one engine.

Per arm: vLLM's preemptions, the tax from kvtax's counters (measured by kvtax's plugin when
the engine loads it), delivered throughput and SLO goodput (tokens clients received during
the window, of all requests / of requests with TTFT <= ``--slo-ttft`` and every gap between
chunks <= ``--slo-gap``), TTFT p50/p99 of admitted requests (and p99 of the long ones), the
worst gap, the share shed, time to refusal p50/p99, Retry-After on every 429, and kvtax's gate
rejections by reason as its metrics label them. Then the best kvtax arm against the issue's
targets, computed from those numbers. Markdown into ``--out`` and JSON beside it.

Run from the repository root under the end-to-end lock; ``--dry-run`` prints the plan::

    flock /tmp/kvtax-e2e.lock .venv/bin/python -m bench.gate --out bench/results/gate.md
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import math
import os
import platform
import shlex
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench import record
from bench.gate import client, engines
from bench.gate.arrivals import (
    WORKLOADS,
    Spec,
    Workload,
    closed_loop_specs,
    held_concurrency,
    open_loop_plan,
)
from bench.gate.stats import (
    ArmResult,
    Record,
    against_targets,
    arm_table,
    by_length_table,
    loads_of,
    summarize,
    targets_table,
)
from kvtax_dev.exposition import read_series
from kvtax_dev.testbed import VllmEngine
from kvtax_dev.testbed.engine import BLOCK_SIZE_TOKENS, ensure_vllm_venv
from kvtax_dev.testbed.prefill_model import (
    PREFILL_HEAVY_NAME,
)
from kvtax_dev.testbed.sidecar import KvtaxProcess

ALL_ARMS = (
    "no-gate",
    "vllm-max-num-seqs",
    "vllm-max-num-queued-reqs",
    "gie-saturation",
    "kvtax-budget",
    "kvtax-auto",
    "kvtax-adaptive",
)
STALL_S = 1.0
# Guesses for --dry-run's time estimate only.
ENGINE_START_S = 90.0
ARM_OVERHEAD_S = 15.0
WARMUP_REQUEST_S = 15.0  # one warm-up request, about one service time
WARMUP_TIMEOUT_S = 120.0  # fails a hung warm-up; not a measurement


def progress(message: str) -> None:
    print(f"bench.gate: {message}", file=sys.stderr, flush=True)


# -- the plan ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArmPlan:
    """One arm: its name, the engine it needs, and kvtax's gate flags (None: gate off)."""

    name: str
    engine: str
    mode: str | None = None
    order: str = "fifo"
    gie: bool = False


def plan_arms(arms: Sequence[str], orders: Sequence[str]) -> list[ArmPlan]:
    """The arms in running order: no-gate first (the recommendation comes from it), then the
    rest of the shared engine's, then the restarted engines'."""
    unknown = [a for a in arms if a not in ALL_ARMS]
    if unknown:
        raise ValueError(f"unknown arm(s) {', '.join(unknown)}; known: {', '.join(ALL_ARMS)}")
    plans: list[ArmPlan] = []
    for name in ALL_ARMS:  # the canonical order, whatever order --arms lists them in
        if name not in arms:
            continue
        if name.startswith("kvtax-"):
            mode = name.removeprefix("kvtax-")
            for order in orders:
                label = name if order == "fifo" else f"{name}-{order}"
                plans.append(ArmPlan(label, engines.SHARED, mode=mode, order=order))
        else:
            plans.append(
                ArmPlan(
                    name, engines.ENGINE_OF.get(name, engines.SHARED), gie=name == "gie-saturation"
                )
            )
    shared = [p for p in plans if p.engine == engines.SHARED]
    return shared + [p for p in plans if p.engine != engines.SHARED]


def gate_flags(plan: ArmPlan, args: argparse.Namespace) -> list[str]:
    if plan.mode is None:
        return []
    return [
        f"--gate.mode={plan.mode}",
        f"--gate.order={plan.order}",
        f"--gate.block-size={BLOCK_SIZE_TOKENS}",
        f"--gate.max-model-len={args.max_model_len}",
        f"--gate.max-queue={args.gate_max_queue}",
        f"--gate.max-wait={args.gate_max_wait}",
        *shlex.split(args.gate_extra),
    ]


def estimate_seconds(plans: Sequence[ArmPlan], args: argparse.Namespace) -> float:
    """A rough guess of the run's length: engine starts, the rate, and every arm at every
    load (its window, half its drain, kvtax's start and the settling around it)."""
    kinds = {p.engine for p in plans}
    if args.rate is None:
        kinds.add(engines.SHARED)  # the rate is measured on the shared engine
    rate = 0.0 if args.rate is not None else float(args.rate_duration) + ARM_OVERHEAD_S
    warm: float = WARMUP_REQUEST_S * args.warmup
    per_arm = float(args.duration) + float(args.drain) / 2 + ARM_OVERHEAD_S + warm
    return len(kinds) * ENGINE_START_S + rate + len(plans) * len(args.loads) * per_arm


# -- one arm ----------------------------------------------------------------------------------


@dataclass
class Load:
    """One load level: its multiple, the offered rate, and the requests (open loop)."""

    multiple: float
    rate: float
    specs: list[Spec] = field(default_factory=list)
    clients: int = 0


def drive(url: str, load: Load, salt: str, args: argparse.Namespace) -> tuple[list[Record], float]:
    if args.loop == "open":
        return asyncio.run(
            client.open_loop(
                url,
                load.specs,
                salt,
                PREFILL_HEAVY_NAME,
                duration=args.duration,
                drain=args.drain,
            )
        )
    return asyncio.run(
        client.closed_loop(
            url,
            load.clients,
            closed_loop_specs(WORKLOADS[args.workload], args.seed),
            salt,
            PREFILL_HEAVY_NAME,
            duration=args.duration,
            drain=args.drain,
        )
    )


async def warm_up(url: str, workload: Workload, salt: str, count: int) -> list[Record]:
    """``count`` requests of the workload's sizes through ``url``, one after another, before
    the window. A kvtax gate foretells a wait once SERVICE_ENOUGH (3) requests have left it;
    a gate that has run for a while has, so the window measures the gate as it runs, not its
    first seconds after a start (a run with --warmup 0 shows those)."""
    sizes = closed_loop_specs(workload, 0)
    done: list[Record] = []
    async with client.new_session() as session:
        t0 = time.monotonic()
        for _ in range(count):
            spec = next(sizes)
            rec = client.new_record(spec, time.monotonic() - t0)
            body = client.request_body(spec, f"{salt}/warm-up", PREFILL_HEAVY_NAME)
            await asyncio.wait_for(client.attempt(session, url, body, rec, t0), WARMUP_TIMEOUT_S)
            done.append(rec)
    return done


def run_arm(
    plan: ArmPlan, engine: VllmEngine, load: Load, args: argparse.Namespace, note: str
) -> tuple[ArmResult, dict[str, float]]:
    progress(f"arm {plan.name} at {load.multiple:g}x ({load.rate:.3f} req/s offered)...")
    engine.wait_idle(timeout=300)
    salt = f"{plan.name}/{load.multiple:g}/{args.seed}"
    if args.warmup:
        note = (f"{note}; " if note else "") + f"{args.warmup} warm-up requests before the window"
    with KvtaxProcess(
        engine.url,
        proxy=True,
        scrape_interval="1s",
        window="60s",
        extra_args=gate_flags(plan, args),
    ) as kvtax:
        kvtax.wait_for(lambda m: m.get("kvtax_vllm_up") == 1.0, what="first scrape")
        assert kvtax.proxy_url is not None
        workload = WORKLOADS[args.workload]

        def warmed(url: str) -> tuple[str, float, float]:
            """Warm ``url`` up, wait for the engine to idle, then read the counters the arm
            starts from: kvtax's page, vLLM's preemptions and prefix-cache hits."""
            asyncio.run(warm_up(url, workload, salt, args.warmup))
            engine.wait_idle(timeout=300)
            return (kvtax.metrics_text(), *engines.engine_counters(engine))

        extra: dict[str, Any] = {}
        if plan.gie:
            with engines.gie_proxy(kvtax.proxy_url, engine, args) as url:
                text0, pre0, hits0 = warmed(url)
                records, cutoff = drive(url, load, salt, args)
                extra = engines.gie_stats(url)
        else:
            text0, pre0, hits0 = warmed(kvtax.proxy_url)
            records, cutoff = drive(kvtax.proxy_url, load, salt, args)
        time.sleep(2.5)  # two more scrapes, so kvtax's counters hold the whole arm
        text1 = kvtax.metrics_text()
        pre1, hits1 = engines.engine_counters(engine)
    before, after = read_series(text0), read_series(text1)
    tax, method = engines.tax_between(before, after)
    if extra:
        polls = max(1, int(extra.get("polls", 0)))
        note = (
            f"{note}; " if note else ""
        ) + f"saturated in {100 * extra.get('saturated_polls', 0) / polls:.0f} % of {polls} polls"
    result = ArmResult(
        arm=plan.name,
        load=load.multiple,
        rate=load.rate,
        loop=args.loop,
        summary=summarize(
            records,
            window=args.duration,
            cutoff=cutoff,
            slo_ttft=args.slo_ttft,
            slo_gap=args.slo_gap,
            stall=STALL_S,
        ),
        preemptions=pre1 - pre0,
        tax=tax,
        tax_method=method,
        prefix_cache_hits=hits1 - hits0,
        rejections=engines.rejections_between(text0, text1),
        note=note,
        requests=[r.row() for r in records],
    )
    s = result.summary
    progress(
        f"arm {plan.name} at {load.multiple:g}x: {s.offered} offered, {s.admitted} admitted, "
        f"{s.completed} completed, {s.refused_429} x 429, {s.refused_503} x 503, "
        f"{result.preemptions:.0f} preemptions, delivered {s.delivered_tps:.1f} tok/s, "
        f"SLO goodput {s.slo_goodput_tps:.1f} tok/s"
    )
    return result, after


# -- the sustained rate -----------------------------------------------------------------------


@dataclass
class RateMeasurement:
    concurrency: int
    seconds: float
    completions: int
    rate: float
    preemptions: float
    measured: bool = True


def measure_rate(
    engine: VllmEngine, args: argparse.Namespace, workload: Workload
) -> RateMeasurement:
    held = held_concurrency(workload, args.blocks, BLOCK_SIZE_TOKENS)
    progress(f"measuring the sustained rate: {held} closed-loop clients, {args.rate_duration:g} s")
    engine.wait_idle(timeout=300)
    # Warm-up: the first requests pay one-off costs.
    asyncio.run(
        client.closed_loop(
            engine.url,
            1,
            closed_loop_specs(workload, args.seed + 1),
            "warm-up",
            PREFILL_HEAVY_NAME,
            duration=0.1,
            drain=120,
        )
    )
    pre0, _ = engines.engine_counters(engine)
    records, _ = asyncio.run(
        client.closed_loop(
            engine.url,
            held,
            closed_loop_specs(workload, args.seed + 2),
            "rate",
            PREFILL_HEAVY_NAME,
            duration=args.rate_duration,
            drain=0.0,
        )
    )
    pre1, _ = engines.engine_counters(engine)
    done = sum(1 for r in records if r.completed and r.events[-1][0] <= args.rate_duration)
    rate = done / args.rate_duration
    progress(f"sustained rate {rate:.3f} req/s ({done} completions, {pre1 - pre0:.0f} preemptions)")
    return RateMeasurement(held, args.rate_duration, done, rate, pre1 - pre0)


def make_loads(rate: float, args: argparse.Namespace, workload: Workload) -> list[Load]:
    held = held_concurrency(workload, args.blocks, BLOCK_SIZE_TOKENS)
    loads = []
    for multiple in args.loads:
        offered = multiple * rate
        if args.loop == "open":
            specs = open_loop_plan(offered, args.duration, workload, args.seed)
            loads.append(Load(multiple, offered, specs=specs))
        else:
            clients = args.clients or max(1, math.ceil(multiple * held))
            loads.append(Load(multiple, 0.0, clients=clients))
    return loads


# -- the report -------------------------------------------------------------------------------


def vllm_version() -> str:
    with contextlib.suppress(Exception):
        venv = ensure_vllm_venv()
        for info in sorted(venv.glob("lib/python*/site-packages/vllm*.dist-info")):
            return info.name.removesuffix(".dist-info").replace("-", " ").replace("_", "-")
    return "vLLM (version unknown)"


def render(data: dict[str, Any]) -> str:
    """The markdown report from the JSON the run saves."""
    meta = data["meta"]
    rate = data["rate"]
    arms = [ArmResult.from_json(a) for a in data["arms"]]
    workload = WORKLOADS[meta["workload"]]
    how = (
        f"measured: {rate['completions']} completions in {rate['seconds']:g} s of "
        f"{rate['concurrency']} closed-loop clients straight to vLLM, "
        f"{rate['preemptions']:.0f} preemptions"
        if rate.get("measured")
        else "given with --rate"
    )
    if meta["loop"] == "open":
        loop = (
            f"Open loop: Poisson arrivals at load x the sustained rate for {meta['duration']:g} s "
            f"(seed {meta['seed']}), the same arrival times and sizes in every arm; a 429 or 503 "
            "is not retried"
        )
    else:
        loop = (
            f"Closed loop: load x {rate['concurrency']} clients for {meta['duration']:g} s, each "
            "retrying a refusal after its Retry-After (1 s without one, at most 5 s)"
        )
    lines = [
        "# The gate against vLLM's caps and GIE's saturation rule (bench/gate/gate.py, issue 25)",
        "",
        f"Run on {meta['date']} on {meta['host']}. Engine: {meta['engine']} on the "
        f"prefill-heavy random Llama (`{PREFILL_HEAVY_NAME}`, float32), KV pool "
        f"{meta['blocks'] * BLOCK_SIZE_TOKENS:,} tokens ({meta['blocks']} blocks of "
        f"{BLOCK_SIZE_TOKENS}), `--max-model-len {meta['max_model_len']}`, "
        f"`--max-num-seqs {engines.DEFAULT_MAX_NUM_SEQS}` unless the arm sets a cap"
        + (f", extra engine flags `{' '.join(meta['engine_args'])}`" if meta["engine_args"] else "")
        + ".",
        f"Workload ({meta['workload']}): {workload.describe()}, random token ids (fresh in every "
        f"arm, so no arm prefills from another's prefix cache). {loop}. After the "
        f"window, requests in flight get {meta['drain']:g} s more, then are cancelled "
        "(*unfinished*).",
        f"Sustained rate: **{rate['rate']:.3f} requests/s** ({how}). kvtax's recommendation "
        f"(`kvtax_recommended_max_num_seqs`): **{data.get('recommended')}** "
        f"({data.get('recommended_source', 'n/a')}), used by both vLLM cap arms.",
        f"Gate flags of the kvtax arms: `{' '.join(meta['gate_flags'])}`. The GIE arm's proxy "
        f"polls vLLM's /metrics every {meta['gie_poll']:g} s"
        + (f" (stale after {meta['gie_stale']:g} s)" if meta.get("gie_stale") else "")
        + " and sheds with 429 when KV usage >= 0.8 or waiting >= 5. Every arm's requests pass "
        "a fresh `kvtax serve` proxy (gate off but in the kvtax arms).",
        f"Delivered throughput and SLO goodput count the completion tokens clients received "
        f"during the {meta['duration']:g} s window, per second; SLO goodput only of requests "
        f"that completed with TTFT <= {meta['slo_ttft']:g} s and every gap between chunks <= "
        f"{meta['slo_gap']:g} s. TTFT is of admitted requests (not refused); '≥' marks a "
        "quantile that fell on an unfinished request's wait so far. Worst gap and gaps > 1 s: "
        "between chunks of admitted streams. Shed: refused attempts / attempts. Raw numbers: "
        f"[{meta['json']}]({meta['json']}).",
        "",
        "```",
        *meta["commands"],
        "```",
    ]
    for multiple in loads_of(arms):
        here = [a for a in arms if a.load == multiple]
        offered = here[0].rate
        heading = f"## {multiple:g}x"
        if meta["loop"] == "open":
            heading += f": {offered:.3f} requests/s offered, {here[0].summary.offered} requests"
        lines += ["", heading, "", arm_table(here)]
        apart = by_length_table(here)
        if apart is not None:
            lines += ["", "Long and short prompts apart (TTFT of those that had a first token):"]
            lines += ["", apart]
        notes = [f"- {a.arm}: {a.note}" for a in here if a.note]
        if notes:
            lines += ["", *notes]
        best, checks = against_targets(here, stall_limit=STALL_S)
        lines += ["", f"### Against the targets at {multiple:g}x", "", targets_table(best, checks)]
    lines.append("")
    return "\n".join(lines)


def _arm_key(a: dict[str, Any]) -> tuple[str, float]:
    return a["arm"], a["load"]


# -- the command line -------------------------------------------------------------------------


def _floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a comma list of numbers: {text!r}") from exc
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError("need one or more positive numbers")
    return values


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench.gate",
        description=(__doc__ or "").split("\n\n")[0],
    )
    p.add_argument(
        "--arms",
        default=",".join(ALL_ARMS),
        help="Comma list of arms to run (default: all): " + ", ".join(ALL_ARMS) + ".",
    )
    p.add_argument(
        "--orders",
        default=None,
        help="Comma list of --gate.order values each kvtax arm runs with (fifo, shortest); "
        "default fifo, or fifo,shortest with --workload mixed.",
    )
    p.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        default="long",
        help="Request mix (default %(default)s).",
    )
    p.add_argument(
        "--loop",
        choices=("open", "closed"),
        default="open",
        help="Open loop (Poisson arrivals, no retries) or closed loop (clients that retry); "
        "default %(default)s.",
    )
    p.add_argument(
        "--load",
        dest="loads",
        type=_floats,
        default=[2.0, 4.0],
        help="Comma list of multiples of the sustained rate (closed loop: of its concurrency); "
        "default 2,4.",
    )
    p.add_argument(
        "--duration",
        type=float,
        default=60.0,
        help="Seconds of arrivals per arm (default %(default)g).",
    )
    p.add_argument(
        "--drain",
        type=float,
        default=30.0,
        help="Seconds requests in flight get after the window before they are cancelled "
        "(default %(default)g).",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=3,
        help="Requests sent one at a time through each arm's front door before its window, "
        "not counted (default %(default)s): kvtax's gate foretells waits once 3 requests "
        "have left it. 0 measures the gate's first seconds after a start.",
    )
    p.add_argument(
        "--seed", type=int, default=25, help="Seed of arrivals and sizes (default %(default)s)."
    )
    p.add_argument(
        "--rate",
        type=float,
        default=None,
        help="Sustained rate in requests/s; skips measuring it.",
    )
    p.add_argument(
        "--rate-duration",
        type=float,
        default=60.0,
        help="Seconds of the closed-loop measurement of the sustained rate (default %(default)g).",
    )
    p.add_argument(
        "--clients",
        type=int,
        default=None,
        help="Closed loop: clients per arm (default: load x the concurrency the pool holds).",
    )
    p.add_argument(
        "--recommended",
        type=int,
        default=None,
        help="The vLLM cap arms' number, instead of kvtax's recommendation after no-gate.",
    )
    p.add_argument(
        "--slo-ttft",
        type=float,
        default=2.0,
        help="SLO: most seconds to first token (default %(default)g).",
    )
    p.add_argument(
        "--slo-gap",
        type=float,
        default=0.5,
        help="SLO: most seconds between two chunks (default %(default)g).",
    )
    p.add_argument(
        "--blocks",
        type=int,
        default=32,
        help="KV pool, in blocks of 128 tokens (default %(default)s).",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=2048,
        help="vLLM --max-model-len (default %(default)s).",
    )
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="An extra vLLM flag for every engine, repeatable; write values with '=' "
        "(--engine-arg=--max-num-batched-tokens=512).",
    )
    p.add_argument(
        "--gate-max-queue",
        type=int,
        default=4,
        help="The kvtax arms' --gate.max-queue (default %(default)s).",
    )
    p.add_argument(
        "--gate-max-wait",
        default="30s",
        help="The kvtax arms' --gate.max-wait, a duration (default %(default)s).",
    )
    p.add_argument(
        "--gate-extra",
        default="",
        help="More kvtax serve flags for the kvtax arms, one shell-quoted string.",
    )
    p.add_argument(
        "--gie-poll",
        type=float,
        default=0.1,
        help="Seconds between the GIE proxy's polls of vLLM's /metrics (default %(default)g).",
    )
    p.add_argument(
        "--gie-stale",
        type=float,
        default=None,
        help="The GIE proxy counts a reading older than this as saturated (default off).",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="Write the markdown report here and the raw JSON beside it (.json).",
    )
    p.add_argument(
        "--append",
        action="store_true",
        help="Keep the arms already in --out's JSON (the same arm and load is replaced), and "
        "reuse its sustained rate and recommendation unless given: to split the run over "
        "lock holds.",
    )
    p.add_argument(
        "--render",
        action="store_true",
        help="Only write --out's markdown again from its JSON.",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="Print the plan (arms, engines, schedules when --rate is given) and exit.",
    )
    return p


def dry_run(plans: Sequence[ArmPlan], args: argparse.Namespace, workload: Workload) -> str:
    held = held_concurrency(workload, args.blocks, BLOCK_SIZE_TOKENS)
    lines = [
        f"workload {workload.name}: {workload.describe()}",
        f"pool {args.blocks} x {BLOCK_SIZE_TOKENS} tokens; held concurrency {held}",
        f"loop {args.loop}, loads {', '.join(f'{x:g}x' for x in args.loads)}, "
        f"duration {args.duration:g} s, drain {args.drain:g} s, seed {args.seed}",
        "arms:",
    ]
    for plan in plans:
        flags = " ".join(gate_flags(plan, args)) or "gate off"
        where = (
            "shared engine" if plan.engine == engines.SHARED else f"engine with --{plan.engine} N"
        )
        lines.append(f"  {plan.name}: {where}; {flags}" + ("; GIE proxy" if plan.gie else ""))
    if args.rate is None:
        lines.append("rate: measured first (pass --rate to see the schedules)")
    else:
        for load in make_loads(args.rate, args, workload):
            if args.loop == "open":
                longs = sum(1 for s in load.specs if s.long)
                lines.append(
                    f"  {load.multiple:g}x: {load.rate:.3f} req/s, {len(load.specs)} requests "
                    f"({longs} long), first at "
                    + ", ".join(f"{s.at:.2f}" for s in load.specs[:5])
                    + " s"
                )
            else:
                lines.append(f"  {load.multiple:g}x: {load.clients} closed-loop clients")
    lines.append(f"estimated time: {estimate_seconds(plans, args) / 60:.0f} min")
    return "\n".join(lines)


def _exit_on_sigterm() -> None:
    """``kill`` ends a run as Ctrl-C does, through the ``with`` blocks that stop what it started.
    Each engine runs in a process group of its own, which a signal to this process misses: a
    killed run left its engine serving (seen: two prefill-heavy engines on two cores)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    _exit_on_sigterm()
    workload = WORKLOADS[args.workload]
    orders = (args.orders or ("fifo,shortest" if args.workload == "mixed" else "fifo")).split(",")
    plans = plan_arms([a for a in args.arms.split(",") if a], orders)
    saved = args.out.with_suffix(".json") if args.out is not None else None
    if args.render:
        if saved is None or not saved.exists():
            raise SystemExit("--render needs --out with a JSON beside it")
        record.save(args.out, render(json.loads(saved.read_text())), None)
        return 0
    if args.dry_run:
        print(dry_run(plans, args, workload))
        return 0

    earlier: dict[str, Any] = {}
    if args.append and saved is not None and saved.exists():
        earlier = json.loads(saved.read_text())
    rate_info: dict[str, Any] | None = None
    if args.rate is not None:
        rate_info = asdict(RateMeasurement(0, 0.0, 0, args.rate, 0.0, measured=False))
        rate_info["concurrency"] = held_concurrency(workload, args.blocks, BLOCK_SIZE_TOKENS)
    elif earlier.get("rate"):
        rate_info = earlier["rate"]
        progress(f"reusing the sustained rate {rate_info['rate']:.3f} req/s from {saved}")
    recommended = args.recommended or earlier.get("recommended")
    source = "--recommended" if args.recommended else earlier.get("recommended_source")
    results: list[ArmResult] = []
    command = ".venv/bin/python -m bench.gate " + shlex.join(
        sys.argv[1:] if argv is None else list(argv)
    )
    commands = [*earlier.get("meta", {}).get("commands", []), command]

    def report() -> str:
        """Write what ran so far (the JSON and the markdown), so a failed arm loses nothing."""
        assert rate_info is not None
        fresh = [asdict(r) for r in results]
        ran = {_arm_key(a) for a in fresh}
        kept = [a for a in earlier.get("arms", []) if _arm_key(a) not in ran]
        data = {
            "meta": run_meta(args, saved, commands),
            "rate": rate_info,
            "recommended": recommended,
            "recommended_source": source,
            "arms": kept + fresh,
        }
        text = render(data)
        if args.out is not None:
            record.save(args.out, text, data)
        return text

    shared = [p for p in plans if p.engine == engines.SHARED]
    if shared or rate_info is None:
        progress("starting the shared engine...")
        with engines.make_engine(args, engines.SHARED, None) as engine:
            if rate_info is None:
                rate_info = asdict(measure_rate(engine, args, workload))
            for load in make_loads(rate_info["rate"], args, workload):
                for plan in shared:
                    result, page = run_arm(plan, engine, load, args, "")
                    results.append(result)
                    if plan.name == "no-gate" and recommended is None:
                        recommended = engines.recommended_of(page)
                        source = f"after no-gate at {load.multiple:g}x"
                        progress(f"kvtax's recommendation: {recommended}")
                    report()
    assert rate_info is not None
    capped = [p for p in plans if p.engine != engines.SHARED]
    if capped and recommended is None:
        recommended = held_concurrency(workload, args.blocks, BLOCK_SIZE_TOKENS)
        source = "none read from kvtax: the concurrency the pool holds"
        progress(f"no recommendation from kvtax; the vLLM caps use {recommended}")
    for plan in capped:
        note = engines.engine_note(plan.engine, recommended)
        progress(f"starting an engine with {note}...")
        with engines.make_engine(args, plan.engine, recommended) as engine:
            for load in make_loads(rate_info["rate"], args, workload):
                results.append(run_arm(plan, engine, load, args, note)[0])
                report()
    print(report())
    return 0


def run_meta(args: argparse.Namespace, saved: Path | None, commands: list[str]) -> dict[str, Any]:
    """The report's header: when, where, the engine, the workload and the flags."""
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "host": f"{platform.node() or 'this host'} ({os.cpu_count()} cores, load average "
        f"{os.getloadavg()[0]:.1f} when written)",
        "engine": vllm_version(),
        "blocks": args.blocks,
        "max_model_len": args.max_model_len,
        "engine_args": args.engine_arg,
        "workload": args.workload,
        "loop": args.loop,
        "duration": args.duration,
        "drain": args.drain,
        "seed": args.seed,
        "slo_ttft": args.slo_ttft,
        "slo_gap": args.slo_gap,
        "gate_flags": gate_flags(ArmPlan("kvtax-MODE", engines.SHARED, mode="MODE"), args),
        "gie_poll": args.gie_poll,
        "gie_stale": args.gie_stale,
        "json": saved.name if saved is not None else "gate.json",
        "commands": commands,
    }


if __name__ == "__main__":
    sys.exit(main())
