"""The tax with a KV connector, on the real engine: LMCache gives resumed requests their KV back.

The same overload runs on two real vLLM 0.32 CPU engines: one without a connector, one with
LMCache's multiprocess connector and its cache server (kvtax_dev.testbed.lmcache: the one
connector that restores a preempted request's KV on the CPU build; vLLM's own offloading
connectors need CUDA there, docs/tax.md says where). 48 requests, each with a prompt of 200
token ids shared with no other, and 300 output tokens, against the 2,048-token pool.

On each engine a fresh ``kvtax serve`` watches, and an independent count sits beside it: a
scheduler probe of the harness's own (kvtax_dev.testbed.schedprobe, none of kvtax's code) reads
every step's scheduled tokens, from which the recompute follows by arithmetic with vLLM's own
counters, and the scheduler's record of what resumed requests found and loaded. kvtax's
measured recompute must equal the scheduler's count exactly, with and without the connector;
what the connector loaded, and what the prefix cache held, must be counted apart, exactly as the
scheduler recorded them. While the connector's engine runs, Prometheus scrapes kvtax, and every
query of the Overview's "Recompute avoided" row must return data.

The arm without a connector runs on the session's engine, which loads the probe and logs
per-step details for it (tests/e2e/conftest.py); the connector's arm needs an engine of its own,
the connector being chosen when vLLM starts, and computes on the core beside the session
engine's. ``--max-num-batched-tokens 4096``, twice the pool, on both: the per-step count assumes
no prefill is cut into chunks (see recomputed_by_steps).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvtax import plugin
from kvtax.mixin.dashboards import dashboards
from kvtax.mixin.dashboards.queries import expand
from kvtax_dev.dashboard_lint import queries
from kvtax_dev.exposition import read_samples, total
from kvtax_dev.promapi import PrometheusApi
from kvtax_dev.testbed import VllmEngine
from kvtax_dev.testbed.engine import beside_cores
from kvtax_dev.testbed.lmcache import NO_TELEMETRY, LmcacheServer, ensure_lmcache_venv
from kvtax_dev.testbed.load import RequestResult, distinct_prompts, drive
from kvtax_dev.testbed.promstack import PrometheusProcess, prometheus_config
from kvtax_dev.testbed.schedprobe import FLAG, SERIES, probe_dir, recomputed_by_steps
from kvtax_dev.testbed.sidecar import KvtaxProcess, series_key

pytestmark = pytest.mark.e2e

MODEL = "tiny-llama"
REQUESTS = 48
PROMPT_TOKENS = 200
MAX_TOKENS = 300
ENGINE_FLAGS = (FLAG, "--max-num-batched-tokens", "4096")
SETTLE_TIMEOUT_S = 300.0  # a hang guard, not a performance claim
ROW = "Recompute avoided"

AVOIDED = "kvtax_recompute_avoided_tokens_total"
R_MEASURED = series_key("kvtax_recomputed_tokens_measured_total", {"model_name": MODEL})
TAX = series_key("kvtax_preemption_tax_ratio", {"model_name": MODEL, "method": "measured"})
CONNECTOR_SERIES = plugin.family_name(plugin.CONNECTOR_CONCEPT) + "_total"


def avoided_key(source: str) -> str:
    return series_key(AVOIDED, {"model_name": MODEL, "source": source})


# -- what vLLM and the probe say --------------------------------------------------------------
def read_engine(engine: VllmEngine) -> dict[str, float]:
    """vLLM's own counters, the probe's, and whether kvtax's plugin counts a connector."""
    samples = read_samples(engine.metrics_text())
    by_source = samples.get("vllm:prompt_tokens_by_source_total", {})
    out = {
        "generated": total(samples, "vllm:generation_tokens_total"),
        "prompt_computed": sum(
            v for labels, v in by_source.items() if ("source", "local_compute") in labels
        ),
        "preemptions": total(samples, "vllm:num_preemptions_total"),
        "load": total(samples, "vllm:num_requests_running")
        + total(samples, "vllm:num_requests_waiting"),
        "plugin_counts_connector": float(CONNECTOR_SERIES in samples),
    }
    out.update({key: total(samples, name) for key, name in SERIES.items()})
    return out


def settle(engine: VllmEngine) -> dict[str, float]:
    """The engine's counters once it is idle and they stopped moving (its last update landed)."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    readings: list[dict[str, float]] = []
    while time.monotonic() < deadline:
        now = read_engine(engine)
        readings = [*readings[-2:], now] if now["load"] == 0 else []
        if len(readings) == 3 and readings[0] == readings[1] == readings[2]:
            return now
        time.sleep(0.5)
    raise AssertionError(f"engine did not settle within {SETTLE_TIMEOUT_S:.0f} s: {readings}")


@dataclass(frozen=True)
class Arm:
    """One overload on one engine: vLLM's and the probe's deltas, kvtax's before and after."""

    delta: dict[str, float]
    results: list[RequestResult]
    kvtax_before: dict[str, float]
    kvtax: dict[str, float]
    prometheus: PrometheusApi | None
    end: float

    def kvtax_delta(self, key: str) -> float | None:
        if key not in self.kvtax:
            return None
        return self.kvtax[key] - self.kvtax_before.get(key, 0.0)

    @property
    def recomputed_by_steps(self) -> float:
        d = self.delta
        return recomputed_by_steps(
            d["scheduled"],
            d["prompt_computed"],
            d["generated"],
            len(self.results),
            d["preemptions"],
        )


def caught_up(engine_now: dict[str, float]) -> Callable[[dict[str, float]], bool]:
    def check(m: dict[str, float]) -> bool:
        gen = m.get(series_key("kvtax_engine_generation_tokens_total", {"model_name": MODEL}))
        return gen == engine_now["generated"] and TAX in m

    return check


def overload(engine: VllmEngine, tmp_path: Path, *, with_prometheus: bool) -> Iterator[Arm]:
    """Idle engine, a fresh kvtax (and Prometheus scraping it), the overload, idle engine."""
    before = settle(engine)
    with contextlib.ExitStack() as stack:
        kvtax = stack.enter_context(
            KvtaxProcess(
                engine.url, scrape_interval="0.5s", window="1h", log_path=tmp_path / "kvtax.log"
            )
        )
        idle = kvtax.wait_for(
            lambda m: m.get("kvtax_vllm_up") == 1.0 and R_MEASURED in m, what="first scrape"
        )
        prom = None
        if with_prometheus:
            jobs = {"kvtax": [kvtax.base_url.removeprefix("http://")]}
            config = prometheus_config(jobs, interval="1s")
            prom = stack.enter_context(PrometheusProcess(config, log_path=tmp_path / "prom.log"))
            prom.wait_for(lambda: prom.query("kvtax_vllm_up == 1"), what="Prometheus reads kvtax")
        results = asyncio.run(
            drive(
                engine.url,
                MODEL,
                concurrency=REQUESTS,
                max_tokens=MAX_TOKENS,
                stream=True,
                include_usage=True,
                prompts=distinct_prompts(REQUESTS, PROMPT_TOKENS, seed=33),
            )
        )
        after = settle(engine)
        done = kvtax.wait_for(caught_up(after), what="kvtax scraped the idle engine")
        if prom is not None:
            # Two more scrapes by Prometheus, so every rate's last sample is after the load.
            since = time.time() + 1
            prom.wait_for(
                lambda: prom.query(f"min(timestamp(up)) > {since}"), what="two more scrapes"
            )
        yield Arm(
            {k: after[k] - before[k] for k in after},
            results,
            idle,
            done,
            prom.api if prom is not None else None,
            time.time(),
        )


def check_accounting(arm: Arm) -> None:
    """kvtax's numbers against the scheduler's own, exactly."""
    assert [r.error for r in arm.results if not r.ok] == []
    d = arm.delta
    assert d["preemptions"] > 0, "the overload made no preemption to account for"
    assert d["steps"] > 0, f"the probe saw no step: vLLM ran without {FLAG}?"
    # The scheduler's two records agree: what resumes needed, less what they found or loaded,
    # is what the steps show was computed again (no connector here takes back a local hit).
    assert d["dropped"] == 0
    assert d["queried"] - d["local_hits"] - d["loaded"] == arm.recomputed_by_steps > 0
    assert d["resumes"] == d["preemptions"]
    # kvtax's measurement is that count, exactly; so is its tax.
    assert arm.kvtax_delta(R_MEASURED) == arm.recomputed_by_steps
    r, pc, g = arm.recomputed_by_steps, d["prompt_computed"], d["generated"]
    assert arm.kvtax[TAX] == r / (pc + g + r)
    assert arm.kvtax_delta(avoided_key("prefix_cache")) == d["local_hits"]


@pytest.fixture
def without_connector(
    vllm_engine: VllmEngine, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Arm]:
    assert FLAG in vllm_engine.extra_args, "the session's engine runs without the probe's flag"
    yield from overload(vllm_engine, tmp_path_factory.mktemp("no-connector"), with_prometheus=False)


@pytest.fixture(scope="module")
def with_lmcache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Arm]:
    tmp = tmp_path_factory.mktemp("lmcache")
    venv = ensure_lmcache_venv()
    with (
        LmcacheServer(venv, log_path=tmp / "lmcache.log") as cache,
        VllmEngine(
            venv=venv,
            extra_args=(*ENGINE_FLAGS, "--kv-transfer-config", cache.transfer_config()),
            extra_env=NO_TELEMETRY,
            python_path=[probe_dir(tmp / "probe")],
            cpus=beside_cores(),
            log_path=tmp / "engine.log",
        ) as engine,
    ):
        yield from overload(engine, tmp, with_prometheus=True)


def test_without_a_connector_the_measured_recompute_is_the_schedulers_count(
    without_connector: Arm,
) -> None:
    arm = without_connector
    check_accounting(arm)
    assert arm.delta["plugin_counts_connector"] == 0
    assert arm.delta["loaded"] == 0
    # No connector, no line for it: absent, not 0.
    assert avoided_key("kv_connector") not in arm.kvtax
    print(f"\nwithout a connector: {describe(arm)}")


def test_with_lmcache_resumed_requests_load_their_kv_and_it_is_counted_apart(
    with_lmcache: Arm,
) -> None:
    arm = with_lmcache
    check_accounting(arm)
    # LMCache gave resumed requests KV back, and kvtax counts it apart, as the scheduler did.
    assert arm.delta["loaded"] > 0
    assert arm.kvtax_delta(avoided_key("kv_connector")) == arm.delta["loaded"]
    print(f"\nwith LMCache: {describe(arm)}")


def test_the_recompute_avoided_row_has_data_with_a_connector(with_lmcache: Arm) -> None:
    api = with_lmcache.prometheus
    assert api is not None
    overview = dashboards()["kvtax-overview.json"]
    cases = [
        (panel["title"], target["expr"])
        for panel, target in queries(overview)
        if panel["title"] in row_titles(overview)
    ]
    assert len(cases) >= 3
    for title, expr in cases:
        filled = expand(expr, rate_interval="2m", values={"model_name": MODEL})
        series = api.query(filled, with_lmcache.end)
        assert series, f"{title}: no series for\n{filled}"
        assert any(v > 0 for s in series for _, v in s.points), (title, filled)


def row_titles(board: dict[str, object]) -> set[str]:
    """The titles of the panels under the row titled :data:`ROW` (up to the next row)."""
    titles: list[str] = []
    inside = False
    for panel in board["panels"]:  # type: ignore[attr-defined]
        if panel["type"] == "row":
            inside = panel["title"] == ROW
        elif inside:
            titles.append(panel["title"])
    return set(titles)


def describe(arm: Arm) -> str:
    d = arm.delta
    return (
        f"{d['preemptions']:.0f} preemptions; resumes needed {d['queried']:.0f} tokens: "
        f"{d['local_hits']:.0f} in vLLM's prefix cache, {d['loaded']:.0f} loaded by the "
        f"connector, {arm.recomputed_by_steps:.0f} computed again; tax {arm.kvtax[TAX]:.4f}"
    )
