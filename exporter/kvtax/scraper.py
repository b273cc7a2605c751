"""Fetch vLLM's /metrics (and /version) over HTTP: the scrape edge.

Every failure maps onto one :class:`ScrapeError` with a ``reason`` from a fixed set, so the
sidecar can count errors by reason without a broad ``except`` anywhere else. The client session is
created once and shared; each request has its own timeout, kept below the scrape interval.

Example::

    async with Scraper("http://127.0.0.1:8000", timeout=4.0) as s:
        text = await s.fetch_metrics()
"""

from __future__ import annotations

import json
from types import TracebackType

import aiohttp

__all__ = ["REASONS", "ScrapeError", "Scraper"]

# Created at start with zero values, so rate() works before the first error.
REASONS = ("timeout", "connect", "http_status", "parse", "no_models")

_MAX_BODY = 64 * 1024 * 1024  # a /metrics page larger than this is a misconfiguration


class ScrapeError(Exception):
    """A scrape failed; ``reason`` is one of :data:`REASONS`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class Scraper:
    """A reusable async client for one vLLM server."""

    def __init__(self, base_url: str, timeout: float) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Scraper:
        self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def open(self) -> None:
        if self._session is None:
            # One connection is plenty; keep-alive avoids a handshake per scrape.
            connector = aiohttp.TCPConnector(limit=2)
            self._session = aiohttp.ClientSession(connector=connector)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _get(self, path: str) -> str:
        self.open()
        assert self._session is not None
        try:
            async with self._session.get(
                self.base_url + path, timeout=aiohttp.ClientTimeout(total=self.timeout)
            ) as resp:
                if resp.status != 200:
                    raise ScrapeError("http_status", f"GET {path} answered {resp.status}")
                # read(n) returns whatever has arrived, up to n bytes: read to the end in chunks.
                body = bytearray()
                async for chunk in resp.content.iter_chunked(1 << 16):
                    body += chunk
                    if len(body) > _MAX_BODY:
                        raise ScrapeError("parse", f"GET {path} body exceeds {_MAX_BODY} bytes")
                return body.decode("utf-8", errors="replace")
        except TimeoutError as exc:
            raise ScrapeError("timeout", f"GET {path} took more than {self.timeout}s") from exc
        except aiohttp.ClientError as exc:
            raise ScrapeError("connect", f"GET {path}: {exc}") from exc

    async def fetch_metrics(self) -> str:
        return await self._get("/metrics")

    async def fetch_version(self) -> str | None:
        """vLLM's version from GET /version, or None if the server does not say."""
        try:
            body = await self._get("/version")
            version = json.loads(body).get("version")
        except (ScrapeError, ValueError, AttributeError):
            return None
        return str(version) if version else None
