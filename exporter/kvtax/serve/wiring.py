"""Start-up wiring of ``kvtax serve``: every part built in one place and handed what it needs.

:func:`build` makes the parts and connects them explicitly, in data-flow order:

- the delivery ledger and its model names, written by the proxy, the push route and the
  gateway poller;
- the gate and the proxy, which credits its running streams to the ledger on demand;
- the window (:class:`~kvtax.figures.window.Window`), written only by the scrape job
  (:class:`~kvtax.serve.scrape.job.ScrapeJob`: scraper, parse pool, its job on the scheduler),
  which credits the proxy's running streams and then pairs the ledger's totals with the
  engine's;
- the report behind ``/metrics``: the scrape job's health and figures, the ledger's counters,
  the proxy's gauges, the gate's and the self-watch's samples, read and never written;
- the web port (:class:`~kvtax.serve.web.port.WebPort`), handed that report, the scrape job's
  readiness for ``/readyz``, and the push route.

Each part is built after the parts it reads, so nothing is connected after the fact.

The gate (:mod:`kvtax.serve.proxy.gatekeeper`) follows the scrape's figures: the scrape hands each
fold's figures to its ``on_figures`` subscribers, :meth:`Gate.on_figures
<kvtax.serve.proxy.gatekeeper.Gate.on_figures>` among them; the proxy holds the gate only when
``--gate.mode`` is not ``off``, and ``/metrics`` shows its advice either way.

Periodic work has one mechanism: the APScheduler scheduler made here
(:func:`kvtax.serve.schedule.new_scheduler`) and handed to each part that runs on a clock. Its
jobs are the scrape, the gateway poll, the ``/v1/models`` refresh and the loop watch; each part
adds its job when it starts and removes it when it stops, and :meth:`Stack.stop` shuts the
scheduler down last.

The proxy starts when ``--proxy.listen_address`` is set, the gateway poller when
``--gateway.url`` is set; the push endpoint is always on the web port (and refuses pushes until a
token is configured).

Example::

    stack = build(config)
    await stack.start()
    ...
    await stack.drain(grace=30.0)
    await stack.stop()
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from aiohttp import web
from apscheduler.schedulers.asyncio import AsyncIOScheduler

from kvtax.delivery.cost import RelayCost
from kvtax.delivery.ledger import DeliveryLedger, ModelNames
from kvtax.expose.publish import (
    adapter_samples,
    api_samples,
    ledger_samples,
    proxy_samples,
    worker_samples,
)
from kvtax.expose.samples import HistogramSample, Sample
from kvtax.figures.window import Window
from kvtax.gate.cap import CapSettings, Mode
from kvtax.gate.footprint import OverBudget
from kvtax.gate.order import Order
from kvtax.serve.config import Config
from kvtax.serve.proxy import Proxy, ProxySettings
from kvtax.serve.proxy.gatekeeper import Gate, GateSettings
from kvtax.serve.schedule import new_scheduler
from kvtax.serve.scrape.job import LedgerFeed, ScrapeJob
from kvtax.serve.scrape.parsepool import ParsePool
from kvtax.serve.selfwatch import LoopWatch
from kvtax.serve.sources.models import ModelsPoller
from kvtax.serve.sources.push import PUSH_PATH, GatewayPoller, push_handler
from kvtax.serve.web.port import Report, WebPort
from kvtax.serve.web.webconfig import load as load_web_config
from kvtax.serve.workers.pool import WorkerPool

__all__ = ["Relay", "Stack", "build", "gate_settings", "report_of", "run"]

log = logging.getLogger("kvtax.serve.wiring")


class Relay(Protocol):
    """What ``/metrics`` and the scrape read of the relay: the proxy in this process, or the
    pool of proxy workers (``--proxy.workers`` above 1)."""

    @property
    def in_flight(self) -> int: ...

    @property
    def streams_open(self) -> int: ...

    @property
    def upstream_retries(self) -> int: ...

    @property
    def cost(self) -> RelayCost: ...

    def credit_in_flight(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Stack:
    """The parts of one running kvtax, as :func:`build` connected them."""

    config: Config
    names: ModelNames
    ledger: DeliveryLedger
    window: Window
    proxy: Proxy
    gateway: GatewayPoller | None
    loopwatch: LoopWatch
    scrape: ScrapeJob
    gate: Gate
    # Everything /metrics shows (see report_of); the web port renders it.
    report: Report
    web: WebPort
    scheduler: AsyncIOScheduler
    models: ModelsPoller | None = None
    # --proxy.workers above 1: the workers relay, and ``proxy`` is never started.
    workers: WorkerPool | None = None

    async def start(self) -> None:
        # The one scheduler first: each part adds its job to it as it starts, removes it as
        # it stops.
        self.scheduler.start()
        # The web port before the scrape: a port kvtax cannot listen on fails the start
        # before any scrape ran.
        await self.web.start()
        self.scrape.start()
        self.loopwatch.start()
        address = self.config.proxy_listen_address
        if address is not None and self.workers is not None:
            await self.workers.start(*address)
        elif address is not None:
            await self.proxy.start(*address)
        if self.gateway is not None:
            self.gateway.start()
        if self.models is not None:
            self.models.start()

    async def drain(self, grace: float = 0.0) -> None:
        """Stop taking requests: /readyz fails, the proxy lets requests in flight finish for up
        to ``grace`` seconds, and the gateway and ``/v1/models`` pollers stop (their jobs leave
        the scheduler). ``/metrics`` stays up, and the scrape goes on."""
        self.scrape.draining = True
        if self.workers is not None:
            await self.workers.stop(grace)
        await self.proxy.stop(grace)
        if self.gateway is not None:
            await self.gateway.stop()
        if self.models is not None:
            await self.models.stop()

    async def stop(self) -> None:
        # The scrape ends first (one in flight finishes), then the web port, then the scrape's
        # clients to vLLM: /readyz asks vLLM's /health through one of them until the port is
        # down.
        await self.scrape.stop()
        await self.web.stop()
        await self.scrape.close()
        await self.loopwatch.stop()
        # Last: its jobs are gone by now (a part that never started added none).
        if self.scheduler.running:
            self.scheduler.shutdown(wait=False)


def report_of(
    scrape: ScrapeJob,
    ledger: DeliveryLedger,
    proxy: Relay,
    gate: Gate,
    loopwatch: LoopWatch,
    *,
    workers: WorkerPool | None = None,
) -> Report:
    """Everything ``/metrics`` shows, read from the parts on each call; it changes none of
    them. (The web port adds its own ``kvtax_metrics_requests_total``.)"""

    def report() -> Iterator[Sample | HistogramSample]:
        yield from scrape.samples()
        yield from ledger_samples(ledger.counts())
        yield from adapter_samples(ledger.adapter_counts())
        yield from api_samples(ledger.api_counts())
        yield from proxy_samples(
            proxy.in_flight, proxy.streams_open, proxy.upstream_retries, proxy.cost
        )
        if workers is None:
            yield from worker_samples(0, 0.0, 0)
        else:
            yield from worker_samples(workers.running, workers.cpu, workers.restarts)
        yield from gate.samples()
        yield from loopwatch.samples()

    return report


def _proxy(
    config: Config, ledger: DeliveryLedger, gate: Gate, *, version: Callable[[], str | None]
) -> Proxy:
    """The proxy, holding the gate only when it is on (off, the gate still advises)."""
    settings = _proxy_settings(config)
    return Proxy(settings, ledger, gate=gate if gate.settings.on else None, vllm_version=version)


def _workers(
    config: Config, ledger: DeliveryLedger, gate: Gate, *, version: Callable[[], str | None]
) -> WorkerPool | None:
    """The pool of proxy workers, when ``--proxy.workers`` asks for more than one."""
    if config.proxy_workers < 2 or config.proxy_listen_address is None:
        return None
    return WorkerPool(
        _proxy_settings(config),
        ledger,
        count=config.proxy_workers,
        version=version,
        grace=config.shutdown_grace_period,
        log_level=config.log_level,
        log_format=config.log_format,
        gate=gate if gate.settings.on else None,
    )


def _proxy_settings(config: Config) -> ProxySettings:
    return ProxySettings(
        upstream=config.vllm_url,
        max_body=config.proxy_max_body,
        timeout=config.proxy_timeout,
        send_timeout=config.proxy_send_timeout,
        stall_factor=config.proxy_stall_factor,
        stall_min=config.proxy_stall_min,
        slo_ttft=config.slo_ttft,
        slo_itl=config.slo_itl,
    )


def gate_settings(config: Config) -> GateSettings:
    """The gate's settings, from the ``gate.*`` options."""
    mode: Mode = config.gate_mode  # type: ignore[assignment]  # checked by the option
    order: Order = config.gate_order  # type: ignore[assignment]
    over: OverBudget = config.gate_over_budget  # type: ignore[assignment]
    return GateSettings(
        cap=CapSettings(
            mode=mode,
            static_cap=config.gate_static_cap,
            floor=config.gate_floor,
            ceiling=config.gate_ceiling,
            target_usage=config.target_usage,
            block_size=config.gate_block_size,
        ),
        max_queue=config.gate_max_queue,
        max_wait=config.gate_max_wait,
        order=order,
        token_budget=config.gate_token_budget,
        over_budget=over,
        max_model_len=config.gate_max_model_len,
        fairness_header=_header(config.gate_fairness_header),
        priority_header=_header(config.gate_priority_header),
        fair_reserve=config.gate_fair_reserve,
    )


def _header(name: str | None) -> bytes | None:
    return name.encode("ascii") if name is not None else None


def _gateway(
    config: Config, ledger: DeliveryLedger, scheduler: AsyncIOScheduler
) -> GatewayPoller | None:
    if config.gateway_url is None:
        return None
    return GatewayPoller(
        ledger,
        url=config.gateway_url,
        metric=config.gateway_metric,
        model_label=config.gateway_model_label,
        selector=config.gateway_selector,
        interval=config.scrape_interval,
        timeout=config.effective_timeout,
        scheduler=scheduler,
    )


def _models(config: Config, names: ModelNames, scheduler: AsyncIOScheduler) -> ModelsPoller | None:
    poller = ModelsPoller(
        names,
        url=config.vllm_url,
        configured=config.delivery_adapters,
        interval=config.delivery_models_refresh,
        # Read rarely, so it may wait longer than a scrape: a busy vLLM still answers.
        timeout=max(config.effective_timeout, 10.0),
        scheduler=scheduler,
    )
    # Built even when polling is off: it installs the configured adapters.
    return poller if config.delivery_models_refresh > 0 else None


def build(
    config: Config,
    *,
    clock: Callable[[], float] = time.time,
    parser: ParsePool | None = None,
) -> Stack:
    """Build and connect every part of ``kvtax serve``; nothing starts until ``Stack.start``.

    Reads ``--web.config.file`` (and the certificates it names) first: a bad file raises
    ConfigError before anything is built.
    """
    security = load_web_config(config.web_config_file)
    scheduler = new_scheduler()  # every periodic job of kvtax runs on this one
    names = ModelNames()
    ledger = DeliveryLedger(names)
    window = Window(config.window, max_models=config.scrape_max_models)
    gate = Gate(gate_settings(config))
    # The scrape reads vLLM's version (GET /version); how streams are counted follows it.
    proxy = _proxy(config, ledger, gate, version=lambda: scrape.health.version)
    workers = _workers(config, ledger, gate, version=lambda: scrape.health.version)
    push = push_handler(
        ledger, config.push_token, allow_unauthenticated=config.push_allow_unauthenticated
    )
    scrape = ScrapeJob(
        config,
        window=window,
        feed=LedgerFeed(names, ledger, (workers or proxy).credit_in_flight),
        clock=clock,
        parser=parser,
        scheduler=scheduler,
        # Pushed by the scrape after each fold: the gate steps its cap on the new figures.
        on_figures=[gate.on_figures],
    )
    loopwatch = LoopWatch(scheduler=scheduler)
    report = report_of(scrape, ledger, workers or proxy, gate, loopwatch, workers=workers)
    port = WebPort(
        config,
        report=report,
        readiness=scrape.readiness,
        # A scrape that changed the figures makes the next GET of /metrics render anew.
        revision=scrape.revision,
        security=security,
        routes=[web.post(PUSH_PATH, push)],
    )
    return Stack(
        config=config,
        names=names,
        ledger=ledger,
        window=window,
        proxy=proxy,
        gateway=_gateway(config, ledger, scheduler),
        loopwatch=loopwatch,
        scrape=scrape,
        gate=gate,
        report=report,
        web=port,
        scheduler=scheduler,
        models=_models(config, names, scheduler),
        workers=workers,
    )


def _settle_heap() -> None:
    """Take what start-up built out of the garbage collector's full collections.

    Start-up leaves some 50,000 objects that live as long as kvtax: modules, classes, pydantic's
    validators, the parts :func:`build` made. CPython's full (oldest-generation) collection
    walks all of them: 50 to 70 ms of a held event loop on a 2-vCPU machine, every 30 to 45 s
    under bench/relay/relay.py's load. The requests' own allocations set it off, so it falls in a
    burst of new requests and holds up their first bytes. One collection here, then
    :func:`gc.freeze`, moves the survivors to the permanent generation, which no collection
    walks: a full collection under the same load then takes 5 to 15 ms. Garbage made later is
    collected as before.
    """
    gc.collect()
    gc.freeze()


async def run(config: Config) -> int:
    """Run the sidecar until SIGTERM or SIGINT, then drain; the exit status for the CLI."""
    stack = build(config)
    # Before anything listens: the one collection holds no request up.
    _settle_heap()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stack.start()
    except OSError as exc:
        log.error("cannot listen: %s", exc.strerror)
        await stack.drain()
        await stack.stop()
        return 1
    await stop.wait()
    log.info(
        "shutting down: letting requests in flight finish for up to %.0fs",
        config.shutdown_grace_period,
    )
    # The proxy drains first; /metrics stays up meanwhile so the last figures can be scraped.
    await stack.drain(config.shutdown_grace_period)
    await stack.stop()
    settled = ", ".join(f"{k} {v:.0f}" for k, v in stack.ledger.outcomes().items())
    log.info("stopped; requests settled by outcome: %s", settled)
    return 0
