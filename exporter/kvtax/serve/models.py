"""Reads vLLM's ``/v1/models`` now and then, to learn which served names are LoRA adapters.

vLLM lists every LoRA adapter it serves in ``/v1/models`` with ``parent`` set to the base model.
:class:`ModelsPoller` reads that list at start and every ``--delivery.models-refresh`` after, and
hands :meth:`ModelNames.set_adapters <kvtax.delivery.ledger.ModelNames.set_adapters>` the
adapters it found merged with those in ``--delivery.adapters`` (which win). Adapters change
rarely (a deployment, or vLLM's runtime load endpoint), so the default refresh is minutes.

It never stops kvtax: a vLLM that is down, slow, old (no ``parent`` field) or that answers
something else leaves the last known map in place, logged once per run of failures. Redirects
are not followed, and the body is read with a bound. Parsing is
:func:`kvtax.delivery.adapters.adapters_from_models`.

Example::

    poller = ModelsPoller(names, url="http://127.0.0.1:8000", configured=(("sql", "base"),),
                          interval=300.0, timeout=4.0)
    poller.start()  # in the running loop
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import aiohttp

from kvtax.delivery.adapters import AdapterError, adapters_from_models, merge_adapters
from kvtax.delivery.ledger import ModelNames
from kvtax.serve.bodies import read_bounded
from kvtax.serve.logsafe import redact_url

__all__ = ["MAX_MODELS_BODY", "MODELS_PATH", "ModelsPoller"]

log = logging.getLogger("kvtax.serve.models")

MODELS_PATH = "/v1/models"
# 256 adapters with their permission blocks come to well under a megabyte.
MAX_MODELS_BODY = 4 * 1024 * 1024


class ModelsPoller:
    """Keeps ``names``' adapter map in step with vLLM's ``/v1/models`` and the config."""

    def __init__(
        self,
        names: ModelNames,
        *,
        url: str,
        configured: tuple[tuple[str, str], ...],
        interval: float,
        timeout: float,
    ) -> None:
        self.names = names
        self.url = url.rstrip("/") + MODELS_PATH
        self.configured = configured
        self.interval = interval
        self.timeout = timeout
        self.errors = 0
        self._discovered: dict[str, str] = {}
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        # The configured map holds from the start, before vLLM has answered at all.
        names.set_adapters(merge_adapters(configured, {}))

    def fold(self, body: bytes) -> None:
        """Take one ``/v1/models`` body (raises ValueError when it is not a model list)."""
        try:
            document = json.loads(body)
        except ValueError as exc:
            raise AdapterError("the body is not JSON") from exc
        self._discovered = adapters_from_models(document)
        self.names.set_adapters(merge_adapters(self.configured, self._discovered))

    async def _fetch(self, session: aiohttp.ClientSession) -> bytes:
        async with session.get(
            self.url, timeout=aiohttp.ClientTimeout(total=self.timeout), allow_redirects=False
        ) as resp:
            if resp.status != 200:
                raise AdapterError(f"it answered {resp.status}")
            return await read_bounded(resp.content, MAX_MODELS_BODY, resp.content_length)

    async def poll_once(self) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        try:
            self.fold(await self._fetch(self._session))
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            if self.errors == 0:
                log.warning("reading vLLM's model list at %s failed: %s", redact_url(self.url), exc)
            self.errors += 1
        else:
            if self.errors:
                log.info("read vLLM's model list again: %d adapters", len(self._discovered))
            self.errors = 0

    async def _loop(self) -> None:
        while True:
            await self.poll_once()
            # After a failure retry sooner (vLLM is often still starting), backing off.
            await asyncio.sleep(min(self.interval, 5.0 * self.errors) or self.interval)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None
