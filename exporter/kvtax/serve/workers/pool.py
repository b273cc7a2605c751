"""``--proxy.workers N``: N proxy processes on one port, and the one ledger they report to.

One Python process relays on one core. Above one worker, the parent kvtax stops relaying: it
starts N workers (:mod:`kvtax.serve.workers.child`), each listening on the proxy port with
SO_REUSEPORT, so the kernel spreads new client connections across them. The parent keeps
everything there is one of: the scrape, the web port and ``/metrics``, and the ledger. Each
worker reports over its own socketpair (:mod:`~kvtax.serve.workers.frames`), and the parent
applies each report to the ledger as it arrives; so ``/metrics`` shows one set of series, and
each request is counted once, by the worker that relayed it.

- **Credits.** A scrape credits running streams (``credit_in_flight``): the pool sends each
  worker a tick, and the credits the workers send back count from the next scrape on.
- **A worker that dies**, or that answers no tick for ``hung_after`` seconds (its loop is
  stuck: it is killed), is started again (after a second if it died within a second of its
  start, so a worker that cannot run does not spin; after a second too if it drained on a
  SIGTERM of its own, and only if kvtax's stop has not begun by then). The requests it had
  begun and not settled settle as ``shutdown``: kvtax ended them. Their tokens credited while
  they ran stay counted; their model and API are unknown to the parent (the default model's
  label, no API).
- **The parent's death** takes the workers with it (``PR_SET_PDEATHSIG``; a worker whose link
  closes drains and ends too).
- **Shutdown** sends every worker a stop with the grace period: each drains as one kvtax would,
  and the parent reads every frame each one wrote before it counts the worker gone.
- **One gate.** With the gate on, the parent's gate decides for every worker: each worker
  budgets a request itself and asks the parent to let it in (:mod:`kvtax.serve.workers.gate`),
  so the cap, the KV blocks, the queue and the fair shares are counted once. A dead worker's
  slots are freed and its queued asks dropped.

Example::

    pool = WorkerPool(ProxySettings(upstream="http://127.0.0.1:8000"), ledger, count=2)
    port = await pool.start("127.0.0.1", 0)
    ...
    await pool.stop(grace=30.0)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from kvtax.delivery.cost import FORWARD_BUCKETS, RELAY_BUCKETS, RelayCost
from kvtax.delivery.ledger import DeliveryLedger, HistogramAccumulator, RequestRecord
from kvtax.serve.proxy import ProxySettings
from kvtax.serve.proxy.gatekeeper import CLOSED, REASONS, Gate, Ticket
from kvtax.serve.workers.child import ENV, Launch
from kvtax.serve.workers.frames import (
    TO_PARENT,
    Answer,
    Ask,
    Credit,
    FrameError,
    Frames,
    Learned,
    Leave,
    Opened,
    Ready,
    Rejected,
    Settled,
    Stats,
    Stop,
    Tick,
    encode,
)

__all__ = ["WorkerPool"]

log = logging.getLogger("kvtax.serve.workers")

# Seconds a worker has to import, listen and say it is ready.
_START_LIMIT = 30.0
# A worker that died sooner than this after its start waits this long before the next.
_QUICK_DEATH = 1.0
# Seconds past the grace period (and the proxy's own cut) a stopping worker is given before it
# is killed.
_STOP_MARGIN = 10.0
# Seconds the parent reads a dead worker's last frames for.
_LAST_FRAMES = 5.0


@dataclass(eq=False)
class _Worker:
    """One worker process, as the parent follows it."""

    index: int
    process: asyncio.subprocess.Process
    ready: asyncio.Future[int]
    closed: asyncio.Future[None]
    transport: asyncio.Transport | None = None
    opened: int = 0
    settled: int = 0
    stats: Stats | None = None
    started_at: float = 0.0
    # The gate's side: asks waiting in the parent's gate, and tickets it let in, by ask id.
    asks: dict[int, asyncio.Task[None]] = field(default_factory=dict)
    tickets: dict[int, Ticket] = field(default_factory=dict)
    reported: asyncio.Event = field(default_factory=asyncio.Event)  # set by each Stats
    # When the oldest tick still unanswered went out (the loop's clock); None: none is.
    unanswered: float | None = None

    def tell(self, message: Tick | Stop | Answer) -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(encode(message))


class _Link(asyncio.Protocol):
    """A worker's reports, read and applied to the ledger as they arrive; its asks handed to
    the gate's side (``on_gate``)."""

    def __init__(
        self,
        worker: _Worker,
        ledger: DeliveryLedger,
        on_gate: Callable[[_Worker, Ask | Leave | Rejected], None],
    ) -> None:
        self._worker = worker
        self._ledger = ledger
        self._on_gate = on_gate
        self._frames = Frames(TO_PARENT)
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        worker = self._worker
        try:
            messages = self._frames.feed(data)
        except FrameError as exc:
            log.error("worker %d sent what is not a frame (%s): dropping it", worker.index, exc)
            worker.process.kill()
            return
        ledger = self._ledger
        for message in messages:
            if isinstance(message, Settled):
                worker.settled += 1
                try:
                    ledger.settle(message.record)
                except ValueError as exc:
                    log.error(
                        "worker %d settled a record kvtax cannot count: %s", worker.index, exc
                    )
            elif isinstance(message, Credit):
                ledger.credit(message.model, message.tokens, message.api)
            elif isinstance(message, Learned):
                ledger.learn(message.model)
            elif isinstance(message, Opened):
                worker.opened += 1
            elif isinstance(message, Ask | Leave | Rejected):
                self._on_gate(worker, message)
            elif isinstance(message, Stats):
                if _fits(message):
                    worker.stats = message
                else:
                    log.error("worker %d reported a relay cost of other buckets", worker.index)
                worker.unanswered = None
                worker.reported.set()
            elif isinstance(message, Ready) and not worker.ready.done():
                worker.ready.set_result(message.pid)

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._worker.closed.done():
            self._worker.closed.set_result(None)


@dataclass
class _Retired:
    """The counters of workers that ended, so that /metrics' totals never go back."""

    cost: RelayCost = field(default_factory=RelayCost)
    retries: int = 0
    encoded_streams: int = 0
    cpu: float = 0.0


def _unshared(family: socket.AddressFamily, host: str, port: int) -> None:
    """OSError (address in use) if anything listens on ``port`` already.

    Workers listen with SO_REUSEPORT, which lets any process of the same user that sets it too
    share the port: a second kvtax started by mistake would split the clients with the first
    instead of failing. A plain bind first makes it fail, as one process does.
    """
    with socket.socket(family) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio's servers
        probe.bind((host or "0.0.0.0", port))


def _fits(stats: Stats) -> bool:
    """The stats' histograms have kvtax's buckets (else /metrics could not add them up)."""
    return len(stats.relay[0]) == len(RELAY_BUCKETS) + 1 and (
        len(stats.forward[0]) == len(FORWARD_BUCKETS) + 1
    )


def _add_stats(cost: RelayCost, stats: Stats) -> None:
    cost.relay.add(HistogramAccumulator.restored(RELAY_BUCKETS, *stats.relay))
    cost.forward.add(HistogramAccumulator.restored(FORWARD_BUCKETS, *stats.forward))
    cost.events += stats.events
    for scheme, streams in stats.schemes.items():
        cost.schemes[scheme] = cost.schemes.get(scheme, 0) + streams


class WorkerPool:
    """N proxy worker processes on one port; see the module docstring."""

    def __init__(
        self,
        settings: ProxySettings,
        ledger: DeliveryLedger,
        *,
        count: int,
        version: Callable[[], str | None] = lambda: None,
        grace: float = 30.0,
        log_level: str = "info",
        log_format: str = "logfmt",
        gate: Gate | None = None,
        hung_after: float = 30.0,
    ) -> None:
        if count < 1:
            raise ValueError(f"a pool of {count} workers")
        self.settings = settings
        self.ledger = ledger
        self.count = count
        # The one gate, when it is on: every worker's requests are let in here.
        self.gate = gate
        # Seconds a worker may leave ticks unanswered before it counts as stuck.
        self.hung_after = hung_after
        self._version = version
        self._grace = grace
        self._log = (log_level, log_format)
        self._live: dict[int, _Worker] = {}
        self._keepers: list[asyncio.Task[None]] = []
        self._retired = _Retired()
        self._stopping = False
        self._stopped = asyncio.Event()  # set with _stopping: ends a pause between starts
        self._reserved: socket.socket | None = None
        self._address: tuple[str, int] | None = None
        self.restarts = 0
        # Requests dead workers had begun and never settled (settled here as shutdown).
        self.lost = 0

    # -- what /metrics and the scrape read ---------------------------------------------------
    def _stats(self) -> list[Stats]:
        return [w.stats for w in self._live.values() if w.stats is not None]

    @property
    def in_flight(self) -> int:
        """Accounted requests the workers are handling now: begun and not yet settled, as
        their frames say (live, not as of their last stats)."""
        return self.unsettled

    @property
    def streams_open(self) -> int:
        return sum(s.streams_open for s in self._stats())

    @property
    def upstream_retries(self) -> int:
        return self._retired.retries + sum(s.retries for s in self._stats())

    @property
    def encoded_streams(self) -> int:
        return self._retired.encoded_streams + sum(s.encoded_streams for s in self._stats())

    @property
    def running(self) -> int:
        """Workers running now."""
        return len(self._live)

    @property
    def cpu(self) -> float:
        """The workers' CPU seconds as each last reported them, the ended ones' included."""
        return self._retired.cpu + sum(s.cpu for s in self._stats())

    @property
    def cost(self) -> RelayCost:
        """Every worker's relay cost added up, the ended ones' included."""
        total = RelayCost()
        retired = self._retired.cost
        total.relay.add(retired.relay)
        total.forward.add(retired.forward)
        total.events = retired.events
        total.schemes = dict(retired.schemes)
        for stats in self._stats():
            _add_stats(total, stats)
        return total

    @property
    def pids(self) -> list[int]:
        """The live workers' process ids, in worker order."""
        return [self._live[i].process.pid for i in sorted(self._live)]

    @property
    def unsettled(self) -> int:
        """Requests the live workers began whose records have not reached the ledger yet."""
        return sum(w.opened - w.settled for w in self._live.values())

    async def report(self, limit: float = 10.0) -> None:
        """Tick every worker and wait (up to ``limit`` seconds) until each has answered with
        its stats: the gauges and the cost read afterwards are current."""
        workers = list(self._live.values())
        for worker in workers:
            worker.reported.clear()
        self.credit_in_flight()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(limit):
                for worker in workers:
                    await worker.reported.wait()

    async def _stopped_or(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._stopped.wait()

    def credit_in_flight(self) -> None:
        """Ask every worker to credit its running streams (and report its stats); their
        credits count from the next scrape on. A worker that has left ticks unanswered for
        ``hung_after`` seconds is killed, and its successor started: its loop is stuck, and
        so is every client it holds."""
        tick = Tick(self._version())
        now = asyncio.get_running_loop().time()
        for worker in list(self._live.values()):
            if worker.unanswered is None:
                worker.unanswered = now
            elif now - worker.unanswered > self.hung_after:
                log.error(
                    "proxy worker %d (pid %d) answered no tick for %.0f s: killing it",
                    worker.index,
                    worker.process.pid,
                    now - worker.unanswered,
                )
                with contextlib.suppress(ProcessLookupError):
                    worker.process.kill()
                continue
            worker.tell(tick)

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self, host: str, port: int = 0) -> int:
        """Start every worker on ``host``:``port`` and wait until each listens; the port (the
        kernel's choice for 0). OSError if the port is taken or a worker cannot listen."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        if port != 0:
            _unshared(family, host, port)
        # Hold the port, bound and not listening, so that every worker (and every restarted
        # one) joins the same one (the kernel's choice, for port 0); it takes no connection.
        reserved = socket.socket(family)
        reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        reserved.bind((host or "0.0.0.0", port))
        self._reserved = reserved
        port = int(reserved.getsockname()[1])
        self._address = (host, port)
        try:
            for index in range(self.count):
                self._follow(await self._spawn(index))
        except OSError:
            await self.stop(0.0)
            raise
        log.info(
            "proxy on %s:%d: %d workers relay to %s",
            host,
            port,
            self.count,
            self.settings.upstream,
        )
        return port

    async def _spawn(self, index: int) -> _Worker:
        assert self._address is not None
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair()
        launch = Launch(
            proxy=self.settings,
            host=self._address[0],
            port=self._address[1],
            fd=theirs.fileno(),
            parent=os.getpid(),
            index=index,
            log_level=self._log[0],
            log_format=self._log[1],
            version=self._version(),
            grace=self._grace,
            gate=self.gate.settings if self.gate is not None else None,
        )
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "kvtax.serve.workers.child",
                pass_fds=(theirs.fileno(),),
                env={**os.environ, ENV: msgspec.json.encode(launch).decode()},
                stdin=subprocess.DEVNULL,
            )
        finally:
            theirs.close()
        worker = _Worker(
            index,
            process,
            ready=loop.create_future(),
            closed=loop.create_future(),
            started_at=loop.time(),
        )
        transport, _ = await loop.create_unix_connection(
            lambda: _Link(worker, self.ledger, self._gatekeeping), sock=ours
        )
        worker.transport = transport
        exited = asyncio.ensure_future(process.wait())
        try:
            await asyncio.wait(
                {worker.ready, exited}, timeout=_START_LIMIT, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            exited.cancel()
        if not worker.ready.done():
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
            transport.close()
            raise OSError(f"proxy worker {index} did not start (exit status {process.returncode})")
        return worker

    def _follow(self, worker: _Worker) -> None:
        self._live[worker.index] = worker
        self._keepers = [k for k in self._keepers if not k.done()]
        self._keepers.append(asyncio.create_task(self._keep(worker)))

    async def _keep(self, worker: _Worker) -> None:
        """Follow one worker to its end: account for it and, unless the pool is stopping,
        start its successor."""
        status = await worker.process.wait()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_LAST_FRAMES):
                await worker.closed  # every frame it wrote is read first
        self._retire(worker)
        if status == 0 and not self._stopping:
            # It drained on a SIGTERM of its own. One sent to kvtax's whole process group (a
            # supervisor that signals every process) reaches kvtax too, whose stop is then on
            # its way: a worker is started again only if none comes.
            await self._pause(_QUICK_DEATH)
            if self._stopping:
                return
            log.warning(
                "proxy worker %d (pid %d) drained and ended on its own: starting another",
                worker.index,
                worker.process.pid,
            )
        elif self._stopping:
            return
        else:
            log.error(
                "proxy worker %d (pid %d) ended with status %s: starting another",
                worker.index,
                worker.process.pid,
                status,
            )
            if asyncio.get_running_loop().time() - worker.started_at < _QUICK_DEATH:
                await self._pause(_QUICK_DEATH)
        successor = await self._successor(worker.index)
        if successor is None:
            return
        self.restarts += 1
        self._follow(successor)
        if self._stopping:  # the stop came while it started: it drains at once
            successor.tell(Stop(0.0))

    async def _successor(self, index: int) -> _Worker | None:
        """A new worker in slot ``index``, tried again each second it fails to start; None if
        the pool stops first."""
        while not self._stopping:
            try:
                return await self._spawn(index)
            except OSError as exc:
                log.error("%s; trying again", exc)
                await self._pause(_QUICK_DEATH)
        return None

    async def _pause(self, seconds: float) -> None:
        """Wait ``seconds`` between a worker's death and the next start, or until the stop."""
        await self._stopped_or(seconds)

    # -- the one gate --------------------------------------------------------------------------
    def _gatekeeping(self, worker: _Worker, message: Ask | Leave | Rejected) -> None:
        gate = self.gate
        if gate is None:
            log.error("worker %d asked the gate, which is off", worker.index)
            return
        if isinstance(message, Ask):
            worker.asks[message.id] = asyncio.create_task(self._ask(gate, worker, message))
        elif isinstance(message, Leave):
            waiting = worker.asks.pop(message.id, None)
            if waiting is not None:
                waiting.cancel()  # its client left while it waited: out of the queue
            ticket = worker.tickets.pop(message.id, None)
            if ticket is not None:
                gate.leave(ticket)
        elif message.reason in REASONS:
            gate.rejected(message.reason)

    async def _ask(self, gate: Gate, worker: _Worker, ask: Ask) -> None:
        """One worker's request at the parent's gate, as one of its own would stand."""
        ticket = gate.ticket(
            ask.prompt, ask.limit, prompts=ask.prompts, n=ask.n, headers=ask.headers
        )
        try:
            reason = await gate.enter(ticket, carried=ask.carried)
        finally:
            worker.asks.pop(ask.id, None)
        if reason is None and worker.closed.done():
            gate.leave(ticket)  # the worker ended as it was let in
            return
        if reason is None:
            worker.tickets[ask.id] = ticket
        retry = gate.retry_after() if reason not in {None, CLOSED} else 0
        worker.tell(Answer(ask.id, reason, retry))

    def _retire(self, worker: _Worker) -> None:
        """A worker ended: its counters join the retired ones, and the requests it began and
        never settled settle as ``shutdown``."""
        if self._live.get(worker.index) is worker:
            del self._live[worker.index]
        if worker.transport is not None:
            worker.transport.close()
        for waiting in worker.asks.values():
            waiting.cancel()
        if self.gate is not None:
            for ticket in worker.tickets.values():
                self.gate.leave(ticket)  # its requests are over for vLLM: their slots free
        worker.asks.clear()
        worker.tickets.clear()
        worker.reported.set()  # a report() waits for it no longer
        stats = worker.stats
        if stats is not None:
            _add_stats(self._retired.cost, stats)
            self._retired.retries += stats.retries
            self._retired.encoded_streams += stats.encoded_streams
            self._retired.cpu += stats.cpu
        lost = worker.opened - worker.settled
        if lost > 0:
            self.lost += lost
            log.error(
                "proxy worker %d ended with %d request(s) in flight: settled as shutdown",
                worker.index,
                lost,
            )
            for _ in range(lost):
                # Most requests in flight had reached vLLM, whose HTTP counter counts them.
                self.ledger.settle(RequestRecord(model=None, outcome="shutdown", forwarded=True))

    async def stop(self, grace: float = 0.0) -> None:
        """Drain every worker within ``grace`` seconds and wait for their ends (killing any
        that outlast the grace period by the proxy's cut and a margin)."""
        self._stopping = True
        self._stopped.set()
        if self.gate is not None:
            self.gate.close()  # every ask still queued is answered: shutting down
        stop = Stop(grace)
        for worker in list(self._live.values()):
            worker.tell(stop)
        # Twice: a worker that was starting as the stop came has a keeper of its own by then.
        for _ in range(2):
            keepers = [k for k in self._keepers if not k.done()]
            if not keepers:
                break
            _, late = await asyncio.wait(keepers, timeout=grace + _STOP_MARGIN)
            if late:
                for worker in list(self._live.values()):
                    log.error("proxy worker %d outlasted its drain: killing it", worker.index)
                    with contextlib.suppress(ProcessLookupError):
                        worker.process.kill()
                await asyncio.wait(late)
        if self._reserved is not None:
            self._reserved.close()
            self._reserved = None
