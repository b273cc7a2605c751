"""Fetch vLLM's /metrics (and /version) over HTTP: the scrape edge.

Every failure maps onto one :class:`ScrapeError` with a ``reason`` from a fixed set, so the
sidecar can count errors by reason without a broad ``except`` anywhere else. The client session is
created once and shared; each request has its own timeout, kept below the scrape interval.

The page is hostile input until parsed: redirects are not followed (a 302 could hand kvtax any
host's page as vLLM's), and the body is read to the end under a byte bound that fails as soon as
it is crossed, without buffering the rest.

Example::

    async with Scraper("http://127.0.0.1:8000", timeout=4.0, max_bytes=8 << 20) as s:
        text = await s.fetch_metrics()
"""

from __future__ import annotations

import json
from types import TracebackType

import aiohttp

from kvtax.errors import UpstreamError

__all__ = ["REASONS", "ScrapeError", "Scraper"]

# Created at start with zero values, so rate() works before the first error. "refused" (nothing
# listens: vLLM is down) is kept apart from "timeout" (vLLM is slow) and other "connect" errors
# so that an operator can tell slow from down. The page-bound reasons come from normalize.
REASONS = (
    "timeout",
    "refused",
    "connect",
    "http_status",
    "too_large",
    "truncated",
    "too_many_series",
    "parse",
    "no_models",
)

DEFAULT_MAX_BYTES = 8 * 1024 * 1024
_CHUNK = 1 << 16


class ScrapeError(UpstreamError):
    """A scrape failed; ``reason`` is one of :data:`REASONS`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class Scraper:
    """A reusable async client for one vLLM server."""

    def __init__(self, base_url: str, timeout: float, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.max_bytes = max_bytes
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
            # One connection is plenty; keep-alive avoids a handshake per scrape. No transparent
            # decompression: a small gzip body could inflate far past the byte bound per chunk.
            connector = aiohttp.TCPConnector(limit=2)
            self._session = aiohttp.ClientSession(
                connector=connector,
                auto_decompress=False,
                headers={"Accept-Encoding": "identity"},
            )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _get(self, path: str) -> str:
        self.open()
        assert self._session is not None
        try:
            async with self._session.get(
                self.base_url + path,
                timeout=aiohttp.ClientTimeout(total=self.timeout),
                allow_redirects=False,
            ) as resp:
                _check_status(resp, path)
                return await self._read_bounded(resp, path)
        except TimeoutError as exc:
            raise ScrapeError("timeout", f"GET {path} took more than {self.timeout}s") from exc
        except aiohttp.ClientConnectorError as exc:
            reason = "refused" if isinstance(exc.os_error, ConnectionRefusedError) else "connect"
            raise ScrapeError(reason, f"GET {path}: {exc}") from exc
        except aiohttp.ClientError as exc:
            raise ScrapeError("connect", f"GET {path}: {exc}") from exc

    async def _read_bounded(self, resp: aiohttp.ClientResponse, path: str) -> str:
        """The whole body, or ``too_large`` the moment it passes :attr:`max_bytes`."""
        limit = self.max_bytes
        if resp.content_length is not None and resp.content_length > limit:
            resp.close()
            raise ScrapeError("too_large", _too_large(path, limit, resp.content_length))
        # read(n) returns whatever has arrived, up to n bytes: read to the end in chunks.
        body = bytearray()
        async for chunk in resp.content.iter_chunked(_CHUNK):
            body += chunk
            if len(body) > limit:
                resp.close()  # drop the connection: the rest is never read or buffered
                raise ScrapeError("too_large", _too_large(path, limit, None))
        return body.decode("utf-8", errors="replace")

    async def fetch_metrics(self) -> str:
        return await self._get("/metrics")

    async def fetch_health(self) -> None:
        """GET /health: returns when vLLM answers 200, else raises :class:`ScrapeError`."""
        await self._get("/health")

    async def fetch_version(self) -> str | None:
        """vLLM's version from GET /version, or None if the server does not say."""
        try:
            body = await self._get("/version")
            version = json.loads(body).get("version")
        except (ScrapeError, ValueError, AttributeError):
            return None
        return str(version) if version else None


def _check_status(resp: aiohttp.ClientResponse, path: str) -> None:
    if 300 <= resp.status < 400:
        location = resp.headers.get("Location", "")[:200]
        raise ScrapeError(
            "http_status",
            f"GET {path} answered {resp.status}, a redirect to {location!r}; kvtax does not "
            "follow redirects: set --vllm.url to the vLLM server itself",
        )
    if resp.status != 200:
        raise ScrapeError("http_status", f"GET {path} answered {resp.status}")


def _too_large(path: str, limit: int, announced: int | None) -> str:
    size = f"{announced} bytes" if announced is not None else f"more than {limit} bytes"
    return f"GET {path} body is {size}, above --scrape.max-bytes={limit}"
