"""Reads vLLM's ``/v1/models`` now and then, to learn which names it serves and under what label.

vLLM lists every ``--served-model-name`` in ``/v1/models``, the first (its default, and the name
its metrics use) first, and every LoRA adapter it serves with ``parent`` set to the base model.
:class:`ModelsPoller` reads that list at start and every ``--delivery.models-refresh`` after (the
``models`` job of kvtax's one scheduler, :mod:`kvtax.serve.schedule`), sooner after a failure. It
hands :meth:`ModelNames.set_served <kvtax.delivery.ledger.ModelNames.set_served>` the default
model and its aliases, and :meth:`ModelNames.set_adapters
<kvtax.delivery.ledger.ModelNames.set_adapters>` the adapters it found merged with those in
``--delivery.adapters`` (which win). Both change rarely (a deployment, or vLLM's runtime load
endpoint), so the default refresh is minutes.

It never stops kvtax: a vLLM that is down, slow, old (no ``parent`` field) or that answers
something else leaves the last known map in place, logged once per run of failures. Redirects
are not followed, and the body is read with a bound. Parsing is
:func:`kvtax.delivery.adapters.adapters_from_models` and
:func:`~kvtax.delivery.adapters.served_from_models`.

Example::

    poller = ModelsPoller(names, url="http://127.0.0.1:8000", configured=(("sql", "base"),),
                          interval=300.0, timeout=4.0)
    poller.start()  # in the running loop; build() hands it kvtax's scheduler
"""

from __future__ import annotations

import json
import logging

import aiohttp
from apscheduler.schedulers.asyncio import AsyncIOScheduler

from kvtax.delivery.adapters import (
    AdapterError,
    adapters_from_models,
    merge_adapters,
    served_from_models,
)
from kvtax.delivery.ledger import ModelNames
from kvtax.serve.sources.bodies import read_bounded
from kvtax.serve.sources.poller import Poller

__all__ = ["MAX_MODELS_BODY", "MODELS_PATH", "ModelsPoller"]

log = logging.getLogger("kvtax.serve.sources.models")

MODELS_PATH = "/v1/models"
# 256 adapters with their permission blocks come to well under a megabyte.
MAX_MODELS_BODY = 4 * 1024 * 1024


class ModelsPoller(Poller):
    """Keeps ``names``' adapter map in step with vLLM's ``/v1/models`` and the config."""

    what = "vLLM's model list"
    job_id = "models"

    def __init__(
        self,
        names: ModelNames,
        *,
        url: str,
        configured: tuple[tuple[str, str], ...],
        interval: float,
        timeout: float,
        scheduler: AsyncIOScheduler | None = None,
    ) -> None:
        super().__init__(
            url=url.rstrip("/") + MODELS_PATH,
            interval=interval,
            timeout=timeout,
            log=log,
            scheduler=scheduler,
        )
        self.names = names
        self.configured = configured
        self._discovered: dict[str, str] = {}
        # The configured map holds from the start, before vLLM has answered at all.
        names.set_adapters(merge_adapters(configured, {}))

    def fold(self, body: bytes) -> None:
        """Take one ``/v1/models`` body (raises ValueError when it is not a model list)."""
        try:
            document = json.loads(body)
        except ValueError as exc:
            raise AdapterError("the body is not JSON") from exc
        self._discovered = adapters_from_models(document)
        served = served_from_models(document)
        self.names.set_served(served.default, served.aliases)
        self.names.set_adapters(merge_adapters(self.configured, self._discovered))

    async def read(self, session: aiohttp.ClientSession) -> None:
        async with session.get(
            self.url, timeout=aiohttp.ClientTimeout(total=self.timeout), allow_redirects=False
        ) as resp:
            if resp.status != 200:
                raise AdapterError(f"it answered {resp.status}")
            body = await read_bounded(resp.content, MAX_MODELS_BODY, resp.content_length)
        self.fold(body)

    def recovered(self) -> None:
        log.info("read vLLM's model list again: %d adapters", len(self._discovered))

    def retry_in(self) -> float | None:
        # After a failure retry sooner (vLLM is often still starting), backing off: 5 s, 10 s,
        # ... up to the interval.
        return min(self.interval, 5.0 * self.errors) if self.errors else None
