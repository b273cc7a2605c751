"""Benchmark: the stream relay beside nginx and a bare pass-through, in interleaved rounds.

Four modes stream from the same synthetic vLLM-shaped upstream (:mod:`bench.relay.sse_upstream`):
``direct`` (no relay: the baseline of every "added" figure), ``kvtax`` (a ``kvtax serve`` process),
``nginx`` (one worker, ``proxy_buffering off``, keep-alive to the upstream: the reference) and
``passthrough`` (:mod:`bench.relay.passthrough`, a bare TCP splice on uvloop: the floor, what plain
Python costs to relay a stream). On a 2-core machine each relay is pinned to core 0; the upstream
and this load generator share core 1 in every mode, so "direct" carries the same client and upstream
cost and the difference is the relay's. The client asks for no usage, the common case and the
costlier one for kvtax (it asks vLLM for usage on every chunk and must cut it out again).

At each concurrency (1, 64 and 512 streams by default) the run makes R rounds, and each round
measures every mode once, in an order that rotates from round to round, so that drift and other
jobs on the machine hit all modes alike. One mode's turn is three measurements:

- paced: streams of 100 token chunks and ``[DONE]``, 10 ms apart, all streams in step like a
  decode batch, on connections opened beforehand: time to first byte and the gaps between reads
  as the client sees them, and the relay's CPU time per event;
- unpaced: events as fast as the sockets take them: events per CPU-second of the relay;
- short streams: waves of as many concurrent streams as the concurrency (64 in the targets), of
  4 events each (3 token chunks and ``[DONE]``), unpaced, each on a new client connection, so
  that the per-request work (accept, request head, upstream request, response head) dominates:
  the relay's CPU time per request.

The relay's CPU time is the run time of its processes, all threads, from /proc
(``task/*/schedstat``, in ns): kvtax's main process and its proxy workers (not its parse
worker), nginx's master and worker, the pass-through. Its RSS is sampled every 50 ms. The report
gives the median over the rounds of each CPU figure, percentiles of the samples of all rounds
pooled, the peak RSS of all rounds, then the issue's targets for kvtax against nginx in this
run, met or not, with the pass-through's figure beside each.

Flags:

- ``--streams N[,N...]``: the concurrencies to run, comma-separated (default 1,64,512). The
  targets need 64 and 512; a target whose concurrency did not run is reported as not checked.
- ``--rounds R``: rounds at each concurrency (default 3).
- ``--quick``: fewer events and requests per measurement: a check that it all works.
- ``--out FILE``: also write the report to FILE.
- ``--kvtax-arg FLAG``: one extra flag for ``kvtax serve`` (repeat for several), e.g.
  ``--kvtax-arg=--scrape.interval=1h``.
- ``--unpinned``: pin nothing, so the relays, the upstream and the load share both cores, as
  in a pod where kvtax and vLLM's API server share a CPU limit (default: pinned as above).
- ``--apis NAME[,NAME...]``: the generation APIs whose streams are measured, one after the
  other in the same run with the same relays (default ``completions``; ``messages`` and
  ``responses`` stream vLLM's named events, one token per delta, usage at the end only). The
  report gives each API's table, then kvtax's CPU per event on each beside nginx's.
- ``--kvtax-before DIR``: one more relay, ``kvtax-before``: ``kvtax serve`` run from another
  checkout (``DIR/exporter`` first on its path), interleaved with the others round by round,
  so that a change's before and after are measured in one run. ``git worktree add DIR REV``
  makes one.

Run from the repository root (nginx from Debian's nginx-light), alone on the machine: take the
end-to-end lock so no vLLM engine competes for the two cores::

    flock /tmp/kvtax-e2e.lock .venv/bin/python -m bench.relay --out bench/results/relay.md
    .venv/bin/python -m bench.relay --quick --streams 64    # one concurrency, a quick check
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from bench import procfs, record
from bench.net import Children, free_port
from bench.stats import quantile

RELAY_CORE, LOAD_CORE = 0, 1
CONCURRENCY = (1, 64, 512)
ROUNDS = 3
PACED_CHUNKS, PACED_INTERVAL = 100, 0.010
# Token chunks of a short stream: with [DONE], 4 events.
SHORT_CHUNKS = 3
MODES = ("direct", "kvtax", "kvtax-before", "nginx", "passthrough")


@dataclass(frozen=True)
class StreamKind:
    """How to ask one generation API for a stream of n tokens: the path, the body, the key of
    its output limit, and the events a stream has besides its token events."""

    path: str
    body: dict[str, object]
    limit: str
    framing: int


STREAM_KINDS = {
    "completions": StreamKind("/v1/completions", {"prompt": "x"}, "max_tokens", 1),  # [DONE]
    # message_start, content_block_start, content_block_stop, message_delta, message_stop
    "messages": StreamKind(
        "/v1/messages", {"messages": [{"role": "user", "content": "x"}]}, "max_tokens", 5
    ),
    # created, in_progress, output_item.added, output_text.done, output_item.done, completed
    "responses": StreamKind("/v1/responses", {"input": "x"}, "max_output_tokens", 6),
}
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


def _more_files() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


@dataclass
class Relay:
    name: str
    url: str
    pids: Callable[[], list[int]]


def _kvtax_serve(upstream: int, port: int, web: int, args: tuple[str, ...]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "kvtax.cli.main",
        "serve",
        f"--vllm.url=http://127.0.0.1:{upstream}",
        f"--proxy.listen-address=127.0.0.1:{port}",
        f"--web.listen-address=127.0.0.1:{web}",
        "--log.level=warning",
        *args,
    ]


@contextlib.contextmanager
def relays(
    kvtax_args: tuple[str, ...] = (), *, pinned: bool = True, before: Path | None = None
) -> Iterator[list[Relay]]:
    """Start the upstream and the relays; yield the modes, in MODES' order (``kvtax-before``
    only with ``before``, a checkout whose kvtax it runs). ``pinned``: each relay on
    RELAY_CORE, the upstream on LOAD_CORE; else none pinned."""
    work = Path(tempfile.mkdtemp(prefix="kvtax-bench-relay-"))
    children = Children(work)

    def start(
        name: str, args: list[str], port: int, core: int, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        return children.start(name, args, port, core=core if pinned else None, env=env)

    try:
        upstream_port = free_port()
        start(
            "upstream",
            [sys.executable, "-m", "bench.relay.sse_upstream", f"--port={upstream_port}"],
            upstream_port,
            LOAD_CORE,
        )
        kvtax_port, web_port = free_port(), free_port()
        kvtax = start(
            "kvtax",
            _kvtax_serve(upstream_port, kvtax_port, web_port, kvtax_args),
            kvtax_port,
            RELAY_CORE,
        )
        modes = [
            Relay("direct", f"http://127.0.0.1:{upstream_port}", lambda: []),
            Relay("kvtax", f"http://127.0.0.1:{kvtax_port}", lambda: procfs.kvtax_pids(kvtax.pid)),
        ]
        if before is not None:
            old_port, old_web = free_port(), free_port()
            # The other checkout's package first on the path: its kvtax, this one's libraries.
            env = {**os.environ, "PYTHONPATH": str(before / "exporter")}
            old = start(
                "kvtax-before",
                _kvtax_serve(upstream_port, old_port, old_web, kvtax_args),
                old_port,
                RELAY_CORE,
                env,
            )
            old_pids = functools.partial(procfs.kvtax_pids, old.pid)
            modes.append(Relay("kvtax-before", f"http://127.0.0.1:{old_port}", old_pids))
        nginx_port = free_port()
        (work / "nginx.conf").write_text(
            NGINX_CONF.format(dir=work, upstream=upstream_port, port=nginx_port)
        )
        nginx_bin = shutil.which("nginx") or "/usr/sbin/nginx"
        nginx = start(
            "nginx",
            [nginx_bin, "-p", str(work), "-c", str(work / "nginx.conf"), "-e", str(work / "e.log")],
            nginx_port,
            RELAY_CORE,
        )
        floor_port = free_port()
        floor = start(
            "passthrough",
            [
                sys.executable,
                "-m",
                "bench.relay.passthrough",
                f"--port={floor_port}",
                f"--upstream-port={upstream_port}",
            ],
            floor_port,
            RELAY_CORE,
        )
        yield [
            *modes,
            Relay(
                "nginx",
                f"http://127.0.0.1:{nginx_port}",
                lambda: [nginx.pid, *procfs.children(nginx.pid)],
            ),
            Relay("passthrough", f"http://127.0.0.1:{floor_port}", lambda: [floor.pid]),
        ]
    finally:
        children.stop()
        shutil.rmtree(work, ignore_errors=True)


@dataclass
class StreamStats:
    ttfb: float
    gaps: list[float]
    events: int


async def _stream(
    session: aiohttp.ClientSession, url: str, chunks: int, interval: float, kind: StreamKind
) -> StreamStats:
    """One stream of ``chunks`` token events of the API ``kind``; the gaps between reads are
    kept for paced streams only (an unpaced stream's reads are back to back)."""
    body = {
        "model": "bench",
        **kind.body,
        "stream": True,
        kind.limit: chunks,
        "bench_interval": interval,
    }
    started = time.perf_counter()
    ttfb = 0.0
    gaps: list[float] = []
    events = 0
    last = None
    tail = b""  # a lone "\n" that may be the first half of a separator split across reads
    async with session.post(url + kind.path, json=body) as resp:
        assert resp.status == 200, resp.status
        async for data in resp.content.iter_any():
            if last is None:
                last = time.perf_counter()
                ttfb = last - started
            elif interval:
                now = time.perf_counter()
                gaps.append(now - last)
                last = now
            joined = tail + data if tail else data
            events += joined.count(b"\n\n")
            tail = b"\n" if joined.endswith(b"\n") and not joined.endswith(b"\n\n") else b""
    # Every token event and every other event arrived: the relay lost nothing.
    assert events == chunks + kind.framing, (events, chunks)
    return StreamStats(ttfb, gaps, events)


async def _wave(
    session: aiohttp.ClientSession,
    url: str,
    streams: int,
    chunks: int,
    interval: float,
    *,
    kind: StreamKind,
) -> list[StreamStats]:
    return list(
        await asyncio.gather(
            *(_stream(session, url, chunks, interval, kind) for _ in range(streams))
        )
    )


@dataclass
class Turn:
    """One mode's measurements in one round, at one concurrency."""

    ttfbs: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    paced_events: int = 0
    paced_cpu: float = 0.0
    paced_calls: int = 0  # read and write system calls: fewer a read means more batched
    unpaced_events: int = 0
    unpaced_cpu: float = 0.0
    unpaced_wall: float = 0.0
    short_requests: int = 0
    short_cpu: float = 0.0
    rss_kib: int = 0


@dataclass(frozen=True)
class Plan:
    """How much each measurement of one turn does."""

    paced_waves: int
    paced_chunks: int
    unpaced_chunks: int
    short_waves: int

    @classmethod
    def of(cls, streams: int, rounds: int, quick: bool) -> Plan:
        # Paced: at least 64 streams' worth of samples over all rounds, so a p99 means
        # something at 1 stream too. Unpaced: a budget of events over all rounds.
        waves = max(3, 64 // streams) // (4 if quick else 1) or 1
        budget = 60_000 if quick else 200_000
        requests = 256 if quick else 1024
        return cls(
            paced_waves=math.ceil(waves / rounds),
            paced_chunks=PACED_CHUNKS // (2 if quick else 1),
            unpaced_chunks=max(100, budget // rounds // streams),
            short_waves=max(2, requests // streams),
        )


async def _sample_rss(relay: Relay, turn: Turn, stop: asyncio.Event) -> None:
    while not stop.is_set():
        turn.rss_kib = max(turn.rss_kib, procfs.rss_bytes(relay.pids()) // 1024)
        await asyncio.sleep(0.05)


async def measure(
    relay: Relay, streams: int, plan: Plan, kind: StreamKind = STREAM_KINDS["completions"]
) -> Turn:
    turn = Turn()
    stop = asyncio.Event()
    sampler = asyncio.create_task(_sample_rss(relay, turn, stop))

    def cpu() -> float:
        return procfs.run_seconds(relay.pids())

    # The client's own full collections (20-40 ms at 64 streams) would otherwise run inside a
    # measured wave, and because the client allocates alike every run, they land on the same
    # mode's wave run after run. Collect before each turn and not during it, for every mode.
    gc.collect()
    gc.disable()
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            # Open the streams' connections (and the relay's upstream ones) beforehand: the
            # paced and unpaced runs measure the streams, the short run the connections.
            await _wave(session, relay.url, streams, 2, 0.0, kind=kind)
            before, calls = cpu(), procfs.io_calls(relay.pids())
            for _ in range(plan.paced_waves):
                for s in await _wave(
                    session, relay.url, streams, plan.paced_chunks, PACED_INTERVAL, kind=kind
                ):
                    turn.ttfbs.append(s.ttfb)
                    turn.gaps += s.gaps
                    turn.paced_events += s.events
            turn.paced_cpu = cpu() - before
            turn.paced_calls = procfs.io_calls(relay.pids()) - calls
            before, started = cpu(), time.perf_counter()
            unpaced = await _wave(session, relay.url, streams, plan.unpaced_chunks, 0.0, kind=kind)
            turn.unpaced_cpu, turn.unpaced_wall = cpu() - before, time.perf_counter() - started
            turn.unpaced_events = sum(s.events for s in unpaced)
        # A new connection for every request: force_close closes each after its response.
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session:
            before = cpu()
            for _ in range(plan.short_waves):
                await _wave(session, relay.url, streams, SHORT_CHUNKS, 0.0, kind=kind)
            turn.short_cpu = cpu() - before
            turn.short_requests = plan.short_waves * streams
    finally:
        gc.enable()
        stop.set()
        await sampler
    return turn


@dataclass(frozen=True)
class Figures:
    """One mode at one concurrency over all rounds: CPU figures are medians of the rounds'
    (their spread in ``*_rounds``), percentiles are of all rounds' samples pooled."""

    cpu_us_per_event: float
    cpu_ms_per_request: float
    events_per_cpu_s: float
    events_per_s: float
    ttfb_p50: float
    ttfb_p99: float
    gap_p99: float
    rss_mib: float
    calls_per_event: float
    cpu_us_per_event_rounds: tuple[float, ...]
    cpu_ms_per_request_rounds: tuple[float, ...]
    events_per_cpu_s_rounds: tuple[float, ...]

    @classmethod
    def of(cls, turns: list[Turn]) -> Figures:
        def per(num: float, den: float) -> float:
            return num / den if den > 0 else math.nan

        us = tuple(per(t.paced_cpu * 1e6, t.paced_events) for t in turns)
        ms = tuple(per(t.short_cpu * 1e3, t.short_requests) for t in turns)
        rate = tuple(per(t.unpaced_events, t.unpaced_cpu) for t in turns)
        ttfbs = [x for t in turns for x in t.ttfbs]
        gaps = [x for t in turns for x in t.gaps]
        return cls(
            cpu_us_per_event=statistics.median(us),
            cpu_ms_per_request=statistics.median(ms),
            events_per_cpu_s=statistics.median(rate),
            events_per_s=statistics.median(per(t.unpaced_events, t.unpaced_wall) for t in turns),
            ttfb_p50=quantile(ttfbs, 0.5),
            ttfb_p99=quantile(ttfbs, 0.99),
            gap_p99=quantile(gaps, 0.99),
            rss_mib=max(t.rss_kib for t in turns) / 1024,
            calls_per_event=statistics.median(per(t.paced_calls, t.paced_events) for t in turns),
            cpu_us_per_event_rounds=us,
            cpu_ms_per_request_rounds=ms,
            events_per_cpu_s_rounds=rate,
        )


Results = dict[tuple[str, int], Figures]


def _added(results: Results, name: str, streams: int, key: str) -> float:
    """The mode's figure minus direct's at the same concurrency, in ms."""
    mode, base = results[(name, streams)], results[("direct", streams)]
    return float(getattr(mode, key) - getattr(base, key)) * 1000


def _spread(values: tuple[float, ...], fmt: str) -> str:
    return "/".join(format(v, fmt) for v in values)


def _relays(results: Results) -> list[str]:
    """The relays that ran, in MODES' order."""
    ran = {name for name, _ in results}
    return [name for name in MODES[1:] if name in ran]


COLUMNS = ["streams", "relay", "CPU µs per event (paced)", "x nginx", "CPU ms per request (short)"]
COLUMNS += ["x nginx", "events per relay CPU-s (unpaced)", "x nginx", "added TTFB p50 ms"]
COLUMNS += ["added TTFB p99 ms", "added gap p99 ms", "RSS peak MiB"]


def _cells(results: Results, name: str, streams: int) -> list[str]:
    """A relay's row at a concurrency: its CPU beside nginx's, its added latency over direct."""
    r, nginx = results[(name, streams)], results[("nginx", streams)]
    return [
        str(streams),
        name,
        f"{r.cpu_us_per_event:.1f}",
        f"{r.cpu_us_per_event / nginx.cpu_us_per_event:.2f}",
        f"{r.cpu_ms_per_request:.3f}",
        f"{r.cpu_ms_per_request / nginx.cpu_ms_per_request:.2f}",
        f"{r.events_per_cpu_s:,.0f}",
        f"{r.events_per_cpu_s / nginx.events_per_cpu_s:.2f}",
        *(f"{_added(results, name, streams, k):+.2f}" for k in ("ttfb_p50", "ttfb_p99", "gap_p99")),
        f"{r.rss_mib:.1f}",
    ]


def report(results: Results, rounds: int) -> str:
    ran = sorted({s for _, s in results})
    relays_ran = _relays(results)
    lines = [
        f"Medians of {rounds} interleaved rounds; percentiles of all rounds' samples pooled.",
        "",
        record.table(
            COLUMNS,
            [_cells(results, name, streams) for streams in ran for name in relays_ran],
            "rl" + "r" * 10,
        ),
    ]
    lines += ["", "Direct (absolute):"]
    for streams in ran:
        d = results[("direct", streams)]
        lines.append(
            f"- {streams} streams: TTFB p50 {d.ttfb_p50 * 1000:.2f} ms, "
            f"p99 {d.ttfb_p99 * 1000:.2f} ms, gap p99 {d.gap_p99 * 1000:.2f} ms, "
            f"{d.events_per_s:,.0f} events/s received (unpaced)"
        )
    lines += ["", "Per round (CPU µs per event / ms per request / events per CPU-s), and the"]
    lines += ["read and write calls per paced event (/proc/PID/io, median; libuv relays only):"]
    for streams in ran:
        for name in relays_ran:
            r = results[(name, streams)]
            lines.append(
                f"- {streams} {name}: {_spread(r.cpu_us_per_event_rounds, '.1f')}; "
                f"{_spread(r.cpu_ms_per_request_rounds, '.3f')}; "
                f"{_spread(r.events_per_cpu_s_rounds, ',.0f')}; "
                f"{r.calls_per_event:.2f} calls per event"
            )
    if "kvtax-before" in relays_ran:
        lines += ["", "This checkout's kvtax against kvtax-before's (after / before):"]
        for streams in ran:
            now, old = results[("kvtax", streams)], results[("kvtax-before", streams)]
            lines.append(
                f"- {streams} streams: CPU per event "
                f"{now.cpu_us_per_event / old.cpu_us_per_event:.3f}x, CPU per request "
                f"{now.cpu_ms_per_request / old.cpu_ms_per_request:.3f}x, events per CPU-s "
                f"{now.events_per_cpu_s / old.events_per_cpu_s:.3f}x"
            )
    return "\n".join([*lines, "", *_targets(results, ran)])


@dataclass(frozen=True)
class Target:
    """One of the issue's targets for kvtax: a figure at a concurrency, and its limit."""

    streams: int
    what: str
    key: str  # a Figures field
    against: str  # "nginx": a ratio to nginx's; "direct": added ms over direct's; "": as is
    limit: float
    at_least: bool = False

    def value(self, results: Results, name: str) -> float:
        figure = float(getattr(results[(name, self.streams)], self.key))
        if self.against == "nginx":
            return figure / float(getattr(results[("nginx", self.streams)], self.key))
        if self.against == "direct":
            return _added(results, name, self.streams, self.key)
        return figure

    def line(self, results: Results) -> str:
        unit = {"nginx": "x", "direct": " ms", "": " MiB"}[self.against]
        fmt = "+.2f" if self.against == "direct" else ".2f"
        kvtax, floor = self.value(results, "kvtax"), self.value(results, "passthrough")
        met = kvtax >= self.limit if self.at_least else kvtax <= self.limit
        return (
            f"- {self.streams} {self.what} {'>=' if self.at_least else '<='} {self.limit:g}"
            f"{unit}{' nginx' if self.against == 'nginx' else ''}: kvtax {kvtax:{fmt}}{unit} "
            f"(pass-through {floor:{fmt}}{unit}): **{'met' if met else 'NOT met'}**"
        )


TARGETS = (
    Target(64, "paced streams, CPU per event", "cpu_us_per_event", "nginx", 1.3),
    Target(64, "paced streams, added TTFB p50", "ttfb_p50", "direct", 5),
    Target(64, "paced streams, added TTFB p99", "ttfb_p99", "direct", 15),
    Target(64, "paced streams, added p99 gap", "gap_p99", "direct", 1),
    Target(64, "short streams (4 events), CPU per request", "cpu_ms_per_request", "nginx", 1.5),
    Target(64, "unpaced streams, events per CPU-s", "events_per_cpu_s", "nginx", 0.8, True),
    Target(512, "paced streams, added p99 gap", "gap_p99", "direct", 5),
    Target(512, "paced streams, added TTFB p99", "ttfb_p99", "direct", 50),
    Target(512, "paced streams, RSS peak", "rss_mib", "", 128),
)


def _targets(results: Results, ran: list[int]) -> list[str]:
    """The issue's targets, kvtax against nginx in this same run, the floor beside."""
    out = ["## Targets", ""]
    for target in TARGETS:
        if target.streams in ran:
            out.append(target.line(results))
        else:
            out.append(
                f"- {target.streams} {target.what}: not checked, {target.streams} did not run"
            )
    return out


async def main_async(
    quick: bool,
    concurrency: tuple[int, ...] = CONCURRENCY,
    kvtax_args: tuple[str, ...] = (),
    rounds: int = ROUNDS,
    *,
    pinned: bool = True,
    before: Path | None = None,
    apis: tuple[str, ...] = ("completions",),
) -> str:
    turns: dict[str, dict[tuple[str, int], list[Turn]]] = {api: {} for api in apis}
    with relays(kvtax_args, pinned=pinned, before=before) as modes:
        for api in apis:
            await _measure_api(
                modes, api, concurrency=concurrency, rounds=rounds, quick=quick, turns=turns[api]
            )
    placement = (
        f"pinned: each relay on core {RELAY_CORE}, the upstream and the load on core {LOAD_CORE}"
        if pinned
        else "unpinned: every process on any core, as in a pod where the relay and vLLM's API "
        "server share a CPU limit"
    )
    results = {api: {k: Figures.of(ts) for k, ts in by.items()} for api, by in turns.items()}
    if len(apis) == 1:
        return f"Placement: {placement}.\n\n" + report(results[apis[0]], rounds)
    sections = [f"Placement: {placement}.", "", *_by_api(results)]
    for api in apis:
        sections += ["", f"## {api} streams", "", report(results[api], rounds)]
    return "\n".join(sections)


def _by_api(results: dict[str, Results]) -> list[str]:
    """kvtax's CPU per event and per request on each API, beside nginx's in the same run."""
    header = ["API", "streams", "kvtax µs per event", "x nginx", "kvtax ms per request", "x nginx"]
    rows = []
    for api, figures in results.items():
        for streams in sorted({s for _, s in figures}):
            kvtax, nginx = figures[("kvtax", streams)], figures[("nginx", streams)]
            event, request = kvtax.cpu_us_per_event, kvtax.cpu_ms_per_request
            x_event = f"{event / nginx.cpu_us_per_event:.2f}"
            x_request = f"{request / nginx.cpu_ms_per_request:.2f}"
            rows.append([api, str(streams), f"{event:.1f}", x_event, f"{request:.3f}", x_request])
    title = "CPU per event (paced) and per request (short), by the API streamed:"
    return [title, "", record.table(header, rows, "lrrrrr")]


async def _measure_api(
    modes: list[Relay],
    api: str,
    *,
    concurrency: tuple[int, ...],
    rounds: int,
    quick: bool,
    turns: dict[tuple[str, int], list[Turn]],
) -> None:
    """Every relay's rounds at every concurrency, on streams of the API ``api``."""
    kind = STREAM_KINDS[api]
    for streams in sorted(concurrency):
        plan = Plan.of(streams, rounds, quick)
        for r in range(rounds):
            # Rotate the order each round, so that no mode always follows the same one.
            for relay in modes[r % len(modes) :] + modes[: r % len(modes)]:
                turn = await measure(relay, streams, plan, kind)
                turns.setdefault((relay.name, streams), []).append(turn)
                one = Figures.of([turn])
                cost = (
                    f"{one.cpu_us_per_event:.1f} µs/event paced, "
                    f"{one.cpu_ms_per_request:.3f} ms/request short, "
                    f"{one.events_per_cpu_s:,.0f} events/CPU-s unpaced, "
                    f"RSS {one.rss_mib:.1f} MiB, "
                    if relay.name != "direct"
                    else ""
                )
                print(
                    f"{api}, round {r + 1}/{rounds}, {streams} streams, {relay.name}: {cost}"
                    f"TTFB p50 {one.ttfb_p50 * 1000:.2f} ms, "
                    f"gap p99 {one.gap_p99 * 1000:.2f} ms",
                    file=sys.stderr,
                )


def _concurrencies(value: str) -> tuple[int, ...]:
    streams = tuple(int(x) for x in value.split(","))
    if not streams or min(streams) < 1:
        raise argparse.ArgumentTypeError(f"concurrencies must be positive integers: {value!r}")
    return streams


def _apis(value: str) -> tuple[str, ...]:
    apis = tuple(value.split(","))
    unknown = [api for api in apis if api not in STREAM_KINDS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown API {', '.join(unknown)}: choose from {', '.join(STREAM_KINDS)}"
        )
    return apis


def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {value!r}")
    return n


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="Fewer events and requests per measurement: a check that the run works.",
    )
    parser.add_argument("--out", type=Path, help="Also write the report to this file.")
    parser.add_argument(
        "--streams",
        type=_concurrencies,
        default=CONCURRENCY,
        help="Concurrencies to run, comma-separated (default 1,64,512; the targets need 64 "
        "and 512).",
    )
    parser.add_argument(
        "--rounds",
        type=_positive,
        default=ROUNDS,
        help=f"Rounds at each concurrency, each measuring every mode once in a rotating order "
        f"(default {ROUNDS}).",
    )
    parser.add_argument(
        "--kvtax-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="An extra flag for `kvtax serve`, e.g. --kvtax-arg=--scrape.interval=1h (repeat).",
    )
    parser.add_argument(
        "--unpinned",
        action="store_true",
        help="Pin nothing: the relays, the upstream and the load share every core (default: "
        f"each relay on core {RELAY_CORE}, the upstream and the load on core {LOAD_CORE}).",
    )
    parser.add_argument(
        "--kvtax-before",
        type=Path,
        metavar="DIR",
        help="Also run `kvtax serve` from the checkout DIR (e.g. `git worktree add DIR REV`), "
        "interleaved with the others: a change's before and after in one run.",
    )
    parser.add_argument(
        "--apis",
        type=_apis,
        default=("completions",),
        metavar="NAME[,NAME...]",
        help=f"The APIs whose streams to measure, one after the other in one run: "
        f"{', '.join(STREAM_KINDS)} (default completions).",
    )
    args = parser.parse_args()
    if args.kvtax_before is not None and not (args.kvtax_before / "exporter/kvtax").is_dir():
        parser.error(f"--kvtax-before: {args.kvtax_before} holds no exporter/kvtax")
    _more_files()
    if not args.unpinned:
        os.sched_setaffinity(0, {LOAD_CORE})
    table = asyncio.run(
        main_async(
            args.quick,
            args.streams,
            tuple(args.kvtax_arg),
            args.rounds,
            pinned=not args.unpinned,
            before=args.kvtax_before,
            apis=args.apis,
        )
    )
    print(table)
    if args.out:
        record.save(args.out, table, None)  # every figure is in the tables


if __name__ == "__main__":
    main()
