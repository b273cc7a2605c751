"""kvtax's vLLM stat-logger plugin: exact recompute counters on vLLM's own /metrics.

vLLM counts, per scheduler step, how many tokens of *resumed* (previously preempted) requests it
looked up in the prefix cache and how many it found (``PrefixCacheStats.preempted_queries`` and
``preempted_hits``, 0.12+), but publishes neither. With a KV connector (LMCache, CPU offloading)
it also counts, apart, the tokens of resumed requests the connector loaded back
(``connector_prefix_cache_stats.preempted_hits``): vLLM's ``external_prefix_cache_*`` counters
leave resumed requests out. This module is loaded by vLLM's OpenAI server through the
``vllm.stat_logger_plugins`` entry point and turns them into four Prometheus counters (five with
a connector), labelled ``model_name``/``engine`` exactly like vLLM's own series, in
prometheus-client's default registry, which is the registry vLLM's /metrics serves. Their names
come from :mod:`kvtax.engine.vocabulary`, so the sidecar that reads them and the plugin that
writes them cannot disagree.

Nothing here imports vLLM at import time: vLLM resolves ``kvtax.plugin:KvtaxStatLogger``, and only
that attribute access (the module ``__getattr__``) imports vLLM's ``StatLoggerBase`` and builds the
subclass. ``import kvtax`` never imports this module. The plugin fails soft: if vLLM's stats have
another shape, or prefix caching is off (then vLLM records nothing and a zero would be a lie), it
logs once and publishes nothing; it never raises into the engine.

Example (what vLLM does with the entry point)::

    from kvtax.plugin import KvtaxStatLogger      # builds the StatLoggerBase subclass
    logger = KvtaxStatLogger(vllm_config, engine_index=0)
    logger.record(scheduler_stats, iteration_stats)
"""

from __future__ import annotations

import contextlib
import logging
import operator
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from prometheus_client import REGISTRY, CollectorRegistry, Counter

from kvtax.engine.vocabulary import CONCEPTS

__all__ = [
    "CONNECTOR_CONCEPT",
    "ENTRY_POINT_GROUP",
    "ENTRY_POINT_NAME",
    "LABELS",
    "PLUGIN_CONCEPTS",
    "KvtaxStatLogger",
    "PluginCounters",
    "PreemptionDeltas",
    "Recorder",
    "build_stat_logger",
    "family_name",
    "has_preemption_fields",
    "new_recorder",
    "read_deltas",
]

ENTRY_POINT_GROUP = "vllm.stat_logger_plugins"
# The name VLLM_PLUGINS must list when an operator uses that allowlist.
ENTRY_POINT_NAME = "kvtax"
LABELS = ("model_name", "engine")
PLUGIN_PREFIX = "kvtax_plugin_"
# Vocabulary concepts the plugin writes, in the order of PluginCounters' fields.
PLUGIN_CONCEPTS = (
    "recomputed_tokens",
    "preempted_queried_tokens",
    "preempted_hit_tokens",
    "preempted_resumes",
)
# Published only where vLLM runs with a KV connector: without one, "nothing loaded" is not a
# measurement but the absence of a tier.
CONNECTOR_CONCEPT = "preempted_connector_hit_tokens"
_PREEMPTION_FIELDS = ("preempted_requests", "preempted_queries", "preempted_hits")

# A child of vLLM's logger, so the plugin's few lines land in the engine log with vLLM's format
# (vLLM configures the "vllm" logger; an unconfigured "kvtax" logger would print bare lines).
log = logging.getLogger("vllm.kvtax_plugin")

# Declared for readers and type checkers; the class is built on first access (__getattr__).
KvtaxStatLogger: type[Any]


def family_name(concept: str) -> str:
    """The prometheus-client family name of a plugin concept (the vocabulary name minus _total)."""
    for name in CONCEPTS[concept].names:
        if name.startswith(PLUGIN_PREFIX):
            return name.removesuffix("_total")
    raise KeyError(f"vocabulary concept {concept!r} has no {PLUGIN_PREFIX}* name")


class PreemptionDeltas(NamedTuple):
    """One stats update's increments: tokens of resumed requests queried and hit, and resumes.

    ``hits`` counts every token the resume did not compute again; ``connector_hits`` is the part
    of them a KV connector loaded back (the rest was still in vLLM's own prefix cache).
    """

    queried: int
    hits: int
    resumes: int
    connector_hits: int = 0

    @property
    def recomputed(self) -> int:
        """Tokens the resume prefill computed again: queried minus found in a cache."""
        return self.queried - self.hits


def _signed_count(value: object, what: str) -> int:
    # Any integer type (numpy's too) is a count; a float is not, and neither is a bool, which
    # would mean the field now holds a flag: either way the shape changed.
    if isinstance(value, bool):
        raise TypeError(f"{what} is bool, expected an integer count")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{what} is {type(value).__name__}, expected an integer count") from None


def _count(value: object, what: str) -> int:
    count = _signed_count(value, what)
    if count < 0:
        raise ValueError(f"{what} is negative ({count})")
    return count


def read_deltas(scheduler_stats: Any) -> PreemptionDeltas:
    """The preemption increments of one ``SchedulerStats``.

    Raises AttributeError, TypeError or ValueError when vLLM's stats do not have the 0.12+ shape.
    With a KV connector, tokens of a resumed request loaded from the external cache are hits too:
    loading is not recomputing. vLLM's scheduler (``v1/core/sched/scheduler.py``, 0.32) looks a
    resumed request up locally first and records all its tokens as queried and the local hit as
    hit; it then asks the connector for the rest, and records that rest as the connector's query
    and what the connector will load as the connector's hit. So the local queries already hold
    the connector's, and the tokens computed again are local queries - local hits - connector
    hits.
    """
    local = scheduler_stats.prefix_cache_stats
    queried = _count(local.preempted_queries, "preempted_queries")
    hits = _count(local.preempted_hits, "preempted_hits")
    resumes = _count(local.preempted_requests, "preempted_requests")
    loaded = 0
    connector = getattr(scheduler_stats, "connector_prefix_cache_stats", None)
    if connector is not None:
        # Negative where a connector asks vLLM to drop part of its own hit: vLLM 0.32's
        # ExampleConnector answers its stored prompt length minus the local hit, below zero once
        # a resumed request's local hit runs past it (seen: -128), and vLLM then computes those
        # tokens again. So they join the recompute, and the connector loaded nothing.
        change = _signed_count(connector.preempted_hits, "connector preempted_hits")
        loaded = max(0, change)
        hits += change
    if hits < 0:
        raise ValueError(f"preempted hits ({hits}) are negative")
    if hits > queried:
        raise ValueError(f"preempted hits ({hits}) exceed queries ({queried})")
    return PreemptionDeltas(queried, hits, resumes, loaded)


def has_preemption_fields(stats_class: type) -> bool:
    """Whether vLLM's ``PrefixCacheStats`` carries the preempted_* fields (0.12+)."""
    return all(hasattr(stats_class, name) for name in _PREEMPTION_FIELDS)


@dataclass(frozen=True, slots=True)
class PluginCounters:
    """The plugin's labelled counters in one registry: the four of PLUGIN_CONCEPTS, and the
    connector's (a family always registered, a series only for an engine with a connector).

    One set per registry per process (:meth:`shared`): vLLM creates one logger per engine, and a
    restarted ``AsyncLLM`` in the same process creates them again, so a second registration must
    reuse the families rather than fail as a duplicate.
    """

    recomputed: Counter
    queried: Counter
    hits: Counter
    resumes: Counter
    connector_hits: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry) -> PluginCounters:
        def counter(concept: str) -> Counter:
            return Counter(
                family_name(concept),
                CONCEPTS[concept].help,
                LABELS,
                registry=registry,
            )

        return cls(*(counter(concept) for concept in (*PLUGIN_CONCEPTS, CONNECTOR_CONCEPT)))

    @classmethod
    def shared(cls, registry: CollectorRegistry = REGISTRY) -> PluginCounters:
        with _SHARED_LOCK:
            found = _SHARED.get(id(registry))
            if found is None or found[0] is not registry:
                found = _SHARED[id(registry)] = (registry, cls.create(registry))
            return found[1]

    def families(self) -> tuple[Counter, ...]:
        return (self.recomputed, self.queried, self.hits, self.resumes, self.connector_hits)


_SHARED: dict[int, tuple[CollectorRegistry, PluginCounters]] = {}
_SHARED_LOCK = threading.Lock()
_WARNED: set[str] = set()


def _warn_once(key: str, message: str, *args: object) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning(message, *args)


class Recorder:
    """Increments one engine's series from vLLM's stats; the vLLM-free core of the plugin.

    ``counters=None`` makes a recorder that publishes nothing (the plugin found it cannot measure).
    The series are created at zero on construction, so ``rate()`` works before the first
    preemption; on a shape error they are removed again, so no stale zero suggests "no recompute".
    ``connector`` (vLLM runs with a KV connector) adds the series of tokens the connector loaded.
    """

    def __init__(
        self,
        model_name: str,
        engine: str,
        counters: PluginCounters | None,
        *,
        connector: bool = False,
    ) -> None:
        self.labels = (model_name, engine)
        self._counters = counters
        self._children: tuple[Any, Any, Any, Any] | None = None
        self._loaded: Any = None
        if counters is not None:
            self._children = (
                counters.recomputed.labels(*self.labels),
                counters.queried.labels(*self.labels),
                counters.hits.labels(*self.labels),
                counters.resumes.labels(*self.labels),
            )
            if connector:
                self._loaded = counters.connector_hits.labels(*self.labels)

    @property
    def active(self) -> bool:
        return self._children is not None

    @property
    def counts_connector(self) -> bool:
        """Whether this engine's series include the tokens a KV connector loaded back."""
        return self._loaded is not None

    def record(self, scheduler_stats: Any) -> None:
        children = self._children
        if children is None or scheduler_stats is None:
            # Updates without scheduler stats (iteration-only) carry no cache lookups.
            return
        try:
            deltas = read_deltas(scheduler_stats)
        except (AttributeError, TypeError, ValueError) as exc:
            self.stop(f"vLLM's scheduler stats have an unexpected shape ({exc})")
            return
        if deltas.queried or deltas.resumes:
            recomputed, queried, hits, resumes = children
            recomputed.inc(deltas.recomputed)
            queried.inc(deltas.queried)
            hits.inc(deltas.hits)
            resumes.inc(deltas.resumes)
            if self._loaded is not None:
                self._loaded.inc(deltas.connector_hits)

    def stop(self, reason: str) -> None:
        """Stop publishing this engine's series, logging the reason once per process."""
        _warn_once(
            "stopped", "kvtax plugin: %s; recompute is no longer measured, only estimated", reason
        )
        counters, self._counters, self._children = self._counters, None, None
        self._loaded = None
        if counters is not None:
            for family in counters.families():
                with contextlib.suppress(KeyError):
                    family.remove(*self.labels)


def _model_name(vllm_config: Any) -> str:
    # vLLM's own PrometheusStatLogger labels with model_config.served_model_name.
    return str(vllm_config.model_config.served_model_name)


def _kv_connector(vllm_config: Any) -> bool:
    # vLLM's scheduler makes a connector (and keeps its lookup stats) exactly when
    # kv_transfer_config is set: --kv-transfer-config, or --kv-offloading-backend which fills it.
    return getattr(vllm_config, "kv_transfer_config", None) is not None


def _prefix_caching(vllm_config: Any) -> bool | None:
    cache_config = getattr(vllm_config, "cache_config", None)
    value = getattr(cache_config, "enable_prefix_caching", None)
    return value if isinstance(value, bool) else None


def new_recorder(
    vllm_config: Any,
    engine_index: int,
    *,
    supported: bool,
    registry: CollectorRegistry = REGISTRY,
) -> Recorder:
    """The recorder for one engine, or a silent one when measuring is impossible."""
    model = _model_name(vllm_config)
    engine = str(engine_index)
    if not supported:
        _warn_once(
            "unsupported",
            "kvtax plugin: this vLLM has no PrefixCacheStats.preempted_* fields (they arrived in "
            "0.12); publishing nothing, kvtax will estimate recompute instead",
        )
        return Recorder(model, engine, None)
    if _prefix_caching(vllm_config) is False:
        # vLLM records cache lookups (preempted ones included) only with prefix caching on.
        _warn_once(
            "no_prefix_caching",
            "kvtax plugin: prefix caching is disabled, so vLLM does not count re-prefilled "
            "tokens; publishing nothing, kvtax will estimate recompute instead",
        )
        return Recorder(model, engine, None)
    return Recorder(
        model, engine, PluginCounters.shared(registry), connector=_kv_connector(vllm_config)
    )


def _vllm_has_preemption_fields() -> bool:
    """Whether this vLLM's ``PrefixCacheStats`` counts resumed requests' lookups (0.12+)."""
    try:
        from vllm.v1.metrics.stats import PrefixCacheStats
    except ImportError:
        return False
    return has_preemption_fields(PrefixCacheStats)


def _log_publishing(recorder: Recorder | None) -> None:
    """The engine log's one line saying the plugin publishes, once vLLM's engine is up."""
    if recorder is not None and recorder.active:
        log.info(
            "kvtax plugin: publishing exact recompute counters (%s) for model_name=%s engine=%s",
            family_name("recomputed_tokens"),
            *recorder.labels,
        )
        if recorder.counts_connector:
            log.info(
                "kvtax plugin: vLLM runs with a KV connector; tokens it loads back for resumed "
                "requests are counted apart (%s)",
                family_name(CONNECTOR_CONCEPT),
            )


def build_stat_logger(registry: CollectorRegistry = REGISTRY) -> type[Any]:
    """Import vLLM and build the ``StatLoggerBase`` subclass vLLM instantiates per engine.

    ``registry`` is where its counters go: the default registry is the one vLLM's /metrics serves
    (with one API server; with several, vLLM serves a multiprocess collector that reads what every
    process's prometheus-client writes under ``PROMETHEUS_MULTIPROC_DIR``).

    An ImportError here (no vLLM, or a vLLM without ``StatLoggerBase``) propagates to vLLM's
    plugin loader, which logs it and starts the engine without the plugin.
    """
    from vllm.v1.metrics.loggers import StatLoggerBase

    supported = _vllm_has_preemption_fields()
    # Which copy of kvtax vLLM loaded: the plugin folder an init container put on PYTHONPATH,
    # a custom image's site-packages, or a checkout. The chart's e2e test reads this line.
    log.info("kvtax plugin: loaded from %s", Path(__file__).resolve().parent)

    # StatLoggerBase is untyped to mypy (vLLM is not in the sidecar's environment).
    class _KvtaxStatLogger(StatLoggerBase):  # type: ignore[misc]
        """Publishes resumed requests' re-prefilled tokens; one instance per engine.

        Every method is an edge into vLLM's engine loop: nothing may escape it.
        """

        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self._recorder: Recorder | None = None
            try:
                self._recorder = new_recorder(
                    vllm_config, engine_index, supported=supported, registry=registry
                )
            except Exception as exc:
                _warn_once("init", "kvtax plugin: could not start (%r); publishing nothing", exc)

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any = None,
            *args: Any,
            **kwargs: Any,
        ) -> None:
            # Extra arguments (mm_cache_stats, engine_idx) vary across versions and are unused:
            # vLLM gives each engine its own instance, labelled at construction.
            recorder = self._recorder
            if recorder is None:
                return
            try:
                recorder.record(scheduler_stats)
            except Exception as exc:
                self._recorder = None
                # stop() logs the reason once and removes the series; it must not raise either.
                with contextlib.suppress(Exception):
                    recorder.stop(f"unexpected error {exc!r}")

        def log_engine_initialized(self) -> None:
            _log_publishing(self._recorder)

    _KvtaxStatLogger.__name__ = _KvtaxStatLogger.__qualname__ = "KvtaxStatLogger"
    _KvtaxStatLogger.__module__ = __name__
    return _KvtaxStatLogger


_BUILT: list[type[Any]] = []
_BUILD_LOCK = threading.Lock()


def __getattr__(name: str) -> Any:
    # PEP 562: the StatLoggerBase subclass exists only once vLLM asks for it.
    if name == "KvtaxStatLogger":
        with _BUILD_LOCK:
            if not _BUILT:
                _BUILT.append(build_stat_logger())
            return _BUILT[0]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
