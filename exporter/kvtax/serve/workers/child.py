"""One proxy worker: a process that relays on the shared proxy port and reports to its parent.

The parent (:class:`~kvtax.serve.workers.pool.WorkerPool`) starts it as
``python -m kvtax.serve.workers.child`` with its settings in ``KVTAX_WORKER`` (JSON: a
:class:`Launch`) and its end of a socketpair as file descriptor ``Launch.fd``. The worker:

- dies with its parent (``PR_SET_PDEATHSIG``), and also ends when its link to the parent
  closes: no worker outlives the process that keeps its ledger;
- listens on the proxy port with SO_REUSEPORT beside its siblings, and says :class:`Ready`;
- relays with the same :class:`~kvtax.serve.proxy.Proxy` as one kvtax does, whose ledger is a
  :class:`Reporter`: each request begun, settled or credited becomes a frame to the parent,
  the frames of one turn of the loop written together;
- with the gate on, admits through the parent's gate (:class:`~kvtax.serve.workers.gate.
  RemoteGate`);
- on :class:`~kvtax.serve.workers.frames.Tick`, credits its running streams and sends its
  :class:`~kvtax.serve.workers.frames.Stats`; on ``Stop`` (or SIGTERM, or the link closing),
  drains like kvtax's own shutdown and exits once every frame is written.

SIGINT is ignored: a terminal's Ctrl-C reaches the whole process group, and the parent drains
its workers itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable

import msgspec

from kvtax.delivery.ledger import RequestRecord
from kvtax.serve import logformat
from kvtax.serve.proxy import Proxy, ProxySettings
from kvtax.serve.proxy.gatekeeper import GateSettings
from kvtax.serve.workers.frames import (
    TO_WORKER,
    Answer,
    Credit,
    FrameError,
    Frames,
    Learned,
    Opened,
    Ready,
    Settled,
    Stats,
    Tick,
    ToParent,
    encode,
)
from kvtax.serve.workers.gate import RemoteGate

__all__ = ["ENV", "Launch", "Reporter", "main"]

log = logging.getLogger("kvtax.serve.workers")

ENV = "KVTAX_WORKER"
_PR_SET_PDEATHSIG = 1
_LEARNED_LIMIT = 4096


class Launch(msgspec.Struct, frozen=True):
    """What a worker is started with."""

    proxy: ProxySettings
    host: str
    port: int
    fd: int  # its end of the socketpair to the parent
    parent: int  # the parent's pid
    index: int  # its place among the workers, for its log lines
    log_level: str = "info"
    log_format: str = "logfmt"
    version: str | None = None  # vLLM's, as the parent's scrape last read it
    grace: float = 30.0  # --shutdown.grace-period: a SIGTERM's drain
    gate: GateSettings | None = None  # the gate's settings, when it is on


class Reporter:
    """The worker's ledger: every record and credit becomes a frame to the parent.

    Frames wait in a list until the end of the loop's turn, then go in one write: a burst of
    settled requests costs one syscall, not one each.
    """

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._pending: list[bytes] = []
        self._loop = asyncio.get_running_loop()
        self._learned: set[str] = set()

    def send(self, message: ToParent) -> None:
        if not self._pending:
            self._loop.call_soon(self.flush)
        self._pending.append(encode(message))

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        if pending and not self._transport.is_closing():
            self._transport.writelines(pending)

    def opened(self) -> None:
        self.send(Opened())

    def settle(self, record: RequestRecord) -> None:
        self.send(Settled(record))

    def credit(self, model: str | None, tokens: int, api: str | None = None) -> None:
        self.send(Credit(model, tokens, api))

    def learn(self, model: str) -> None:
        # Once per name: the parent's ModelNames keeps what it learned (and bounds it; so does
        # this set, at a size no pod's models reach).
        if model not in self._learned and len(self._learned) < _LEARNED_LIMIT:
            self._learned.add(model)
            self.send(Learned(model))


def stats_of(proxy: Proxy) -> Stats:
    """The worker's gauges and counters, as the parent adds them up."""
    cost = proxy.cost
    return Stats(
        streams_open=proxy.streams_open,
        retries=proxy.upstream_retries,
        encoded_streams=proxy.encoded_streams,
        events=cost.events,
        relay=cost.relay.raw(),
        forward=cost.forward.raw(),
        schemes=dict(cost.schemes),
        cpu=time.process_time(),
    )


class _Link(asyncio.Protocol):
    """The parent's side of the talk, read: a tick is answered at once; the stop, a stream
    that is not frames, or the link's end ends the worker (``stopped`` holds the grace)."""

    def __init__(
        self,
        on_tick: Callable[[Tick], None],
        on_answer: Callable[[Answer], None],
        stopped: asyncio.Future[float],
    ) -> None:
        self._frames = Frames(TO_WORKER)
        self._on_tick = on_tick
        self._on_answer = on_answer
        self._stopped = stopped
        self.transport: asyncio.Transport | None = None
        self._drained: asyncio.Future[None] | None = None

    def _stop(self, grace: float) -> None:
        _settle_once(self._stopped, grace)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            messages = self._frames.feed(data)
        except FrameError as exc:
            log.error("the link to the parent carries no frames (%s): stopping", exc)
            self._stop(0.0)
            return
        for message in messages:
            if isinstance(message, Answer):
                self._on_answer(message)
            elif isinstance(message, Tick):
                self._on_tick(message)
            else:
                self._stop(message.grace)

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop(0.0)  # the parent is gone: no ledger to report to
        self.resume_writing()

    def resume_writing(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    async def written(self) -> None:
        """Every frame handed to the transport has gone to the socket (or the link is gone)."""
        transport = self.transport
        while transport is not None and not transport.is_closing():
            if transport.get_write_buffer_size() == 0:
                return
            self._drained = asyncio.get_running_loop().create_future()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.05):
                    await self._drained


def _settle_once(future: asyncio.Future[float], value: float) -> None:
    if not future.done():
        future.set_result(value)


def _die_with_parent(parent: int) -> None:
    """Have the kernel kill this process when its parent dies; exit now if it already did."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        raise SystemExit(0)


class _Child:
    """The worker's state: its proxy (once built) and vLLM's version as last told."""

    def __init__(self, launch: Launch) -> None:
        self.launch = launch
        self.version = launch.version
        self.proxy: Proxy | None = None
        self.reporter: Reporter | None = None
        self.gate: RemoteGate | None = None

    def tick(self, message: Tick) -> None:
        self.version = message.version
        if self.proxy is not None and self.reporter is not None:
            self.proxy.credit_in_flight()
            self.reporter.send(stats_of(self.proxy))

    def answer(self, message: Answer) -> None:
        if self.gate is not None:
            self.gate.answered(message)


async def _serve(launch: Launch) -> int:
    loop = asyncio.get_running_loop()
    child = _Child(launch)
    stopped: asyncio.Future[float] = loop.create_future()
    sock = socket.socket(fileno=launch.fd)
    transport, link = await loop.create_unix_connection(
        lambda: _Link(child.tick, child.answer, stopped), sock=sock
    )
    reporter = child.reporter = Reporter(transport)
    if launch.gate is not None:
        child.gate = RemoteGate(launch.gate, reporter.send)
    proxy = child.proxy = Proxy(
        launch.proxy,
        reporter,
        gate=child.gate,
        vllm_version=lambda: child.version,
        on_accounted=reporter.opened,
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    loop.add_signal_handler(signal.SIGTERM, _settle_once, stopped, launch.grace)
    # What start-up built stays out of full collections (kvtax.serve.wiring's _settle_heap).
    gc.collect()
    gc.freeze()
    try:
        await proxy.start(launch.host, launch.port, reuse_port=True)
    except OSError as exc:
        log.error("worker %d cannot listen: %s", launch.index, exc.strerror)
        transport.close()
        return 1
    reporter.send(Ready(os.getpid()))
    await proxy.stop(await stopped)
    reporter.send(stats_of(proxy))
    reporter.flush()
    await link.written()
    transport.close()
    return 0


def main() -> int:
    launch = msgspec.json.decode(os.environ[ENV], type=Launch)
    _die_with_parent(launch.parent)
    logformat.install(launch.log_level, launch.log_format, worker=launch.index)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - a dependency on Linux
        return asyncio.run(_serve(launch))
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(_serve(launch))


if __name__ == "__main__":
    sys.exit(main())
