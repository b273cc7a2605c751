"""``--proxy.workers``: what a second worker adds, and how fast a killed one is replaced
(``python -m bench.relay.scaling``).

Relays stream from one synthetic upstream (:mod:`bench.relay.sse_upstream`), unpinned, in
rounds that rotate their order: ``direct`` (no relay: what the load generator and the upstream
manage on their own, the ceiling of every relay here), ``kvtax`` with 1 worker and with 2
(``--proxy.workers``), and nginx with 1 and 2 worker processes (the reference's own scaling on
the same cores). Each turn is one unpaced wave: ``--streams`` streams of ``--chunks`` token
chunks, as fast as the sockets take them. It reports events per second received (wall) and the
relay's CPU per event (its processes' run time from /proc: kvtax's parent and its workers,
nginx's master and workers), the median of the rounds.

Then the restart: ``--kills`` times, 64 paced streams run through kvtax with 2 workers, one
worker is killed (SIGKILL) half a second in, and the time is taken from the kill to kvtax's
``kvtax_proxy_workers`` gauge reading 2 again with a new process in the slot (the successor
listens by then: it says it is ready only once it does), polled every 5 ms.

On a 2-core machine the load generator, the upstream and the relays share both cores, so no
relay can go faster than ``direct``; the report gives each relay's rate as a share of it too.
Run it alone, holding the end-to-end lock::

    flock /tmp/kvtax-e2e.lock .venv/bin/python -m bench.relay.scaling --out COPY.md
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from bench import procfs, record
from bench.net import Children, free_port
from bench.relay.relay import (
    NGINX_CONF,
    STREAM_KINDS,
    Relay,
    _kvtax_serve,
    _more_files,
    _wave,
)
from bench.soak.compare import gauge

__all__ = ["main"]

COMPLETIONS = STREAM_KINDS["completions"]
_POLL = 0.005


@dataclass
class Turns:
    rates: list[float] = field(default_factory=list)  # events per second received
    cpu: list[float] = field(default_factory=list)  # relay CPU µs per event


@contextlib.contextmanager
def started() -> Iterator[tuple[list[Relay], str]]:
    """The upstream and every relay, unpinned; the relays and kvtax 2-worker's /metrics URL."""
    work = Path(tempfile.mkdtemp(prefix="kvtax-bench-scaling-"))
    children = Children(work)
    start = children.start

    try:
        upstream = free_port()
        start(
            "upstream",
            [sys.executable, "-m", "bench.relay.sse_upstream", f"--port={upstream}"],
            upstream,
        )
        relays = [Relay("direct", f"http://127.0.0.1:{upstream}", lambda: [])]
        metrics = ""
        for workers in (1, 2):
            port, web = free_port(), free_port()
            flags = (f"--proxy.workers={workers}", "--scrape.interval=1h", "--window=2h")
            proc = start(f"kvtax-{workers}", _kvtax_serve(upstream, port, web, flags), port)
            metrics = f"http://127.0.0.1:{web}/metrics"
            _until_workers(metrics, workers if workers > 1 else 0)
            relays.append(
                Relay(f"kvtax, {workers} worker(s)", f"http://127.0.0.1:{port}", _pids_of(proc))
            )
        nginx_bin = shutil.which("nginx") or "/usr/sbin/nginx"
        for workers in (1, 2):
            port = free_port()
            folder = work / f"nginx-{workers}"
            folder.mkdir()
            conf = NGINX_CONF.format(dir=folder, upstream=upstream, port=port).replace(
                "worker_processes 1;", f"worker_processes {workers};"
            )
            (folder / "nginx.conf").write_text(conf)
            args = [
                nginx_bin,
                "-p",
                str(folder),
                "-c",
                str(folder / "nginx.conf"),
                "-e",
                str(folder / "e.log"),
            ]
            proc = start(f"nginx-{workers}", args, port)
            relays.append(
                Relay(
                    f"nginx, {workers} worker(s)",
                    f"http://127.0.0.1:{port}",
                    _nginx_pids(proc),
                )
            )
        yield relays, metrics
    finally:
        children.stop()
        shutil.rmtree(work, ignore_errors=True)


def _pids_of(proc: subprocess.Popen[bytes]) -> Callable[[], list[int]]:
    return lambda: procfs.kvtax_pids(proc.pid)


def _nginx_pids(proc: subprocess.Popen[bytes]) -> Callable[[], list[int]]:
    return lambda: [proc.pid, *procfs.children(proc.pid)]


def _workers_now(metrics: str) -> float | None:
    try:
        with urllib.request.urlopen(metrics, timeout=5.0) as resp:
            return gauge(resp.read().decode(), "kvtax_proxy_workers")
    except OSError:
        return None


def _until_workers(metrics: str, want: int, limit: float = 60.0) -> float:
    """Seconds until kvtax's gauge of workers reads ``want``; RuntimeError past ``limit``."""
    started = time.perf_counter()
    while _workers_now(metrics) != want:
        if time.perf_counter() - started > limit:
            raise RuntimeError(f"{metrics}: not {want} workers within {limit:.0f} s")
        time.sleep(_POLL)
    return time.perf_counter() - started


async def _turn(relay: Relay, streams: int, chunks: int, interval: float) -> tuple[float, float]:
    """One wave through ``relay`` (chunks ``interval`` seconds apart; 0: unpaced): events per
    second received, relay CPU µs per event."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        before = procfs.run_seconds(relay.pids())
        started = time.perf_counter()
        seen = await _wave(session, relay.url, streams, chunks, interval, kind=COMPLETIONS)
        wall = time.perf_counter() - started
        cpu = procfs.run_seconds(relay.pids()) - before
    events = sum(s.events for s in seen)
    return events / wall, cpu / events * 1e6


async def _restart(relay: Relay, metrics: str, pid_of_parent: int) -> float:
    """Kill one of kvtax's two workers under 64 paced streams; seconds until its successor is
    ready."""
    url = relay.url + COMPLETIONS.path
    body = {
        "model": "bench",
        "prompt": "x",
        "stream": True,
        "max_tokens": 200,
        "bench_interval": 0.01,
    }

    async def stream(session: aiohttp.ClientSession) -> None:
        with contextlib.suppress(aiohttp.ClientError):
            async with session.post(url, json=body) as resp:
                async for _ in resp.content.iter_any():
                    pass

    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        load = [asyncio.create_task(stream(session)) for _ in range(64)]
        await asyncio.sleep(0.5)
        before = set(procfs.kvtax_pids(pid_of_parent)[1:])
        victim = min(before)
        os.kill(victim, signal.SIGKILL)
        killed = time.perf_counter()
        # Ready: a worker that was not there before is running, and the parent counts two (it
        # counts the successor only once it said it listens; until then it counts one).
        while not set(procfs.kvtax_pids(pid_of_parent)[1:]) - before or _workers_now(metrics) != 2:
            await asyncio.sleep(_POLL)
        seconds = time.perf_counter() - killed
        await asyncio.gather(*load)
    return seconds


async def run(streams: int, chunks: int, rounds: int, kills: int, interval: float = 0.0) -> str:
    with started() as (relays, metrics):
        turns = {relay.name: Turns() for relay in relays}
        for r in range(rounds):
            order = relays[r % len(relays) :] + relays[: r % len(relays)]
            for relay in order:
                rate, cpu = await _turn(relay, streams, chunks, interval)
                turns[relay.name].rates.append(rate)
                turns[relay.name].cpu.append(cpu)
                print(
                    f"round {r + 1} {relay.name}: {rate:,.0f} events/s, {cpu:.1f} µs/event",
                    file=sys.stderr,
                    flush=True,
                )
        two = next(relay for relay in relays if relay.name.startswith("kvtax, 2"))
        parent = int(two.pids()[0])
        restarts = [await _restart(two, metrics, parent) for _ in range(kills)]
    paced = f"paced {interval * 1000:g} ms apart" if interval else "unpaced"
    return _report(
        relays,
        turns=turns,
        restarts=restarts,
        waves=f"{streams} streams of {chunks} chunks, {paced}",
        rounds=rounds,
    )


def _report(
    relays: list[Relay],
    *,
    turns: dict[str, Turns],
    restarts: list[float],
    waves: str,
    rounds: int,
) -> str:
    rate = {name: statistics.median(t.rates) for name, t in turns.items()}
    cpu = {name: statistics.median(t.cpu) for name, t in turns.items()}
    direct = rate["direct"]
    rows = []
    for relay in relays:
        name = relay.name
        one = rate.get(name.replace("2 worker", "1 worker"), rate[name])
        rows.append(
            [
                name,
                f"{rate[name]:,.0f}",
                f"{rate[name] / direct:.2f}",
                f"{rate[name] / one:.2f}" if relay.name != "direct" else "-",
                f"{cpu[name]:.1f}" if relay.name != "direct" else "-",
                " ".join(f"{x:,.0f}" for x in turns[name].rates),
            ]
        )
    header = [
        "relay",
        "events/s received",
        "x direct",
        "x its 1 worker",
        "CPU µs per event",
        "rounds",
    ]
    lines = [
        f"{waves}, {rounds} rounds, unpinned, medians; "
        f"{os.cpu_count()} CPUs ({procfs.cpu_model()})",
        "",
        record.table(header, rows, "lrrrrl"),
    ]
    if restarts:
        lines += [
            "",
            f"Worker killed under 64 paced streams, {len(restarts)} times: its successor ready "
            "after "
            + ", ".join(f"{s * 1000:.0f}" for s in restarts)
            + f" ms (max {max(restarts) * 1000:.0f} ms).",
        ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=64, help="streams per wave (default 64)")
    parser.add_argument("--chunks", type=int, default=400, help="chunks per stream (default 400)")
    parser.add_argument(
        "--interval",
        type=float,
        default=0.0,
        help="seconds between a stream's chunks (default 0: unpaced, as fast as they go)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    parser.add_argument(
        "--kills", type=int, default=5, help="workers killed, one at a time (default 5)"
    )
    parser.add_argument("--out", type=Path, help="Also write the report to this file.")
    args = parser.parse_args()
    _more_files()
    text = asyncio.run(run(args.streams, args.chunks, args.rounds, args.kills, args.interval))
    print(text)
    if args.out is not None:
        record.save(args.out, text, None)


if __name__ == "__main__":
    main()
