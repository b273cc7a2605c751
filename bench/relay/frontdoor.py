"""What hostile traffic costs kvtax's proxy in memory: the figures issue 29 asks to be bounded.

The proxy runs alone in a child process (:mod:`bench.relay.proxy_child`, uvloop, ``kvtax serve``'s
defaults), in front of the test suite's scriptable upstream
(:class:`kvtax_dev.fakevllm.upstream.RawUpstream`, in this process), so that only the proxy's memory
is measured. For each scenario the child's peak RSS (VmHWM, reset first through
``/proc/<pid>/clear_refs``) is compared with its RSS before, and its CPU time is read:

- ``flood``: one connection pipelines 100,000 small requests in one write and reads nothing;
- ``n2-hold``: an n=2 stream whose choice 0 finishes first while choice 1 sends 64 MiB, read as
  fast as the client can;
- ``head``: vLLM answers with a 32 MiB head;
- ``gzip-bomb``: vLLM answers a stream with gzip that inflates to 256 MiB, to a client that
  reads 1 MiB and then nothing for the rest of the scenario;
- ``body-*`` (issue 43): one accounted request of about 60 MiB of millions of small JSON
  values (:func:`kvtax_dev.fakevllm.client.costly_bodies`; ``body-token-ids-gate`` with the gate
  on), which vLLM answers 400 once it has it, while a probe asks the proxy's loop for
  ``/healthz`` every 10 ms: the worst answer is what every stream of the pod waited meanwhile.

Run from the repository root (take the end-to-end lock; it takes about a minute)::

    flock /tmp/kvtax-e2e.lock .venv/bin/python -m bench.relay.frontdoor
    .venv/bin/python -m bench.relay.frontdoor --only flood --seconds 6
    .venv/bin/python -m bench.relay.frontdoor --bodies   # the body-* scenarios only

The unit tests (tests/unit/test_front_door.py) assert the bounds on what a test can see
deterministically; this prints the RSS figures behind them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import subprocess
import sys
import time
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from bench import procfs, record
from kvtax_dev.fakevllm.client import (
    connect,
    costly_bodies,
    post,
    raw_request,
    read_head,
    read_reply,
)
from kvtax_dev.fakevllm.events import DONE, completion_event, sse, usage_event
from kvtax_dev.fakevllm.raw import LAST_CHUNK, Link, Seen, answer, chunk, stream_head, writes
from kvtax_dev.fakevllm.upstream import RawUpstream

__all__ = ["Figure", "main"]

# A scenario against the proxy child's port (and its /healthz port): what happened, in words.
Run = Callable[[int, int], Awaitable[str]]

ROOT = Path(__file__).resolve().parents[2]
MiB = 1024**2
FLOOD = 100_000  # requests pipelined in one write by the flood


@dataclass(frozen=True)
class Figure:
    scenario: str
    rss_before_mib: float
    peak_growth_mib: float
    cpu_seconds: float
    note: str


async def _measure(
    upstream: RawUpstream, name: str, run: Run, child_args: tuple[str, ...] = ()
) -> Figure:
    """Start a proxy child in front of ``upstream``, run one scenario against its port."""
    child = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench.relay.proxy_child",
            f"--upstream={upstream.url}",
            "--healthz",
            *child_args,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": f"{ROOT / 'exporter'}:{ROOT}"},
    )
    try:
        assert child.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 30)
        port = int(line.split()[1])
        line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 30)
        healthz = int(line.split()[1])
        # Warm up: one plain request through (whatever the scenario's script), so that the
        # baseline includes a live connection each way.
        upstream.then(answer(200, [("Content-Type", "text/plain")], b"ok"))
        reader, writer = await connect(port)
        writer.write(raw_request("GET", "/v1/models"))
        await read_head(reader)
        writer.close()
        before = procfs.rss_bytes([child.pid])
        cpu_before = procfs.cpu_seconds([child.pid])
        procfs.reset_peak(child.pid)
        note = await run(port, healthz)
        peak = procfs.peak_rss_bytes([child.pid])
        cpu = procfs.cpu_seconds([child.pid]) - cpu_before
    finally:
        child.terminate()
        await asyncio.to_thread(child.wait, 30)
        if child.stdout is not None:
            child.stdout.close()
    return Figure(name, before / MiB, (peak - before) / MiB, cpu, note)


async def _flood(upstream: RawUpstream, seconds: float) -> Run:
    upstream.script = answer(200, [("Content-Type", "text/plain")], b"z" * 1024)

    async def run(port: int, healthz: int) -> str:
        start = len(upstream.seen)
        _, writer = await connect(port, rcvbuf=4096)
        writer.write(raw_request("GET", "/v1/models") * FLOOD)
        await asyncio.sleep(seconds)  # the client reads nothing
        reached = len(upstream.seen) - start
        writer.transport.abort()
        return f"{reached:,} of {FLOOD:,} requests reached vLLM in {seconds:g} s"

    return run


async def _n2_hold(upstream: RawUpstream, total: int) -> Run:
    async def script(seen: Seen, link: Link) -> None:
        await seen.complete.wait()
        await link.send(stream_head())
        await link.send(chunk(sse(completion_event(0, "a", finish="length", usage=(3, 1)))))
        sent, k, batch = 0, 0, []
        while sent < total:
            k += 1
            event = sse(completion_event(1, "b" * 1000, usage=(3, k)))
            batch.append(event)
            sent += len(event)
            if len(batch) == 64:
                await link.send(chunk(b"".join(batch)))
                batch.clear()
        last = completion_event(1, "end", finish="length", usage=(3, k + 1))
        tail = sse(last) + sse(usage_event(3, k + 2)) + DONE
        await link.send(chunk(b"".join(batch) + tail), LAST_CHUNK)

    upstream.script = script

    async def run(port: int, healthz: int) -> str:
        reader, writer = await connect(port)
        writer.write(post("/v1/completions", {"model": "m", "stream": True, "n": 2}))
        got = 0
        while piece := await asyncio.wait_for(reader.read(1 << 20), 60):
            got += len(piece)
            if piece.endswith(b"0\r\n\r\n"):
                break
        writer.close()
        after = f"{total / MiB:.0f} MiB of choice 1 after choice 0 finished"
        return f"{after}; the client read {got / MiB:.0f} MiB"

    return run


async def _head(upstream: RawUpstream, size: int) -> Run:
    sent: list[int] = []

    async def script(seen: Seen, link: Link) -> None:
        await seen.complete.wait()
        line = b"X-Big: " + b"a" * 8000 + b"\r\n"
        try:
            await link.send(b"HTTP/1.1 200 OK\r\n")
            while link.sent < size:
                await link.send(line * 8)
            await link.send(b"Content-Length: 2\r\n\r\nok")
        finally:
            sent.append(link.sent)

    upstream.script = script

    async def run(port: int, healthz: int) -> str:
        reader, writer = await connect(port)
        writer.write(raw_request("GET", "/x"))
        status = await asyncio.wait_for(reader.readline(), 60)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(30):
                while not sent:
                    await asyncio.sleep(0.05)
        writer.close()
        could = sent[0] / MiB if sent else -1
        return f"the client got {status.strip()!r}; vLLM could send {could:.1f} MiB"

    return run


def _bomb(inflated: int) -> bytes:
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    parts = [
        packer.compress(sse(completion_event(0, "a", usage=(3, 1)))),
        packer.compress(b"data: "),
    ]
    zeros = b"0" * MiB
    parts += [packer.compress(zeros) for _ in range(inflated // MiB)]
    parts += [packer.compress(b"\n\n" + DONE), packer.flush()]
    return b"".join(parts)


async def _gzip_bomb(upstream: RawUpstream, inflated: int, seconds: float) -> Run:
    bomb = _bomb(inflated)
    upstream.script = writes(stream_head([("Content-Encoding", "gzip")]), chunk(bomb) + LAST_CHUNK)

    async def run(port: int, healthz: int) -> str:
        reader, writer = await connect(port, rcvbuf=16 * 1024)
        writer.write(post("/v1/completions", {"model": "m", "stream": True}))
        got = 0
        while got < MiB:
            got += len(await asyncio.wait_for(reader.read(65536), 60))
        await asyncio.sleep(seconds)  # then reads nothing
        writer.transport.abort()
        gzip = f"{len(bomb) / 1024:.0f} KiB of gzip inflating to {inflated / MiB:.0f} MiB"
        return f"{gzip}; the client read 1 MiB, then nothing for {seconds:g} s"

    return run


async def _body(upstream: RawUpstream, path: str, body: bytes) -> Run:
    upstream.script = answer(400, [("Content-Type", "application/json")], b'{"error":"no"}')

    async def run(port: int, healthz: int) -> str:
        probe_reader, probe_writer = await connect(healthz)
        worst, probes, sending = 0.0, 0, True

        async def probe() -> None:
            nonlocal worst, probes
            while sending:
                began = time.perf_counter()
                probe_writer.write(raw_request("GET", "/healthz"))
                await read_reply(probe_reader)
                worst, probes = max(worst, time.perf_counter() - began), probes + 1
                await asyncio.sleep(0.01)

        probing = asyncio.ensure_future(probe())
        reader, writer = await connect(port)
        headers = [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
        writer.write(raw_request("POST", path, headers=headers))
        for start in range(0, len(body), MiB):
            writer.write(body[start : start + MiB])
            await writer.drain()
        reply = await asyncio.wait_for(read_reply(reader), 120)
        await asyncio.sleep(0.3)  # and what the proxy does after its answer
        sending = False
        await probing
        writer.close()
        probe_writer.close()
        return (
            f"{len(body) / MiB:.0f} MiB, answered {reply.status}; worst /healthz of {probes}:"
            f" {worst * 1000:.0f} ms"
        )

    return run


def _slug(name: str) -> str:
    return "body-" + name.replace(" ", "-")


async def _run(args: argparse.Namespace) -> list[Figure]:
    figures: list[Figure] = []
    scenarios: dict[str, Callable[[RawUpstream], Awaitable[Run]]] = {
        "flood": lambda up: _flood(up, args.seconds),
        "n2-hold": lambda up: _n2_hold(up, 64 * MiB),
        "head": lambda up: _head(up, 32 * MiB),
        "gzip-bomb": lambda up: _gzip_bomb(up, 256 * MiB, args.seconds),
    }
    child_args: dict[str, tuple[str, ...]] = {}
    if args.bodies or any(name.startswith("body-") for name in args.only or ()):
        for label, path, body in costly_bodies(60 * MiB):
            scenarios[_slug(label)] = functools.partial(_body, path=path, body=body)
            if label == "token ids":
                gated = functools.partial(_body, path=path, body=body)
                scenarios["body-token-ids-gate"] = gated
    child_args["body-token-ids-gate"] = ("--gate-budget=1000000000",)
    for name, make in scenarios.items():
        if args.only and name not in args.only:
            continue
        if args.bodies != name.startswith("body-") and not args.only:
            continue
        upstream = RawUpstream()
        await upstream.start()
        try:
            run = await make(upstream)
            figures.append(await _measure(upstream, name, run, child_args.get(name, ())))
        finally:
            await upstream.stop()
        print(json.dumps(asdict(figures[-1])), file=sys.stderr, flush=True)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", help="run only this scenario (repeatable)")
    parser.add_argument(
        "--seconds", type=float, default=6.0, help="how long a client reads nothing"
    )
    parser.add_argument("--json", action="store_true", help="print JSON lines, not a table")
    parser.add_argument(
        "--bodies", action="store_true", help="run the body-* scenarios (issue 43) instead"
    )
    args = parser.parse_args(argv)
    began = time.monotonic()
    figures = asyncio.run(_run(args))
    if args.json:
        for figure in figures:
            print(json.dumps(asdict(figure)))
    else:
        header = ("scenario", "RSS before (MiB)", "peak growth (MiB)", "CPU (s)", "what happened")
        rows = [
            (
                f.scenario,
                f"{f.rss_before_mib:.0f}",
                f"{f.peak_growth_mib:.1f}",
                f"{f.cpu_seconds:.1f}",
                f.note,
            )
            for f in figures
        ]
        print(record.table(header, rows, "lrrrl"))
        print(f"\n({time.monotonic() - began:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
