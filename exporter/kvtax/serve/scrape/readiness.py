"""vLLM's ``/health`` as ``/readyz`` asks it: one request in flight, its answer reused briefly.

``/readyz`` needs no credentials (kubelet probes carry none), so anyone on the pod network can
call it in a loop, and the kubelet, a mesh and a load balancer may all probe it at once. Asking
vLLM once per hit, through the scraper's two connections, let a flood of probes (or probes piling
up while vLLM is slow) queue the periodic ``/metrics`` scrape behind them until it timed out and
``kvtax_vllm_up`` fell to 0. So :class:`HealthCheck`:

- has a client of its own (its own connection pool), never the scraper's;
- shares the check in flight among every caller that asks meanwhile;
- reuses the last answer for :data:`FRESH_FOR` seconds.

Example::

    health = HealthCheck(Scraper(url, timeout=4.0, max_bytes=HEALTH_MAX_BYTES))
    failure = await health.failure()  # None: vLLM answered 200
    await health.close()
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from kvtax.serve.scrape.scraper import ScrapeError, Scraper

__all__ = ["FRESH_FOR", "HEALTH_MAX_BYTES", "HealthCheck"]

# The kubelet probes every 10 s by default: an answer a second old routes traffic as well as a
# new one, and it caps what any number of /readyz hits cost vLLM at one /health a second.
FRESH_FOR = 1.0
# vLLM's /health answers an empty body; anything much longer is not vLLM.
HEALTH_MAX_BYTES = 64 * 1024


class HealthCheck:
    """Asks vLLM's ``/health`` through ``scraper`` (which it owns); see the module docstring."""

    def __init__(
        self,
        scraper: Scraper,
        *,
        fresh_for: float = FRESH_FOR,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.scraper = scraper
        self.fresh_for = fresh_for
        # Monotonic: a wall clock stepped back would keep an old answer for as long.
        self.clock = clock
        self._pending: asyncio.Task[ScrapeError | None] | None = None
        self._checked_at: float | None = None
        self._failure: ScrapeError | None = None

    async def failure(self) -> ScrapeError | None:
        """None when vLLM's ``/health`` answered 200, else why not; at most FRESH_FOR old."""
        at = self._checked_at
        if at is not None and self.clock() - at < self.fresh_for:
            return self._failure
        if self._pending is None:
            self._pending = asyncio.get_running_loop().create_task(self._check())
        # Shielded: a prober that hangs up must not cancel the check the others wait on.
        return await asyncio.shield(self._pending)

    async def _check(self) -> ScrapeError | None:
        try:
            await self.scraper.fetch_health()
            failure = None
        except ScrapeError as exc:
            failure = exc
        finally:
            self._pending = None
        self._failure, self._checked_at = failure, self.clock()
        return failure

    async def close(self) -> None:
        """Cancel a check in flight and close the client."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.cancel()
            await asyncio.wait([pending])
        await self.scraper.close()
