"""A poll that fails in a way nobody foresaw is one failed poll: polling goes on, stop() returns.

A ``/v1/models`` body nested 100000 deep makes ``json.loads`` raise RecursionError, which is
neither a ClientError, a TimeoutError nor a ValueError; it used to end the polling task unlogged
and then make ``stop()`` (and so kvtax's shutdown) raise it.
"""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvtax.delivery.ledger import ModelNames
from kvtax.serve.sources.models import ModelsPoller
from kvtax.serve.sources.poller import Poller

BASE = "meta-llama/Llama-3.1-8B-Instruct"
NESTED = b'{"data":' + b"[" * 100_000
GOOD = json.dumps(
    {"object": "list", "data": [{"id": BASE}, {"id": "sql-lora", "parent": BASE}]}
).encode()


class Pages:
    """Answers ``/v1/models`` with each body in turn, then the last one for good."""

    def __init__(self, *bodies: bytes) -> None:
        self.bodies = list(bodies)
        self.served = 0

    async def handle(self, request: web.Request) -> web.Response:
        body = self.bodies[min(self.served, len(self.bodies) - 1)]
        self.served += 1
        return web.Response(body=body, content_type="application/json")


async def test_a_body_nested_too_deeply_fails_one_poll_and_polling_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pages = Pages(NESTED, GOOD)
    app = web.Application()
    app.router.add_get("/v1/models", pages.handle)
    names = ModelNames()
    async with TestServer(app) as server:
        poller = ModelsPoller(
            names, url=str(server.make_url("")), configured=(), interval=0.01, timeout=2.0
        )
        with caplog.at_level(logging.WARNING, logger="kvtax.serve.sources.models"):
            poller.start()
            async with asyncio.timeout(5.0):
                while names.adapters != {"sql-lora": BASE}:
                    await asyncio.sleep(0.01)
            await poller.stop()
    assert pages.served >= 2
    warned = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert len(warned) == 1
    assert "RecursionError" in warned[0]
    assert "[[[" not in warned[0]  # the type, not the body


class DiesBetweenPolls(Poller):
    """A poller whose loop dies of its own exception, outside any poll."""

    what = "a test page"

    def __init__(self, log: logging.Logger) -> None:
        super().__init__(url="http://127.0.0.1:9/x", interval=1.0, timeout=1.0, log=log)
        self.died = asyncio.Event()

    async def read(self, session: aiohttp.ClientSession) -> None:
        return None

    def delay(self) -> float:
        self.died.set()
        raise RuntimeError("a bug between polls")


async def test_stop_returns_and_logs_when_the_loop_died_of_its_own_exception(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = logging.getLogger("kvtax.test.poller")
    poller = DiesBetweenPolls(log)
    poller.start()
    await poller.died.wait()  # the loop polled once, then died in the same step
    with caplog.at_level(logging.ERROR, logger="kvtax.test.poller"):
        await poller.stop()  # returns: the rest of the shutdown goes on
    assert any("had stopped: RuntimeError" in r.getMessage() for r in caplog.records)
    await poller.stop()  # a second stop is a no-op
