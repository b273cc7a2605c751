"""Detecting several vLLM API servers from one /metrics page (kvtax.engine.apiservers).

A single API server serves prometheus-client's default registry (python_info, process_*); with
``--api-server-count`` > 1 vLLM serves the multiprocess collector instead, whose page has
neither. The multiprocess page below is an excerpt of a real vLLM 0.32 CPU page with
``--api-server-count 2`` after an overload (docs/multi-api-server.md); the mechanism test runs
prometheus-client's multiprocess mode in two real processes.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from kvtax.engine.apiservers import (
    PLUGIN_API_SERVERS,
    ApiServerReport,
    ApiServerSignals,
    detect,
)
from tests.unit.conftest import read_fixture

# From vLLM 0.32 (CPU) with --api-server-count 2, after 64 requests that preempted 89 times.
TWO_API_SERVERS_PAGE = """\
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="tiny-llama"} 89.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny-llama"} 0.0
# HELP kvtax_plugin_preempted_resumes_total preempted requests resumed
# TYPE kvtax_plugin_preempted_resumes_total counter
kvtax_plugin_preempted_resumes_total{engine="0",model_name="tiny-llama"} 89.0
# HELP http_requests_total Total number of requests by method, status and handler.
# TYPE http_requests_total counter
http_requests_total{handler="/v1/completions",method="POST",status="2xx"} 64.0
"""


def _samples(text: str) -> list[Sample]:
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def _page(text: str) -> ApiServerReport:
    return detect(_samples(text))


@pytest.mark.parametrize("name", ["0.32-idle.prom", "0.32-preempting.prom", "0.8.5.prom"])
def test_a_real_single_server_page_is_single(name: str) -> None:
    report = _page(read_fixture(name))
    assert report.mode == "single"
    assert report.api_servers == 1
    assert not report.several
    assert "default registry" in report.evidence


def test_the_real_two_server_page_is_multiprocess_with_an_unknown_count() -> None:
    report = _page(TWO_API_SERVERS_PAGE)
    assert report.mode == "multiprocess"
    assert report.api_servers is None
    assert report.several
    assert report.engines == 1
    assert report.info_labels() == {"api_server_mode": "multiprocess", "api_servers": "unknown"}


def test_a_page_without_vllm_series_is_unknown() -> None:
    report = _page('# TYPE python_info gauge\npython_info{version="3.11.7"} 1.0\n')
    assert report.mode == "unknown"
    assert not report.several
    assert _page("").mode == "unknown"


def test_the_plugin_gauge_gives_the_count() -> None:
    gauge = f'# TYPE {PLUGIN_API_SERVERS} gauge\n{PLUGIN_API_SERVERS}{{model_name="m"}} 3.0\n'
    report = _page(TWO_API_SERVERS_PAGE + gauge)
    assert (report.mode, report.api_servers, report.several) == ("multiprocess", 3, True)
    assert report.info_labels()["api_servers"] == "3"
    # Beside the default registry the page is one process's, whatever the gauge says.
    single = _page(read_fixture("0.32-idle.prom") + gauge.replace("3.0", "1.0"))
    assert (single.mode, single.api_servers) == ("single", 1)


@pytest.mark.parametrize("bad", [math.nan, -1.0, 0.0, math.inf])
def test_a_nonsense_plugin_count_is_ignored(bad: float) -> None:
    signals = ApiServerSignals()
    signals.see("vllm:num_requests_running", {"engine": "0", "model_name": "m"}, 0.0)
    signals.see(PLUGIN_API_SERVERS, {"model_name": "m"}, bad)
    report = signals.report()
    assert (report.mode, report.api_servers, report.several) == ("multiprocess", None, True)


def test_data_parallel_engines_are_counted() -> None:
    signals = ApiServerSignals()
    for engine in ("0", "1", "1"):
        signals.see("vllm:num_requests_running", {"engine": engine, "model_name": "m"}, 0.0)
    signals.see("python_info", {}, 1.0)
    assert signals.report().engines == 2


_WRITER = textwrap.dedent(
    """
    import sys
    from prometheus_client import Counter, Gauge
    resumes = Counter("kvtax_plugin_preempted_resumes", "r", ["model_name", "engine"])
    resumes.labels("m", "0").inc(int(sys.argv[1]))
    running = Gauge("vllm:num_requests_running", "g", ["model_name", "engine"],
                    multiprocess_mode="mostrecent")
    running.labels("m", "0").set(0)
    Gauge("kvtax_plugin_api_servers", "n", ["model_name"],
          multiprocess_mode="livesum").labels("m").set(1)
    """
)


def test_prometheus_multiprocess_mode_sums_counters_and_hides_the_default_registry(
    tmp_path: Path,
) -> None:
    """What vLLM's /metrics does with two API servers, in two real processes."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    for resumes in ("43", "46"):  # the two servers' shares in the real run
        subprocess.run([sys.executable, "-c", _WRITER, resumes], env=env, check=True)
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(tmp_path))  # type: ignore[no-untyped-call]
    text = generate_latest(registry).decode()

    samples = _samples(text)
    resumes_total = [s.value for s in samples if s.name == "kvtax_plugin_preempted_resumes_total"]
    assert resumes_total == [89.0]  # summed across processes, not duplicated
    assert not any("pid" in s.labels for s in samples)
    report = detect(samples)
    assert (report.mode, report.api_servers) == ("multiprocess", 2)
