"""Pollers on kvtax's scheduler. A poll that fails in a way nobody foresaw is one failed poll:
polling goes on, stop() returns.

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


class FailsBetweenPolls(Poller):
    """A poller whose code between two polls raises: a bug outside any poll."""

    what = "a test page"

    def __init__(self, log: logging.Logger) -> None:
        super().__init__(url="http://127.0.0.1:9/x", interval=0.01, timeout=1.0, log=log)
        self.polls = 0

    async def read(self, session: aiohttp.ClientSession) -> None:
        self.polls += 1

    def retry_in(self) -> float | None:
        raise RuntimeError("a bug between polls")


async def test_a_bug_between_polls_is_logged_and_polling_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Protection: such a bug ended the polling loop, unseen until stop() logged it.
    log = logging.getLogger("kvtax.test.poller")
    poller = FailsBetweenPolls(log)
    with caplog.at_level(logging.ERROR, logger="kvtax.test.poller"):
        poller.start()
        async with asyncio.timeout(5.0):
            while poller.polls < 3:
                await asyncio.sleep(0.01)
        await poller.stop()  # returns: the rest of the shutdown goes on
    assert any(
        "choosing the next poll failed: RuntimeError" in r.getMessage() for r in caplog.records
    )
    assert "127.0.0.1:9/x" in caplog.text
    await poller.stop()  # a second stop is a no-op


class Hangs(Poller):
    """A poller whose read never ends, and which says when it began one."""

    what = "a hanging page"

    def __init__(self) -> None:
        super().__init__(
            url="http://127.0.0.1:9/x",
            interval=60.0,
            timeout=60.0,
            log=logging.getLogger("kvtax.test.poller"),
        )
        self.reading = asyncio.Event()

    async def read(self, session: aiohttp.ClientSession) -> None:
        self.reading.set()
        await asyncio.Event().wait()


async def test_stop_ends_a_poll_in_flight_without_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    poller = Hangs()
    with caplog.at_level(logging.WARNING):
        poller.start()  # the first poll runs at once, not an interval later
        async with asyncio.timeout(5.0):
            await poller.reading.wait()
            await poller.stop()
    assert poller.errors == 0
    # Neither kvtax nor APScheduler calls the cancelled poll an error.
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_after_a_failure_the_models_poller_retries_sooner_then_keeps_its_interval() -> None:
    names = ModelNames()
    poller = ModelsPoller(
        names, url="http://127.0.0.1:9", configured=(), interval=300.0, timeout=1.0
    )
    assert poller.retry_in() is None
    poller.errors = 1
    assert poller.retry_in() == 5.0
    poller.errors = 100
    assert poller.retry_in() == 300.0


class FailsThenWorks(Poller):
    """Fails its first two polls, then reads; asks for a retry 10 ms after a failure."""

    what = "a flaky page"

    def __init__(self) -> None:
        super().__init__(
            url="http://127.0.0.1:9/x",
            interval=300.0,
            timeout=1.0,
            log=logging.getLogger("kvtax.test.poller"),
        )
        self.polls = 0

    async def read(self, session: aiohttp.ClientSession) -> None:
        self.polls += 1
        if self.polls <= 2:
            raise ValueError("not yet")

    def retry_in(self) -> float | None:
        return 0.01 if self.errors else None


async def test_a_failed_poll_is_retried_when_asked_then_the_interval_holds() -> None:
    poller = FailsThenWorks()
    poller.start()
    try:
        async with asyncio.timeout(5.0):
            while poller.polls < 3:
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        assert (poller.polls, poller.errors) == (3, 0)  # the next poll is 300 s away
    finally:
        await poller.stop()
