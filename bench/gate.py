"""The gate against vLLM's own knobs, side by side on the real CPU engine.

One run, five arms, the same offered load in each: ``--clients`` closed-loop clients (default
16) send ``--requests`` streamed generations of 41 prompt + 500 output tokens (``ignore_eos``)
through a fresh ``kvtax serve`` proxy. Each request needs 5 KV blocks of 128; the pool of 16
blocks holds three, so 16 clients offer over four times what it holds. A client that gets a 429
(kvtax's gate) or a 503 (vLLM's --max-num-queued-reqs) waits what Retry-After says (1 s without
one, at most 5 s) and tries again; its time to first token counts from its first attempt.

Arms:

1. ``no-gate``: vLLM as the testbed starts it (--max-num-seqs 64), kvtax's gate off;
2. ``vllm-max-num-seqs``: vLLM restarted with --max-num-seqs = kvtax's recommendation
   (``kvtax_recommended_max_num_seqs`` after arm 1);
3. ``vllm-max-num-queued-reqs``: vLLM restarted with --max-num-queued-reqs = the same number;
4. ``kvtax-auto`` and 5. ``kvtax-adaptive``: the engine of arm 1, the gate on;
6. ``kvtax-budget`` (not in the default five): the budget mode, on the same engine.

Per arm: vLLM's preemptions; the tax R / (Pc + G + R) from kvtax's counters over the arm, with
the measured recompute (kvtax's plugin) when the engine has it; TTFT p50/p99; the p99 of each
request's longest gap between chunks and the requests with a gap over 1 s; throughput
(generated tokens / s), delivered goodput (tokens of completed requests / s), SLO goodput
(tokens / s of requests with TTFT <= --slo-ttft and no gap over 1 s); 429s and 503s; the gate's
queue wait (mean and p99 from its histogram).

Run from the repository root under the end-to-end lock. All five arms take three engine starts
(about 8 minutes on a busy 2-core machine); to keep each lock hold short, run them in two::

    flock /tmp/kvtax-e2e.lock .venv/bin/python -m bench.gate --out bench/results/gate.md \\
        --arms no-gate,kvtax-auto,kvtax-adaptive
    flock /tmp/kvtax-e2e.lock .venv/bin/python -m bench.gate --out bench/results/gate.md \\
        --arms vllm-max-num-seqs,vllm-max-num-queued-reqs --append
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from kvtax_dev.exposition import read_series
from kvtax_dev.testbed import VllmEngine
from kvtax_dev.testbed.load import PROMPT
from kvtax_dev.testbed.sidecar import KvtaxProcess

MODEL = "tiny-llama"
STALL_S = 1.0


@dataclass
class Request:
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    completed: bool = False
    refused: dict[int, int] = field(default_factory=dict)


@dataclass
class ArmResult:
    name: str
    preemptions: float
    tax: float | None
    tax_method: str
    ttft_p50: float | None
    ttft_p99: float | None
    stall_p99: float | None
    stalled_requests: int
    throughput: float
    goodput: float
    slo_goodput: float
    completed: int
    refused_429: int
    refused_503: int
    queue_wait_mean: float | None
    queue_wait_p99: float | None
    wall: float
    note: str = ""


def _quantile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _body(max_tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }


async def _attempt(
    session: aiohttp.ClientSession, url: str, req: Request, began: float, max_tokens: int
) -> float | None:
    """One try; the seconds to wait before the next one, or None when done."""
    async with session.post(url + "/v1/completions", json=_body(max_tokens)) as resp:
        if resp.status in (429, 503):
            await resp.read()
            req.refused[resp.status] = req.refused.get(resp.status, 0) + 1
            after = resp.headers.get("Retry-After")
            return min(5.0, float(after)) if after else 1.0
        if resp.status != 200:
            await resp.read()
            return None
        last: float | None = None
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            now = time.monotonic()
            event = json.loads(line[6:])
            if event.get("usage"):
                req.tokens = event["usage"].get("completion_tokens", req.tokens)
            if not event.get("choices"):
                continue
            if req.ttft is None:
                req.ttft = now - began
            elif last is not None:
                req.gaps.append(now - last)
            last = now
        req.completed = True
        return None


async def _load(
    url: str, clients: int, requests: int, max_tokens: int
) -> tuple[list[Request], float]:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    done: list[Request] = []
    timeout = aiohttp.ClientTimeout(total=600)

    async def client() -> None:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while not queue.empty():
                queue.get_nowait()
                req, began = Request(), time.monotonic()
                while True:
                    wait = await _attempt(session, url, req, began, max_tokens)
                    if wait is None:
                        break
                    await asyncio.sleep(wait)
                done.append(req)

    started = time.monotonic()
    await asyncio.gather(*(client() for _ in range(clients)))
    return done, time.monotonic() - started


def _sum(page: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in page.items() if k == prefix or k.startswith(prefix + "{"))


def _tax(before: dict[str, float], after: dict[str, float]) -> tuple[float | None, str]:
    pc = _sum(after, "kvtax_engine_prompt_computed_tokens_total") - _sum(
        before, "kvtax_engine_prompt_computed_tokens_total"
    )
    g = _sum(after, "kvtax_engine_generation_tokens_total") - _sum(
        before, "kvtax_engine_generation_tokens_total"
    )
    for method in ("measured", "estimated"):
        name = f"kvtax_recomputed_tokens_{method}_total"
        if any(k.startswith(name) for k in after):
            r = _sum(after, name) - _sum(before, name)
            work = pc + g + r
            return (r / work if work > 0 else 0.0), method
    return None, "none"


def _wait_quantiles(page: dict[str, float]) -> tuple[float | None, float | None]:
    count = page.get("kvtax_gate_queue_wait_seconds_count")
    if not count:
        return None, None
    mean = page["kvtax_gate_queue_wait_seconds_sum"] / count
    buckets = sorted(
        (float(k.split('le="')[1].split('"')[0]), v)
        for k, v in page.items()
        if k.startswith("kvtax_gate_queue_wait_seconds_bucket")
    )
    p99 = next((le for le, n in buckets if n >= 0.99 * count), None)
    return mean, p99


def _preemptions(engine: VllmEngine) -> float:
    return _sum(read_series(engine.metrics_text()), "vllm:num_preemptions_total")


def run_arm(
    name: str,
    engine: VllmEngine,
    args: argparse.Namespace,
    gate: Sequence[str] = (),
    note: str = "",
) -> tuple[ArmResult, dict[str, float]]:
    with KvtaxProcess(
        engine.url, proxy=True, scrape_interval="1s", window="60s", extra_args=list(gate)
    ) as kvtax:
        kvtax.wait_for(lambda m: m.get("kvtax_vllm_up") == 1.0, what="first scrape")
        assert kvtax.proxy_url is not None
        before, p0 = kvtax.metrics(), _preemptions(engine)
        done, wall = asyncio.run(
            _load(kvtax.proxy_url, args.clients, args.requests, args.max_tokens)
        )
        time.sleep(2.5)  # two more scrapes, so kvtax's counters hold the whole arm
        after, p1 = kvtax.metrics(), _preemptions(engine)
    tax, method = _tax(before, after)
    ttfts = [r.ttft for r in done if r.ttft is not None]
    worst_gaps = [max(r.gaps, default=0.0) for r in done if r.completed]
    tokens = sum(r.tokens for r in done)
    good = sum(r.tokens for r in done if r.completed)
    slo = sum(
        r.tokens
        for r in done
        if r.completed
        and r.ttft is not None
        and r.ttft <= args.slo_ttft
        and max(r.gaps, default=0.0) <= STALL_S
    )
    mean, p99 = _wait_quantiles(after)
    result = ArmResult(
        name=name,
        preemptions=p1 - p0,
        tax=tax,
        tax_method=method,
        ttft_p50=_quantile(ttfts, 0.5),
        ttft_p99=_quantile(ttfts, 0.99),
        stall_p99=_quantile(worst_gaps, 0.99),
        stalled_requests=sum(1 for g in worst_gaps if g > STALL_S),
        throughput=tokens / wall,
        goodput=good / wall,
        slo_goodput=slo / wall,
        completed=sum(1 for r in done if r.completed),
        refused_429=sum(r.refused.get(429, 0) for r in done),
        refused_503=sum(r.refused.get(503, 0) for r in done),
        queue_wait_mean=mean,
        queue_wait_p99=p99,
        wall=wall,
        note=note,
    )
    print(f"{name}: {json.dumps(asdict(result))}", file=sys.stderr, flush=True)
    return result, after


def _fmt(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def table(results: Sequence[ArmResult]) -> str:
    head = (
        "| arm | preemptions | tax | TTFT p50 s | TTFT p99 s | p99 worst gap s | gaps > 1 s "
        "| throughput tok/s | goodput tok/s | SLO goodput tok/s | completed | 429 | 503 "
        "| queue wait mean / p99 s |\n|" + "---|" * 14
    )
    rows = [
        f"| {r.name} | {r.preemptions:.0f} | "
        f"{'n/a' if r.tax is None else f'{100 * r.tax:.2f}% ({r.tax_method})'} | "
        f"{_fmt(r.ttft_p50)} | {_fmt(r.ttft_p99)} | {_fmt(r.stall_p99)} | {r.stalled_requests} | "
        f"{r.throughput:.0f} | {r.goodput:.0f} | {r.slo_goodput:.0f} | {r.completed} | "
        f"{r.refused_429} | {r.refused_503} | "
        f"{_fmt(r.queue_wait_mean)} / {_fmt(r.queue_wait_p99)} |"
        for r in results
    ]
    return "\n".join([head, *rows])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.gate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=16, help="Concurrent clients.")
    parser.add_argument("--requests", type=int, default=64, help="Requests per arm.")
    parser.add_argument("--max-tokens", type=int, default=500, help="Output tokens per request.")
    parser.add_argument("--slo-ttft", type=float, default=2.0, help="TTFT SLO, seconds.")
    parser.add_argument(
        "--arms",
        default="no-gate,vllm-max-num-seqs,vllm-max-num-queued-reqs,kvtax-auto,kvtax-adaptive",
        help="Comma-separated arms to run (default: all five).",
    )
    parser.add_argument(
        "--recommended",
        type=int,
        default=None,
        help="Use this number instead of kvtax's recommendation.",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="Write the arms as JSON beside this path."
    )
    parser.add_argument(
        "--append",
        action="store_true",
        help="Add to the arms already in the JSON (to run the arms under two lock holds).",
    )
    args = parser.parse_args(argv)
    arms = args.arms.split(",")
    gate_common = [
        "--gate.block-size=128",
        "--gate.max-queue=64",
        "--gate.max-wait=60s",
    ]
    results: list[ArmResult] = []
    recommended = args.recommended
    saved = args.out.with_suffix(".json") if args.out is not None else None
    if recommended is None and args.append and saved is not None and saved.exists():
        recommended = json.loads(saved.read_text())["recommended"]  # the earlier hold's
    shared = {"no-gate", "kvtax-auto", "kvtax-adaptive", "kvtax-budget"} & set(arms)
    with VllmEngine() if shared else contextlib.nullcontext() as engine:
        if "no-gate" in arms:
            result, page = run_arm("no-gate", engine, args)
            results.append(result)
            found = [v for k, v in page.items() if k.startswith("kvtax_recommended_max_num_seqs")]
            if recommended is None and found:
                recommended = int(min(found))
        for mode in ("auto", "adaptive", "budget"):
            if f"kvtax-{mode}" in arms:
                gate = [f"--gate.mode={mode}", *gate_common]
                results.append(run_arm(f"kvtax-{mode}", engine, args, gate)[0])
    recommended = recommended or 3
    print(f"kvtax's recommendation: {recommended}", file=sys.stderr, flush=True)
    if "vllm-max-num-seqs" in arms:
        with VllmEngine(max_num_seqs=recommended) as engine:
            results.append(
                run_arm("vllm-max-num-seqs", engine, args, note=f"--max-num-seqs {recommended}")[0]
            )
    if "vllm-max-num-queued-reqs" in arms:
        extra = ["--max-num-queued-reqs", str(recommended)]
        with VllmEngine(extra_args=extra) as engine:
            results.append(
                run_arm(
                    "vllm-max-num-queued-reqs",
                    engine,
                    args,
                    note=f"--max-num-queued-reqs {recommended}",
                )[0]
            )
    if args.out is not None:
        saved = args.out.with_suffix(".json")
        earlier = []
        if args.append and saved.exists():
            earlier = [ArmResult(**a) for a in json.loads(saved.read_text())["arms"]]
        results = [*earlier, *results]
        saved.write_text(
            json.dumps(
                {
                    "recommended": recommended,
                    "args": vars(args) | {"out": str(args.out)},
                    "arms": [asdict(r) for r in results],
                },
                indent=2,
            )
            + "\n"
        )
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
