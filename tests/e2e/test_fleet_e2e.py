"""End to end: two real vLLM replicas, one overloaded and one calm, seen as one fleet.

Each replica is a real vLLM CPU engine (the session's, and a second one started here) with its
own ``kvtax serve`` in front (proxy on, as in a pod). The two engines compute on separate cores
(the session's on core 0, as vLLM binds it by default; the second on core 1). The second one
is a stock vLLM that loads kvtax's plugin the way a pod does by default: from a folder on
``PYTHONPATH`` made from this checkout's wheel, as the image makes it (docs/plugin.md). The last
tests here check that folder and that vLLM loaded the plugin from it. One real Prometheus
scrapes all four targets every second, with the labels a PodMonitor would attach
(``namespace`` and ``pod``, the same on a pod's vLLM and kvtax), and evaluates kvtax's rules
three times over:

- the committed recording rules (5m windows), which the Fleet dashboard reads;
- the same rules with a 15m window, longer than this whole test, so that each pod's rate spans
  all of its load and the fleet tax is the ratio of the load's sums;
- the short test profile (20s windows, ``for: 5s``) with the alerts, so they fire in seconds.

The hot replica gets 64 requests of 300 tokens, all at once, against its 2,048-token pool; the
calm one gets 2 at a time of 200 tokens, which fit. The calm replica also serves a LoRA adapter
(random weights, made by :mod:`kvtax_dev.testbed.lora`; vLLM's CPU build serves it), and half its
requests name the adapter. Then:

- the fleet tax record equals the tax computed here from both engines' own counters (recompute,
  computed prompt and generated tokens, read from each vLLM's /metrics before and after);
- the preemption alerts fire for the hot pod and name it; no alert names the calm pod, pending
  or firing, unless the test's own timing of its clients and of its /metrics shows the
  alert's condition true;
- every query of the Fleet dashboard returns one series per replica (or one per model for the
  fleet panels), with the hot replica's tax above the calm one's;
- the adapter's tokens count under the base model, whose engine generated them (the calm pod
  delivered exactly what its engine generated), and once more by adapter;
- the plugin folder holds kvtax alone; the calm engine loaded the plugin from it (not from the
  engine venv's editable install: ``PYTHONPATH`` entries come before site-packages, and
  ``importlib.metadata`` yields the first distribution of a name on ``sys.path``), served its
  counters, and under an overload of its own kvtax publishes the measured tax.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import requests

from kvtax import plugin
from kvtax.delivery.timing import StreamTiming
from kvtax.engine.vocabulary import CONCEPTS
from kvtax.mixin.dashboards.generate import dashboards
from kvtax.mixin.dashboards.queries import expand
from kvtax.mixin.rules import DEFAULT, TEST_PROFILE, RulesConfig, fleet, per_pod
from kvtax.mixin.rules.render import alerts_yaml, dump, recording_groups
from kvtax_dev import repo_root
from kvtax_dev.dashboard_lint import queries
from kvtax_dev.exposition import read_samples, read_series
from kvtax_dev.plugindir import build_plugin_dir
from kvtax_dev.process import HANG_GUARD_S
from kvtax_dev.promapi import PrometheusApi
from kvtax_dev.testbed import EngineStartError, VllmEngine
from kvtax_dev.testbed.engine import cache_dir, ensure_vllm_venv
from kvtax_dev.testbed.load import RequestResult, drive
from kvtax_dev.testbed.lora import RANK, ensure_adapter
from kvtax_dev.testbed.promstack import PrometheusProcess
from kvtax_dev.testbed.sidecar import KvtaxProcess, series_key

pytestmark = pytest.mark.e2e

NAMESPACE = "fleet-e2e"
HOT, CALM = "replica-hot", "replica-calm"
ADAPTER = "tiny-lora"
COMMITTED_RULES = repo_root() / "alerts" / "kvtax-recording.yaml"
# Longer than the test can run (the hang guard stops it first), so a rate over it spans every
# sample Prometheus holds: its ratio is the ratio of the whole run's increases.
LONG = replace(DEFAULT, rate_window="15m")
FLEET_TAX = fleet("kvtax_preemption_tax", "ratio_rate15m")
POD_TAX = per_pod("kvtax_preemption_tax", "ratio_rate15m")
# vLLM's KV usage gauge under either of its names, as KvtaxVllmMetricsAbsent reads it.
KV_USAGE = (
    f'{{__name__=~"{"|".join(CONCEPTS["kv_usage"].names)}",namespace="{NAMESPACE}",model_name!=""}}'
)
# Alerts that a thrashing replica must raise (both read vLLM's own series or kvtax's counters).
MUST_FIRE = {"KvtaxVllmPreempting", "KvtaxPreemptionTaxHigh"}
# Every alert about KV pressure and its cost: none of them may name the calm replica.
KV_ALERTS = MUST_FIRE | {
    "KvtaxThrashing",
    "KvtaxKvCacheNearFull",
    "KvtaxQueueGrowing",
    "KvtaxOverAdmitted",
}
# The calm replica raises no alert at all, pending or firing, except one whose condition a
# measurement of the test's own showed true (see _excused). The engines compute on separate
# cores (vLLM's "auto" binding would put both on core 0); the rest of this 2-core machine (two
# API servers, two sidecars, Prometheus and the clients) still shares both cores, so the calm
# pod's clients can truly wait, and its /metrics truly answer late.
# vLLM's OpenMP binding of each engine's worker (VLLM_CPU_OMP_THREADS_BIND): core 0 for the
# session's engine (vLLM's "auto"), core 1 for the calm one.
HOT_CORES, CALM_CORES = "[0]", "[1]"
# rate()'s extrapolation to the window's edges differs by up to one scrape (1 s) between the two
# pods' targets, over a span of a minute or more: at most ~1.5 % of a pod's weight in the sum.
# Measured in three runs: |recorded - by hand| 0.0002, 0.0000, 0.0002 (fleet taxes 0.22-0.25).
# The bound is in tax points (a share, 0-1).
TAX_TOLERANCE = 0.005
ALERT_WAIT_S = 90.0  # how long past the load's end the alerts may still take to fire
# How long past the load's end the calm pod is still watched: the test profile's 20 s windows
# sliding past the load's last samples, plus its 5 s hold and a few evaluations.
CALM_WATCH_S = 30.0


@dataclass(frozen=True, slots=True)
class Replica:
    pod: str
    engine: VllmEngine
    kvtax: KvtaxProcess


@dataclass(frozen=True, slots=True)
class FleetRun:
    api: PrometheusApi
    model: str
    end: float
    before: dict[str, dict[str, float]]
    after: dict[str, dict[str, float]]
    calm_page: dict[str, float]  # the calm pod's kvtax /metrics at the end
    results: dict[str, list[RequestResult]]
    firing: list[dict[str, Any]]
    capacity: int  # both pools, tokens
    # The calm pod's alerts in Prometheus' ALERTS series over the run: name -> states seen.
    calm_alerts: dict[str, set[str]]
    # The calm pod's streams as its clients timed them.
    calm_streams: list[Timed]
    # The longest a GET of each calm /metrics took the test's own prober, in seconds.
    calm_metrics_latency: dict[str, float]
    # The lowest join coverage and 20 s delivery yield Prometheus held for the calm pod over the
    # run (printed, so that a run shows how far they stayed from the alerts' thresholds).
    calm_lows: dict[str, float]
    # How many of Prometheus' scrapes of the calm pod's targets failed, by job.
    calm_failed_scrapes: dict[str, int]
    # The longest one of Prometheus' scrapes of each calm target took, by job, in seconds.
    calm_slowest_scrapes: dict[str, float]
    # The calm kvtax's worst event-loop lateness over the run, as it published it, in seconds.
    calm_loop_lag: float


@dataclass(frozen=True, slots=True)
class Timed:
    """One calm stream as its client saw it: the result and when each text chunk arrived
    (seconds after the request was sent)."""

    result: RequestResult
    arrivals: tuple[float, ...]

    def timing(self) -> StreamTiming:
        """The client's view run through kvtax's own definition of TTFT and stalls (the proxy's
        defaults: 5x the running median gap, and at least 50 ms)."""
        timing = StreamTiming(started=0.0, factor=5.0, floor=0.05)
        for n, at in enumerate(self.arrivals):
            timing.tokens_written(at, context=n)
        return timing


def _windowed_records(config: RulesConfig) -> str:
    """The recording rules of ``config`` whose names carry its window. The others (KV usage,
    capacity, max_num_seqs) take no window and come from the committed file already; two groups
    writing one series would collide."""
    window = config.rate_window
    groups = [
        {"name": f"{g['name']}-{window}", "rules": [r for r in g["rules"] if window in r["record"]]}
        for g in recording_groups(config)
    ]
    return dump({"groups": groups})


def _address(url: str) -> str:
    return urllib.parse.urlsplit(url).netloc


def _scrape_config(replicas: list[Replica]) -> str:
    """Both pods' vLLM and kvtax, each target labelled with its pod as a PodMonitor would."""

    def job(name: str, url_of: Any) -> dict[str, Any]:
        return {
            "job_name": name,
            "static_configs": [
                {
                    "targets": [_address(url_of(r))],
                    "labels": {"namespace": NAMESPACE, "pod": r.pod},
                }
                for r in replicas
            ],
        }

    jobs = [job("vllm", lambda r: r.engine.url), job("kvtax", lambda r: r.kvtax.base_url)]
    return (
        "global: " + json.dumps({"scrape_interval": "1s", "evaluation_interval": "1s"}) + "\n"
        "scrape_configs: " + json.dumps(jobs) + "\n"
    )


def _work(replica: Replica) -> dict[str, float]:
    """The engine's own lifetime counters that the tax reads, straight from its /metrics, and
    what its kvtax counted as delivered (every source, every label)."""
    page = read_samples(replica.engine.metrics_text())
    delivered = sum(
        v
        for k, v in replica.kvtax.metrics().items()
        if k.startswith("kvtax_delivered_tokens_total")
    )

    def total(concept: str, where: tuple[tuple[str, str], ...] = ()) -> float:
        names = CONCEPTS[concept].names
        return sum(
            value
            for name in names
            for labels, value in page.get(name, {}).items()
            if all((k, v) in labels for k, v in where)
        )

    return {
        "recomputed": total("recomputed_tokens"),
        "prompt_computed": total("prompt_tokens_local_compute", (("source", "local_compute"),)),
        "generated": total("generation_tokens"),
        "delivered": delivered,
    }


def _tax(increase: dict[str, float]) -> float:
    """recomputed / (computed prompt + generated + recomputed): docs/tax.md's definition."""
    work = increase["recomputed"] + increase["prompt_computed"] + increase["generated"]
    return increase["recomputed"] / work


def _increase(run: FleetRun, pod: str) -> dict[str, float]:
    return {k: run.after[pod][k] - run.before[pod][k] for k in run.after[pod]}


async def _timed_streams(url: str, model: str, *, requests: int, max_tokens: int) -> list[Timed]:
    """``requests`` streamed completions one after another (usage asked for, so each client
    knows how many tokens it received), each text chunk's arrival timed by the client."""
    results = await drive(
        url,
        model,
        concurrency=1,
        requests=requests,
        max_tokens=max_tokens,
        stream=True,
        include_usage=True,
    )
    return [Timed(r, r.arrivals) for r in results]


async def _loads(hot: Replica, calm: Replica) -> tuple[dict[str, list[RequestResult]], list[Timed]]:
    assert hot.kvtax.proxy_url is not None
    assert calm.kvtax.proxy_url is not None
    model = hot.engine.model_name
    hot_results, calm_streams, adapter_streams = await asyncio.gather(
        # One wave that overflows the pool; the calm one's two streams never do.
        drive(hot.kvtax.proxy_url, model, concurrency=64, max_tokens=300, stream=True, requests=64),
        # One stream for the base model and one for its adapter, through the calm pod's proxy.
        # Usage asked for, so each client knows how many tokens it received.
        _timed_streams(calm.kvtax.proxy_url, model, requests=8, max_tokens=200),
        _timed_streams(calm.kvtax.proxy_url, ADAPTER, requests=8, max_tokens=200),
    )
    results = {
        HOT: hot_results,
        CALM: [t.result for t in calm_streams],
        ADAPTER: [t.result for t in adapter_streams],
    }
    return results, [*calm_streams, *adapter_streams]


class _Prober:
    """GETs each calm /metrics once a second while the run lasts and keeps the longest wait:
    the test's own view of whether an endpoint answered later than its scrapers wait."""

    def __init__(self, urls: dict[str, str]) -> None:
        self.urls = urls
        self.longest = dict.fromkeys(urls, 0.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            for name, url in self.urls.items():
                began = time.monotonic()
                try:
                    requests.get(url, timeout=10.0).raise_for_status()
                    took = time.monotonic() - began
                except requests.RequestException:
                    took = float("inf")
                self.longest[name] = max(self.longest[name], took)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join(timeout=HANG_GUARD_S)
        return dict(self.longest)


def _span(seconds: float) -> str:
    """A PromQL range covering the last ``seconds`` whole (at least 1 s)."""
    return f"[{max(1, int(seconds) + 1)}s]"


def _alerts_over(api: PrometheusApi, pod: str, seconds: float) -> dict[str, set[str]]:
    """Every alert Prometheus held for ``pod``, pending or firing, over the last ``seconds``:
    the ALERTS series it writes at each evaluation, so no state is missed between polls."""
    selector = f'ALERTS{{namespace="{NAMESPACE}",pod="{pod}"}}'
    seen: dict[str, set[str]] = {}
    for s in api.query(f"{selector}{_span(seconds)}", time.time()):
        seen.setdefault(s.labels["alertname"], set()).add(s.labels["alertstate"])
    return seen


def _lows_over(api: PrometheusApi, pod: str, seconds: float) -> dict[str, float]:
    """The lowest join coverage and short-window delivery yield of ``pod`` over the last
    ``seconds``, from the series Prometheus stored (the gauge and the test profile's record),
    and how many seconds before now each lowest sample was (``<name>_s_ago``), to place a dip
    in the load (its start, its middle, or the windows sliding past its end)."""
    rate = f"ratio_rate{TEST_PROFILE.rate_window}"
    selector = f'{{namespace="{NAMESPACE}",pod="{pod}"}}'
    now = time.time()
    lows: dict[str, float] = {}
    for name, series in (
        ("coverage", "kvtax_join_coverage_ratio"),
        ("yield", per_pod("kvtax_delivery_yield", rate)),
    ):
        found = api.query(f"{series}{selector}{_span(seconds)}", now)
        points = [p for s in found for p in s.points if not math.isnan(p[1])]  # 0/0 is NaN
        if points:
            at, low = min(points, key=lambda p: p[1])
            lows[name] = low
            lows[f"{name}_s_ago"] = round(now - at, 1)
    return lows


def _failed_scrapes_over(api: PrometheusApi, pod: str, seconds: float) -> dict[str, int]:
    """How many of Prometheus' own scrapes of ``pod``'s targets failed over the last
    ``seconds``, by job: the samples of ``up`` it stored as 0. A failed scrape of vLLM marks its
    series stale at once, which is exactly the condition of KvtaxVllmMetricsAbsent."""
    selector = f'up{{namespace="{NAMESPACE}",pod="{pod}"}}'
    failed: dict[str, int] = {}
    for s in api.query(f"{selector}{_span(seconds)}", time.time()):
        failed[s.labels["job"]] = sum(1 for _, value in s.points if value == 0)
    return failed


def _slowest_scrapes_over(api: PrometheusApi, pod: str, seconds: float) -> dict[str, float]:
    """The longest of Prometheus' own scrapes of each of ``pod``'s targets took over the last
    ``seconds``, by job: ``scrape_duration_seconds``, which it writes for every scrape. It is a
    second client of the same /metrics, timed by Prometheus, not by kvtax or by the test's
    once-a-second prober, which can miss the one slow page that kvtax's fetch met."""
    selector = f'scrape_duration_seconds{{namespace="{NAMESPACE}",pod="{pod}"}}'
    span = _span(seconds)
    slowest: dict[str, float] = {}
    for s in api.query(f"max by (job) (max_over_time({selector}{span}))", time.time()):
        if s.points:
            slowest[s.labels["job"]] = s.points[-1][1]
    return slowest


def _worst_loop_lag_over(api: PrometheusApi, pod: str, seconds: float) -> float:
    """The worst lateness of ``pod``'s kvtax event loop over the last ``seconds``, as kvtax
    published it (``kvtax_event_loop_lag_seconds``, itself the worst of its last few seconds,
    so Prometheus' samples miss no stall)."""
    selector = f'kvtax_event_loop_lag_seconds{{namespace="{NAMESPACE}",pod="{pod}"}}'
    found = api.query(f"max(max_over_time({selector}{_span(seconds)}))", time.time())
    return max((s.points[-1][1] for s in found if s.points), default=0.0)


def _firing(api: PrometheusApi) -> list[dict[str, Any]]:
    return [a for a in api.alerts() if a["state"] == "firing"]


def _fired_for(alerts: list[dict[str, Any]], pod: str) -> set[str]:
    return {a["labels"]["alertname"] for a in alerts if a["labels"].get("pod") == pod}


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_plugin_dir(tmp_path_factory.mktemp("plugin-build"))


@pytest.fixture(scope="module")
def second_engine(
    vllm_engine: VllmEngine, plugin_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmEngine]:
    """The calm replica: the same model and pool as the session's engine, plus a LoRA adapter,
    with kvtax's plugin from the folder alone. An engine of its own: a fleet is two replicas,
    and this one's start-time settings (the adapter, and a ``PYTHONPATH`` of the folder alone)
    are what its tests check; the session's engine must not carry them for the others."""
    tmp = tmp_path_factory.mktemp("vllm-b")
    try:
        # The session's engine has built the tiny model, which the adapter is shaped after.
        adapter = ensure_adapter(ensure_vllm_venv(), cache_dir() / "tiny-llama", tmp / ADAPTER)
        engine = VllmEngine(
            log_path=tmp / "engine.log",
            # Its own core: the session's engine computes on core 0, as vLLM's "auto" binds it.
            # Alone there: the other lanes' engines bound to core 1 (beside_cores) wait while it
            # runs, and it waits for theirs to end (the calm pod was not calm beside them:
            # KvtaxVllmScrapeFailing and KvtaxStreamStalls, true alarms, in a full run).
            cpus=CALM_CORES.strip("[]"),
            alone=True,
            # PYTHONPATH is the folder alone, as in the pod: not the checkout's exporter/ that
            # the testbed puts there for its own child processes.
            extra_env={"PYTHONPATH": str(plugin_dir)},
            extra_args=[
                "--enable-lora",
                "--lora-modules",
                f"{ADAPTER}={adapter}",
                "--max-lora-rank",
                str(RANK),
                "--max-loras",
                "1",
            ],
        )
        engine.start()
    except EngineStartError as exc:
        pytest.fail(f"could not start the second vLLM engine: {exc}", pytrace=False)
    try:
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def run(
    vllm_engine: VllmEngine, second_engine: VllmEngine, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FleetRun]:
    tmp = tmp_path_factory.mktemp("fleet")
    rules = [tmp / "recording-15m.yaml", tmp / "recording-test.yaml", tmp / "alerts-test.yaml"]
    rules[0].write_text(_windowed_records(LONG))
    rules[1].write_text(_windowed_records(TEST_PROFILE))
    rules[2].write_text(alerts_yaml(TEST_PROFILE))
    model = vllm_engine.model_name
    assert second_engine.model_name == model  # replicas of one model
    with (
        KvtaxProcess(vllm_engine.url, proxy=True, log_path=tmp / "kvtax-hot.log") as kvtax_hot,
        KvtaxProcess(second_engine.url, proxy=True, log_path=tmp / "kvtax-calm.log") as kvtax_calm,
    ):
        hot = Replica(HOT, vllm_engine, kvtax_hot)
        calm = Replica(CALM, second_engine, kvtax_calm)
        for r in (hot, calm):
            assert r.kvtax.proxy_url is not None
            # One small request each, so every counter exists before Prometheus' first scrape
            # and rate() sees the load's whole increase. The join counters appear at the
            # scrape of vLLM after it, as of which the yield rule divides them.
            asyncio.run(drive(r.kvtax.proxy_url, model, concurrency=1, max_tokens=8, stream=True))
            r.kvtax.wait_for(
                lambda m: all(
                    any(k.startswith(f"{name}{{") for k in m)
                    for name in (
                        "kvtax_delivered_tokens_total",
                        "kvtax_join_delivered_tokens_total",
                        "kvtax_join_undelivered_tokens_total",
                        "kvtax_recomputed_tokens_measured_total",
                    )
                ),
                what="the delivery, join and measured recompute counters",
            )
        config = _scrape_config([hot, calm])
        probed = {"vllm": f"{second_engine.url}/metrics", "kvtax": kvtax_calm.metrics_url}
        with PrometheusProcess(
            config, [COMMITTED_RULES, *rules], log_path=tmp / "prom.log"
        ) as prom:
            prom_started = time.monotonic()
            prom.wait_for(
                lambda: len(prom.query(f'kvtax_vllm_up{{namespace="{NAMESPACE}"}} == 1')) == 2,
                what="both sidecars scraped, both reading their vLLM",
            )
            prom.wait_for(lambda: prom.query(FLEET_TAX), what="a first fleet tax record")
            # The calm pod's alerts count from here: Prometheus has read both vLLMs. Before its
            # first scrape of a vLLM it may have read that pod's kvtax (each target has its own
            # offset in the 1 s interval), and KvtaxVllmMetricsAbsent's condition, kvtax reads
            # vLLM and Prometheus holds no vLLM series, is then true for an evaluation or two:
            # a fresh Prometheus's start, not the pod's.
            prom.wait_for(
                lambda: len(prom.query(f"count by (pod) ({KV_USAGE})")) == 2,
                what="both vLLMs' KV usage scraped",
            )
            # An evaluation since: a pending state from before has ended.
            since = time.time()
            prom.wait_for(lambda: prom.evaluated_since(since), what="every group evaluated since")
            prom_started = time.monotonic()
            before = {r.pod: _work(r) for r in (hot, calm)}
            results: dict[str, list[RequestResult]] = {}
            calm_streams: list[Timed] = []

            def load_both() -> None:
                by_pod, timed = asyncio.run(_loads(hot, calm))
                results.update(by_pod)
                calm_streams.extend(timed)

            load = threading.Thread(target=load_both)
            prober = _Prober(probed)
            prober.start()
            load.start()
            began = time.monotonic()
            firing: list[dict[str, Any]] = []
            deadline = time.monotonic() + HANG_GUARD_S
            load_end: float | None = None
            # Poll the alerts while the load runs and until the hot pod's have fired: they
            # resolve once the 20 s windows slide past the load. The calm pod is watched until
            # its windows have slid past the load too (ALERTS keeps every state in between).
            try:
                while time.monotonic() < deadline:
                    firing.extend(_firing(prom.api))
                    if load_end is None and not load.is_alive():
                        load_end = time.monotonic()
                    if (
                        load_end is not None
                        and time.monotonic() > load_end + CALM_WATCH_S
                        and (
                            _fired_for(firing, HOT) >= MUST_FIRE
                            or time.monotonic() > load_end + ALERT_WAIT_S
                        )
                    ):
                        break
                    time.sleep(1.0)
            finally:
                metrics_latency = prober.stop()
            load.join(timeout=1.0)
            assert not load.is_alive(), "the load did not finish"
            print(
                f"\nfleet: load {(load_end or time.monotonic()) - began:.0f} s, alerts polled "
                f"{time.monotonic() - began:.0f} s"
            )
            after = {r.pod: _work(r) for r in (hot, calm)}
            # Every counter settled: each kvtax scraped its engine after the load, and
            # Prometheus scraped each kvtax after that.
            for r in (hot, calm):

                def caught_up(m: dict[str, float], g: float = after[r.pod]["generated"]) -> bool:
                    return (
                        sum(
                            v
                            for k, v in m.items()
                            if k.startswith("kvtax_engine_generation_tokens")
                        )
                        >= g
                    )

                r.kvtax.wait_for(caught_up, what="kvtax caught up with its engine")
            # Prometheus has scraped each kvtax since, and evaluated its rules on that.
            since = time.time()
            prom.wait_for(lambda: prom.scraped_since(since), what="every target scraped since")
            since = time.time()
            prom.wait_for(lambda: prom.evaluated_since(since), what="every group evaluated since")
            capacity = vllm_engine.kv_capacity_tokens + second_engine.kv_capacity_tokens
            calm_alerts = _alerts_over(prom.api, CALM, time.monotonic() - prom_started)
            calm_lows = _lows_over(prom.api, CALM, time.monotonic() - prom_started)
            calm_failed = _failed_scrapes_over(prom.api, CALM, time.monotonic() - prom_started)
            calm_slowest = _slowest_scrapes_over(prom.api, CALM, time.monotonic() - prom_started)
            calm_lag = _worst_loop_lag_over(prom.api, CALM, time.monotonic() - prom_started)
            yield FleetRun(
                prom.api,
                model,
                time.time(),
                before,
                after,
                kvtax_calm.metrics(),
                results,
                firing,
                capacity,
                calm_alerts,
                calm_streams,
                metrics_latency,
                calm_lows,
                calm_failed,
                calm_slowest,
                calm_lag,
            )


def test_both_loads_ran(run: FleetRun) -> None:
    for pod, results in run.results.items():
        failed = [(r.index, r.status, r.error) for r in results if not r.ok]
        assert len(failed) <= len(results) // 20, (pod, failed[:5])
    assert len(run.results[ADAPTER]) == 8
    # The hot engine recomputed, the calm one never did.
    assert _increase(run, HOT)["recomputed"] > 0
    assert _increase(run, CALM)["recomputed"] == 0


def test_fleet_tax_is_the_ratio_of_both_engines_sums(run: FleetRun) -> None:
    hot, calm = _increase(run, HOT), _increase(run, CALM)
    by_hand = _tax({k: hot[k] + calm[k] for k in hot})
    fleet_tax = run.api.query(FLEET_TAX, run.end)
    assert [s.labels.get("model_name") for s in fleet_tax] == [run.model]
    recorded = fleet_tax[0].points[0][1]
    pods = {s.labels["pod"]: s for s in run.api.query(POD_TAX, run.end)}
    assert set(pods) == {HOT, CALM}
    hot_recorded, calm_recorded = pods[HOT].points[0][1], pods[CALM].points[0][1]
    print(
        f"\nfleet tax: by hand {by_hand:.4f} (hot {_tax(hot):.4f}, calm {_tax(calm):.4f}); "
        f"recorded {recorded:.4f} (hot {hot_recorded:.4f}, calm {calm_recorded:.4f}); "
        f"average of the pods' ratios {(_tax(hot) + _tax(calm)) / 2:.4f}"
    )
    assert by_hand > 0.02, "the overload produced no tax to compare"
    assert abs(recorded - by_hand) <= TAX_TOLERANCE
    assert abs(hot_recorded - _tax(hot)) <= TAX_TOLERANCE
    assert calm_recorded == 0.0
    # A ratio of sums weighs the pods by their work, unlike an average of the two ratios.
    assert pods[HOT].labels["method"] == pods[CALM].labels["method"] == "measured"


def test_the_engines_compute_on_separate_cores(
    vllm_engine: VllmEngine, second_engine: VllmEngine
) -> None:
    # vLLM logs the cores it bound each worker's OpenMP threads to.
    for engine, cores in ((vllm_engine, HOT_CORES), (second_engine, CALM_CORES)):
        log = engine.log_path.read_text(errors="replace")
        bound = [ln for ln in log.splitlines() if "local_rank=0, core ids=" in ln]
        assert bound, f"no OpenMP binding line in {engine.log_path}"
        assert bound[-1].rstrip().endswith(f"core ids={cores}"), bound


def test_the_thrashing_pod_alerts_and_the_calm_one_stays_silent(run: FleetRun) -> None:
    fired = {
        (a["labels"]["alertname"], a["labels"].get("pod")): a["annotations"] for a in run.firing
    }
    print(f"\nfiring alerts seen: {sorted(fired)}")
    assert _fired_for(run.firing, HOT) >= MUST_FIRE, sorted(fired)
    assert _fired_for(run.firing, CALM) & KV_ALERTS == set(), sorted(fired)
    for name in MUST_FIRE:
        annotations = fired[(name, HOT)]
        assert f"on {NAMESPACE}/{HOT}" in annotations["description"], annotations
    for alert in run.firing:
        if alert["labels"]["alertname"] in KV_ALERTS:
            assert alert["labels"].get("pod") == HOT, alert["labels"]


def _excused(run: FleetRun) -> dict[str, str]:
    """The calm pod's alerts whose condition the test's own measurements saw true, each with
    that evidence: its clients' timing of every stream, its prober's GETs of both /metrics,
    Prometheus' record of its own scrapes, and the calm kvtax's published event-loop lag.
    Nothing here excuses an alert about KV, the tax, the yield or the join: the clients sent
    every calm request through the proxy and received every token the engine generated
    (test_adapter_tokens_join_the_base_models_engine), so those conditions were false."""
    rules, excused = TEST_PROFILE, {}
    timings = [t.timing() for t in run.calm_streams]
    late = [t.ttft for t in timings if t.ttft is not None and t.ttft > rules.slo_ttft_seconds]
    if late:
        excused["KvtaxTtftSloBreach"] = (
            f"{len(late)} calm streams' first token came after {rules.slo_ttft_seconds:g} s "
            f"(the latest {max(late):.2f} s)"
        )
    stalls = [gap for t in timings for gap, _ in t.stalls]
    if stalls:
        excused["KvtaxStreamStalls"] = (
            f"the calm clients saw {len(stalls)} stalls in {len(timings)} streams "
            f"(the longest {max(stalls):.2f} s)"
        )
    # kvtax gives up on vLLM's page after 0.8 of its 1 s interval; Prometheus on any target
    # after its 1 s scrape interval.
    vllm_wait, kvtax_wait = run.calm_metrics_latency["vllm"], run.calm_metrics_latency["kvtax"]
    if vllm_wait > 0.8:
        excused["KvtaxVllmScrapeFailing"] = f"vLLM's /metrics answered after {vllm_wait:.2f} s"
    if vllm_wait > 1.0:
        excused["KvtaxVllmMetricsAbsent"] = f"vLLM's /metrics answered after {vllm_wait:.2f} s"
    if kvtax_wait > 1.0:
        excused["KvtaxSidecarDown"] = f"kvtax's /metrics answered after {kvtax_wait:.2f} s"
    # The prober samples once a second and can miss the one slow page that Prometheus' own
    # scrape met; Prometheus' record of its failed scrapes is the condition itself.
    failed = run.calm_failed_scrapes
    if failed.get("vllm", 0) and "KvtaxVllmMetricsAbsent" not in excused:
        excused["KvtaxVllmMetricsAbsent"] = (
            f"{failed['vllm']} of Prometheus' scrapes of vLLM's /metrics failed"
        )
    if failed.get("kvtax", 0) and "KvtaxSidecarDown" not in excused:
        excused["KvtaxSidecarDown"] = f"{failed['kvtax']} of Prometheus' scrapes of kvtax failed"
    # Prometheus timed every one of its GETs of vLLM's page: one slower than kvtax's 0.8 s
    # deadline shows that vLLM's page was that slow, whatever the prober's samples missed.
    slowest = run.calm_slowest_scrapes.get("vllm", 0.0)
    if slowest > 0.8 and "KvtaxVllmScrapeFailing" not in excused:
        excused["KvtaxVllmScrapeFailing"] = (
            f"Prometheus' slowest scrape of vLLM's /metrics took {slowest:.2f} s"
        )
    # kvtax times its fetch on its own event loop: a loop that ran late (on this machine, the
    # suite's other lanes take its core) misses the 0.8 s deadline on a page that was quick.
    # kvtax measured that lateness itself: its scrape did fail, as the alert says.
    lag = run.calm_loop_lag
    if lag + slowest > 0.8 and "KvtaxVllmScrapeFailing" not in excused:
        excused["KvtaxVllmScrapeFailing"] = (
            f"kvtax's own event loop ran {lag:.2f} s late, and vLLM's page took up to "
            f"{slowest:.2f} s: over kvtax's 0.8 s deadline"
        )
    return excused


def test_calm_pod_raises_no_alert(run: FleetRun) -> None:
    """No alert names the calm pod, pending or firing, over the whole run, unless the test's
    own measurement shows its condition was true.

    The calm pod's clients sent every request through its proxy: vLLM's http_requests_total and
    the ledger's joined requests both end at 17, and the clients received every token generated
    (3,208). Yet, before kvtax fixed the two figures, measured on it with Prometheus' samples of
    kvtax and vLLM:

    - KvtaxJoinCoverageLow fired (both engines on core 0, kvtax's 30 s window): the coverage
      gauge read 0.667, 0.75 and 0.75. Each time the window's base point held a ledger count
      read after a request settled and a vLLM count from a page fetched before vLLM counted it
      (joined 1, 3, 11 against served 0, 1, 9): kvtax read its ledger at the fold, after the
      page's fetch and parse (0.1-4.9 s on this loaded machine). With ~6 requests in 30 s that
      one pair is 25-33 %; the scrapes of the next 5 s then timed out, the gauge held 0.75, and
      the test profile's 5 s hold let it fire. kvtax now reads the ledger's joined requests
      before each fetch as well, and the window counts from the first point's earlier read to
      the last point's later one (kvtax.figures.derive.coverage), so this skew can only raise
      the ratio (tests/unit/test_join_timing.py).
    - KvtaxGoodputDiverging went pending (yield 0.72-0.89, and 0 as the window left the load):
      the yield rule divided the ledger's delivered tokens, published live, by the engine's
      generated tokens, published as of kvtax's last completed scrape of vLLM. Right after a
      stream settled, delivered led generated by 25-163 tokens until the next scrape completed
      (1-5 s here), and a 20 s window whose base sample carries that lead counts those tokens as
      generated but not delivered: at the load's end delivered was 3,208 and generated 3,183 for
      one sample, and the window starting there read 0 delivered against 25 generated. The
      rule now reads kvtax_join_delivered_tokens_total, the ledger as of the same scrape.
      It still went pending in 2 of 4 runs beside the other lanes (a 20 s yield of 0.78 both
      times): kvtax read that ledger as the page arrived, and a sidecar starved after vLLM wrote
      its page relays the tokens generated meanwhile before it gets to read. The count published
      now keeps, between the reads before and after the fetch, to the engine's increase since the
      last page (kvtax.figures.window.delivered_at_page; tests/unit/test_join_timing.py).
    """
    excused = _excused(run)
    unexplained = {name: sorted(states) for name, states in run.calm_alerts.items()}
    print(f"\ncalm pod's alerts: {unexplained}; excused by the test's measurements: {excused}")
    print(f"calm pod's lowest coverage and {TEST_PROFILE.rate_window} yield: {run.calm_lows}")
    print(f"Prometheus' failed scrapes of the calm pod, by job: {run.calm_failed_scrapes}")
    print(f"Prometheus' slowest scrape of each calm target, s: {run.calm_slowest_scrapes}")
    print(f"the calm kvtax's worst event-loop lag, s: {run.calm_loop_lag:.2f}")
    for name in excused:
        unexplained.pop(name, None)
    assert unexplained == {}, (unexplained, excused)


def _fleet_targets() -> list[tuple[str, str, str, str]]:
    board = dashboards()["kvtax-fleet.json"]
    return [
        (panel["title"], target["refId"], target["expr"], target.get("legendFormat", ""))
        for panel, target in queries(board)
    ]


@pytest.mark.parametrize(
    ("title", "ref", "expr", "legend"),
    _fleet_targets(),
    ids=[f"{t[0]}:{t[1]}" for t in _fleet_targets()],
)
def test_every_fleet_panel_breaks_down_by_replica(
    run: FleetRun, title: str, ref: str, expr: str, legend: str
) -> None:
    series = run.api.query(expand(expr, rate_interval="1m"), run.end)
    assert series, f"{title} / {ref}: no series"
    if "{{pod}}" in legend:
        # One series per replica, each in the namespace its target was given.
        assert sorted(s.labels["pod"] for s in series) == sorted([CALM, HOT]), series
        assert {s.labels.get("model_name") for s in series} == {run.model}
    else:
        # A fleet panel: one series for the model, over both replicas.
        assert [s.labels.get("model_name") for s in series] == [run.model], series
        assert {k for s in series for k in s.labels} <= {"__name__", "model_name"}, series


def _by_pod(run: FleetRun, expr: str) -> dict[str, float]:
    return {
        s.labels["pod"]: s.points[0][1]
        for s in run.api.query(expand(expr, rate_interval="1m"), run.end)
    }


def _one(run: FleetRun, expr: str) -> float:
    (series,) = run.api.query(expand(expr, rate_interval="1m"), run.end)
    return series.points[0][1]


def test_fleet_panels_sum_the_replicas(run: FleetRun) -> None:
    targets = {(t[0], t[1]): t[2] for t in _fleet_targets()}
    title = {t[0] for t in targets}

    def expr(panel: str, ref: str = "A") -> str:
        assert panel in title, sorted(title)
        return targets[(panel, ref)]

    goodput = _by_pod(run, expr("Goodput by pod"))
    assert goodput[HOT] > 0, goodput
    assert goodput[CALM] > 0, goodput
    fleet_goodput = _one(run, expr("Fleet goodput against engine throughput", "B"))
    assert fleet_goodput == pytest.approx(goodput[HOT] + goodput[CALM], rel=1e-9)
    tax = _by_pod(run, expr("Preemption tax by pod"))
    assert tax[HOT] > 0.02, tax
    assert tax[CALM] == 0.0, tax
    top = _by_pod(run, expr("Top pods by preemption tax"))
    assert top == tax
    capacity = _one(run, expr("Fleet KV capacity against demand", "A"))
    assert capacity == run.capacity


def test_adapter_tokens_join_the_base_models_engine(run: FleetRun) -> None:
    calm = _increase(run, CALM)
    adapter_tokens = sum(r.completion_tokens or 0 for r in run.results[ADAPTER])
    base_tokens = sum(r.completion_tokens or 0 for r in run.results[CALM])
    assert adapter_tokens > 0
    # The engine generated both kinds under its one model_name, and kvtax delivered the same.
    assert calm["generated"] == adapter_tokens + base_tokens
    assert calm["delivered"] == calm["generated"]
    page = run.calm_page
    assert (
        page[
            f'kvtax_adapter_delivered_tokens_total{{adapter="{ADAPTER}",model_name="{run.model}"}}'
        ]
        == adapter_tokens
    )
    assert not [k for k in page if f'model_name="{ADAPTER}"' in k or 'model_name="other"' in k]
    # In Prometheus the calm pod's yield (delivered / generated) stays 1, adapter included.
    record = per_pod("kvtax_delivery_yield", "ratio_rate15m")
    yields = {s.labels["pod"]: s.points[0][1] for s in run.api.query(record, run.end)}
    assert yields[CALM] == pytest.approx(1.0, abs=0.005)


# -- the plugin folder: a stock vLLM measures the tax with no rebuild ---------------------------
def test_plugin_folder_holds_kvtax_alone_with_its_entry_point(plugin_dir: Path) -> None:
    top = sorted(p.name for p in plugin_dir.iterdir() if p.name != "bin")
    # kvtax and its dist-info only: vLLM already ships prometheus-client, and nothing of
    # kvtax's other dependencies (aiohttp, apscheduler, ...) may land next to vLLM.
    assert [n for n in top if not n.startswith("kvtax")] == []
    (dist_info,) = plugin_dir.glob("kvtax-*.dist-info")
    entry_points = (dist_info / "entry_points.txt").read_text()
    assert f"{plugin.ENTRY_POINT_NAME} = kvtax.plugin:KvtaxStatLogger" in entry_points
    assert not (plugin_dir / "kvtax_dev").exists()


def test_vllm_loads_the_plugin_from_the_folder_and_kvtax_publishes_the_measured_tax(
    run: FleetRun, second_engine: VllmEngine, plugin_dir: Path, tmp_path: Path
) -> None:
    # After the fleet's own tests (``run`` is set up), so this overload of the calm replica
    # cannot disturb what they read.
    log = second_engine.log_path.read_text(errors="replace")
    loaded_from = [ln for ln in log.splitlines() if "kvtax plugin: loaded from" in ln]
    assert loaded_from, f"the plugin logged no load line:\n{second_engine.log_tail()}"
    # The folder's copy, not the engine venv's editable install of the main checkout.
    assert all(ln.rstrip().endswith(str(plugin_dir / "kvtax")) for ln in loaded_from), loaded_from
    print(loaded_from[0])  # shown with -s: the evidence of which copy vLLM loaded
    assert "kvtax plugin: publishing exact recompute counters" in log
    page = read_series(second_engine.metrics_text())
    for concept in plugin.PLUGIN_CONCEPTS:
        name = plugin.family_name(concept) + "_total"
        assert series_key(name, {"model_name": run.model, "engine": "0"}) in page, name

    measured = series_key(
        "kvtax_preemption_tax_ratio", {"model_name": run.model, "method": "measured"}
    )
    recomputed = series_key("kvtax_recomputed_tokens_measured_total", {"model_name": run.model})
    with KvtaxProcess(
        second_engine.url,
        proxy=True,
        scrape_interval="0.5s",
        window="1h",
        log_path=tmp_path / "kvtax.log",
    ) as kvtax:
        assert kvtax.proxy_url is not None
        kvtax.wait_for(lambda m: recomputed in m, what="the plugin's counter read by kvtax")
        # An overload of the 2,048-token pool: 32 streams of 300 tokens preempt.
        results = asyncio.run(
            drive(kvtax.proxy_url, run.model, concurrency=32, max_tokens=300, stream=True)
        )
        assert [r.error for r in results if not r.ok] == []
        page_after = kvtax.wait_for(
            lambda m: m.get(recomputed, 0.0) > 0 and m.get(measured, 0.0) > 0,
            what="a measured tax above zero",
        )
    assert 0.0 < page_after[measured] < 1.0
    tax, tokens = page_after[measured], page_after[recomputed]
    print(f"measured tax {tax:.3f}, recomputed {tokens:.0f} tokens")
