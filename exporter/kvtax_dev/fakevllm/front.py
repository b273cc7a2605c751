"""The raw transport's rig: :class:`Front`, a started :class:`~kvtax.serve.proxy.Proxy`
(``start(host, 0)``) in front of a :class:`~kvtax_dev.fakevllm.upstream.RawUpstream`, the one
"fake upstream + proxy" of the tests of kvtax's front door, with the ledger readers they need.

:func:`start_front` makes one and :func:`stop_front` tears it down; the unit tests reach them
through the ``front_door`` fixture (``tests/unit/conftest.py``: the fixture stays with pytest,
so that this package imports without it).

Example::

    async def test_x(front_door: StartFront) -> None:
        front = await front_door(VllmLike(tokens=3))
        reply = await front.exchange(post("/v1/completions", STREAM))
        assert front.upstream.seen[0].target == b"/v1/completions"
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from kvtax.delivery.ledger import DeliveryLedger, ModelNames
from kvtax.expose.publish import ledger_samples
from kvtax.expose.samples import Sample
from kvtax.serve.proxy import Proxy, ProxySettings
from kvtax.serve.proxy.gatekeeper import Gate
from kvtax_dev.fakevllm.client import Reply, connect, read_reply
from kvtax_dev.fakevllm.raw import GUARD, WAIT, Script
from kvtax_dev.fakevllm.upstream import RawUpstream
from kvtax_dev.process import until

__all__ = ["Front", "StartFront", "start_front", "stop_front"]


@dataclass
class Front:
    """A started Proxy in front of a RawUpstream, and the client connections a test opened."""

    upstream: RawUpstream
    proxy: Proxy
    port: int
    writers: list[asyncio.StreamWriter] = field(default_factory=list)

    async def connect(
        self, *, rcvbuf: int | None = None
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await connect(self.port, rcvbuf=rcvbuf)
        self.writers.append(writer)
        return reader, writer

    async def exchange(self, request: bytes, *, method: str = "GET") -> Reply:
        """One request on a fresh connection and its response."""
        reader, writer = await self.connect()
        writer.write(request)
        await writer.drain()
        return await read_reply(reader, method=method)

    def outcomes(self, model: str = "m") -> dict[str, float]:
        """Requests settled by outcome (non-zero ones) for ``model``."""
        return {
            s.labels[1]: s.value
            for s in ledger_samples(self.proxy.ledger.counts())
            if isinstance(s, Sample)
            and s.metric == "kvtax_requests_total"
            and s.labels[0] == model
            and s.value
        }

    def delivered(self, model: str = "m") -> float:
        totals = self.proxy.ledger.totals()
        return totals[model].delivered if model in totals else 0.0

    async def settled(self, n: int, model: str = "m", limit: float = GUARD) -> dict[str, float]:
        """The outcomes once ``n`` requests settled and none is in flight (called once the
        client has its answer, when settling is a matter of a turn of the loop)."""

        def done() -> bool:
            return sum(self.outcomes(model).values()) >= n and self.proxy.in_flight == 0

        await until(done, limit)
        return self.outcomes(model)


StartFront = Callable[..., Coroutine[Any, Any, Front]]


async def start_front(
    script: Script | None = None, *, gate: Gate | None = None, **settings: Any
) -> Front:
    """A RawUpstream answering with ``script`` and a Proxy in front of it, both on port 0."""
    upstream = RawUpstream(script)
    await upstream.start()
    names = ModelNames()
    names.update(["m"])
    proxy = Proxy(
        ProxySettings(upstream=upstream.url, **settings), DeliveryLedger(names), gate=gate
    )
    port = await proxy.start("127.0.0.1", 0)
    return Front(upstream, proxy, port)


async def stop_front(front: Front) -> None:
    for writer in front.writers:
        writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await writer.wait_closed()
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(WAIT):
            await front.proxy.stop()
    await front.upstream.stop()
