"""The web port: kvtax's ``/metrics``, ``/healthz``, ``/readyz`` and any plain routes beside them.

:class:`WebPort` owns the aiohttp app, runner and site of ``--web.listen-address``. It renders
what a ``report`` callable returns (in ``kvtax serve``, every part's samples, which
:func:`kvtax.serve.wiring.build` gathers) on ``--web.telemetry-path``, answers ``/readyz`` from a
``readiness`` callable (the scrape job's, :meth:`kvtax.serve.scrape.job.ScrapeJob.readiness`),
and serves the routes it is given as they are (the push route,
:mod:`kvtax.serve.sources.push`). A GET of ``/metrics`` only reads; the one state of its own is
the count of those GETs by format and encoding (``kvtax_metrics_requests_total``), which it adds
to the report.

kvtax's own page is rendered at most once per turn of the event loop that also relays the
proxy's streams: a render costs milliseconds, and a burst of scrapers (200 at once) shares one
render instead of holding a relayed stream for each. A page is rendered anew, too, as soon as
the ``revision`` callable (the scrape job's) has moved: a scrape that changed the figures in
the middle of a turn shows on the next GET.

TLS and basic auth come from ``--web.config.file`` (:mod:`kvtax.serve.web.webconfig`). Basic
auth guards the page; the probes, and the routes given (the push route carries its own bearer
token in the same Authorization header), stay open.

The web port never inflates a request body (its server runs with ``auto_decompress`` off): the
push route refuses a compressed body with 415 (:mod:`kvtax.serve.sources.push`), and a body
refused for any other reason, or never read, is never decoded.

Example::

    port = WebPort(config, report=job.samples, readiness=job.readiness, revision=job.revision)
    await port.start()
    ...
    await port.stop()
"""

from __future__ import annotations

import asyncio
import gzip
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from itertools import chain

from aiohttp import web
from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.exposition import choose_encoder, gzip_accepted

from kvtax.expose.exposition import ReportCollector
from kvtax.expose.samples import HistogramSample, Sample
from kvtax.serve.config import Config
from kvtax.serve.web.webconfig import WebSecurity

__all__ = ["Readiness", "Report", "WebPort"]

log = logging.getLogger(__name__)

# Everything /metrics shows, read fresh on each render.
Report = Callable[[], Iterable[Sample | HistogramSample]]
# Whether the pod may take traffic, and why: /readyz answers 200 or 503 with the reason.
Readiness = Callable[[], Awaitable[tuple[bool, str]]]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class WebPort:
    """Serves kvtax's metrics, probes and the routes it is given. See the module docstring."""

    def __init__(
        self,
        config: Config,
        *,
        report: Report,
        readiness: Readiness,
        revision: Callable[[], int] | None = None,
        security: WebSecurity | None = None,
        routes: Sequence[web.RouteDef] = (),
    ) -> None:
        self.config = config
        # TLS and basic auth of the web port (--web.config.file); plain HTTP without.
        self.security = security or WebSecurity()
        self._readiness = readiness
        self._revision = revision
        self._routes = tuple(routes)
        self.registry = CollectorRegistry(auto_describe=False)
        # The report, and this port's own counter beside it: one collector, so the families
        # come out in catalog order.
        self.registry.register(ReportCollector(lambda: chain(report(), self.samples())))
        # process_* (RSS, open FDs, CPU seconds) of this process, the standard way.
        ProcessCollector(registry=self.registry)
        self._runner: web.AppRunner | None = None
        # kvtax's own page as rendered in this turn of the loop, by format and encoding, and
        # the revision it was rendered at.
        self._pages: dict[tuple[str, bool], bytes] = {}
        self._pages_revision: int | None = None
        # /metrics answers by format (openmetrics, text) and encoding (gzip, identity).
        self.served: Counter[tuple[str, str]] = Counter()

    def samples(self) -> Iterator[Sample]:
        """The port's own series: the GETs of /metrics by format and encoding."""
        for (form, encoding), count in sorted(self.served.items()):
            yield Sample("kvtax_metrics_requests_total", (form, encoding), float(count))

    # -- the page ----------------------------------------------------------------------------
    def page(self, accept: str = "", *, gzipped: bool = False) -> tuple[bytes, str]:
        """kvtax's /metrics page in the format ``accept`` asks for (prometheus-client's own
        negotiation: OpenMetrics or text 0.0.4), gzipped if asked, and its Content-Type.

        Each format is rendered at most once per turn of the event loop: scrapers that ask in
        the same turn (a burst of them lands in one or a few turns) share one render; the next
        turn renders anew, so a page never shows counters older than the turn it was asked in.
        """
        if self._revision is not None:
            revision = self._revision()
            if revision != self._pages_revision:
                self._pages.clear()  # a scrape changed the figures: render anew
                self._pages_revision = revision
        encoder, content_type = choose_encoder(accept)
        key = (content_type, gzipped)
        body = self._pages.get(key)
        if body is None:
            plain = self._pages.get((content_type, False))
            if plain is None:
                plain = encoder(self.registry)
            body = gzip.compress(plain, compresslevel=6, mtime=0) if gzipped else plain
            if not self._pages:
                try:
                    asyncio.get_running_loop().call_soon(self._pages.clear)
                except RuntimeError:  # no loop (a direct call): nothing would clear it
                    return body, content_type
            self._pages[(content_type, False)] = plain
            self._pages[key] = body
        return body, content_type

    # -- HTTP --------------------------------------------------------------------------------
    async def _metrics(self, request: web.Request) -> web.Response:
        gzipped = gzip_accepted(request.headers.get("Accept-Encoding", ""))
        body, content_type = self.page(request.headers.get("Accept", ""), gzipped=gzipped)
        form = "openmetrics" if content_type.startswith("application/openmetrics") else "text"
        self.served[form, "gzip" if gzipped else "identity"] += 1
        headers = {"Content-Type": content_type}
        if gzipped:
            headers["Content-Encoding"] = "gzip"
        return web.Response(body=body, headers=headers)

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def _readyz(self, request: web.Request) -> web.Response:
        ready, why = await self._readiness()
        return web.Response(text=why + "\n", status=200 if ready else 503)

    def _open_paths(self) -> frozenset[str]:
        """Paths basic auth leaves alone: the probes, and the routes given (the push route),
        which carry their own bearer token in the same Authorization header."""
        return frozenset({"/healthz", "/readyz", *(route.path for route in self._routes)})

    def app(self) -> web.Application:
        security, open_paths = self.security, self._open_paths()

        @web.middleware
        async def basic_auth(request: web.Request, handler: Handler) -> web.StreamResponse:
            if request.path in open_paths:
                return await handler(request)
            verdict = await security.verdict(request.headers.get("Authorization"))
            if verdict == "ok":
                return await handler(request)
            if verdict == "busy":
                # This user name has its share of bcrypt checks pending (someone is guessing):
                # answered at once rather than queued behind them.
                return web.Response(
                    status=429,
                    text="Too Many Requests: logins of this user are being checked; retry\n",
                    headers={"Retry-After": "1"},
                )
            return web.Response(
                status=401,
                text="Unauthorized\n",
                headers={"WWW-Authenticate": 'Basic realm="kvtax"'},
            )

        middlewares = [basic_auth] if security.basic_auth is not None else []
        app = web.Application(middlewares=middlewares)
        app.router.add_get(self.config.web_telemetry_path, self._metrics)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_routes(self._routes)
        return app

    def runner(self) -> web.AppRunner:
        """The web port's server. It never inflates a request body: with aiohttp's default, a
        gzip body is inflated as it arrives, before any handler refused it, and what a handler
        left unread (a 401, a 413) is read on for 10 s after the answer ("lingering"), which
        inflated a 1 MiB gzip bomb to 1 GiB on the loop the proxy relays on."""
        return web.AppRunner(self.app(), access_log=None, auto_decompress=False)

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Listen on ``--web.listen-address``; raises OSError when it cannot."""
        host, port = self.config.web_listen_address
        self._runner = self.runner()
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, ssl_context=self.security.ssl_context)
        await site.start()
        # One line for the pod's two duties, as before the split: where kvtax serves, and what
        # it scrapes (the scrape job starts right after the port).
        log.info(
            "serving %s on %s://%s:%d%s, scraping %s every %.1fs",
            self.config.web_telemetry_path,
            self.security.scheme,
            host,
            port,
            " with basic auth" if self.security.basic_auth is not None else "",
            self.config.vllm_url,
            self.config.scrape_interval,
        )

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
