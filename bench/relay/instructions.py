"""Instructions per relayed event and per request, under valgrind's callgrind: kvtax beside
nginx and the bare pass-through, on one upstream (``python -m bench.relay.instructions``).

CPU time on a shared 2-core VM moves by 10-20 % from run to run; an instruction count repeats
to a percent or so, so a change of a few percent in the relay's work shows. Each relay runs
alone under ``valgrind --tool=callgrind --instr-atstart=no`` (nginx as one process, no
master), in front of :mod:`bench.relay.sse_upstream` (not under valgrind). Once it answers, one
warm-up wave goes through it; then counting is switched on (``callgrind_control -i on``)
for:

- ``paced``: ``--streams`` streams of ``--events`` completions events each, 10 ms apart;
- ``short``: the same number of streams of 4 events each, one connection per stream;

and the instructions counted (Ir: user space, the relay's own process, libraries included;
the kernel's share of a syscall is not counted) are divided by the events, or the requests.
Valgrind runs a relay some 50 times slower, so the streams arrive paced but are read as fast
as the relay can: the counts are per event, whatever the pace.

Run from the repository root, holding the end-to-end lock (about four minutes)::

    flock /tmp/kvtax-e2e.lock .venv/bin/python -m bench.relay.instructions
    .venv/bin/python -m bench.relay.instructions --relays kvtax --streams 16 --events 50
    .venv/bin/python -m bench.relay.instructions --relays kvtax --upstream-version 0.10.1
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from bench import record
from bench.net import free_port, wait_port
from bench.relay.relay import NGINX_CONF, STREAM_KINDS, _kvtax_serve, _stream
from kvtax_dev.fakevllm.fast import VERSION

__all__ = ["Count", "main"]

RELAYS = ("kvtax", "nginx", "passthrough")
SHORT_EVENTS = 4


@dataclass(frozen=True)
class Count:
    relay: str
    paced_per_event: float
    short_per_request: float


def _relay_args(name: str, upstream: int, port: int, work: Path) -> list[str]:
    if name == "kvtax":
        return _kvtax_serve(upstream, port, free_port(), ())
    if name == "passthrough":
        return [
            sys.executable,
            "-m",
            "bench.relay.passthrough",
            f"--port={port}",
            f"--upstream-port={upstream}",
        ]
    conf = NGINX_CONF.format(dir=work, upstream=upstream, port=port)
    (work / "nginx.conf").write_text("master_process off;\n" + conf)
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    return [nginx, "-p", str(work), "-c", str(work / "nginx.conf"), "-e", str(work / "e.log")]


@contextlib.contextmanager
def _under_callgrind(
    name: str, upstream: int, work: Path
) -> Iterator[tuple[subprocess.Popen[bytes], int, Path]]:
    port = free_port()
    out = work / f"{name}.callgrind"
    log = work / f"{name}.log"
    args = [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        f"--callgrind-out-file={out}",
        *_relay_args(name, upstream, port, work),
    ]
    with log.open("wb") as sink:
        proc = subprocess.Popen(args, stdout=sink, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:  # a relay under valgrind starts slowly
            try:
                wait_port(port, proc, log)
                break
            except RuntimeError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise
        yield proc, port, out
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def _control(pid: int, url: str, *flags: str) -> None:
    """``callgrind_control`` on ``pid``. A relay idle in epoll_wait takes the command only once
    it wakes: a cheap request wakes it now and then until the command is taken (and is counted
    too, a request or two beside thousands of events)."""
    args = ["callgrind_control", *flags, str(pid)]
    taken = asyncio.ensure_future(asyncio.to_thread(subprocess.run, args, check=True))
    async with aiohttp.ClientSession() as session:
        while not taken.done():
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(url + "/v1/models", timeout=aiohttp.ClientTimeout(5)):
                    pass
            await asyncio.sleep(0.2)
    await taken


def _counted(out: Path) -> int:
    """The Ir counted in a dump (its ``totals:`` line), every dump of the run summed."""
    total = 0
    for path in out.parent.glob(out.name + "*"):
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("totals:"):
                total += int(line.split()[1])
                break
    return total


async def _waves(url: str, streams: int, events: int, interval: float) -> int:
    kind = STREAM_KINDS["completions"]
    connector = aiohttp.TCPConnector(limit=0, force_close=events == SHORT_EVENTS)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(
            *(_stream(session, url, events, interval, kind) for _ in range(streams))
        )
    return streams


async def _count(
    proc: subprocess.Popen[bytes], url: str, out: Path, *, streams: int, events: int, short: bool
) -> int:
    """Ir counted over one measured wave (paced, or ``short`` streams of 4 events)."""
    for path in out.parent.glob(out.name + "*"):
        path.unlink()
    await _control(proc.pid, url, "-i", "on")
    if short:
        await _waves(url, streams, SHORT_EVENTS, 0.0)
    else:
        await _waves(url, streams, events, 0.01)
    await _control(proc.pid, url, "-i", "off")
    await _control(proc.pid, url, "--dump")
    deadline = time.monotonic() + 60
    while not (counted := _counted(out)) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)  # the dump is written at the relay's next turn
    return counted


async def _measure(name: str, upstream: int, work: Path, streams: int, events: int) -> Count:
    with _under_callgrind(name, upstream, work) as (proc, port, out):
        url = f"http://127.0.0.1:{port}"
        await _waves(url, streams, 10, 0.0)  # warm-up: connections, buffers, imports
        paced = await _count(proc, url, out, streams=streams, events=events, short=False)
        short = await _count(proc, url, out, streams=streams, events=events, short=True)
    # Each stream's events, and its one [DONE].
    return Count(name, paced / (streams * (events + 1)), short / streams)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--relays",
        default=",".join(RELAYS),
        help=f"comma-separated, of {', '.join(RELAYS)} (default all)",
    )
    parser.add_argument("--streams", type=int, default=32, help="streams per wave (default 32)")
    parser.add_argument(
        "--events", type=int, default=100, help="events per paced stream (default 100)"
    )
    parser.add_argument(
        "--upstream-version",
        default=VERSION,
        help=(
            f"the vLLM version the upstream says it is (default {VERSION}); one before the "
            "token ids (0.10.1) has kvtax count by continuous usage"
        ),
    )
    args = parser.parse_args()
    names = [name.strip() for name in args.relays.split(",") if name.strip()]
    unknown = sorted(set(names) - set(RELAYS))
    if unknown:
        parser.error(f"--relays: unknown relay(s) {', '.join(unknown)}; known: {RELAYS}")
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        parser.error("valgrind and callgrind_control are needed: apt-get install valgrind")
    work = Path(tempfile.mkdtemp(prefix="kvtax-bench-ir-"))
    upstream_port = free_port()
    log = work / "upstream.log"
    with log.open("wb") as sink:
        upstream = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.relay.sse_upstream",
                f"--port={upstream_port}",
                f"--version={args.upstream_version}",
            ],
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_port(upstream_port, upstream, log)
        counts = []
        for name in names:
            print(f"{name}: under callgrind ...", file=sys.stderr, flush=True)
            counts.append(
                asyncio.run(_measure(name, upstream_port, work, args.streams, args.events))
            )
    finally:
        upstream.terminate()
        upstream.wait()
        shutil.rmtree(work, ignore_errors=True)
    base = next((c for c in counts if c.relay == "nginx" and c.paced_per_event), None)
    print(f"{args.streams} streams; paced: {args.events} events each; short: 4 events each\n")
    rows = []
    for c in counts:
        event_x = f"{c.paced_per_event / base.paced_per_event:.2f}" if base else "-"
        request_x = f"{c.short_per_request / base.short_per_request:.2f}" if base else "-"
        paced, short = f"{c.paced_per_event:,.0f}", f"{c.short_per_request:,.0f}"
        rows.append([c.relay, paced, event_x, short, request_x])
    header = ["relay", "Ir per event (paced)", "x nginx", "Ir per request (short)", "x nginx"]
    print(record.table(header, rows, "lrrrr"))


if __name__ == "__main__":
    main()
