"""``kvtax loadtest URL`` and ``kvtax annotate REPORT``: flags, progress, and the files written.

Bad input raises :class:`kvtax.errors.InputError`; :func:`kvtax.cli.main.main` prints it as one
line naming the field (``kvtax loadtest: <field>: <problem>``, or ``kvtax annotate: ...``) and
exits with status 2.
Ctrl-C stops a sweep or a recording cleanly: what was measured is written, and the exit status
is 130.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtax.figures.derive import EngineSettings
from kvtax.figures.window import Point
from kvtax.tools.loadtest.distributions import parse_distribution
from kvtax.tools.loadtest.measure import StepResult, engine_step
from kvtax.tools.loadtest.output import write_report
from kvtax.tools.loadtest.plan import MODES, LoadPlan, check_plan, parse_levels
from kvtax.tools.loadtest.table import loadtest_json, loadtest_table

if TYPE_CHECKING:  # the driver imports aiohttp: loaded at run time only by run_loadtest
    from kvtax.tools.loadtest.driver import Target

__all__ = ["add_parser", "run"]


def _err(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def add_parser(sub: Any, help: str) -> None:
    p = sub.add_parser(
        "loadtest",
        help=help,
        description="Step through concurrency (or request rate) against URL, read the server's "
        "vLLM metrics alongside, and report per step throughput, goodput, preemptions, the "
        "preemption tax, TTFT/ITL, stalls and KV usage, with the preemption and throughput "
        "knees. Ctrl-C stops and still writes what was measured.",
    )
    p.add_argument("url", metavar="URL", help="The server's base URL, e.g. http://127.0.0.1:8000.")
    p.add_argument(
        "--metrics-url", metavar="URL", help="vLLM's metrics page (default URL/metrics)."
    )
    p.add_argument("--model", help="Model name to request (default: the first of URL/v1/models).")
    p.add_argument(
        "--mode",
        choices=MODES,
        default="concurrency",
        help="Step through requests in flight, or arrivals per second (default concurrency).",
    )
    p.add_argument(
        "--levels",
        default="1,2,4,8,16,32",
        help="Load levels, rising: a list (1,2,4) or a range (1:8, 1:64:x2) "
        "(default 1,2,4,8,16,32).",
    )
    p.add_argument(
        "--step-duration",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="How long each level is held before the step drains (default 30).",
    )
    p.add_argument(
        "--prompt-tokens",
        default="uniform:64-256",
        metavar="DIST",
        help="Prompt length distribution: const:N, uniform:LO-HI, normal:MEAN,SD, "
        "lognormal:MEDIAN,SIGMA, pareto:MIN,ALPHA, each with an optional ,max=N "
        "(default uniform:64-256).",
    )
    p.add_argument(
        "--output-tokens",
        default="lognormal:200,0.8,max=1024",
        metavar="DIST",
        help="Output length distribution, as --prompt-tokens; the default is "
        "heavy-tailed (lognormal:200,0.8,max=1024).",
    )
    p.add_argument(
        "--scrape-interval",
        type=float,
        default=0.5,
        metavar="SECONDS",
        help="How often the metrics page is read during a step (default 0.5).",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="Longest wait for a step's requests in flight (default 120).",
    )
    p.add_argument(
        "--rest",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="Idle time between steps (default 1).",
    )
    p.add_argument(
        "--slo-ttft",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="TTFT SLO for SLO goodput (default 2, as kvtax serve).",
    )
    p.add_argument(
        "--slo-itl",
        type=float,
        default=0.2,
        metavar="SECONDS",
        help="Inter-token SLO, every gap, for SLO goodput (default 0.2).",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        metavar="N",
        help="The server's max_num_seqs, for the over-admission note.",
    )
    p.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Send vLLM's ignore_eos so outputs are as long as asked (default on; "
        "--no-ignore-eos for servers that refuse the field).",
    )
    p.add_argument("--seed", type=int, default=0, help="Seed of the lengths and prompts.")
    p.add_argument(
        "--out",
        type=Path,
        default=Path("kvtax-loadtest"),
        metavar="DIR",
        help="Where report.json, report.md and the PNG plots go (default kvtax-loadtest).",
    )


def _plan(args: argparse.Namespace) -> LoadPlan:
    return check_plan(
        LoadPlan(
            mode=args.mode,
            levels=parse_levels(args.levels, mode=args.mode, field="--levels"),
            step_seconds=args.step_duration,
            prompt_tokens=parse_distribution(args.prompt_tokens, field="--prompt-tokens"),
            output_tokens=parse_distribution(args.output_tokens, field="--output-tokens"),
            scrape_interval=args.scrape_interval,
            drain_seconds=args.drain_timeout,
            rest_seconds=args.rest,
            slo_ttft=args.slo_ttft,
            slo_itl=args.slo_itl,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
        )
    )


def run(args: argparse.Namespace) -> int:
    from kvtax.tools.loadtest import driver  # aiohttp loads only for the commands that use it

    # An InputError (a bad flag, an unreachable URL) reaches kvtax.cli.main: one line, exit 2.
    plan = _plan(args)
    target = asyncio.run(driver.check_target(args.url, args.metrics_url, args.model))
    settings = EngineSettings(configured_max_num_seqs=args.max_num_seqs)
    steps: list[StepResult] = []
    points: list[Point] = []
    interrupted = False
    _err(
        f"kvtax loadtest: {target.model} at {target.url}, metrics {target.metrics_url}; "
        f"{len(plan.levels)} steps of {plan.step_seconds:g} s"
    )
    try:
        points = asyncio.run(driver.run_sweep(plan, target, steps, _err, settings))
    except KeyboardInterrupt:
        interrupted = True
        _err(f"kvtax loadtest: stopped; writing the {len(steps)} step(s) measured")
    whole = engine_step(points, settings) if points else None
    report = loadtest_json(
        url=target.url,
        metrics_url=target.metrics_url,
        model=target.model,
        plan=plan,
        steps=steps,
        recommended_max_num_seqs=whole.recommended_max_num_seqs if whole else None,
        interrupted=interrupted,
    )
    table = loadtest_table(plan.mode, steps)
    intro = _intro(target, plan, report["recommendations"], args.max_num_seqs, interrupted)
    write_report(args.out, "report", report, title="kvtax load test", intro=intro, table=table)
    problem = _too_short(plan, steps)
    if problem:
        _err(problem)
        return 2
    return 130 if interrupted else 0


def _intro(
    target: Target,
    plan: LoadPlan,
    rec: dict[str, Any],
    max_num_seqs: int | None,
    interrupted: bool,
) -> list[str]:
    """The report's opening lines: what ran, what is recommended, and the server's setting."""
    intro = [
        f"{target.model} at {target.url}; {plan.mode} steps of {plan.step_seconds:g} s; "
        f"prompts {plan.prompt_tokens.describe()}, outputs {plan.output_tokens.describe()}.",
        "",
        f"Recommended: max_num_seqs {rec['max_num_seqs'] or '-'} (KV capacity x 0.9 / p95 "
        f"request length, as on the dashboard); gate cap {rec['gate_cap'] or '-'} requests in "
        "flight (the last level before preemption, at most the throughput knee's).",
    ]
    if max_num_seqs and rec["max_num_seqs"]:
        ratio = max_num_seqs / rec["max_num_seqs"]
        intro.append(
            f"\nThe server runs max_num_seqs {max_num_seqs}: {ratio:.1f} x the "
            "recommendation (over-admission above 1)."
        )
    if interrupted:
        intro.append("\nStopped by Ctrl-C: the steps after the last one shown were not run.")
    return intro


def _too_short(plan: LoadPlan, steps: list[StepResult]) -> str | None:
    """The error for the first step too short to measure, or None when every step measured.

    A step needs a finished request and two scrapes: its counters are differences.
    """
    bad = [s for s in steps if s.ok == 0 or s.engine.scrapes < 2]
    if not bad:
        return None
    s = bad[0]
    return (
        f"kvtax loadtest: --step-duration: step {s.index} ({plan.mode} {s.level:g}) is too short "
        f"to measure: {s.ok} request(s) finished, {s.engine.scrapes} scrape(s) in "
        f"{s.span:.1f} s" + (f" ({s.errors[0]})" if s.errors else "")
    )
