"""The scrape job: scrape vLLM on a schedule, fold, derive, and hand the figures on.

:class:`ScrapeJob` is the ``scrape`` job of kvtax's one scheduler (:mod:`kvtax.serve.schedule`):
it scrapes vLLM every interval, and the fold step (normalize, then the window and derive of
:mod:`kvtax.figures`) turns the text into figures. A vLLM that is down, slow or restarting shows
as ``kvtax_vllm_up 0`` and a scrape error by reason; it never stops the sidecar. The scrape is
the write path: with a :class:`LedgerFeed`, it credits the proxy's running streams and pairs the
ledger's totals with the engine's in the window. What it knows is read through
:meth:`~ScrapeJob.samples` (its health and the figures) and :meth:`~ScrapeJob.readiness` (for
``/readyz``); the web port (:mod:`kvtax.serve.web.port`) serves both, and
:func:`kvtax.serve.wiring.build` passes each part what it needs.

The scrape pushes its figures: after each fold it calls every ``on_figures`` subscriber with the
new figures (the gate steps its cap there), so nobody polls the job for them. A subscriber that
raises is logged; the scrape and the other subscribers go on.

The ledger is read as near to vLLM's page as the scrape can: its totals as soon as the page has
arrived, before the parse (which can take seconds on a starved machine, while streams go on
delivering), and its joined requests on both sides of the page, just before the fetch and again
at the fold, so that join coverage can bracket the instant vLLM counted its requests
(:func:`kvtax.figures.derive.coverage`). A page whose models differ from the last one's is the
exception: the names the ledger labels running streams with are learned from that page, so the
totals are read again at the fold, after the names.

The page is parsed in a worker process (:class:`~kvtax.serve.scrape.parsepool.ParsePool`), so a
big page never holds up the event loop that also relays the proxy's streams.

Every change to what the job publishes (a fold, a scrape's outcome) moves its
:meth:`~ScrapeJob.revision`, so that the web port renders its page anew rather than serve one
rendered before the change.

Example::

    job = ScrapeJob(config)  # alone; see kvtax.serve.wiring for the whole stack
    job.start()
    ...
    await job.close()
"""

from __future__ import annotations

import asyncio
import logging
import platform
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from apscheduler.schedulers.asyncio import AsyncIOScheduler

from kvtax import __version__
from kvtax.delivery.ledger import DeliveryLedger, LedgerTotals, ModelNames
from kvtax.engine.apiservers import ApiServerReport
from kvtax.engine.normalize import REJECT_REASONS, ParseError, normalize
from kvtax.engine.snapshot import VllmSnapshot
from kvtax.expose.publish import model_samples
from kvtax.expose.samples import Sample
from kvtax.figures.derive import EngineSettings, ModelFigures, derive_all
from kvtax.figures.window import Window, candidates
from kvtax.serve.config import Config
from kvtax.serve.schedule import Periodic
from kvtax.serve.scrape.parsepool import ParsePool
from kvtax.serve.scrape.readiness import HEALTH_MAX_BYTES, HealthCheck
from kvtax.serve.scrape.scraper import REASONS, ScrapeError, Scraper

__all__ = ["FiguresSubscriber", "LedgerFeed", "ScrapeHealth", "ScrapeJob"]

log = logging.getLogger(__name__)

# Called with the new figures after each fold (the gate's Gate.on_figures).
FiguresSubscriber = Callable[[Mapping[str, ModelFigures]], None]


@dataclass(frozen=True, slots=True)
class LedgerFeed:
    """What a scrape of vLLM needs of the delivery side, to pair the ledger with the engine.

    ``names`` learns the models vLLM serves (the only labels the ledger gives their own);
    ``credit`` counts the tokens of streams still running (the proxy's ``credit_in_flight``)
    so that the totals read next are current.
    """

    names: ModelNames
    ledger: DeliveryLedger
    credit: Callable[[], None]


@dataclass(slots=True)
class ScrapeHealth:
    """The sidecar's own counters about scraping vLLM."""

    up: bool = False
    scrapes: int = 0
    errors: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    last_duration: float | None = None
    last_success: float | None = None
    last_error: str | None = None
    # The reason of the last failure while it is the latest outcome; None after a good scrape.
    last_reason: str | None = None
    rejected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REJECT_REASONS, 0))
    version: str | None = None
    engine: str | None = None
    # API-server processes behind vLLM's page: "1", a count, "several" (count unknown), or
    # "unknown" (see kvtax.engine.apiservers).
    api_servers: str | None = None
    # vLLM answered, but its page held no vllm: series with model_name (stats off, renamed).
    metrics_missing: bool = False


class ScrapeJob:
    """Scrapes one vLLM server and folds its pages into figures. See the module docstring."""

    def __init__(
        self,
        config: Config,
        *,
        window: Window | None = None,
        feed: LedgerFeed | None = None,
        clock: Callable[[], float] = time.time,
        parser: ParsePool | None = None,
        scheduler: AsyncIOScheduler | None = None,
        on_figures: Sequence[FiguresSubscriber] = (),
    ) -> None:
        self.config = config
        self.clock = clock
        self.window = window or Window(config.window, max_models=config.scrape_max_models)
        self.feed = feed
        self.health = ScrapeHealth()
        self.figures: dict[str, ModelFigures] = {}
        self.settings = EngineSettings(
            target_usage=config.target_usage, configured_max_num_seqs=config.max_num_seqs
        )
        self.scraper = Scraper(config.vllm_url, config.effective_timeout, config.scrape_max_bytes)
        # /readyz asks vLLM's /health through a client of its own, shared and cached, so that
        # probes never take (or queue behind) the scraper's connections.
        self.vllm_health = HealthCheck(
            Scraper(config.vllm_url, config.effective_timeout, HEALTH_MAX_BYTES)
        )
        # A parser passed in belongs to the caller (tests share one); one made here is ours.
        self._owns_parser = parser is None
        self.parser = parser if parser is not None else ParsePool()
        # The scrape job, on the scheduler the wiring hands every part (alone: one of its own).
        self._job = Periodic("scrape", self.scrape_once, config.scrape_interval, scheduler)
        self.on_figures = tuple(on_figures)
        self._lock = asyncio.Lock()
        # The models of the last page folded: while a page has the same ones, the ledger's
        # labels are already right when the page arrives (see _read_ledger).
        self._page_models: frozenset[str] = frozenset()
        self._first: asyncio.Task[None] | None = None
        # Moves whenever what samples() returns changed (see revision()).
        self._revision = 0
        # Set on SIGTERM: /readyz fails so the Service stops sending new requests.
        self.draining = False

    def revision(self) -> int:
        """A number that moves whenever a scrape changed what :meth:`samples` returns: the web
        port renders its page anew when it has moved."""
        return self._revision

    # -- the fold step (the write path) -----------------------------------------------------
    def ingest(self, text: str, timestamp: float) -> VllmSnapshot:
        """Normalize one scrape body (pure) and fold it; raises ParseError. For tests and bench."""
        max_series = self.config.scrape_max_series
        return self._fold(
            normalize(text, timestamp=timestamp, version=self.health.version, max_series=max_series)
        )

    def _fold(
        self,
        parsed: VllmSnapshot,
        *,
        joined_before: float | None = None,
        arrived: Mapping[str, LedgerTotals] | None = None,
        before: Mapping[str, LedgerTotals] | None = None,
    ) -> VllmSnapshot:
        """The one state change of a scrape: the window, then the figures derived from it.

        ``joined_before`` is the ledger's joined requests read before the page was fetched,
        ``before`` and ``arrived`` its totals read before the fetch and as the page arrived
        (:meth:`scrape_once`); without them (:meth:`ingest`) the ledger is read here. Returns
        the snapshot cut to the models tracked.
        """
        for reason, count in parsed.rejected.items():
            self.health.rejected[reason] += count
        totals, joined_after = self._ledger_totals(parsed, arrived)
        # The bracket's floor holds only for the totals it brackets: not for a re-read ledger.
        floor = before if totals is arrived else None
        snap = self.window.observe(
            parsed,
            totals,
            joined_before=joined_before,
            joined_after=joined_after,
            before=floor,
        )
        self.figures = derive_all(self.window, self.settings)
        self._revision += 1  # the next GET of /metrics shows the new figures
        self._hand_on(self.figures)
        return snap

    def _hand_on(self, figures: Mapping[str, ModelFigures]) -> None:
        """Give a fold's figures to each subscriber; one that raises is logged and skipped, and
        neither the scrape nor the subscribers after it notice."""
        for subscriber in self.on_figures:
            try:
                subscriber(figures)
            except Exception:
                log.exception("handing the scrape's figures to %s failed", _name(subscriber))

    def _ledger_totals(
        self, parsed: VllmSnapshot, arrived: Mapping[str, LedgerTotals] | None
    ) -> tuple[Mapping[str, LedgerTotals], float | None]:
        """The ledger's totals for this scrape's points, and its joined requests now.

        The totals are ``arrived`` when the page has the models of the last one, else read now,
        after the page's models are learned and the running streams credited under them.
        """
        feed = self.feed
        if feed is None:
            return {}, None
        # The models this scrape will track: running streams credit under their own label.
        kept = candidates(parsed, self.window.models(), self.window.max_models)
        models = frozenset(kept.models)
        feed.names.update(kept.models)
        known, self._page_models = self._page_models, models
        if arrived is not None and models == known:
            return arrived, _joined(feed.ledger.totals())
        feed.credit()
        totals = feed.ledger.totals()
        return totals, _joined(totals)

    def _joined_now(self) -> float | None:
        """The ledger's joined requests, every label together (None without a ledger)."""
        return None if self.feed is None else _joined(self.feed.ledger.totals())

    def _read_ledger(self) -> Mapping[str, LedgerTotals] | None:
        """The ledger's totals now, running streams credited, or None: read as the fetch of
        vLLM's page begins and as it arrives, the two sides of the page's render.

        None before a page was folded: the labels of the running streams are learned from the
        page, so the fold reads the ledger then.
        """
        feed = self.feed
        if feed is None or not self._page_models:
            return None
        feed.credit()
        return feed.ledger.totals()

    async def scrape_once(self) -> None:
        """One scrape; every failure becomes a counted reason, never an exception."""
        async with self._lock:  # a slow scrape must not overlap the next one
            started = time.perf_counter()
            self.health.scrapes += 1
            try:
                before = self._read_ledger()
                joined_before = _joined(before) if before is not None else self._joined_now()
                text = await self.scraper.fetch_metrics()
                arrived = self._read_ledger()
                if not self.health.up:
                    # (Re)connected: the server may have been upgraded in between.
                    self.health.version = await self.scraper.fetch_version()
                parsed = await self.parser.normalize(
                    text,
                    timestamp=self.clock(),
                    version=self.health.version,
                    max_series=self.config.scrape_max_series,
                    tracked=self.window.models(),
                    max_models=self.window.max_models,
                )
                del text  # the page can be megabytes: do not hold it while folding
                snap = self._fold(
                    parsed, joined_before=joined_before, arrived=arrived, before=before
                )
                self._note_metrics_missing(not snap.models)
                if not snap.models:
                    raise ScrapeError("no_models", "no vllm: series with a model_name label")
            except ScrapeError as exc:
                self._failed(exc.reason, exc.detail)
            except ParseError as exc:
                self._failed(exc.reason, str(exc))
            else:
                if not self.health.up:
                    log.info(
                        "vLLM at %s is up (version %s)",
                        self.config.vllm_url,
                        self.health.version or "unknown",
                    )
                self.health.up = True
                self.health.last_success = self.clock()
                self.health.last_error = None
                self.health.last_reason = None
                self.health.engine = "v0" if snap.is_v0 else "v1"
                self._note_api_servers(snap.api_servers)
            finally:
                self.health.last_duration = time.perf_counter() - started
                self._revision += 1  # up, errors and figures changed: render anew when asked

    def _note_api_servers(self, report: ApiServerReport | None) -> None:
        """Keep what the page says about vLLM's API-server processes; say once when several
        serve it, so an operator reading the figures knows they are the processes' sums."""
        if report is None:
            return
        if report.mode == "multiprocess":
            servers = "several" if report.api_servers is None else str(report.api_servers)
        else:
            servers = "1" if report.mode == "single" else "unknown"
        if report.several and self.health.api_servers != servers:
            log.info(
                "vLLM at %s serves /metrics from several API-server processes (%s; %s): its "
                "counters and kvtax's plugin counters are the sums over all of them, so the "
                "figures stay whole (docs/multi-api-server.md)",
                self.config.vllm_url,
                servers,
                report.evidence,
            )
        self.health.api_servers = servers

    def _note_metrics_missing(self, missing: bool) -> None:
        """Log the moment vLLM's page loses (or regains) every series kvtax reads."""
        if missing and not self.health.metrics_missing:
            log.warning(
                "vLLM at %s answers /metrics without vllm: series carrying model_name: its "
                "stats logging is off (--disable-log-stats) or its metrics were renamed; kvtax "
                "keeps serving (kvtax_vllm_metrics_missing 1) and does not fail readiness",
                self.config.vllm_url,
            )
        elif not missing and self.health.metrics_missing:
            log.info("vLLM at %s publishes its vllm: series again", self.config.vllm_url)
        self.health.metrics_missing = missing

    def _failed(self, reason: str, detail: str) -> None:
        if self.health.up or self.health.last_error is None:
            log.warning("scrape of %s failed: %s: %s", self.config.vllm_url, reason, detail)
        self.health.up = False
        self.health.errors[reason] += 1
        self.health.last_error = f"{reason}: {detail}"
        self.health.last_reason = reason

    def samples(self) -> Iterator[Sample]:
        """The scrape's health and the models' figures, as of the last scrape (reads only)."""
        h = self.health
        yield Sample("kvtax_build_info", (__version__, platform.python_version()), 1.0)
        yield Sample("kvtax_vllm_up", (), 1.0 if h.up else 0.0)
        if h.last_duration is not None:
            yield Sample("kvtax_scrape_duration_seconds", (), h.last_duration)
        yield Sample("kvtax_scrapes_total", (), float(h.scrapes))
        for reason, count in h.errors.items():
            yield Sample("kvtax_scrape_errors_total", (reason,), float(count))
        for reason in h.errors:
            yield Sample("kvtax_last_scrape_error", (reason,), float(reason == h.last_reason))
        for reason, count in h.rejected.items():
            yield Sample("kvtax_scrape_rejected_samples_total", (reason,), float(count))
        yield Sample("kvtax_scrape_dropped_models_total", (), float(self.window.dropped_models))
        if h.last_success is not None:
            yield Sample("kvtax_last_scrape_success_timestamp_seconds", (), h.last_success)
        yield Sample("kvtax_vllm_restarts_total", (), float(self.window.restarts))
        yield Sample("kvtax_vllm_metrics_missing", (), float(h.metrics_missing))
        if h.engine is not None:
            servers = h.api_servers or "unknown"
            yield Sample("kvtax_vllm_info", (h.version or "unknown", h.engine, servers), 1.0)
        yield from model_samples(self.figures, self.config.max_num_seqs)

    # -- readiness ---------------------------------------------------------------------------
    async def readiness(self) -> tuple[bool, str]:
        """Whether the pod may take traffic, and why (``/readyz`` on the web port).

        With the proxy on, traffic flows through kvtax to vLLM: ready means the proxy reaches
        vLLM's /health (an answer at most a second old, one request however many probes ask).
        Observe-only, kvtax is beside the traffic and never gates it. Neither depends on vLLM's
        metrics: a vLLM with its stats off serves fine.
        """
        if self.draining:
            return False, "shutting down"
        if self.config.proxy_listen_address is None:
            return True, "ok (observe-only: kvtax does not gate readiness)"
        failure = await self.vllm_health.failure()
        if failure is not None:
            return False, f"the proxy cannot reach vLLM: {failure.reason}: {failure.detail}"
        return True, "ok"

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Add the job to the scheduler and run the first scrape now, not one interval from
        now: a task of its own (not a run of the job), so that :meth:`stop` can wait for it
        wherever the scheduler is. Call it in the running loop."""
        self._job.start()
        self._first = asyncio.get_running_loop().create_task(self.scrape_once())

    async def stop(self) -> None:
        """End the scraping: no new scrape starts, and one in flight ends first."""
        if self._owns_parser:
            self.parser.close()  # a parse in flight fails at once
        # Let a scrape in flight end (its fetch is bounded by the timeout) rather than be
        # cancelled mid-way: the job's run, then the first scrape.
        await self._job.stop(cancel=False)
        first, self._first = self._first, None
        if first is not None:
            await first
        async with self._lock:
            pass
        if self._owns_parser:
            self.parser.close()  # again: a scrape that reached its parse after the first close

    async def close(self) -> None:
        """:meth:`stop`, then close the clients to vLLM: the scraper's, and the one ``/readyz``
        asks through (so, in the stack, after the web port stopped)."""
        await self.stop()
        await self.scraper.close()
        await self.vllm_health.close()


def _name(subscriber: FiguresSubscriber) -> str:
    """A subscriber as the log names it: its qualified name (``Gate.on_figures``)."""
    return getattr(subscriber, "__qualname__", None) or repr(subscriber)


def _joined(totals: Mapping[str, LedgerTotals]) -> float:
    """Joined requests over every label: those the ledger could not attribute reached vLLM too."""
    return sum(t.joined_requests for t in totals.values())
