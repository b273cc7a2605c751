"""Wires delivered-token accounting into the sidecar: ledger, proxy, push, gateway and the join.

:class:`Delivery` attaches to a :class:`~kvtax.serve.sidecar.Sidecar` before it starts. At every
scrape of vLLM it learns the served model names (the only label values the ledger accepts) and
folds one aligned point into the join; on every scrape of kvtax it publishes the ledger's counters
and the join's window figures. It starts the proxy when ``--proxy.listen_address`` is set and the
gateway poller when ``--gateway.url`` is set; the push endpoint is always on the web port (and
refuses pushes until a token is configured).

Example::

    sidecar = Sidecar(config)
    delivery = Delivery(config, sidecar)
    await sidecar.start()
    await delivery.start()
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Iterator

from kvtax.delivery.ledger import DeliveryLedger, ModelNames
from kvtax.engine.snapshot import VllmSnapshot
from kvtax.expose.report import HistogramSample, Sample
from kvtax.figures.join import SERVED_HANDLERS, JoinFigures, JoinHistory, join_samples
from kvtax.serve.config import Config
from kvtax.serve.proxy import Proxy, ProxySettings
from kvtax.serve.sidecar import Sidecar
from kvtax.serve.sources import PUSH_PATH, GatewayPoller, push_handler

__all__ = ["Delivery", "run", "served_requests"]

log = logging.getLogger("kvtax.serve.wiring")


def served_requests(snap: VllmSnapshot) -> float:
    """vLLM's count of completion and chat requests, from its server-wide HTTP counter.

    A server that has answered nothing yet exposes the family without samples: that is 0.
    """
    for metrics in snap.models.values():
        by_handler = metrics.split.get("http_requests")
        if by_handler is not None:
            return sum(by_handler.get(h, 0.0) for h in SERVED_HANDLERS)
    return 0.0


class Delivery:
    """The delivery side of one sidecar. See the module docstring."""

    def __init__(self, config: Config, sidecar: Sidecar) -> None:
        self.config = config
        self.sidecar = sidecar
        self.names = ModelNames()
        self.ledger = DeliveryLedger(self.names)
        self.join = JoinHistory(config.window)
        self.figures: dict[str, JoinFigures] = {}
        self.proxy = Proxy(
            ProxySettings(
                upstream=config.vllm_url,
                max_body=config.proxy_max_body,
                timeout=config.proxy_timeout,
                stall_factor=config.proxy_stall_factor,
                stall_min=config.proxy_stall_min,
                slo_ttft=config.slo_ttft,
                slo_itl=config.slo_itl,
            ),
            self.ledger,
        )
        self.gateway: GatewayPoller | None = None
        if config.gateway_url is not None:
            self.gateway = GatewayPoller(
                self.ledger,
                url=config.gateway_url,
                metric=config.gateway_metric,
                model_label=config.gateway_model_label,
                selector=config.gateway_selector,
                interval=config.scrape_interval,
                timeout=config.effective_timeout,
            )
        sidecar.add_observer(self.observe)
        sidecar.add_producer(self.samples)
        push = push_handler(
            self.ledger,
            config.push_token,
            allow_unauthenticated=config.push_allow_unauthenticated,
        )
        sidecar.add_route("POST", PUSH_PATH, push)

    def observe(self, snap: VllmSnapshot) -> None:
        """Fold one vLLM scrape into the join, aligned with the ledger at this instant."""
        self.names.update(snap.models)
        engine = {}
        for model in snap.models:
            point = self.sidecar.history.latest(model)
            if point is not None:
                engine[model] = point.counters
        self.proxy.credit_in_flight()
        self.join.observe(snap.timestamp, engine, served_requests(snap), self.ledger.totals())
        self.figures = self.join.figures()

    def samples(self) -> Iterator[Sample | HistogramSample]:
        self.proxy.credit_in_flight()
        yield from self.ledger.samples()
        yield from join_samples(self.figures)
        yield Sample("kvtax_proxy_requests_in_flight", (), float(self.proxy.in_flight))
        yield Sample("kvtax_proxy_streams_open", (), float(self.proxy.streams_open))

    async def start(self) -> None:
        if self.config.proxy_listen_address is not None:
            await self.proxy.start(*self.config.proxy_listen_address)
        if self.gateway is not None:
            self.gateway.start()

    async def stop(self, grace: float = 0.0) -> None:
        """Stop the proxy, letting requests in flight finish for up to ``grace`` seconds."""
        await self.proxy.stop(grace)
        if self.gateway is not None:
            await self.gateway.stop()


async def run(config: Config) -> int:
    """Run the sidecar until SIGTERM or SIGINT, then drain; the exit status for the CLI."""
    sidecar = Sidecar(config)
    delivery = Delivery(config, sidecar)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await sidecar.start()
        await delivery.start()
    except OSError as exc:
        log.error("cannot listen: %s", exc.strerror)
        await delivery.stop()
        await sidecar.stop()
        return 1
    await stop.wait()
    log.info(
        "shutting down: letting requests in flight finish for up to %.0fs",
        config.shutdown_grace_period,
    )
    sidecar.draining = True
    # The proxy drains first; /metrics stays up meanwhile so the last figures can be scraped.
    await delivery.stop(config.shutdown_grace_period)
    await sidecar.stop()
    settled = ", ".join(f"{k} {v:.0f}" for k, v in delivery.ledger.outcomes().items())
    log.info("stopped; requests settled by outcome: %s", settled)
    return 0
