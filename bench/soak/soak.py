"""Soak: thousands of mixed requests through a real ``kvtax serve``, then the ledger against the
clients, and kvtax's memory and descriptors when it is idle again.

A fake vLLM (:mod:`bench.soak.upstream`, its own process on loopback) answers a deterministic mix
of requests (:mod:`bench.soak.client`): streams closed the instant ``[DONE]`` is read, streams
read to the end, clients that hang up mid-stream, non-streamed bodies of 1 KB to 3 MB arriving in
several writes, 500s, an upstream that breaks off, slow readers. 64 clients at a time, in ten
phases of 10 %. After each phase the soak waits until kvtax has settled every request so far and
samples its VmRSS and open descriptors from /proc, and the event-loop tasks and open streams if
kvtax publishes them; then again once idle. Verdicts:

- RSS grows less than 2 % between the 50 % and the 100 % marks (a plateau);
- descriptors (and tasks, and open streams) return to their level before the load once idle;
- kvtax's ledger equals what the clients saw (:func:`bench.soak.compare.compare`);
- every client got what the upstream sent (no cut body, no missing token).

The results, verdicts and Markdown tables are in :mod:`bench.soak.report`.

Run from the repository root, alone on the machine (take the end-to-end lock)::

    flock /tmp/kvtax-e2e.lock .venv/bin/python -m bench.soak --out bench/results/soak.md
    .venv/bin/python -m bench.soak --requests 600      # the short form CI runs
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from bench import procfs, record
from bench.net import free_port, wait_port
from bench.soak.client import HANGUP_MODEL, KINDS, MODEL, Spec, plan, run_one
from bench.soak.compare import (
    ClientRecord,
    LedgerView,
    compare,
    gauge,
    ledger_delta,
    parse_ledger,
)
from bench.soak.report import IDLE_LIMIT_S, MARKS, Mark, SoakResult, report
from bench.soak.report import header as report_header
from kvtax.delivery.ledger import OUTCOMES
from kvtax_dev.process import poll_until

__all__ = ["Mark", "SoakResult", "main", "report", "run"]

ROOT = Path(__file__).resolve().parents[2]
CAPTURE = ROOT / "tests" / "fixtures" / "vllm" / "0.32-idle.prom"
TASKS, STREAMS = "kvtax_event_loop_tasks", "kvtax_proxy_streams_open"
SETTLE_S = 30.0  # longest wait for kvtax to settle requests its clients have finished
_EXCEPTION = re.compile(r"[\w.]*(Error|Exception)\b[^ ]*(: |$)")


def _proc(pid: int) -> tuple[int, int, int]:
    """VmRSS and VmHWM in KiB, and the number of open descriptors, of kvtax: its process and
    its proxy workers' (--proxy.workers), added up."""
    pids = procfs.kvtax_pids(pid)
    fds = sum(procfs.open_fds(p) for p in pids)
    return procfs.rss_bytes(pids) // 1024, procfs.peak_rss_bytes(pids) // 1024, fds


@dataclass(frozen=True, slots=True)
class Sidecar:
    pid: int
    proxy: str  # the proxy's base URL
    metrics: str  # kvtax's own /metrics
    logs: tuple[Path, ...]


def _start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        # From the repository root, so that ``-m bench.soak.upstream`` imports.
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)


@contextlib.contextmanager
def processes(work: Path, workers: int = 1) -> Iterator[Sidecar]:
    """The fake vLLM and a ``kvtax serve`` in front of it (relaying with ``workers`` proxy
    processes), both stopped on the way out."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        upstream_port = free_port()
        up_log = work / "upstream.log"
        up_args = ["-m", "bench.soak.upstream", f"--port={upstream_port}", f"--metrics={CAPTURE}"]
        up_args.append(f"--also-model={HANGUP_MODEL}")
        procs.append(_start([sys.executable, *up_args], up_log))
        wait_port(upstream_port, procs[-1], up_log)
        proxy_port, web_port = free_port(), free_port()
        kvtax_log = work / "kvtax.log"
        serve = [
            f"--vllm.url=http://127.0.0.1:{upstream_port}",
            f"--proxy.listen-address=127.0.0.1:{proxy_port}",
            f"--web.listen-address=127.0.0.1:{web_port}",
            # Scrape often: each scrape also credits running streams, a path to keep exact.
            "--scrape.interval=1s",
            "--shutdown.grace-period=1s",
            "--log.level=warning",
            f"--proxy.workers={workers}",
        ]
        procs.append(_start([sys.executable, "-m", "kvtax.cli.main", "serve", *serve], kvtax_log))
        wait_port(proxy_port, procs[-1], kvtax_log)
        wait_port(web_port, procs[-1], kvtax_log)
        metrics = f"http://127.0.0.1:{web_port}/metrics"
        if workers > 1:
            # The port opens with the first worker: the baseline waits for every one of them.
            started = poll_until(lambda: _workers_running(metrics) == workers, timeout=60.0)
            if started is None:
                raise RuntimeError(f"kvtax did not start {workers} proxy workers: {kvtax_log}")
        yield Sidecar(
            procs[-1].pid,
            f"http://127.0.0.1:{proxy_port}",
            metrics,
            (kvtax_log, up_log),
        )
    finally:
        for proc in reversed(procs):
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _workers_running(metrics: str) -> float | None:
    with urllib.request.urlopen(metrics, timeout=5.0) as resp:
        return gauge(resp.read().decode(), "kvtax_proxy_workers")


async def _page(scrape: aiohttp.ClientSession, side: Sidecar) -> str:
    async with scrape.get(side.metrics) as resp:
        resp.raise_for_status()
        return await resp.text()


async def _mark(scrape: aiohttp.ClientSession, side: Sidecar, label: str, done: int) -> Mark:
    # Descriptors first: fetching /metrics opens a connection to kvtax for a moment.
    rss, _, fds = _proc(side.pid)
    page = await _page(scrape, side)
    return Mark(label, done, rss, fds, gauge(page, TASKS), gauge(page, STREAMS))


async def _wait_for(
    scrape: aiohttp.ClientSession, side: Sidecar, ready: Callable[[str], bool], limit: float
) -> str:
    """Poll kvtax's /metrics until ``ready(page)``, or until ``limit`` seconds have passed."""
    deadline = time.monotonic() + limit
    page = await _page(scrape, side)
    while not ready(page) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        page = await _page(scrape, side)
    return page


async def _drive(
    session: aiohttp.ClientSession,
    base: str,
    specs: list[Spec],
    records: list[ClientRecord],
    concurrency: int,
) -> None:
    pending = iter(specs)  # shared by the workers: each takes the next spec when it is free

    async def worker() -> None:
        for spec in pending:
            records.append(await run_one(session, base, spec))

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def _phases(
    scrape: aiohttp.ClientSession,
    side: Sidecar,
    specs: list[Spec],
    result: SoakResult,
    *,
    concurrency: int,
    before: dict[str, LedgerView],
) -> None:
    """Run the specs in five parts; after each, wait for kvtax to settle them, then sample."""
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=90)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        for mark in range(1, MARKS + 1):
            part = specs[len(specs) * (mark - 1) // MARKS : len(specs) * mark // MARKS]
            await _drive(session, side.proxy, part, result.records, concurrency)
            done = len(result.records)

            def settled(page: str, n: int = done) -> bool:
                delta = ledger_delta(parse_ledger(page), before)
                return sum(view.requests for view in delta.values()) >= n

            # A client may finish before kvtax's handler does (it hung up, or closed at [DONE]).
            await _wait_for(scrape, side, settled, SETTLE_S)
            result.marks.append(await _mark(scrape, side, f"{mark * 100 // MARKS} %", done))


async def _baseline(scrape: aiohttp.ClientSession, side: Sidecar) -> Mark:
    """kvtax idle before the load: the fewest descriptors over 2 s, so that a scrape of vLLM
    in progress at one instant does not raise the level the idle soak is held to."""
    marks = []
    for _ in range(10):
        marks.append(await _mark(scrape, side, "before the load", 0))
        await asyncio.sleep(0.2)
    return min(marks, key=lambda m: m.fds)


def _at_or_below(mark: Mark, base: Mark) -> bool:
    pairs = ((mark.fds, base.fds), (mark.tasks, base.tasks), (mark.streams, base.streams))
    return all(a <= b for a, b in pairs if a is not None and b is not None)


async def _back_to_idle(
    scrape: aiohttp.ClientSession, side: Sidecar, result: SoakResult, idle: float
) -> None:
    """Sample after ``idle`` s, then poll until kvtax is back to its level before the load."""
    await asyncio.sleep(idle)
    done = result.requests
    result.marks.append(await _mark(scrape, side, f"idle {idle:g} s", done))
    started = time.monotonic()
    mark = result.marks[-1]
    while not _at_or_below(mark, result.baseline):
        if time.monotonic() - started > IDLE_LIMIT_S:
            result.marks.append(mark)
            return
        await asyncio.sleep(0.5)
        waited = idle + time.monotonic() - started
        mark = await _mark(scrape, side, f"idle {waited:.1f} s", done)
    result.idle_seconds = idle + time.monotonic() - started
    if mark is not result.marks[-1]:
        result.marks.append(mark)


def _knows_models(page: str) -> bool:
    return all(f'model_name="{model}"' in page for model in (MODEL, HANGUP_MODEL))


async def soak(side: Sidecar, specs: list[Spec], concurrency: int, idle: float) -> SoakResult:
    result = SoakResult(len(specs))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as scrape:
        # The model name comes from the first scrape of vLLM; wait for it like a real client.
        await _wait_for(scrape, side, _knows_models, SETTLE_S)
        result.marks.append(await _baseline(scrape, side))
        before = parse_ledger(await _page(scrape, side))
        await _phases(scrape, side, specs, result, concurrency=concurrency, before=before)
        await _back_to_idle(scrape, side, result, idle)
        result.ledger = ledger_delta(parse_ledger(await _page(scrape, side)), before)
    result.peak_rss_kib = _proc(side.pid)[1]
    result.checks = compare(result.records, result.ledger, OUTCOMES)
    return result


def run(
    requests: int,
    *,
    seed: int = 1,
    concurrency: int = 64,
    idle: float = 3.0,
    only: frozenset[str] = frozenset(),
    workers: int = 1,
) -> SoakResult:
    """The whole soak, processes included (the short form in CI calls this)."""
    specs = plan(requests, seed)
    # Filtered after drawing, so that the requests kept are the same as in the full mix.
    specs = [spec for spec in specs if not only or spec.kind in only]
    with (
        tempfile.TemporaryDirectory(prefix="kvtax-soak-") as tmp,
        processes(Path(tmp), workers) as side,
    ):
        result = asyncio.run(soak(side, specs, concurrency, idle))
        result.log_lines = _log_errors(side.logs)
    return result


def _log_errors(logs: tuple[Path, ...]) -> Counter[str]:
    """The errors the processes logged (exception lines and ERROR records), with their counts."""
    found: Counter[str] = Counter()
    for log in logs:
        for raw in log.read_text(errors="replace").splitlines():
            line = raw.strip()
            if _EXCEPTION.match(line) or "ERROR" in line or "Error handling" in line:
                found[f"{log.stem}: {line[:160]}"] += 1
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--idle", type=float, default=3.0, help="seconds idle before sampling")
    parser.add_argument(
        "--only",
        default="",
        help=f"run only these kinds of the mix, e.g. drop ({', '.join(KINDS)})",
    )
    parser.add_argument(
        "--workers", type=int, default=1, help="kvtax's --proxy.workers (default 1)"
    )
    parser.add_argument("--out", type=Path, help="Also write the tables to this file.")
    args = parser.parse_args()
    header = report_header(sys.argv[1:])
    only = frozenset(filter(None, args.only.split(",")))
    if only - set(KINDS):
        parser.error(f"--only: unknown kinds {', '.join(sorted(only - set(KINDS)))}")
    result = run(
        args.requests,
        seed=args.seed,
        concurrency=args.concurrency,
        idle=args.idle,
        only=only,
        workers=args.workers,
    )
    text = header + "\n" + report(result)
    print(text)
    if args.out:
        record.save(args.out, text, None)  # every figure is in the tables
    sys.exit(0 if all(passed for _, passed, _ in result.verdicts()) else 1)


if __name__ == "__main__":
    main()
