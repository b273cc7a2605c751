"""Benchmark: the stream relay side by side — direct, through kvtax, through nginx — in one run.

All three modes stream from the same synthetic vLLM-shaped upstream (:mod:`bench.sse_upstream`).
On a 2-core machine the relay under test (a ``kvtax serve`` process, or nginx with one worker and
``proxy_buffering off``) is pinned to core 0; the upstream and this load generator share core 1,
in every mode, so "direct" carries the same client and upstream cost and the difference is the
relay's. The client asks for no usage, the common case and the costlier one for kvtax (it asks
vLLM for usage on every chunk and must cut it out again).

For 1, 64 and 512 concurrent streams it measures:

- a paced run (100 chunks, 10 ms apart, all streams in step like a decode batch): time to first
  byte p50/p99 and the p99 gap between chunks as the client sees them, reported as the added
  time over direct;
- an unpaced run (chunks as fast as the sockets take them): chunks/s the client received, and
  chunks per CPU-second the relay itself used (from /proc). The relay is pinned to one core, so
  both are rates on one core; the first is also bounded by the client and upstream on core 1;
- the relay's peak RSS (kvtax: its process; nginx: master + worker) from /proc.

Run from the repository root (nginx from Debian's nginx-light), alone on the machine: take the
end-to-end lock so no vLLM engine competes for the two cores::

    flock /tmp/kvtax-e2e.lock .venv/bin/python -m bench.relay --out bench/results/relay.md
    .venv/bin/python -m bench.relay --quick    # fewer chunks
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp

RELAY_CORE, LOAD_CORE = 0, 1
CONCURRENCY = (1, 64, 512)
PACED_CHUNKS, PACED_INTERVAL = 100, 0.010
NGINX_CONF = """
daemon off;
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
worker_rlimit_nofile 65536;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    upstream vllm {{ server 127.0.0.1:{upstream}; keepalive 1024; }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{
            proxy_pass http://vllm;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 300s;
        }}
    }}
}}
"""


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _more_files() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _spawn(args: list[str], core: int, log: Path) -> subprocess.Popen[bytes]:
    # The open-files limit is inherited from this process (raised in main()).
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    os.sched_setaffinity(proc.pid, {core})
    return proc


def _wait_port(port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited:\n{log.read_text()[-2000:]}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listens on {port}")


def _rss_kib(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
    return total


def _cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of the processes, from /proc/<pid>/stat."""
    ticks = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    with contextlib.suppress(OSError):
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return []


@dataclass
class Relay:
    name: str
    url: str
    pids: Callable[[], list[int]]


@contextlib.contextmanager
def relays(quick: bool, kvtax_args: tuple[str, ...] = ()) -> Iterator[list[Relay]]:
    work = Path(tempfile.mkdtemp(prefix="kvtax-bench-relay-"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        upstream_port = _port()
        up = _spawn(
            [sys.executable, "-m", "bench.sse_upstream", f"--port={upstream_port}"],
            LOAD_CORE,
            work / "upstream.log",
        )
        procs.append(up)
        _wait_port(upstream_port, up, work / "upstream.log")

        kvtax_port, web_port = _port(), _port()
        kvtax = _spawn(
            [
                sys.executable,
                "-m",
                "kvtax.cli",
                "serve",
                f"--vllm.url=http://127.0.0.1:{upstream_port}",
                f"--proxy.listen-address=127.0.0.1:{kvtax_port}",
                f"--web.listen-address=127.0.0.1:{web_port}",
                "--log.level=warning",
                *kvtax_args,
            ],
            RELAY_CORE,
            work / "kvtax.log",
        )
        procs.append(kvtax)
        _wait_port(kvtax_port, kvtax, work / "kvtax.log")

        nginx_port = _port()
        (work / "nginx.conf").write_text(
            NGINX_CONF.format(dir=work, upstream=upstream_port, port=nginx_port)
        )
        nginx_bin = shutil.which("nginx") or "/usr/sbin/nginx"
        nginx = _spawn(
            [nginx_bin, "-p", str(work), "-c", str(work / "nginx.conf"), "-e", str(work / "e.log")],
            RELAY_CORE,
            work / "nginx.log",
        )
        procs.append(nginx)
        _wait_port(nginx_port, nginx, work / "nginx.log")

        yield [
            Relay("direct", f"http://127.0.0.1:{upstream_port}", lambda: []),
            Relay("kvtax", f"http://127.0.0.1:{kvtax_port}", lambda: [kvtax.pid]),
            Relay(
                "nginx",
                f"http://127.0.0.1:{nginx_port}",
                lambda: [nginx.pid, *_children(nginx.pid)],
            ),
        ]
    finally:
        for proc in reversed(procs):
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(work, ignore_errors=True)


@dataclass
class StreamStats:
    ttfb: float
    gaps: list[float]
    chunks: int


async def _stream(
    session: aiohttp.ClientSession, url: str, chunks: int, interval: float
) -> StreamStats:
    body = {
        "model": "bench",
        "prompt": "x",
        "stream": True,
        "max_tokens": chunks,
        "bench_interval": interval,
    }
    started = time.perf_counter()
    ttfb = 0.0
    gaps: list[float] = []
    events = 0
    last = None
    tail = b""  # a lone "\n" that may be the first half of a separator split across reads
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, resp.status
        async for data in resp.content.iter_any():
            now = time.perf_counter()
            if last is None:
                ttfb = now - started
            else:
                gaps.append(now - last)
            last = now
            joined = tail + data
            events += joined.count(b"\n\n")
            tail = b"\n" if joined.endswith(b"\n") and not joined.endswith(b"\n\n") else b""
    # Every token chunk and [DONE] arrived: the relay lost nothing.
    assert events == chunks + 1, (events, chunks)
    return StreamStats(ttfb, gaps, events)


async def _run(
    url: str, streams: int, chunks: int, interval: float
) -> tuple[list[StreamStats], float]:
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(_stream(session, url, 2, 0.0) for _ in range(min(streams, 8))))
        started = time.perf_counter()
        stats = await asyncio.gather(
            *(_stream(session, url, chunks, interval) for _ in range(streams))
        )
        return list(stats), time.perf_counter() - started


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _sample_rss(relay: Relay, peak: list[int], stop: asyncio.Event) -> None:
    while not stop.is_set():
        peak[0] = max(peak[0], _rss_kib(relay.pids()))
        await asyncio.sleep(0.05)


async def measure(relay: Relay, streams: int, quick: bool) -> dict[str, float]:
    peak = [_rss_kib(relay.pids())]
    idle = peak[0]
    stop = asyncio.Event()
    sampler = asyncio.create_task(_sample_rss(relay, peak, stop))
    paced: list[StreamStats] = []
    paced_cpu_before = _cpu_seconds(relay.pids())
    # At least 64 streams' worth of samples, so a p99 means something at 1 stream too.
    for _ in range(max(3, 64 // streams) // (4 if quick else 1) or 1):
        stats, _ = await _run(
            relay.url, streams, PACED_CHUNKS // (2 if quick else 1), PACED_INTERVAL
        )
        paced += stats
    paced_cpu = _cpu_seconds(relay.pids()) - paced_cpu_before
    budget = 60_000 if quick else 200_000
    fast_chunks = max(100, budget // streams)
    cpu_before = _cpu_seconds(relay.pids())
    unpaced, wall = await _run(relay.url, streams, fast_chunks, 0.0)
    cpu = _cpu_seconds(relay.pids()) - cpu_before
    stop.set()
    await sampler
    ttfbs = [s.ttfb for s in paced]
    gaps = [g for s in paced for g in s.gaps]
    return {
        "ttfb_p50": _pct(ttfbs, 0.5),
        "ttfb_p99": _pct(ttfbs, 0.99),
        "gap_p50": _pct(gaps, 0.5),
        "gap_p99": _pct(gaps, 0.99),
        # Paced chunks arrive one per read, so each costs a full read-parse-write cycle.
        "paced_chunks_per_cpu_s": (
            sum(s.chunks for s in paced) / paced_cpu if paced_cpu > 0 else float("nan")
        ),
        "chunks_per_s": sum(s.chunks for s in unpaced) / wall,
        # Chunks per second of the relay's own CPU time: its rate on one fully busy core.
        "chunks_per_cpu_s": sum(s.chunks for s in unpaced) / cpu if cpu > 0 else float("nan"),
        "rss_mib": peak[0] / 1024,
        "rss_idle_mib": idle / 1024,
    }


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:+.2f}"


def _cpu_us(r: dict[str, float]) -> float:
    """Relay CPU time per chunk in the paced run, in microseconds: the cost of one relayed
    chunk when every chunk is its own read and write, as in a decoding batch."""
    return 1e6 / r["paced_chunks_per_cpu_s"]


def report(results: dict[tuple[str, int], dict[str, float]]) -> str:
    ran = sorted({s for _, s in results})
    lines = [
        "| streams | relay | added TTFB p50 ms | added TTFB p99 ms | added gap p99 ms "
        "| CPU µs per chunk (paced) | x nginx | chunks/s received (unpaced) "
        "| chunks per relay CPU-s (unpaced) | relay RSS peak MiB |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for streams in ran:
        base, nginx = results[("direct", streams)], results[("nginx", streams)]
        for name in ("direct", "kvtax", "nginx"):
            r = results[(name, streams)]
            relay = name != "direct"
            rss = f"{r['rss_mib']:.1f}" if relay else "-"
            per_cpu = f"{r['chunks_per_cpu_s']:,.0f}" if relay else "-"
            cpu_us = f"{_cpu_us(r):.1f}" if relay else "-"
            ratio = f"{_cpu_us(r) / _cpu_us(nginx):.2f}" if relay else "-"
            lines.append(
                f"| {streams} | {name} | {_ms(r['ttfb_p50'] - base['ttfb_p50'])} "
                f"| {_ms(r['ttfb_p99'] - base['ttfb_p99'])} "
                f"| {_ms(r['gap_p99'] - base['gap_p99'])} | {cpu_us} | {ratio} "
                f"| {r['chunks_per_s']:,.0f} | {per_cpu} | {rss} |"
            )
    lines.append("")
    lines.append(
        "Direct baselines (absolute): "
        + "; ".join(
            f"{s} streams: TTFB p50 {results[('direct', s)]['ttfb_p50'] * 1000:.2f} ms, "
            f"gap p99 {results[('direct', s)]['gap_p99'] * 1000:.2f} ms"
            for s in ran
        )
    )
    return "\n".join([*lines, "", *_targets(results, ran)])


def _targets(results: dict[tuple[str, int], dict[str, float]], ran: list[int]) -> list[str]:
    """The issue's targets, for the concurrencies that ran."""

    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    def added(streams: int, key: str) -> float:
        return (results[("kvtax", streams)][key] - results[("direct", streams)][key]) * 1000

    out = ["Targets (kvtax, side by side with nginx on the same upstream):"]
    if 64 in ran:
        ttfb, gap = added(64, "ttfb_p50"), added(64, "gap_p99")
        ratio = _cpu_us(results[("kvtax", 64)]) / _cpu_us(results[("nginx", 64)])
        out += [
            f"- 64 streams, added TTFB p50 <= 5 ms: {ttfb:+.2f} ms, {verdict(ttfb <= 5)}",
            f"- 64 streams, added p99 gap <= 1 ms: {gap:+.2f} ms, {verdict(gap <= 1)}",
            f"- 64 streams, CPU per chunk <= 1.5x nginx: {ratio:.2f}x, {verdict(ratio <= 1.5)}",
        ]
    if 512 in ran:
        gap = added(512, "gap_p99")
        rss = results[("kvtax", 512)]["rss_mib"] * 1.048576
        out += [
            f"- 512 streams, added p99 gap <= 5 ms: {gap:+.2f} ms, {verdict(gap <= 5)}",
            f"- RSS < 150 MB at 512 streams: {rss:.1f} MB, {verdict(rss < 150)}",
        ]
    return out


async def main_async(
    quick: bool, concurrency: tuple[int, ...] = CONCURRENCY, kvtax_args: tuple[str, ...] = ()
) -> str:
    results: dict[tuple[str, int], dict[str, float]] = {}
    with relays(quick, kvtax_args) as modes:
        for streams in concurrency:
            # Interleave the modes at each concurrency so drift hits all three alike.
            for relay in modes:
                results[(relay.name, streams)] = await measure(relay, streams, quick)
                print(
                    f"{relay.name:6} {streams:4} streams: {results[(relay.name, streams)]}",
                    file=sys.stderr,
                )
    return report(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, help="Also write the table to this file.")
    parser.add_argument(
        "--streams",
        type=lambda v: tuple(int(x) for x in v.split(",")),
        default=CONCURRENCY,
        help="Concurrencies to run, comma-separated (default 1,64,512; the report needs all).",
    )
    parser.add_argument(
        "--kvtax-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="An extra flag for `kvtax serve`, e.g. --kvtax-arg=--scrape.interval=1h (repeat).",
    )
    args = parser.parse_args()
    _more_files()
    os.sched_setaffinity(0, {LOAD_CORE})
    table = asyncio.run(main_async(args.quick, args.streams, tuple(args.kvtax_arg)))
    print(table)
    if args.out:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
