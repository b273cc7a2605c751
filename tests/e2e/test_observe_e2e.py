"""Observe mode against a real vLLM 0.32 CPU engine: capacity, preemption, thrash, restarts.

One ``kvtax serve`` process scrapes the session's engine every second. The overload is the one
a smaller cut of shared/real-vllm-on-cpu.md's: 32 concurrent generations of 300 tokens
against a 2,048-token pool, five times what it holds.

Every state here depends on when scrapes land, and under load vLLM's /metrics can take longer
than the 1 s scrape allows (kvtax rightly publishes up 0 then). So the tests wait for the state
they mean to check, with :meth:`KvtaxProcess.wait_for`, and never read it once and assert.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Iterator

import pytest
import requests

from kvtax_dev.testbed import VllmEngine
from kvtax_dev.testbed.load import drive
from kvtax_dev.testbed.sidecar import KvtaxProcess, series_key

MODEL = {"model_name": "tiny-llama"}


def _capacity_from_log(engine: VllmEngine) -> int:
    """The pool size vLLM printed at startup ("KV cache size: 2,048 tokens")."""
    text = engine.log_path.read_text(errors="replace")
    found = re.findall(r"KV cache size:\s*([\d,]+)\s*tokens", text)
    assert found, "the engine log has no 'KV cache size' line"
    return int(found[-1].replace(",", ""))


@pytest.fixture
def kvtax(vllm_engine: VllmEngine) -> Iterator[KvtaxProcess]:
    with KvtaxProcess(vllm_engine.url, scrape_interval="1s", window="60s") as proc:
        proc.wait_for(lambda m: m.get("kvtax_vllm_up") == 1.0, what="first scrape")
        yield proc


def test_overload_shows_capacity_preemption_and_thrash(
    vllm_engine: VllmEngine, kvtax: KvtaxProcess
) -> None:
    capacity = series_key("kvtax_kv_capacity_tokens", MODEL)
    idle = kvtax.wait_for(
        lambda m: m.get("kvtax_vllm_up") == 1.0 and capacity in m, what="up with a capacity"
    )
    assert idle[capacity] == _capacity_from_log(vllm_engine)

    results = asyncio.run(
        drive(vllm_engine.url, vllm_engine.model_name, concurrency=32, max_tokens=300, stream=True)
    )
    assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]

    # Scrapes land once a second, and right after the overload one may time out: wait for a
    # good scrape that saw the preemptions.
    preemptions = series_key("kvtax_engine_preemptions_total", MODEL)
    after = kvtax.wait_for(
        lambda m: (
            m.get("kvtax_vllm_up") == 1.0
            and m.get(preemptions, 0.0) > idle.get(preemptions, 0.0)
            and sum(_taxes(m).values()) > 0
        ),
        what="up, with new preemptions and a nonzero tax",
    )
    assert after[series_key("kvtax_thrash_state", MODEL)] >= 1
    # One tax series for the model, named by the best method the engine allows: measured when
    # vLLM loaded kvtax's plugin (it is installed in the engine's venv), else the estimate.
    [(method, tax)] = _taxes(after).items()
    assert method in ("measured", "estimated")
    assert tax > 0
    assert after[series_key("kvtax_recommended_max_num_seqs", MODEL)] >= 1


def _taxes(metrics: dict[str, float]) -> dict[str, float]:
    """The model's tax series, by the method each names."""
    taxes = {}
    for key, value in metrics.items():
        if key.startswith("kvtax_preemption_tax_ratio{"):
            taxes[key.partition('method="')[2].partition('"')[0]] = value
    return taxes


def _rates(metrics: dict[str, float]) -> dict[str, float]:
    return {
        k: v
        for k, v in metrics.items()
        if "_per_second" in k or k.startswith(("kvtax_preemption_tax_ratio", "kvtax_waste_ratio"))
    }


def _scraped_after(page: dict[str, float]) -> Callable[[dict[str, float]], bool]:
    seen = page["kvtax_scrapes_total"]
    return lambda m: m["kvtax_scrapes_total"] > seen


def _readyz_status(kvtax: KvtaxProcess) -> int:
    return requests.get(kvtax.base_url + "/readyz", timeout=5).status_code


def _wait_readyz(kvtax: KvtaxProcess, status: int) -> None:
    """Readiness follows vLLM's /health (with the proxy on): wait for it, not read it once."""
    kvtax.wait_for(lambda m: _readyz_status(kvtax) == status, what=f"/readyz {status}")


@pytest.mark.plugins_off
def test_vllm_down_then_back(vllm_engine: VllmEngine, kvtax: KvtaxProcess) -> None:
    """Stop the real engine under kvtax, then start it again on the same port, as a rollout
    does: kvtax tells vLLM down from slow, holds its last figures, counts the restart, and its
    totals stay monotonic across vLLM's reset. The session's engine comes back without kvtax's
    plugin, the state test_tax_e2e's plugin-less test reads, so one restart serves both."""
    # Some traffic first, so that vLLM's counters are above zero and a restart resets them.
    asyncio.run(
        drive(vllm_engine.url, vllm_engine.model_name, concurrency=2, max_tokens=16, stream=False)
    )
    gen = series_key("kvtax_engine_generation_tokens_total", MODEL)
    before = kvtax.wait_for(lambda m: m.get(gen, 0.0) > 0, what="tokens counted")
    # A stopped engine's port refuses connections: kvtax tells that ("down") from a timeout.
    refused = series_key("kvtax_scrape_errors_total", {"reason": "refused"})
    last_refused = series_key("kvtax_last_scrape_error", {"reason": "refused"})
    # A second kvtax with its proxy on: traffic flows through it, so its readiness follows
    # vLLM's /health, while the observe-only one never gates the pod.
    proxied = KvtaxProcess(vllm_engine.url, proxy=True, scrape_interval="1s", window="60s")
    proxied.start()
    _wait_readyz(proxied, 200)
    vllm_engine.stop()
    try:
        down = kvtax.wait_for(
            lambda m: m["kvtax_vllm_up"] == 0.0 and m[last_refused] == 1.0,
            what="kvtax_vllm_up 0, the last scrape refused",
        )
        assert down[refused] > before[refused]
        # Still serving its own page, last known engine figures included; they stay put while
        # vLLM is down.
        assert down["kvtax_scrapes_total"] > before["kvtax_scrapes_total"]
        assert down[gen] >= before[gen]
        later = kvtax.wait_for(_scraped_after(down), what="a scrape while down")
        assert later[gen] == down[gen]
        _wait_readyz(proxied, 503)
        assert _readyz_status(kvtax) == 200  # observe-only: vLLM down is not kvtax's outage
    finally:
        vllm_engine.turn_plugins_off()
        vllm_engine.start()
    # Back up: wait for a good scrape (the first ones may time out while the engine warms up).
    restarts = "kvtax_vllm_restarts_total"
    page = kvtax.wait_for(
        lambda m: m["kvtax_vllm_up"] == 1.0 and m[restarts] > before[restarts],
        what="up again, with the restart counted",
    )
    assert page[restarts] == before[restarts] + 1
    assert page[last_refused] == 0.0
    _wait_readyz(proxied, 200)
    assert proxied.stop() == 0
    assert _readyz_status(kvtax) == 200
    # vLLM restarted from zero: kvtax's totals stay monotonic and no rate goes negative.
    for _ in range(3):
        page = kvtax.wait_for(_scraped_after(page), what="another scrape")
        assert all(v >= 0 for v in _rates(page).values()), _rates(page)
        assert page[gen] >= before[gen]
