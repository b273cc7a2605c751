"""A probe inside vLLM that counts what its scheduler did, with none of kvtax's code.

The end-to-end tests check kvtax's measured recompute against an independent count. This is
that count's source: a stat logger of the harness's own, loaded by vLLM through an entry point
in a folder :func:`probe_dir` writes, which publishes on vLLM's /metrics (``probe_*``):

- ``probe_scheduled_tokens_total``: every token vLLM's scheduler handed the model, step by step
  (``SchedulerStats.iteration_details``: context plus generation tokens of the step; vLLM fills
  it only with ``--enable-logging-iteration-details``), and ``probe_steps_total``;
- ``probe_resumed_*``: what the scheduler recorded for resumed requests, read here on its own:
  tokens queried, found in vLLM's prefix cache (``prefix_cache_stats``), loaded by a KV
  connector (``connector_prefix_cache_stats``), and the resumes. A connector's hit can be
  negative (vLLM 0.32's ExampleConnector takes back part of vLLM's own hit); that part is
  ``probe_resumed_dropped_local_tokens_total``, since a counter only grows.

From the first, recompute follows by arithmetic alone (:func:`recomputed_by_steps`). It imports
nothing from :mod:`kvtax`, on purpose.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prometheus_client import Counter

__all__ = [
    "ENTRY_POINT",
    "FLAG",
    "SERIES",
    "SchedulerProbe",
    "probe_dir",
    "recomputed_by_steps",
]

FLAG = "--enable-logging-iteration-details"
ENTRY_POINT = "kvtax-scheduler-probe"
SERIES = {
    "scheduled": "probe_scheduled_tokens_total",
    "steps": "probe_steps_total",
    "queried": "probe_resumed_queried_tokens_total",
    "local_hits": "probe_resumed_local_hit_tokens_total",
    "loaded": "probe_resumed_loaded_tokens_total",
    "dropped": "probe_resumed_dropped_local_tokens_total",
    "resumes": "probe_resumes_total",
}
_LABELS = ("engine",)


def recomputed_by_steps(
    scheduled: float, prompt_computed: float, generated: float, requests: float, resumes: float
) -> float:
    """Tokens computed again, from the scheduler's per-step counts and vLLM's own counters.

    With no preemption a request of P computed prompt tokens and n outputs is scheduled P + n - 1
    tokens: the prefill samples the first output, each later output takes one decode step, and
    the last output is never fed back. A resume schedules its re-prefill R_i and samples the next
    output from it, sparing the decode step that would have fed the previous output. So over
    whole requests (idle to idle, no prefill cut into chunks) the scheduled tokens are
    Pc + G - requests + R - resumes.
    """
    return scheduled - prompt_computed - generated + requests + resumes


def probe_dir(folder: Path) -> Path:
    """A folder that, on vLLM's ``PYTHONPATH``, makes vLLM load :class:`SchedulerProbe`.

    vLLM finds stat loggers by entry point (group ``vllm.stat_logger_plugins``); a dist-info
    with that entry point is all it needs. The module itself comes from ``exporter/``, which
    the testbed puts on the engine's path.
    """
    info = folder / "kvtax_scheduler_probe-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: kvtax-scheduler-probe\nVersion: 0\n"
    )
    (info / "entry_points.txt").write_text(
        f"[vllm.stat_logger_plugins]\n{ENTRY_POINT} = {__name__}:SchedulerProbe\n"
    )
    return folder


class _Counters:
    """The probe's families, one set per process (vLLM makes one logger per engine)."""

    _made: _Counters | None = None

    def __init__(self) -> None:
        self.by_name = {
            key: Counter(name.removesuffix("_total"), f"scheduler probe: {key}", _LABELS)
            for key, name in SERIES.items()
        }

    @classmethod
    def get(cls) -> _Counters:
        if cls._made is None:
            cls._made = cls()
        return cls._made


def _build() -> type[Any]:
    from vllm.v1.metrics.loggers import StatLoggerBase

    class Probe(StatLoggerBase):  # type: ignore[misc]
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            counters = _Counters.get().by_name
            self.children = {key: c.labels(str(engine_index)) for key, c in counters.items()}

        def record(
            self, scheduler_stats: Any, iteration_stats: Any = None, *a: Any, **k: Any
        ) -> None:
            if scheduler_stats is None:
                return
            add = {key: child.inc for key, child in self.children.items()}
            details = scheduler_stats.iteration_details
            if details is not None and not details.is_dummy:
                add["scheduled"](details.num_ctx_tokens + details.num_generation_tokens)
                add["steps"](1)
            local = scheduler_stats.prefix_cache_stats
            add["queried"](local.preempted_queries)
            add["local_hits"](local.preempted_hits)
            add["resumes"](local.preempted_requests)
            connector = scheduler_stats.connector_prefix_cache_stats
            if connector is not None:
                add["loaded"](max(0, connector.preempted_hits))
                add["dropped"](max(0, -connector.preempted_hits))

        def log_engine_initialized(self) -> None:
            pass

    return Probe


_BUILT: list[type[Any]] = []
SchedulerProbe: type[Any]


def __getattr__(name: str) -> Any:
    # Built on first access, inside vLLM: the harness's own venv has no vLLM to subclass.
    if name == "SchedulerProbe":
        if not _BUILT:
            _BUILT.append(_build())
        return _BUILT[0]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
