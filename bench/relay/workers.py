"""What a proxy worker's talk with its parent would cost: one settled record reported, one
admission asked (``python -m bench.relay.workers``; issue 45, ``--proxy.workers``).

With N workers relaying, one parent keeps the ledger and the gate. Each request then costs a
worker one report (its settled record) and, with the gate on, one question (may it go to vLLM?)
answered by the parent. This bench measures both over the transport a worker would use: a Unix
stream socket between two uvloop processes, length-prefixed msgspec (MessagePack) frames,
the parent applying each record to a real :class:`~kvtax.delivery.ledger.DeliveryLedger`.

- ``records``: the worker writes each record as it settles (one ``transport.write`` each);
- ``batched``: the worker writes what settled in one turn of its loop in one write;
- ``asks``: 64 requests at a time ask and wait for the parent's answer, as a gate's admission
  would (the parent answers at once: the figure is the transport's, not the gate's);
- and, for scale, the same record settled in the process that relayed it, as one kvtax does.

CPU is each process's own (``time.process_time``: user and system), per record or per ask, and
an ask's round trip is wall time. Run it alone, holding the end-to-end lock::

    flock /tmp/kvtax-e2e.lock .venv/bin/python -m bench.relay.workers
"""

from __future__ import annotations

import argparse
import asyncio
import os
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import msgspec
import uvloop

from bench import record
from bench.stats import quantile
from kvtax.delivery.ledger import DeliveryLedger, ModelNames, RequestRecord

__all__ = ["main"]

_LENGTH = struct.Struct("<I")
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder()
MODES = ("records", "batched", "asks")
_CONCURRENT_ASKS = 64
# A stream's record as a worker would send it: its counts, its timing, its ITL bucket counts.
_RECORD: tuple[object, ...] = (
    "record",
    "tiny-llama",
    "completed",
    412,
    0,
    128,
    0,
    True,
    3.2,
    0.041,
    [0, 3, 120, 260, 20, 5, 2, 1, 0, 0, 0, 0, 0, 0],
    8.25,
    [],
    True,
    False,
    "chat",
)


def _frame(message: object) -> bytes:
    body = _ENCODER.encode(message)
    return _LENGTH.pack(len(body)) + body


class _Frames(asyncio.Protocol):
    """Length-prefixed frames in, each handed to ``on_message``."""

    def __init__(self, on_message: Callable[[list[object], asyncio.Transport], None]) -> None:
        self._buffer = bytearray()
        self._on_message = on_message
        self.transport: asyncio.Transport | None = None
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        at = 0
        while len(buffer) - at >= 4:
            (size,) = _LENGTH.unpack_from(buffer, at)
            if len(buffer) - at - 4 < size:
                break
            message = _DECODER.decode(buffer[at + 4 : at + 4 + size])
            at += 4 + size
            assert self.transport is not None
            self._on_message(message, self.transport)
        del buffer[:at]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


def _settle(ledger: DeliveryLedger, m: list[object]) -> None:
    """A record as the parent would apply it."""
    ledger.settle(
        RequestRecord(
            model=str(m[1]),
            outcome=str(m[2]),
            delivered_tokens=int(m[3]),  # type: ignore[call-overload]
            credited_tokens=int(m[4]),  # type: ignore[call-overload]
            prompt_tokens=int(m[5]),  # type: ignore[call-overload]
            undelivered_tokens=int(m[6]),  # type: ignore[call-overload]
            forwarded=bool(m[7]),
            duration=float(m[8]),  # type: ignore[arg-type]
            ttft=float(m[9]),  # type: ignore[arg-type]
            slo_met=bool(m[13]),
            usage_missing=bool(m[14]),
            api=str(m[15]),
        )
    )


async def _parent(path: str, mode: str, n: int) -> tuple[float, float, float, list[float]]:
    """Serve one worker; its CPU per operation, the parent's, the run's seconds, and the asks'
    round trips."""
    names = ModelNames()
    names.update(["tiny-llama"])
    ledger = DeliveryLedger(names)
    done: asyncio.Future[list[object]] = asyncio.get_running_loop().create_future()

    def on_message(message: list[object], transport: asyncio.Transport) -> None:
        kind = message[0]
        if kind == "record":
            _settle(ledger, message)
        elif kind == "ask":
            transport.write(_frame(("grant", message[1])))
        elif not done.done():
            done.set_result(message)

    server = await asyncio.get_running_loop().create_unix_server(lambda: _Frames(on_message), path)
    worker = subprocess.Popen(
        [sys.executable, "-m", "bench.relay.workers", "--worker", path, "--mode", mode, f"-n{n}"]
    )
    began = time.process_time()
    summary = await done
    parent_cpu = time.process_time() - began
    server.close()
    worker.wait()
    settled = sum(ledger.outcomes().values())
    if mode != "asks":
        assert settled == n, (settled, n)
    _, worker_cpu, seconds, trips = summary
    cpu, wall = cast(float, worker_cpu), cast(float, seconds)
    return cpu / n, parent_cpu / n, wall, cast(list[float], trips)


async def _worker(path: str, mode: str, n: int) -> None:
    loop = asyncio.get_running_loop()
    waiting: dict[int, asyncio.Future[None]] = {}

    def on_message(message: list[object], transport: asyncio.Transport) -> None:
        waiting.pop(int(message[1])).set_result(None)  # type: ignore[call-overload]

    transport, _ = await loop.create_unix_connection(lambda: _Frames(on_message), path)
    # Buffered without bound, as a worker would (a report is never dropped for being early).
    transport.set_write_buffer_limits(high=1 << 30)
    trips: list[float] = []
    began, wall = time.process_time(), time.perf_counter()
    if mode == "records":
        for i in range(n):
            transport.write(_frame(_RECORD))
            if i % 64 == 63:
                await asyncio.sleep(0)  # a turn of the loop: the requests of one turn settled
    elif mode == "batched":
        for i in range(0, n, 64):
            transport.write(b"".join(_frame(_RECORD) for _ in range(min(64, n - i))))
            await asyncio.sleep(0)
    else:
        ids = iter(range(n))

        async def asker() -> None:
            for i in ids:
                answered = waiting[i] = loop.create_future()
                sent = time.perf_counter()
                transport.write(_frame(("ask", i)))
                await answered
                trips.append(time.perf_counter() - sent)

        await asyncio.gather(*(asker() for _ in range(_CONCURRENT_ASKS)))
    cpu, seconds = time.process_time() - began, time.perf_counter() - wall
    transport.write(_frame(("done", cpu, seconds, trips)))
    while transport.get_write_buffer_size():  # what the loop still holds is lost as it ends
        await asyncio.sleep(0.01)
    transport.close()


def _in_process(n: int) -> float:
    """CPU per record of settling it in the process that relayed it, as one kvtax does today:
    what the parent's figure is to be read against."""
    names = ModelNames()
    names.update(["tiny-llama"])
    ledger = DeliveryLedger(names)
    message = list(_RECORD)
    began = time.process_time()
    for _ in range(n):
        _settle(ledger, message)
    return (time.process_time() - began) / n


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-n", type=int, default=100_000, help="records or asks (default 100000)")
    parser.add_argument("--mode", choices=MODES, help="one mode (default: all, in turn)")
    parser.add_argument("--worker", metavar="PATH", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        uvloop.run(_worker(args.worker, args.mode, args.n))
        return
    rows = []
    for mode in [args.mode] if args.mode else MODES:
        with tempfile.TemporaryDirectory(prefix="kvtax-ipc-") as work:
            path = str(Path(work) / "parent.sock")
            print(f"{mode}: {args.n:,} ...", file=sys.stderr, flush=True)
            worker, parent, seconds, trips = uvloop.run(_parent(path, mode, args.n))
        p50, p99 = (f"{quantile(trips, q) * 1e6:,.0f}" if trips else "-" for q in (0.5, 0.99))
        rows.append(
            [
                mode,
                f"{worker * 1e6:.2f}",
                f"{parent * 1e6:.2f}",
                f"{args.n / seconds:,.0f}",
                p50,
                p99,
            ]
        )
    alone = f"{_in_process(args.n) * 1e6:.2f}"
    rows.insert(0, ["in process (one kvtax)", "-", alone, "-", "-", "-"])
    print(f"{args.n:,} per mode, pid {os.getpid()}; CPU is each process's own (user + system)\n")
    header = ["mode", "worker CPU µs each", "parent CPU µs each", "per s", "ask p50 µs", "p99 µs"]
    print(record.table(header, rows, "lrrrrr"))


if __name__ == "__main__":
    main()
