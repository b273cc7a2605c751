"""Soak: thousands of mixed requests through a real ``kvtax serve``, then the ledger against the
clients, and kvtax's memory and descriptors when it is idle again.

A fake vLLM (:mod:`bench.soak_upstream`, its own process on loopback) answers a deterministic mix
of requests (:mod:`bench.soak_client`): streams closed the instant ``[DONE]`` is read, streams
read to the end, clients that hang up mid-stream, non-streamed bodies of 1 KB to 3 MB arriving in
several writes, 500s, an upstream that breaks off, slow readers. 64 clients at a time, in five
phases of 20 %. After each phase the soak waits until kvtax has settled every request so far and
samples its VmRSS and open descriptors from /proc, and the event-loop tasks and open streams if
kvtax publishes them; then again once idle. Verdicts:

- RSS grows less than 5 % between the 20 % and the 100 % marks;
- descriptors (and tasks, and open streams) return to their level before the load once idle;
- kvtax's ledger equals what the clients saw (:func:`bench.soak_compare.compare`);
- every client got what the upstream sent (no cut body, no missing token).

Run from the repository root, alone on the machine (take the end-to-end lock)::

    flock /tmp/kvtax-e2e.lock .venv/bin/python -m bench.soak --out bench/results/soak.md
    .venv/bin/python -m bench.soak --requests 600      # the short form CI runs
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from bench.relay import _port, _wait_port
from bench.soak_client import HANGUP_MODEL, KINDS, MODEL, Spec, plan, run_one
from bench.soak_compare import (
    Check,
    ClientRecord,
    LedgerView,
    compare,
    gauge,
    ledger_delta,
    parse_ledger,
)
from kvtax.delivery.ledger import OUTCOMES

__all__ = ["Mark", "SoakResult", "main", "report", "run"]

ROOT = Path(__file__).resolve().parents[1]
CAPTURE = ROOT / "tests" / "fixtures" / "vllm" / "0.32-idle.prom"
TASKS, STREAMS = "kvtax_event_loop_tasks", "kvtax_proxy_streams_open"
MARKS = 5  # samples at 20 %, 40 %, ... 100 %
SETTLE_S = 30.0  # longest wait for kvtax to settle requests its clients have finished
IDLE_LIMIT_S = 30.0  # longest wait for descriptors to come back once idle
RSS_GROWTH = 0.05
_EXCEPTION = re.compile(r"[\w.]*(Error|Exception)\b[^ ]*(: |$)")


@dataclass(frozen=True, slots=True)
class Mark:
    """One sample of the kvtax process."""

    label: str
    requests: int
    rss_kib: int
    fds: int
    tasks: float | None
    streams: float | None


@dataclass
class SoakResult:
    """Everything one soak saw. ``marks``: before the load, at each 20 %, then idle."""

    requests: int
    records: list[ClientRecord] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)
    ledger: dict[str, LedgerView] = field(default_factory=dict)  # by model, over the soak
    checks: list[Check] = field(default_factory=list)
    idle_seconds: float | None = None  # time until the idle level was back; None: never
    peak_rss_kib: int = 0
    log_lines: Counter[str] = field(default_factory=Counter)  # what kvtax or the upstream logged

    @property
    def baseline(self) -> Mark:
        return self.marks[0]

    def verdicts(self) -> list[tuple[str, bool, str]]:
        """(verdict, passed, the figures it was judged on)."""
        by_pct = self.marks[1 : 1 + MARKS]
        first, last = by_pct[0].rss_kib, by_pct[-1].rss_kib
        growth = (last - first) / first
        idle = self.marks[-1]
        problems = [r for r in self.records if r.problem]
        back = self.idle_seconds is not None
        return [
            (
                f"RSS grows < {RSS_GROWTH:.0%} from the 20 % to the 100 % mark",
                growth < RSS_GROWTH,
                f"{first / 1024:.1f} -> {last / 1024:.1f} MiB ({growth:+.1%})",
            ),
            (
                "descriptors, tasks and open streams back to their idle level",
                back,
                _idle_figures(self.baseline, idle, self.idle_seconds),
            ),
            (
                "the ledger equals what the clients saw",
                all(c.ok for c in self.checks),
                f"{sum(not c.ok for c in self.checks)} of {len(self.checks)} checks differ",
            ),
            (
                "every client got what the upstream sent",
                not problems,
                f"{len(problems)} of {len(self.records)} clients did not",
            ),
        ]


def _idle_figures(before: Mark, idle: Mark, seconds: float | None) -> str:
    parts = [f"FDs {before.fds} before, {idle.fds} idle"]
    for name, a, b in (
        ("tasks", before.tasks, idle.tasks),
        ("streams", before.streams, idle.streams),
    ):
        parts.append(
            f"{name} {a:g} before, {b:g} idle"
            if a is not None and b is not None
            else f"{name} not published"
        )
    when = (
        f"back after {seconds:.1f} s idle"
        if seconds is not None
        else f"not back within {IDLE_LIMIT_S:g} s"
    )
    return "; ".join(parts) + f"; {when}"


def _proc(pid: int) -> tuple[int, int, int]:
    """VmRSS and VmHWM in KiB, and the number of open descriptors, of a process."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    fields = dict(line.split(":", 1) for line in status if ":" in line)
    rss, hwm = (int(fields[key].split()[0]) for key in ("VmRSS", "VmHWM"))
    return rss, hwm, len(os.listdir(f"/proc/{pid}/fd"))


@dataclass(frozen=True, slots=True)
class Sidecar:
    pid: int
    proxy: str  # the proxy's base URL
    metrics: str  # kvtax's own /metrics
    logs: tuple[Path, ...]


def _start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        # From the repository root, so that ``-m bench.soak_upstream`` imports.
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)


@contextlib.contextmanager
def processes(work: Path) -> Iterator[Sidecar]:
    """The fake vLLM and a ``kvtax serve`` in front of it, both stopped on the way out."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        upstream_port = _port()
        up_log = work / "upstream.log"
        up_args = ["-m", "bench.soak_upstream", f"--port={upstream_port}", f"--metrics={CAPTURE}"]
        up_args.append(f"--also-model={HANGUP_MODEL}")
        procs.append(_start([sys.executable, *up_args], up_log))
        _wait_port(upstream_port, procs[-1], up_log)
        proxy_port, web_port = _port(), _port()
        kvtax_log = work / "kvtax.log"
        serve = [
            f"--vllm.url=http://127.0.0.1:{upstream_port}",
            f"--proxy.listen-address=127.0.0.1:{proxy_port}",
            f"--web.listen-address=127.0.0.1:{web_port}",
            # Scrape often: each scrape also credits running streams, a path to keep exact.
            "--scrape.interval=1s",
            "--shutdown.grace-period=1s",
            "--log.level=warning",
        ]
        procs.append(_start([sys.executable, "-m", "kvtax.cli", "serve", *serve], kvtax_log))
        _wait_port(proxy_port, procs[-1], kvtax_log)
        _wait_port(web_port, procs[-1], kvtax_log)
        yield Sidecar(
            procs[-1].pid,
            f"http://127.0.0.1:{proxy_port}",
            f"http://127.0.0.1:{web_port}/metrics",
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
) -> SoakResult:
    """The whole soak, processes included (the short form in CI calls this)."""
    specs = plan(requests, seed)
    # Filtered after drawing, so that the requests kept are the same as in the full mix.
    specs = [spec for spec in specs if not only or spec.kind in only]
    with tempfile.TemporaryDirectory(prefix="kvtax-soak-") as tmp, processes(Path(tmp)) as side:
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


def _cell(value: float | None) -> str:
    return "not published" if value is None else f"{value:g}"


def _marks_table(result: SoakResult) -> list[str]:
    lines = [
        "| mark | requests done | VmRSS MiB | open FDs | event-loop tasks | streams open |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for m in result.marks:
        lines.append(
            f"| {m.label} | {m.requests:,} | {m.rss_kib / 1024:.1f} | {m.fds} "
            f"| {_cell(m.tasks)} | {_cell(m.streams)} |"
        )
    lines.append(f"\nPeak RSS (VmHWM): {result.peak_rss_kib / 1024:.1f} MiB.")
    return lines


def _clients_table(result: SoakResult) -> list[str]:
    kinds = Counter(r.kind for r in result.records)
    wrong = Counter(r.kind for r in result.records if r.problem)
    tokens = Counter[str]()
    for r in result.records:
        tokens[r.kind] += r.tokens
    lines = [
        "| client kind | requests | tokens received | answers not as sent |",
        "|---|---:|---:|---:|",
    ]
    for kind, n in sorted(kinds.items()):
        lines.append(f"| {kind} | {n:,} | {tokens[kind]:,} | {wrong[kind]:,} |")
    examples: dict[str, list[str]] = {}
    for r in result.records:
        if r.problem and len(examples.setdefault(r.kind, [])) < 3:
            examples[r.kind].append(f"- {r.kind}: {r.problem}")
    shown = [line for kind in sorted(examples) for line in examples[kind]]
    return lines + (
        ["", "Answers not as sent (the first three of each kind):", *shown] if shown else []
    )


def report(result: SoakResult) -> str:
    """The soak's tables and verdicts, as Markdown."""
    lines = [*_marks_table(result), "", *_clients_table(result)]
    lines += ["", "| ledger | clients saw | kvtax counted | |", "|---|---:|---:|---|"]
    for c in result.checks:
        lines.append(f"| {c.name} | {c.clients} | {c.kvtax} | {'ok' if c.ok else 'DIFFERS'} |")
    if result.log_lines:
        lines += ["", "Errors in the logs of kvtax and the fake vLLM (times logged):"]
        lines += [f"    {n:5} x {line}" for line, n in result.log_lines.most_common(10)]
    lines += ["", "Verdicts:"]
    for name, passed, figures in result.verdicts():
        lines.append(f"- **{'PASS' if passed else 'FAIL'}** {name}: {figures}")
    return "\n".join(lines)


def _header(argv: list[str]) -> str:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.machine(),
    )
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return (
        f"Measured on {when} on {platform.node()}: {os.cpu_count()} cores ({cpu}), "
        f"Python {platform.python_version()}, aiohttp {aiohttp.__version__}, "
        f"load average {os.getloadavg()[0]:.1f} at the start. {_tree()}\n\n"
        f"Command: `.venv/bin/python -m bench.soak {' '.join(argv)}`".rstrip()
        + "\n"
    )


def _git(*args: str) -> str:
    done = subprocess.run(["git", "-C", str(ROOT), *args], check=False, capture_output=True)
    return done.stdout.decode(errors="replace")


def _tree() -> str:
    """The commit measured, and the package files that differed from it (a shared tree)."""
    changed = sorted(
        line[3:] for line in _git("status", "--porcelain", "--", "exporter").splitlines()
    )
    extra = f", with uncommitted changes to {', '.join(changed)}" if changed else ""
    return f"kvtax at commit {_git('rev-parse', '--short', 'HEAD').strip() or 'unknown'}{extra}."


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
    parser.add_argument("--out", type=Path, help="Also write the tables to this file.")
    args = parser.parse_args()
    header = _header(sys.argv[1:])
    only = frozenset(filter(None, args.only.split(",")))
    if only - set(KINDS):
        parser.error(f"--only: unknown kinds {', '.join(sorted(only - set(KINDS)))}")
    result = run(
        args.requests, seed=args.seed, concurrency=args.concurrency, idle=args.idle, only=only
    )
    text = header + "\n" + report(result)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    sys.exit(0 if all(passed for _, passed, _ in result.verdicts()) else 1)


if __name__ == "__main__":
    main()
