"""Benchmark: where to parse vLLM's page so the event loop stays responsive (issue 10, finding 7).

32 loopback streams do ping-pong on one event loop (a write, an echo, a 10 ms pause: a relay's
pattern) while a page of ``--models`` models (about 425 series each) is normalized one of four
ways: ``inline`` on the loop, in a ``thread``, in a ``multiprocessing`` ``process`` pool, and in
kvtax's own ``worker`` (:class:`kvtax.serve.scrape.parsepool.ParsePool`). It prints the round trips
per second
and their p50/p99/max during the parse, next to an ``idle`` baseline of 2 s. A thread holds the
GIL for the parse, and each socket call of the loop then waits for the switch interval.

Run from the repository root::

    .venv/bin/python -m bench.scrape.parselag --models 60
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures as cf
import sys
import time

from bench import record
from bench.scrape.pipeline import CAPTURE, multi_model_payload
from bench.stats import quantile
from kvtax.engine.normalize import normalize
from kvtax.serve.scrape.parsepool import ParsePool
from kvtax_dev.exposition import read_samples

__all__ = ["main"]

MODES = ("idle", "inline", "thread", "process", "worker")


def _parse(text: str) -> int:
    return len(normalize(text, timestamp=0.0).models)


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(100):
        writer.write(data)
        await writer.drain()
    writer.close()


async def _ping(port: int, stop: asyncio.Event, trips: list[float]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    while not stop.is_set():
        started = time.perf_counter()
        writer.write(b"x")
        await writer.drain()
        await reader.read(100)
        trips.append(time.perf_counter() - started)
        await asyncio.sleep(0.01)
    writer.close()


class Parser:
    """One way to parse, started (pools, worker) before the measurement begins."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.threads = cf.ThreadPoolExecutor(1)
        self.processes = cf.ProcessPoolExecutor(1) if mode == "process" else None
        self.worker = ParsePool() if mode == "worker" else None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        if self.processes is not None:
            await loop.run_in_executor(self.processes, int, "1")
        if self.worker is not None:
            await self.worker.normalize("", timestamp=0.0, version=None, max_series=None)

    async def parse(self, text: str) -> None:
        loop = asyncio.get_running_loop()
        if self.mode == "idle":
            await asyncio.sleep(2)
        elif self.mode == "inline":
            _parse(text)
        elif self.mode == "thread":
            await loop.run_in_executor(self.threads, _parse, text)
        elif self.processes is not None:
            await loop.run_in_executor(self.processes, _parse, text)
        elif self.worker is not None:
            await self.worker.normalize(text, timestamp=0.0, version=None, max_series=None)

    def close(self) -> None:
        self.threads.shutdown()
        if self.processes is not None:
            self.processes.shutdown()
        if self.worker is not None:
            self.worker.close()


async def measure(mode: str, text: str, port: int) -> list[str]:
    """The cells of ``mode``'s row: how long the parse took, and the round trips meanwhile."""
    parser = Parser(mode)
    await parser.start()
    stop = asyncio.Event()
    trips: list[float] = []
    pingers = [asyncio.create_task(_ping(port, stop, trips)) for _ in range(32)]
    await asyncio.sleep(0.3)
    trips.clear()
    started = time.perf_counter()
    await parser.parse(text)
    seconds = time.perf_counter() - started
    stop.set()
    await asyncio.gather(*pingers)
    parser.close()
    if not trips:
        return [mode, f"{seconds:.2f} s", "0", "-", "-", "-"]
    times = [f"{t * 1e3:.1f} ms" for t in (quantile(trips, 0.5), quantile(trips, 0.99), max(trips))]
    return [mode, f"{seconds:.2f} s", f"{len(trips) / seconds:.0f}", *times]


async def main_async(models: int) -> None:
    text = multi_model_payload(CAPTURE.read_text(), models)
    series = sum(len(by_labels) for by_labels in read_samples(text).values())
    print(f"page: {models} models, {series} series, {len(text) / 1e6:.1f} MB")
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    rows = []
    for mode in MODES:
        print(f"{mode} ...", file=sys.stderr, flush=True)
        rows.append(await measure(mode, text, port))
    server.close()
    header = ["parse", "took", "round trips/s", "p50", "p99", "max"]
    print(record.table(header, rows, "lrrrrr"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=int, default=60)
    asyncio.run(main_async(parser.parse_args().models))


if __name__ == "__main__":
    main()
