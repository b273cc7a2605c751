"""Tell from one vLLM /metrics page whether several API-server processes serve it.

With ``--api-server-count`` > 1 (vLLM's default under data parallel with its internal load
balancer) vLLM runs N API-server processes and serves ``/metrics`` from prometheus-client's
multiprocess collector: every process writes its series to files under
``PROMETHEUS_MULTIPROC_DIR`` and each scrape, whichever process answers it, sums the counters
and histograms of all of them. See docs/multi-api-server.md for the evidence.

That collector replaces prometheus-client's default registry, so the per-process series the
default registry always carries (``python_info``, ``python_gc_*``, ``process_*``) vanish from
the page. vLLM's own series keep their names and labels and carry no ``pid`` label, so the
page does not say how many processes there are. Two signals follow:

- ``python_info`` (or another default-registry series) present beside ``vllm:`` series: one
  process serves the page, so one API server;
- ``vllm:`` series present and none of them: the multiprocess collector serves the page, which
  vLLM sets up for ``--api-server-count`` > 1 (or an operator set ``PROMETHEUS_MULTIPROC_DIR``
  by hand). The count is then unknown, unless kvtax's plugin publishes it:
  :data:`PLUGIN_API_SERVERS` is a gauge each API server sets to 1 with prometheus-client's
  ``multiprocess_mode="livesum"``, so the page shows the number of live API servers.

Several values of the ``engine`` label mean data parallel (several engine cores), which is
counted too: it is the case where vLLM starts several API servers by default.

Pure functions on parsed samples; nothing here does I/O.

Example (a page of one API server, which carries its process metrics):

    >>> from prometheus_client.parser import text_string_to_metric_families
    >>> text = "process_cpu_seconds_total 1.5\\nvllm:num_requests_running{model_name=\\"m\\"} 0\\n"
    >>> samples = (s for fam in text_string_to_metric_families(text) for s in fam.samples)
    >>> report = detect(samples)
    >>> report.mode, report.api_servers
    ('single', 1)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

__all__ = [
    "DEFAULT_REGISTRY_SERIES",
    "MODES",
    "PLUGIN_API_SERVERS",
    "ApiServerReport",
    "ApiServerSignals",
    "detect",
]

# Sample names that only prometheus-client's default registry exposes (its platform, GC and
# process collectors). vLLM serves that registry with one API server and never with several.
# python_info exists on every platform; process_* only on Linux; python_gc_* only on CPython.
DEFAULT_REGISTRY_SERIES = frozenset(
    {
        "python_info",
        "python_gc_objects_collected_total",
        "python_gc_collections_total",
        "process_start_time_seconds",
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
    }
)

# Proposed for kvtax's plugin (not published yet): a gauge each API-server process sets to 1,
# with multiprocess_mode="livesum", so that vLLM's multiprocess collector shows the number of live
# API servers (and a single server shows 1).
PLUGIN_API_SERVERS = "kvtax_plugin_api_servers"

MODES = ("single", "multiprocess", "unknown")


class _Sample(Protocol):
    # prometheus_client.samples.Sample and anything shaped like it.
    @property
    def name(self) -> str: ...

    @property
    def labels(self) -> Mapping[str, str]: ...

    @property
    def value(self) -> float: ...


@dataclass(frozen=True, slots=True)
class ApiServerReport:
    """What one page says about vLLM's front-end processes.

    ``mode``: ``single`` (one process serves the page), ``multiprocess`` (vLLM's multiprocess
    collector serves it: several API servers) or ``unknown`` (no ``vllm:`` series on the page).
    ``api_servers``: 1 in ``single`` mode; in ``multiprocess`` mode the plugin's live count when
    it publishes one, else None (at least two, number unknown).
    ``engines``: distinct ``engine`` label values on ``vllm:`` series (data-parallel ranks).
    ``evidence``: the series that decided, for logs and docs.
    """

    mode: str
    api_servers: int | None
    engines: int
    evidence: str

    @property
    def several(self) -> bool:
        """True when more than one API server serves this vLLM (or may: count unknown)."""
        if self.api_servers is not None:
            return self.api_servers > 1
        return self.mode == "multiprocess"

    def info_labels(self) -> dict[str, str]:
        """Labels for an info gauge (e.g. on ``kvtax_vllm_info``): mode and count as text."""
        count = "unknown" if self.api_servers is None else str(self.api_servers)
        return {"api_server_mode": self.mode, "api_servers": count}


@dataclass(slots=True)
class ApiServerSignals:
    """An accumulator fed one sample at a time, for a parser that already walks every sample.

    ``see`` costs a set lookup per sample; call :meth:`report` once the page is read.
    """

    vllm_series: bool = False
    default_registry: str | None = None
    plugin_count: float | None = None
    engines: set[str] = field(default_factory=set)

    def see(self, name: str, labels: Mapping[str, str], value: float) -> None:
        if name.startswith("vllm:"):
            self.vllm_series = True
            engine = labels.get("engine")
            if engine:
                self.engines.add(engine)
        elif name in DEFAULT_REGISTRY_SERIES:
            if self.default_registry is None:
                self.default_registry = name
        elif name == PLUGIN_API_SERVERS and math.isfinite(value) and value >= 0:
            # One series per model_name; every one counts the same processes.
            self.plugin_count = max(value, self.plugin_count or 0.0)

    def report(self) -> ApiServerReport:
        engines = len(self.engines)
        plugin = None
        if self.plugin_count is not None and self.plugin_count >= 1:
            plugin = round(self.plugin_count)
        if not self.vllm_series:
            return ApiServerReport("unknown", plugin, engines, "no vllm: series on the page")
        if self.default_registry is not None:
            # The default registry is served: one process. A plugin gauge, if any, says 1 too.
            return ApiServerReport(
                "single", 1, engines, f"{self.default_registry} present (default registry)"
            )
        if plugin is not None:
            return ApiServerReport(
                "multiprocess", plugin, engines, f"{PLUGIN_API_SERVERS} = {plugin}"
            )
        return ApiServerReport(
            "multiprocess",
            None,
            engines,
            "vllm: series without python_info/process_* (multiprocess collector)",
        )


def detect(samples: Iterable[_Sample]) -> ApiServerReport:
    """The report for one page's samples (any objects with ``name``, ``labels``, ``value``)."""
    signals = ApiServerSignals()
    for sample in samples:
        signals.see(sample.name, sample.labels, sample.value)
    return signals.report()
