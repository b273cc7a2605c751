"""The I/O edges of the other delivered-token sources: a push endpoint and a gateway poller.

:func:`push_handler` serves ``POST /api/v1/delivered`` on kvtax's web port. It requires a bearer
token, or refuses every push when none is configured, unless unauthenticated pushes are allowed
explicitly; it answers every problem with a 4xx and an OpenAI-style JSON message. A report is
plain JSON: a body with a Content-Encoding other than ``identity`` (gzip, deflate, br, zstd) is
refused with 415 before a byte of it is read, and only once the token passed, so kvtax never
inflates a body (a 1 MiB gzip bomb inflates to 1 GiB); the web port's server does not inflate
either (:meth:`kvtax.serve.web.port.WebPort.runner`).
:class:`GatewayPoller` reads a gateway's Prometheus counter on the scrape interval (the
``gateway`` job of kvtax's one scheduler, :mod:`kvtax.serve.schedule`) and turns its
reset-corrected increases into ledger increments (source ``gateway``). It does not follow
redirects: a redirect is an error, so a foreign page is never taken for the gateway's. Parsing
and validation live in :mod:`kvtax.delivery.intake`. The token is compared in constant time and
never logged.

Example::

    app.router.add_post(PUSH_PATH, push_handler(ledger, token="s3cret"))
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web
from apscheduler.schedulers.asyncio import AsyncIOScheduler

from kvtax.delivery.intake import PushError, gateway_totals, parse_push
from kvtax.delivery.ledger import DeliveryCounts, DeliveryLedger
from kvtax.engine.counters import CounterTracker
from kvtax.errors import UpstreamError
from kvtax.serve.logsafe import redact_url
from kvtax.serve.sources.bodies import BodyTooLarge, read_bounded
from kvtax.serve.sources.poller import Poller
from kvtax.serve.sources.refusals import openai_error

__all__ = [
    "MAX_GATEWAY_PAGE",
    "MAX_PUSH_BODY",
    "PUSH_PATH",
    "GatewayError",
    "GatewayPoller",
    "Redirected",
    "push_handler",
]

log = logging.getLogger("kvtax.serve.sources.push")

PUSH_PATH = "/api/v1/delivered"
MAX_PUSH_BODY = 1024 * 1024
# A gateway's page is held whole while it is parsed; this is the scraper's default bound too.
MAX_GATEWAY_PAGE = 8 * 1024 * 1024

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _bearer(header: str) -> bytes:
    """The credentials of a ``Bearer`` Authorization header, or b"" for any other scheme.

    RFC 7235 makes the scheme case-insensitive and allows more than one space before the token.
    """
    scheme, _, credentials = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return b""
    return credentials.lstrip(" ").encode("utf-8", "replace")


def _refusal(
    token: str | None, allow_unauthenticated: bool
) -> Callable[[str], web.Response | None]:
    """Decides, from a request's Authorization header, whether to refuse it (and how)."""
    # An empty token is no token: it would match the empty credentials of any other scheme.
    if not token:
        if allow_unauthenticated:
            log.warning("push endpoint %s accepts reports from any client (no token)", PUSH_PATH)
            return lambda header: None
        refused = (
            "push is off: start kvtax with --push.token-file (or --push.token), "
            "or --push.allow-unauthenticated"
        )
        log.info("push endpoint %s is off: no token is configured", PUSH_PATH)
        return lambda header: openai_error(403, refused, "permission_error")
    expected = token.encode()

    def check(header: str) -> web.Response | None:
        # compare_digest takes time independent of where the two differ.
        if hmac.compare_digest(_bearer(header), expected):
            return None
        response = openai_error(401, "missing or wrong bearer token", "authentication_error")
        response.headers["WWW-Authenticate"] = 'Bearer realm="kvtax"'
        return response

    return check


def _encoded(request: web.Request) -> bool:
    """Whether the body carries a Content-Encoding other than ``identity`` (RFC 9110 8.4)."""
    codings = ",".join(request.headers.getall("Content-Encoding", ()))
    return any(c.strip().lower() not in ("", "identity") for c in codings.split(","))


def push_handler(
    ledger: DeliveryLedger, token: str | None, *, allow_unauthenticated: bool = False
) -> Handler:
    """The push endpoint's handler.

    With ``token`` it requires ``Bearer <token>``; without one it refuses every push with 403,
    unless ``allow_unauthenticated``.
    """
    refuse = _refusal(token, allow_unauthenticated)

    async def handle(request: web.Request) -> web.StreamResponse:
        refusal = refuse(request.headers.get("Authorization", ""))
        if refusal is not None:
            return refusal  # before the body is read: a refused body is never decoded
        if _encoded(request):
            response = openai_error(
                415,
                "the body must not be compressed: send the report as plain JSON "
                "(no Content-Encoding, or identity)",
                "invalid_request_error",
            )
            response.headers["Accept-Encoding"] = "identity"  # RFC 7694
            return response
        try:
            body = await read_bounded(request.content, MAX_PUSH_BODY, request.content_length)
        except BodyTooLarge as exc:
            return openai_error(413, str(exc), "invalid_request_error")
        try:
            reports = parse_push(body)
        except PushError as exc:
            return openai_error(400, str(exc), "invalid_request_error")
        for model, counts in reports:
            ledger.add(model, counts, "push")
        return web.json_response({"accepted": len(reports)})

    return handle


class GatewayError(UpstreamError, ValueError):
    """The gateway's answer cannot be used; the message says why, without the URL's secrets."""


class Redirected(GatewayError):
    """The gateway answered with a redirect, which kvtax does not follow."""

    def __init__(self, status: int, location: str) -> None:
        super().__init__(
            f"it answered {status}, a redirect to {redact_url(location)}; kvtax does not follow "
            "redirects, so set --gateway.url to the final URL"
        )


class GatewayPoller(Poller):
    """Polls a gateway's /metrics and adds its delivered-token increases to the ledger."""

    what = "the gateway's counter"
    job_id = "gateway"

    def __init__(
        self,
        ledger: DeliveryLedger,
        *,
        url: str,
        metric: str,
        model_label: str,
        selector: tuple[tuple[str, str], ...],
        interval: float,
        timeout: float,
        scheduler: AsyncIOScheduler | None = None,
    ) -> None:
        super().__init__(url=url, interval=interval, timeout=timeout, log=log, scheduler=scheduler)
        self.ledger = ledger
        self.metric = metric
        self.model_label = model_label
        self.selector = selector
        self._tracker = CounterTracker()

    def fold(self, text: str) -> None:
        """Turn one gateway scrape into ledger increments (pure apart from the ledger)."""
        totals = gateway_totals(text, self.metric, self.model_label, self.selector)
        for model, raw in totals.items():
            seen = self._tracker.total(model) is not None
            increase = self._tracker.update(model, raw)
            # The first reading is the gateway's lifetime, like kvtax's engine counters.
            delivered = increase if seen else raw
            if delivered > 0:
                self.ledger.add(model, DeliveryCounts(delivered_tokens=delivered), "gateway")

    async def _fetch(self, session: aiohttp.ClientSession) -> str:
        # A redirect could lead anywhere, and the page there would be taken as the gateway's.
        async with session.get(
            self.url, timeout=aiohttp.ClientTimeout(total=self.timeout), allow_redirects=False
        ) as resp:
            if 300 <= resp.status < 400:
                raise Redirected(resp.status, resp.headers.get("Location", ""))
            # Not raise_for_status: its message quotes the URL, query string and all.
            if resp.status >= 400:
                raise GatewayError(f"it answered {resp.status}")
            page = await read_bounded(resp.content, MAX_GATEWAY_PAGE, resp.content_length)
        return page.decode("utf-8", "replace")

    async def read(self, session: aiohttp.ClientSession) -> None:
        self.fold(await self._fetch(session))
