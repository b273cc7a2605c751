"""The stat-logger plugin without vLLM: lazy import, counters, fail-soft, and what kvtax reads.

vLLM itself is not in this environment, so the ``StatLoggerBase`` subclass is built once against
a stand-in module shaped like vLLM 0.32's (the real engine loads the real thing in
tests/e2e/test_tax_e2e.py). Everything below the subclass is vLLM-free and tested directly.
"""

from __future__ import annotations

import abc
import logging
import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvtax import plugin
from kvtax.engine.normalize import normalize
from kvtax.engine.vocabulary import CONCEPTS
from kvtax.expose.publish import model_samples
from kvtax.expose.samples import Sample
from kvtax.figures.derive import EngineSettings, derive_all, tax_ratio
from kvtax.figures.window import Window
from kvtax_dev.testbed.sidecar import parse_metrics

MODEL = "tiny-llama"


# -- stand-ins shaped like vLLM 0.32's stats (vllm/v1/metrics/stats.py) ----------------------
@dataclass
class PrefixCacheStats:
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0


@dataclass
class SchedulerStats:
    prefix_cache_stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    connector_prefix_cache_stats: PrefixCacheStats | None = None


def resumed(queries: int, hits: int, resumes: int = 1) -> SchedulerStats:
    return SchedulerStats(PrefixCacheStats(0, 0, 0, resumes, queries, hits))


def config(
    prefix_caching: bool | None = True, model: str = MODEL, *, connector: bool = False
) -> Any:
    cache = types.SimpleNamespace(enable_prefix_caching=prefix_caching)
    # vLLM 0.32's VllmConfig.kv_transfer_config: None unless a KV connector is configured.
    transfer = types.SimpleNamespace(kv_connector="LMCacheMPConnector") if connector else None
    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(served_model_name=model),
        cache_config=cache,
        kv_transfer_config=transfer,
    )


def loaded(queries: int, local_hits: int, connector_hits: int, resumes: int = 1) -> SchedulerStats:
    """A resume as vLLM 0.32's scheduler records it with a connector: every token queried and
    the local hit in the local stats, the rest queried and the loaded part hit in the
    connector's (v1/core/sched/scheduler.py)."""
    stats = resumed(queries, local_hits, resumes)
    stats.connector_prefix_cache_stats = PrefixCacheStats(
        preempted_requests=resumes,
        preempted_queries=queries - local_hits,
        preempted_hits=connector_hits,
    )
    return stats


def series(registry: CollectorRegistry) -> dict[str, float]:
    """The registry's kvtax_plugin_* samples (without _created), keyed like parse_metrics."""
    return {
        k: v
        for k, v in parse_metrics(generate_latest(registry).decode()).items()
        if k.startswith("kvtax_plugin_") and "_created" not in k
    }


def key(concept: str, engine: str = "0", model: str = MODEL) -> str:
    return f'{plugin.family_name(concept)}_total{{engine="{engine}",model_name="{model}"}}'


@pytest.fixture(autouse=True)
def fresh_warnings() -> Iterator[None]:
    # "Log once" is per process; each test starts as a new process would.
    plugin._WARNED.clear()
    yield
    plugin._WARNED.clear()


# -- import discipline -----------------------------------------------------------------------
def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=60
    )


def test_importing_kvtax_does_not_import_the_plugin_or_vllm() -> None:
    proc = run_python(
        "import sys, kvtax, kvtax.cli.main, kvtax.serve.wiring\n"
        "print(sorted(m for m in sys.modules if m == 'kvtax.plugin' or m.split('.')[0] == 'vllm'))"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_importing_the_plugin_module_does_not_import_vllm() -> None:
    proc = run_python(
        "import sys, kvtax.plugin\nprint(any(m.split('.')[0] == 'vllm' for m in sys.modules))"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


def test_without_vllm_the_entry_point_attribute_raises_import_error() -> None:
    # vLLM's plugin loader catches exceptions from loading and starts without the plugin; an
    # ImportError is the honest one when StatLoggerBase cannot be found.
    proc = run_python(
        "import kvtax.plugin\n"
        "try:\n    kvtax.plugin.KvtaxStatLogger\n"
        "except ImportError as e:\n    print('ImportError', e.name)\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[0] == "ImportError"


def test_unknown_module_attributes_still_raise_attribute_error() -> None:
    with pytest.raises(AttributeError):
        _ = plugin.NoSuchThing


def test_pyproject_declares_the_entry_point() -> None:
    import tomllib
    from pathlib import Path

    data = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    group = data["project"]["entry-points"][plugin.ENTRY_POINT_GROUP]
    assert group == {plugin.ENTRY_POINT_NAME: "kvtax.plugin:KvtaxStatLogger"}


# -- names -----------------------------------------------------------------------------------
def test_counter_names_come_from_the_vocabulary() -> None:
    for concept in plugin.PLUGIN_CONCEPTS:
        assert plugin.family_name(concept) + "_total" in CONCEPTS[concept].names
    assert plugin.family_name("recomputed_tokens") == "kvtax_plugin_recomputed_tokens"


def test_family_name_rejects_concepts_the_plugin_does_not_write() -> None:
    with pytest.raises(KeyError):
        plugin.family_name("generation_tokens")


# -- reading vLLM's stats --------------------------------------------------------------------
def test_recomputed_is_queried_minus_hits() -> None:
    deltas = plugin.read_deltas(resumed(queries=541, hits=128, resumes=2))
    assert deltas == plugin.PreemptionDeltas(541, 128, 2)
    assert deltas.recomputed == 413


def test_connector_hits_of_resumed_requests_are_not_recompute() -> None:
    deltas = plugin.read_deltas(loaded(queries=500, local_hits=100, connector_hits=300))
    assert deltas == plugin.PreemptionDeltas(500, 400, 1, connector_hits=300)
    assert deltas.recomputed == 100


def test_a_connector_that_takes_back_part_of_the_local_hit_adds_to_the_recompute() -> None:
    # vLLM 0.32's ExampleConnector answers (its stored prompt blocks - the local hit), negative
    # once a resumed request's local hit runs past the prompt: seen -128 on the real engine with
    # 300-token prompts. vLLM then computes those 128 tokens again, and nothing was loaded.
    deltas = plugin.read_deltas(loaded(queries=420, local_hits=384, connector_hits=-128))
    assert deltas == plugin.PreemptionDeltas(420, 256, 1, connector_hits=0)
    assert deltas.recomputed == 164


def test_a_connector_cannot_take_back_more_than_the_local_hit() -> None:
    with pytest.raises(ValueError, match="negative"):
        plugin.read_deltas(loaded(queries=420, local_hits=100, connector_hits=-128))


def test_without_connector_stats_nothing_is_loaded() -> None:
    assert plugin.read_deltas(resumed(queries=500, hits=100)).connector_hits == 0


class IntLike:
    """An integer type that is not int (numpy's are like this): usable as a count."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


def test_any_integer_type_is_a_count() -> None:
    stats = resumed(queries=IntLike(40), hits=IntLike(8), resumes=IntLike(1))  # type: ignore[arg-type]
    assert plugin.read_deltas(stats) == plugin.PreemptionDeltas(40, 8, 1)


@pytest.mark.parametrize(
    ("stats", "error"),
    [
        (
            types.SimpleNamespace(prefix_cache_stats=types.SimpleNamespace(queries=1)),
            AttributeError,
        ),
        (types.SimpleNamespace(), AttributeError),
        (resumed(queries=True, hits=0), TypeError),
        (resumed(queries=1.5, hits=0), TypeError),  # type: ignore[arg-type]
        (resumed(queries=10, hits=11), ValueError),
        (resumed(queries=-1, hits=0), ValueError),
    ],
)
def test_unexpected_shapes_are_reported_as_errors(stats: Any, error: type[Exception]) -> None:
    with pytest.raises(error):
        plugin.read_deltas(stats)


def test_preemption_fields_are_detected_on_the_stats_class() -> None:
    assert plugin.has_preemption_fields(PrefixCacheStats)

    @dataclass
    class OldPrefixCacheStats:  # vLLM 0.11 and older
        requests: int = 0
        queries: int = 0
        hits: int = 0

    assert not plugin.has_preemption_fields(OldPrefixCacheStats)


# -- the recorder ----------------------------------------------------------------------------
def test_recorder_creates_zero_series_and_accumulates_updates() -> None:
    registry = CollectorRegistry()
    rec = plugin.new_recorder(config(), 0, supported=True, registry=registry)
    assert series(registry) == {key(c): 0.0 for c in plugin.PLUGIN_CONCEPTS}

    rec.record(resumed(queries=300, hits=128, resumes=1))
    rec.record(SchedulerStats())  # a step with no resumes
    rec.record(None)  # an iteration-only update
    rec.record(resumed(queries=700, hits=0, resumes=2))

    assert series(registry) == {
        key("recomputed_tokens"): 872.0,
        key("preempted_queried_tokens"): 1000.0,
        key("preempted_hit_tokens"): 128.0,
        key("preempted_resumes"): 3.0,
    }


def test_with_a_connector_the_tokens_it_loaded_are_a_series_of_their_own() -> None:
    registry = CollectorRegistry()
    rec = plugin.new_recorder(config(connector=True), 0, supported=True, registry=registry)
    assert rec.counts_connector
    # At zero from the start, like the other four: rate() works before the first load.
    assert series(registry)[key(plugin.CONNECTOR_CONCEPT)] == 0.0

    rec.record(loaded(queries=600, local_hits=128, connector_hits=384))
    rec.record(loaded(queries=300, local_hits=256, connector_hits=0))

    assert series(registry) == {
        key("recomputed_tokens"): 132.0,
        key("preempted_queried_tokens"): 900.0,
        key("preempted_hit_tokens"): 768.0,
        key(plugin.CONNECTOR_CONCEPT): 384.0,
        key("preempted_resumes"): 2.0,
    }


def test_without_a_connector_the_loaded_series_is_absent_not_zero() -> None:
    registry = CollectorRegistry()
    rec = plugin.new_recorder(config(), 0, supported=True, registry=registry)
    rec.record(resumed(queries=10, hits=2))
    assert not rec.counts_connector
    assert key(plugin.CONNECTOR_CONCEPT) not in series(registry)


def test_a_shape_error_removes_the_connector_series_too() -> None:
    registry = CollectorRegistry()
    rec = plugin.new_recorder(config(connector=True), 0, supported=True, registry=registry)
    rec.record(loaded(queries=10, local_hits=0, connector_hits=5))
    rec.record(loaded(queries=10, local_hits=8, connector_hits=5))  # hits above queries
    assert not rec.active
    assert series(registry) == {}


def test_engines_and_repeated_instances_share_families_without_duplicates() -> None:
    registry = CollectorRegistry()
    first = plugin.new_recorder(config(), 0, supported=True, registry=registry)
    other_engine = plugin.new_recorder(config(), 1, supported=True, registry=registry)
    # A restarted AsyncLLM in the same process builds its loggers again.
    again = plugin.new_recorder(config(), 0, supported=True, registry=registry)
    first.record(resumed(queries=10, hits=0))
    other_engine.record(resumed(queries=5, hits=1))
    again.record(resumed(queries=1, hits=0))

    got = series(registry)
    assert got[key("recomputed_tokens", "0")] == 11.0
    assert got[key("recomputed_tokens", "1")] == 4.0
    assert plugin.PluginCounters.shared(registry) is plugin.PluginCounters.shared(registry)


def test_shape_error_logs_once_removes_the_series_and_stops(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = CollectorRegistry()
    rec = plugin.new_recorder(config(), 0, supported=True, registry=registry)
    rec.record(resumed(queries=10, hits=0))
    broken = types.SimpleNamespace(prefix_cache_stats=types.SimpleNamespace(queries=3, hits=1))
    with caplog.at_level(logging.WARNING, logger="vllm.kvtax_plugin"):
        rec.record(broken)
        rec.record(broken)
        rec.record(resumed(queries=99, hits=0))  # stopped for good: a gap would be a lie

    assert not rec.active
    assert series(registry) == {}
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "unexpected shape" in warnings[0].getMessage()


@pytest.mark.parametrize(
    ("prefix_caching", "supported", "reason"),
    [(False, True, "prefix caching is disabled"), (True, False, "preempted_*")],
)
def test_publishes_nothing_when_it_cannot_measure(
    caplog: pytest.LogCaptureFixture, prefix_caching: bool, supported: bool, reason: str
) -> None:
    registry = CollectorRegistry()
    with caplog.at_level(logging.WARNING, logger="vllm.kvtax_plugin"):
        rec = plugin.new_recorder(config(prefix_caching), 0, supported=supported, registry=registry)
        plugin.new_recorder(config(prefix_caching), 1, supported=supported, registry=registry)
    rec.record(resumed(queries=10, hits=0))

    assert not rec.active
    # Not even the families' HELP lines: nothing registered at all.
    assert "kvtax_plugin" not in generate_latest(registry).decode()
    assert [r.getMessage() for r in caplog.records if reason in r.getMessage()] != []
    assert len(caplog.records) == 1


def test_unknown_prefix_caching_setting_still_measures() -> None:
    registry = CollectorRegistry()
    rec = plugin.new_recorder(config(None), 0, supported=True, registry=registry)
    assert rec.active


# -- the StatLoggerBase subclass, built against a stand-in vllm package ------------------------
class _StatLoggerBase(abc.ABC):
    """Shaped like vLLM 0.32's vllm.v1.metrics.loggers.StatLoggerBase."""

    @abc.abstractmethod
    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None: ...

    @abc.abstractmethod
    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None: ...

    @abc.abstractmethod
    def log_engine_initialized(self) -> None: ...


@pytest.fixture
def vllm_package_stub(monkeypatch: pytest.MonkeyPatch) -> Callable[[type], None]:
    """Install a stand-in ``vllm`` package; call it with the PrefixCacheStats class to expose."""

    def install(stats_class: type) -> None:
        loggers = types.ModuleType("vllm.v1.metrics.loggers")
        loggers.StatLoggerBase = _StatLoggerBase  # type: ignore[attr-defined]
        stats = types.ModuleType("vllm.v1.metrics.stats")
        stats.PrefixCacheStats = stats_class  # type: ignore[attr-defined]
        for name in ("vllm", "vllm.v1", "vllm.v1.metrics"):
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
        monkeypatch.setitem(sys.modules, "vllm.v1.metrics.loggers", loggers)
        monkeypatch.setitem(sys.modules, "vllm.v1.metrics.stats", stats)

    return install


def test_built_class_is_a_stat_logger_vllm_can_instantiate(
    vllm_package_stub: Callable[[type], None], caplog: pytest.LogCaptureFixture
) -> None:
    vllm_package_stub(PrefixCacheStats)
    registry = CollectorRegistry()
    cls = plugin.build_stat_logger(registry)
    assert issubclass(cls, _StatLoggerBase)
    assert cls.__name__ == "KvtaxStatLogger"

    logger = cls(config(), engine_index=0)
    with caplog.at_level(logging.INFO, logger="vllm.kvtax_plugin"):
        logger.log_engine_initialized()
    # vLLM 0.32 passes these by keyword; older versions passed fewer arguments.
    logger.record(resumed(queries=50, hits=10), None, mm_cache_stats=None, engine_idx=0)
    logger.record(resumed(queries=5, hits=0), None)

    assert series(registry)[key("recomputed_tokens")] == 45.0
    assert any("kvtax_plugin_recomputed_tokens" in r.getMessage() for r in caplog.records)
    assert not any("KV connector" in r.getMessage() for r in caplog.records)


def test_built_class_with_a_connector_says_so_in_the_engine_log(
    vllm_package_stub: Callable[[type], None], caplog: pytest.LogCaptureFixture
) -> None:
    vllm_package_stub(PrefixCacheStats)
    registry = CollectorRegistry()
    logger = plugin.build_stat_logger(registry)(config(connector=True), engine_index=0)
    with caplog.at_level(logging.INFO, logger="vllm.kvtax_plugin"):
        logger.log_engine_initialized()
    logger.record(loaded(queries=50, local_hits=10, connector_hits=30), None)
    assert series(registry)[key(plugin.CONNECTOR_CONCEPT)] == 30.0
    assert any(
        plugin.family_name(plugin.CONNECTOR_CONCEPT) in r.getMessage() for r in caplog.records
    )


class _Exploding:
    @property
    def prefix_cache_stats(self) -> Any:
        raise RuntimeError("internals moved")


def test_built_class_never_raises_into_the_engine(
    vllm_package_stub: Callable[[type], None], caplog: pytest.LogCaptureFixture
) -> None:
    vllm_package_stub(PrefixCacheStats)
    registry = CollectorRegistry()
    cls = plugin.build_stat_logger(registry)
    logger = cls(config(), engine_index=0)
    with caplog.at_level(logging.WARNING, logger="vllm.kvtax_plugin"):
        logger.record(_Exploding(), None)
        logger.record(_Exploding(), None)
    assert series(registry) == {}
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1

    # A config vLLM renamed things in: construction must not raise either.
    cls(types.SimpleNamespace(), engine_index=1).record(resumed(queries=1, hits=0), None)


def test_built_class_on_a_vllm_without_preemption_fields_publishes_nothing(
    vllm_package_stub: Callable[[type], None],
) -> None:
    @dataclass
    class OldPrefixCacheStats:
        queries: int = 0
        hits: int = 0

    vllm_package_stub(OldPrefixCacheStats)
    registry = CollectorRegistry()
    logger = plugin.build_stat_logger(registry)(config(), engine_index=0)
    logger.log_engine_initialized()
    logger.record(resumed(queries=10, hits=0), None)
    assert "kvtax_plugin" not in generate_latest(registry).decode()


# -- what the sidecar makes of it (real 0.32 captures) ----------------------------------------
CAPTURES = ("0.32-idle.prom", "0.32-preempting.prom", "0.32-after-overload.prom")


def published(texts: list[str]) -> list[Sample]:
    """The sidecar's pure pipeline: normalize, fold, derive, publish; one scrape 10 s apart."""
    window = Window(window_seconds=3600)
    for i, text in enumerate(texts):
        window.observe(normalize(text, timestamp=1000.0 + 10 * i))
    return list(model_samples(derive_all(window, EngineSettings()), None))


def recompute_counters(samples: list[Sample]) -> set[str]:
    return {s.metric for s in samples if s.metric.startswith("kvtax_recomputed_tokens_")}


def tax_methods(samples: list[Sample]) -> set[str]:
    return {s.labels[1] for s in samples if s.metric == "kvtax_preemption_tax_ratio"}


def test_real_captures_without_the_plugin_publish_only_the_estimate(
    fixture_text: Callable[[str], str],
) -> None:
    texts = [fixture_text(name) for name in CAPTURES]
    assert not any("kvtax_plugin_" in t for t in texts)
    samples = published(texts)
    assert "kvtax_recomputed_tokens_measured_total" not in recompute_counters(samples)
    assert "kvtax_recomputed_tokens_estimated_total" in recompute_counters(samples)
    assert tax_methods(samples) == {"estimated"}
    # Not even a zero: no sample anywhere carries method="measured".
    assert [s for s in samples if "measured" in s.labels] == []
    tax = next(s.value for s in samples if s.metric == "kvtax_preemption_tax_ratio")
    assert tax > 0  # 217 preemptions in the captures


def test_real_captures_with_plugin_series_publish_the_measurement(
    fixture_text: Callable[[str], str],
) -> None:
    # The plugin's own exposition (the real Recorder), appended to each real capture as vLLM's
    # /metrics would carry it: nothing recomputed at idle, then two resumes' worth, then more.
    registry = CollectorRegistry()
    rec = plugin.new_recorder(config(), 0, supported=True, registry=registry)
    texts = []
    for name, update in zip(
        CAPTURES, (None, resumed(2000, 500, 30), resumed(20000, 4000, 187)), strict=True
    ):
        rec.record(update)
        texts.append(fixture_text(name) + generate_latest(registry).decode())
    samples = published(texts)

    # One tax series: the measurement is the best method.
    assert tax_methods(samples) == {"measured"}
    by = {(s.metric, s.labels): s.value for s in samples}
    measured = by[("kvtax_recomputed_tokens_measured_total", (MODEL,))]
    assert measured == series(registry)[key("recomputed_tokens")] == 17500.0
    generated = by[("kvtax_engine_generation_tokens_total", (MODEL,))]
    computed = by[("kvtax_engine_prompt_computed_tokens_total", (MODEL,))]
    # The window starts at the idle capture, where every counter was zero.
    assert by[("kvtax_preemption_tax_ratio", (MODEL, "measured"))] == tax_ratio(
        17500.0, computed, generated
    )


def test_measured_total_mirrors_the_plugin_counter_from_the_first_scrape(
    fixture_text: Callable[[str], str],
) -> None:
    # kvtax may start long after vLLM: its total must equal the plugin's, not start at zero.
    registry = CollectorRegistry()
    rec = plugin.new_recorder(config(), 0, supported=True, registry=registry)
    rec.record(resumed(5000, 1000, 40))
    text = fixture_text("0.32-after-overload.prom") + generate_latest(registry).decode()
    samples = published([text])
    by = {(s.metric, s.labels): s.value for s in samples}
    assert by[("kvtax_recomputed_tokens_measured_total", (MODEL,))] == 4000.0


def avoided(samples: list[Sample]) -> dict[str, float]:
    return {
        s.labels[1]: s.value for s in samples if s.metric == "kvtax_recompute_avoided_tokens_total"
    }


def test_recompute_avoided_by_a_connector_is_published_apart_from_the_prefix_cache(
    fixture_text: Callable[[str], str],
) -> None:
    # A real capture with the plugin's own exposition beside it, from an engine with a connector:
    # of 900 re-queried tokens, 128 were still in vLLM's cache, 384 loaded back, 388 computed.
    registry = CollectorRegistry()
    rec = plugin.new_recorder(config(connector=True), 0, supported=True, registry=registry)
    rec.record(loaded(queries=900, local_hits=128, connector_hits=384, resumes=3))
    samples = published(
        [fixture_text("0.32-after-overload.prom") + generate_latest(registry).decode()]
    )

    assert avoided(samples) == {"prefix_cache": 128.0, "kv_connector": 384.0}
    by = {(s.metric, s.labels): s.value for s in samples}
    # Loaded is not recomputed: the measured total is what was computed again, and only that.
    assert by[("kvtax_recomputed_tokens_measured_total", (MODEL,))] == 388.0


def test_without_a_connector_only_the_prefix_cache_avoided_recompute(
    fixture_text: Callable[[str], str],
) -> None:
    registry = CollectorRegistry()
    rec = plugin.new_recorder(config(), 0, supported=True, registry=registry)
    rec.record(resumed(queries=900, hits=512, resumes=3))
    samples = published(
        [fixture_text("0.32-after-overload.prom") + generate_latest(registry).decode()]
    )
    assert avoided(samples) == {"prefix_cache": 512.0}


def test_without_the_plugin_no_recompute_avoided_is_published(
    fixture_text: Callable[[str], str],
) -> None:
    samples = published([fixture_text(name) for name in CAPTURES])
    assert avoided(samples) == {}
