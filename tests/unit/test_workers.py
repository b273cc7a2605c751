"""``--proxy.workers``: several proxy processes on one port, one exact ledger in the parent.

The pool tests run real worker processes (``python -m kvtax.serve.workers.child``) on a real
port, in front of the fast fake vLLM served in this process; the ledger they read is the
parent's. The time limits only guard against hangs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import msgspec
import psutil
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtax.delivery.ledger import (
    ITL_BUCKETS,
    DeliveryLedger,
    HistogramAccumulator,
    ModelNames,
    RequestRecord,
)
from kvtax.errors import ConfigError
from kvtax.gate.cap import CapSettings
from kvtax.serve.config import load_config
from kvtax.serve.config import values as v
from kvtax.serve.proxy import ProxySettings
from kvtax.serve.proxy.gatekeeper import Gate, GateSettings
from kvtax.serve.workers.frames import (
    MAX_FRAME,
    TO_PARENT,
    TO_WORKER,
    Credit,
    FrameError,
    Frames,
    Learned,
    Opened,
    Ready,
    Settled,
    Stats,
    Stop,
    Tick,
    encode,
)
from kvtax.serve.workers.pool import WorkerPool
from kvtax_dev.fakevllm.aio import serve
from kvtax_dev.fakevllm.events import DONE
from kvtax_dev.fakevllm.fast import app, completions
from kvtax_dev.process import until

HANG_GUARD = 60.0  # seconds; see the module docstring


def _record(**changes: object) -> RequestRecord:
    itl = HistogramAccumulator.of(ITL_BUCKETS, [0.004, 0.03, 0.03, 7.0])
    fields: dict[str, object] = {
        "model": "m",
        "outcome": "completed",
        "delivered_tokens": 41,
        "credited_tokens": 12,
        "prompt_tokens": 9,
        "undelivered_tokens": 2,
        "forwarded": True,
        "duration": 1.25,
        "ttft": 0.031,
        "itl": itl,
        "stalls": ((0.8, 300),),
        "slo_met": True,
        "usage_missing": False,
        "api": "completions",
    }
    fields.update(changes)
    return RequestRecord(**fields)  # type: ignore[arg-type]


def _same(a: RequestRecord, b: RequestRecord) -> bool:
    def plain(r: RequestRecord) -> tuple[object, ...]:
        itl = None if r.itl is None else r.itl.raw()
        return (r.model, r.outcome, r.delivered_tokens, r.credited_tokens, r.prompt_tokens,
                r.undelivered_tokens, r.forwarded, r.duration, r.ttft, itl, r.stalls,
                r.slo_met, r.usage_missing, r.api)  # fmt: skip

    return plain(a) == plain(b)


# -- the frames ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "record",
    [_record(), _record(itl=None, ttft=None, duration=None, stalls=(), model=None, api=None)],
)
def test_a_settled_record_crosses_the_link_unchanged(record: RequestRecord) -> None:
    """Every field of a record, its ITL histogram too, reaches the parent as settled."""
    frames = Frames(TO_PARENT)
    (message,) = frames.feed(encode(Settled(record)))
    assert isinstance(message, Settled)
    assert _same(message.record, record)


@settings(max_examples=300)  # the suite's 10,000 are sized for the HTTP differential alone
@given(st.lists(st.integers(min_value=1, max_value=40), max_size=12))
def test_frames_split_anywhere_come_out_whole_and_in_order(cuts: list[int]) -> None:
    """However the socket splits the bytes, each message comes out once, whole, in order."""
    sent: list[Ready | Opened | Learned | Credit | Settled | Stats] = [
        Ready(7),
        Opened(),
        Learned("m"),
        Credit("m", 3, None),
        Settled(_record()),
        Stats(1, 0, 0, 5, ([0] * 13, 0.0), ([0] * 14, 0.0), {"token_ids": 1}, 0.25),
    ]
    data = b"".join(encode(m) for m in sent)
    frames = Frames(TO_PARENT)
    got: list[object] = []
    at = 0
    for cut in cuts:
        got += frames.feed(data[at : at + cut])
        at += cut
    got += frames.feed(data[at:])
    assert [type(m) for m in got] == [type(m) for m in sent]
    assert got[:4] == sent[:4]
    assert got[5] == sent[5]


def test_the_parent_says_tick_and_stop() -> None:
    """The parent's two messages read back as sent."""
    frames = Frames(TO_WORKER)
    assert frames.feed(encode(Tick("0.32.0")) + encode(Stop(2.5))) == [Tick("0.32.0"), Stop(2.5)]


def test_bytes_that_are_not_frames_are_refused_not_buffered_without_end() -> None:
    """A length past the bound, bytes that are not MessagePack, or a message of the other side
    are refused at once, not held while more bytes are awaited."""
    with pytest.raises(FrameError, match="at most"):
        Frames(TO_PARENT).feed((MAX_FRAME + 1).to_bytes(4, "little"))
    with pytest.raises(FrameError):
        Frames(TO_PARENT).feed(b"\x03\x00\x00\x00abc")
    # A worker's message is not one the parent sends, and the other way round.
    with pytest.raises(FrameError):
        Frames(TO_WORKER).feed(encode(Ready(1)))


def test_a_record_whose_histogram_has_other_buckets_is_not_a_frame() -> None:
    """The parent would add the record's ITL to its own: counts of another bucket layout make
    the frame refused, not a histogram that /metrics cannot add up."""
    record = {"model": "m", "outcome": "completed", "itl": [[1, 2], 0.5]}
    body = msgspec.msgpack.encode(["settled", record])
    with pytest.raises(FrameError, match="bucket counts"):
        Frames(TO_PARENT).feed(len(body).to_bytes(4, "little") + body)


def test_a_histogram_restored_from_counts_of_other_buckets_is_refused() -> None:
    """Counts of another bucket layout cannot become a histogram that /metrics would add up."""
    with pytest.raises(ValueError, match="bucket counts"):
        HistogramAccumulator.restored(ITL_BUCKETS, [1, 2], 0.5)


# -- the setting --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "cpus", "want"),
    [("150000 100000\n", 4, 2), ("max 100000\n", 3, 3), ("50000 100000", 4, 1), ("", 2, 2)],
)
def test_auto_counts_the_cores_the_cpu_limit_allows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, cpus: int, want: int
) -> None:
    """auto: the cgroup's quota rounded up, capped by the CPUs the process may run on; without
    a quota or a readable cpu.max, those CPUs."""
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text(text)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(cpus)))
    assert v.cores_allowed(cpu_max) == want
    assert v.cores_allowed(tmp_path / "absent") == cpus


@pytest.mark.parametrize("bad", ["0", "-2", "two", "1.5x", True])
def test_a_worker_count_that_is_not_one_is_refused_by_name(bad: object) -> None:
    """A worker count that is not a positive integer or auto fails the start, naming the flag."""
    with pytest.raises(ConfigError, match=r"--proxy.workers=.* is invalid: .*positive integer"):
        load_config({"proxy.workers": bad}, env={}, file=None)


# -- the pool, through the real port -------------------------------------------------------------
@pytest.fixture
async def upstream() -> AsyncIterator[str]:
    runner, url = await serve(app())
    yield url
    await runner.cleanup()


@pytest.fixture
async def pool(upstream: str) -> AsyncIterator[tuple[WorkerPool, int]]:
    names = ModelNames()
    names.update(["bench"])
    workers = WorkerPool(ProxySettings(upstream=upstream), DeliveryLedger(names), count=2)
    async with asyncio.timeout(HANG_GUARD):
        port = await workers.start("127.0.0.1", 0)
    yield workers, port
    async with asyncio.timeout(HANG_GUARD):
        await workers.stop(1.0)


async def _stream(port: int, tokens: int, interval: float = 0.0) -> tuple[int, bool]:
    """One stream on a connection of its own: the tokens its client read, and whether it ended
    with ``[DONE]``."""
    body = {
        "model": "bench",
        "prompt": "p",
        "max_tokens": tokens,
        "stream": True,
        "bench_interval": interval,
    }
    connector = aiohttp.TCPConnector(force_close=True)
    read = b""
    async with aiohttp.ClientSession(connector=connector) as session:
        try:
            async with session.post(
                f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body)
            ) as response:
                async for chunk in response.content.iter_any():
                    read += chunk
        except aiohttp.ClientError:
            pass
    events = [e for e in read.split(b"\n\n") if e.startswith(b"data: {")]
    return len(events), read.endswith(DONE)


def _outcomes(pool: WorkerPool) -> dict[str, float]:
    return {k: n for k, n in pool.ledger.outcomes().items() if n}


async def test_two_workers_share_the_port_and_the_ledger_counts_every_request_once(
    pool: tuple[WorkerPool, int],
) -> None:
    """120 streams over two workers: both relay some, the parent's ledger counts each once with
    the tokens its client read, and /metrics' event count is the two workers' sum."""
    workers, port = pool
    async with asyncio.timeout(HANG_GUARD):
        seen = await asyncio.gather(*(_stream(port, 1 + i % 7) for i in range(120)))
        assert all(done for _, done in seen)
        # Settled records reach the parent a turn of each worker's loop after the client's end.
        assert await until(lambda: workers.ledger.outcomes()["completed"] == 120)
        await workers.report()  # each worker reports its stats on a tick
    totals = workers.ledger.totals()["bench"]
    assert totals.delivered == sum(tokens for tokens, _ in seen)
    assert _outcomes(workers) == {"completed": 120}
    # Both relayed (the kernel spread 120 connections over two listeners), and /metrics' one
    # count of events is their sum.
    assert all(s.events > 0 for s in workers._stats())
    assert workers.cost.events == sum(s.events for s in workers._stats()) == 120 + totals.delivered
    assert workers.in_flight == 0


async def test_a_killed_worker_breaks_its_streams_settles_them_and_is_replaced(
    pool: tuple[WorkerPool, int],
) -> None:
    """A worker SIGKILLed mid-stream: its clients' streams break, its requests settle as
    shutdown (the completed ones stay exact), and its successor serves new connections."""
    workers, port = pool
    async with asyncio.timeout(HANG_GUARD):
        running = [asyncio.create_task(_stream(port, 40, 0.05)) for _ in range(24)]
        assert await until(lambda: workers.unsettled == 24)
        await workers.report()  # a credit of what the streams delivered so far
        victim = workers.pids[0]
        os.kill(victim, signal.SIGKILL)
        seen = await asyncio.gather(*running)
        assert await until(lambda: victim not in workers.pids and len(workers.pids) == 2)
        assert await until(lambda: sum(_outcomes(workers).values()) == 24)
    broken = [tokens for tokens, done in seen if not done]
    whole = [tokens for tokens, done in seen if done]
    assert broken
    assert whole
    assert _outcomes(workers) == {"completed": len(whole), "shutdown": len(broken)}
    assert workers.lost == len(broken)
    assert workers.restarts == 1
    # The completed streams' tokens exactly; of the broken ones, no more than their clients read.
    delivered = workers.ledger.totals()["bench"].delivered
    assert sum(whole) <= delivered <= sum(whole) + sum(broken)
    # The new worker serves: new connections reach both listeners again.
    async with asyncio.timeout(HANG_GUARD):
        again = await asyncio.gather(*(_stream(port, 2) for _ in range(60)))
        assert all(done for _, done in again)
        await workers.report()
    assert all(s.events > 0 for s in workers._stats())


async def test_a_worker_whose_loop_is_stuck_is_killed_and_replaced(upstream: str) -> None:
    """A worker that answers no tick (stopped here with SIGSTOP, as a loop stuck in one call
    would be) is killed once ``hung_after`` passes, and a new worker takes its slot."""
    workers = WorkerPool(
        ProxySettings(upstream=upstream), DeliveryLedger(ModelNames()), count=2, hung_after=0.3
    )
    async with asyncio.timeout(HANG_GUARD):
        port = await workers.start("127.0.0.1", 0)
        try:
            await workers.report()
            stuck = workers.pids[0]
            os.kill(stuck, signal.SIGSTOP)

            def replaced() -> bool:
                workers.credit_in_flight()  # a scrape's tick
                return stuck not in workers.pids and len(workers.pids) == 2

            assert await until(replaced)
            assert workers.restarts == 1
            seen = await asyncio.gather(*(_stream(port, 2) for _ in range(40)))
            await workers.report()
            assert all(done for _, done in seen)
            assert all(s.events > 0 for s in workers._stats())
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stuck, signal.SIGKILL)
            await workers.stop(0.0)


async def test_a_sigterm_to_the_whole_group_drains_and_restarts_nothing(
    upstream: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A supervisor that signals every process of kvtax's group: each worker drains on its
    own SIGTERM (its streams finish), and the stop that follows restarts none of them. One
    worker signalled alone is replaced."""
    workers = WorkerPool(
        ProxySettings(upstream=upstream), DeliveryLedger(ModelNames()), count=2, grace=10.0
    )
    async with asyncio.timeout(HANG_GUARD):
        port = await workers.start("127.0.0.1", 0)
        alone = workers.pids[1]
        os.kill(alone, signal.SIGTERM)
        assert await until(lambda: alone not in workers.pids and len(workers.pids) == 2)
        assert workers.restarts == 1
        running = [asyncio.create_task(_stream(port, 10, 0.05)) for _ in range(8)]
        assert await until(lambda: workers.unsettled == 8)
        # The wait for kvtax's stop, long enough here that a loaded machine cannot end one
        # worker's wait before the other worker has drained (the stop cuts it short).
        monkeypatch.setattr("kvtax.serve.workers.pool._QUICK_DEATH", 10.0)
        for pid in workers.pids:
            os.kill(pid, signal.SIGTERM)
        seen = await asyncio.gather(*running)
        # Both drained and ended before kvtax's own stop began (a slow supervisor, or a
        # parent still busy): neither is started again meanwhile.
        assert await until(lambda: workers.pids == [])
        await workers.stop(10.0)
    assert all(done for _, done in seen)
    assert _outcomes(workers) == {"completed": 8}
    assert workers.restarts == 1
    assert workers.pids == []


async def test_a_port_another_pool_serves_is_refused_not_shared(
    pool: tuple[WorkerPool, int], upstream: str
) -> None:
    """SO_REUSEPORT would let a second kvtax of the same user share the port and split the
    clients with the first; it fails to start instead, as one process would."""
    _, taken = pool
    second = WorkerPool(ProxySettings(upstream=upstream), DeliveryLedger(ModelNames()), count=2)
    async with asyncio.timeout(HANG_GUARD):
        with pytest.raises(OSError, match="in use"):
            await second.start("127.0.0.1", taken)
    assert second.pids == []


def _alive(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


# A parent of two workers, in a process of its own: it prints their pids and port, then waits.
_PARENT = """
import asyncio, json, sys
from kvtax.delivery.ledger import DeliveryLedger, ModelNames
from kvtax.serve.proxy import ProxySettings
from kvtax.serve.workers.pool import WorkerPool

async def main():
    settings = ProxySettings(upstream="http://127.0.0.1:9")
    pool = WorkerPool(settings, DeliveryLedger(ModelNames()), count=2)
    port = await pool.start("127.0.0.1", 0)
    print(json.dumps({"port": port, "pids": pool.pids}), flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


async def test_the_parents_death_takes_the_workers_with_it() -> None:
    """The parent killed outright (SIGKILL: no drain, no goodbye): its workers die too, and
    none keeps the proxy port open with no ledger behind it."""
    parent = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _PARENT, stdout=subprocess.PIPE
    )
    try:
        async with asyncio.timeout(HANG_GUARD):
            assert parent.stdout is not None
            started = json.loads(await parent.stdout.readline())
            pids, port = started["pids"], started["port"]
            assert len(pids) == 2
            assert _listening(port)
            parent.kill()
            await parent.wait()
            assert await until(lambda: not any(_alive(pid) for pid in pids))
            assert not _listening(port)
    finally:
        if parent.returncode is None:
            parent.kill()
            await parent.wait()


def _listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
        return True
    return False


async def test_a_stop_drains_every_worker_and_reads_all_they_settled(upstream: str) -> None:
    """The pool's stop with a grace period lets every running stream finish on both workers,
    and the parent reads every record they settled before it counts them gone."""
    workers = WorkerPool(ProxySettings(upstream=upstream), DeliveryLedger(ModelNames()), count=2)
    async with asyncio.timeout(HANG_GUARD):
        port = await workers.start("127.0.0.1", 0)
        running = [asyncio.create_task(_stream(port, 10, 0.05)) for _ in range(16)]
        assert await until(lambda: workers.unsettled == 16)
        await workers.stop(grace=10.0)
        seen = await asyncio.gather(*running)
    assert all(done for _, done in seen)  # the grace let every stream finish
    assert _outcomes(workers) == {"completed": 16}
    assert workers.pids == []
    assert workers.restarts == 0


async def test_a_port_another_process_listens_on_fails_the_start(upstream: str) -> None:
    """A port another process listens on fails the start with 'address in use', no worker left."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))  # no SO_REUSEPORT: no worker could share it anyway
    taken.listen()
    try:
        workers = WorkerPool(
            ProxySettings(upstream=upstream), DeliveryLedger(ModelNames()), count=2
        )
        async with asyncio.timeout(HANG_GUARD):
            with pytest.raises(OSError, match="in use"):
                await workers.start("127.0.0.1", taken.getsockname()[1])
        assert workers.pids == []
    finally:
        taken.close()


async def test_a_worker_that_never_says_it_listens_fails_the_start(
    upstream: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that exits before it listens (here: no Python at all runs it) fails the start
    with its exit status, and the workers started before it are stopped."""
    monkeypatch.setattr("kvtax.serve.workers.pool.sys.executable", "/bin/false")
    workers = WorkerPool(ProxySettings(upstream=upstream), DeliveryLedger(ModelNames()), count=2)
    async with asyncio.timeout(HANG_GUARD):
        with pytest.raises(OSError, match=r"proxy worker 0 did not start \(exit status 1\)"):
            await workers.start("127.0.0.1", 0)
    assert workers.pids == []


# -- one gate across workers --------------------------------------------------------------------
@dataclass
class CountingVllm:
    """The fast fake, counting the requests it is answering at once."""

    now: int = 0
    most: int = 0

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.now += 1
        self.most = max(self.most, self.now)
        try:
            return await completions(request)
        finally:
            self.now -= 1


@dataclass
class Gated:
    """Two workers in front of a :class:`CountingVllm`, under one static cap."""

    fake: CountingVllm
    gate: Gate
    workers: WorkerPool
    port: int


@contextlib.asynccontextmanager
async def _gated(cap: int) -> AsyncIterator[Gated]:
    fake = CountingVllm()
    served = web.Application()
    served.router.add_post("/v1/completions", fake.completions)
    runner, url = await serve(served)
    gate = Gate(GateSettings(cap=CapSettings(mode="static", static_cap=cap), max_wait=60.0))
    workers = WorkerPool(
        ProxySettings(upstream=url), DeliveryLedger(ModelNames()), count=2, gate=gate
    )
    try:
        async with asyncio.timeout(HANG_GUARD):
            yield Gated(fake, gate, workers, await workers.start("127.0.0.1", 0))
    finally:
        await workers.stop(0.0)
        await runner.cleanup()


async def test_the_cap_holds_across_workers_that_race_for_it() -> None:
    """A static cap of 4 with two workers racing 32 streams: never more than 4 requests at
    vLLM at once, the rest queued in the parent's one gate, none lost. Two gates of their own
    would let 8 in."""
    async with _gated(4) as rig:
        seen = await asyncio.gather(*(_stream(rig.port, 4, 0.02) for _ in range(32)))
        assert await until(lambda: rig.workers.ledger.outcomes()["completed"] == 32)
        assert await until(lambda: rig.gate.in_flight == 0)
        await rig.workers.report()
        stats = rig.workers._stats()
    assert all(done for _, done in seen)
    assert rig.fake.most == 4  # the cap, reached and never passed
    assert rig.gate.admitted == 32
    assert len(stats) == 2
    assert all(s.events > 0 for s in stats)  # both workers asked


async def test_a_dead_workers_slots_go_to_the_next_in_line() -> None:
    """A worker killed while its requests hold every slot of the cap: the parent frees them,
    and the other worker's queued requests go in."""
    async with _gated(2) as rig:
        gate = rig.gate
        running = [asyncio.create_task(_stream(rig.port, 200, 0.05)) for _ in range(12)]
        assert await until(lambda: gate.in_flight == 2 and gate.queued == 10)
        holder = next(w for w in rig.workers._live.values() if w.tickets)
        os.kill(holder.process.pid, signal.SIGKILL)
        # Its slots go to requests the other worker asked for, which then run.
        assert await until(lambda: gate.in_flight == 2 and not holder.tickets)
        assert await until(lambda: gate.admitted > 2)
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
    # (vLLM may still be answering the dead worker's requests as the next ones arrive: it
    # notices a closed connection at its next write; the gate counts kvtax's requests.)
    assert gate.in_flight == 0
