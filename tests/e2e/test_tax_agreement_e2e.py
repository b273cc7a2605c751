"""End to end: the exporter's tax gauge and the recording rule's tax agree on a real overload.

kvtax computes "the tax" twice, by one definition (docs/tax.md, "The one definition"):
``kvtax_preemption_tax_ratio`` is the exporter's own window (``--window``), and
``namespace_pod_model_name:kvtax_preemption_tax:ratio_rate<W>`` is the recording rule, a ratio of
``rate()`` over the same counters with the same method order. Here both run with W = 30 s on the
session's real vLLM CPU engine while 64 streams of 300 tokens at a time, for 73 s, overload
its 2,048-token pool, and Prometheus (scraping vLLM and kvtax every second) records both. They
must agree within :data:`TOLERANCE_MEDIAN` at the median second, and within :data:`TOLERANCE`
on average over the steady overload (every second whose window lies wholly inside it).

Why they can differ at all: the two windows have the same length but are not the same interval.
The gauge spans kvtax's own scrapes of vLLM (from the last one at or before ``now - W`` to the
latest, so W to W + 1 s); the rule's ``rate()`` spans Prometheus' samples of kvtax's counters in
``(t - W, t]``, each up to one kvtax scrape plus one Prometheus scrape (2 s) late. Where the tax
moves fast (the load's first and last seconds) that 1-3 s of the 30 s window can shift the ratio
by a few points; in steady overload the two are nearly equal, second by second within a few
points, and over the whole steady span, where such a shift moves a few seconds' work at each
end of 25 s of it, within one.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import threading
import time
import urllib.parse
from dataclasses import replace
from pathlib import Path

import pytest

from kvtax.mixin.rules import per_pod
from kvtax.mixin.rules.config import DEFAULT, short_profile
from kvtax.mixin.rules.render import recording_yaml
from kvtax_dev.process import HANG_GUARD_S
from kvtax_dev.testbed import VllmEngine
from kvtax_dev.testbed.load import RequestResult, drive
from kvtax_dev.testbed.promstack import PrometheusProcess, prometheus_config
from kvtax_dev.testbed.sidecar import KvtaxProcess

pytestmark = pytest.mark.e2e

WINDOW_S = 30
PROFILE = short_profile(replace(DEFAULT, kvtax_job_selector='job="kvtax"'), window=f"{WINDOW_S}s")
RULE = per_pod("kvtax_preemption_tax", f"ratio_rate{WINDOW_S}s")
GAUGE = "kvtax_preemption_tax_ratio"
# Absolute difference in tax (a share, 0-1) allowed at the median second of the run, and between
# the two means over the steady overload (the seconds whose window lies wholly inside the load).
# Measured here with 96 requests of 500 tokens (85 s compared, peak tax 0.32): median 0.002,
# p90 0.013, steady max 0.015 over 41 s. A single second of steady overload, beside the suite's
# other lanes, differed by 0.0555: the windows' 1-3 s shift, which the mean over the span does not
# carry. The bounds leave room for a slower machine.
TOLERANCE_MEDIAN = 0.01
TOLERANCE = 0.02
# The load keeps 64 streams open for this long: past its ramp to the first tax (3 to 16 s seen,
# within RAMP_S), one window, and the 3 s the two windows can be apart, the windows wholly inside
# the overload span about STEADY_S seconds however fast the engine is.
STEADY_S = 25
RAMP_S = 15
LOAD_S = RAMP_S + WINDOW_S + 3 + STEADY_S


def _address(url: str) -> str:
    return urllib.parse.urlsplit(url).netloc


def _overload(engine: VllmEngine) -> list[RequestResult]:
    return asyncio.run(
        drive(
            engine.url,
            engine.model_name,
            concurrency=64,
            max_tokens=300,
            stream=True,
            # For a time, not a count of requests: a count held the overload for 33 s on a quiet
            # machine and 60 s beside the other lanes, so the steady windows numbered 0 to 20.
            for_seconds=LOAD_S,
        )
    )


def _by_second(points: tuple[tuple[float, float], ...]) -> dict[int, float]:
    return {round(t): v for t, v in points if not math.isnan(v)}  # 0/0 on an idle window


def test_exporter_gauge_and_recording_rule_agree(vllm_engine: VllmEngine, tmp_path: Path) -> None:
    rules = tmp_path / "kvtax-recording.yaml"
    rules.write_text(recording_yaml(PROFILE))
    with KvtaxProcess(
        vllm_engine.url,
        scrape_interval="1s",
        window=f"{WINDOW_S}s",
        log_path=tmp_path / "kvtax.log",
    ) as kvtax:
        config = prometheus_config(
            {"vllm": [_address(vllm_engine.url)], "kvtax": [_address(kvtax.base_url)]},
            interval="1s",
        )
        with PrometheusProcess(config, [rules], log_path=tmp_path / "prom.log") as prom:
            prom.wait_for(
                lambda: prom.query("kvtax_vllm_up == 1"),
                what="Prometheus reading kvtax, kvtax reading vLLM",
            )
            start = time.time()
            results: list[RequestResult] = []
            load = threading.Thread(target=lambda: results.extend(_overload(vllm_engine)))
            load.start()
            load.join(HANG_GUARD_S)
            assert not load.is_alive(), "the overload did not finish"
            issued_until = start + LOAD_S  # after that no request starts: the drain
            # Let both windows slide past the load's end, so its last seconds are compared too.
            time.sleep(WINDOW_S / 2)
            end = time.time()
            gauge = prom.api.query_range(GAUGE, start, end, 1)
            rule = prom.api.query_range(RULE, start, end, 1)

    assert results
    # The load goes straight to vLLM (kvtax only scrapes here), so a failed request is the
    # engine's or the client's, not kvtax's; it only thins the load this test compares over.
    # Name any failure, and require nearly all of the load to have run.
    failed = [(r.index, r.status, r.error) for r in results if not r.ok]
    print(f"\nload: {len(results)} requests, {len(failed)} failed: {failed[:5]}")
    assert len(failed) <= len(results) // 20, failed[:5]
    assert len(gauge) == 1, gauge
    assert len(rule) == 1, rule
    # The same method on both sides: the plugin is in the engine's venv, so both measure.
    assert gauge[0].labels["method"] == rule[0].labels["method"] == "measured"
    ours, theirs = _by_second(gauge[0].points), _by_second(rule[0].points)
    both = sorted(set(ours) & set(theirs))
    busy = [t for t in both if max(ours[t], theirs[t]) > 0]
    assert len(busy) >= 10, f"too few seconds with a tax on both sides: {len(busy)}"
    diffs = [abs(ours[t] - theirs[t]) for t in busy]
    # Seconds whose whole window lies inside the overload after its ramp: there the 1-3 s shift
    # between the two windows moves little work. At the load's edges (its ramp to the first
    # preemptions, its drain) a window holds a few seconds of changing work, and the same shift
    # can move the ratio by a quarter (at the ramp the rule reads 0 for seconds after the gauge
    # has the first preemptions). The ramp is timed from the first second with a tax, not from
    # the load's start: on a busy machine the first tax comes late, and a window timed from the
    # start would still hold the ramp.
    ramped = busy[0] + WINDOW_S + 3
    span = [t for t in busy if ramped <= t <= issued_until]
    steady = [abs(ours[t] - theirs[t]) for t in span]
    worst = sorted(busy, key=lambda t: -abs(ours[t] - theirs[t]))[:3]
    print(
        f"\nfirst second with a tax: the load's start + {busy[0] - start:.0f} s; largest "
        "differences at + "
        + ", + ".join(f"{t - start:.0f} s ({ours[t]:.3f} vs {theirs[t]:.3f})" for t in worst)
    )
    peak = max(ours[t] for t in busy)
    print(
        f"\ntax agreement: {len(busy)} s compared, peak gauge {peak:.3f}; |gauge - rule| "
        f"median {statistics.median(diffs):.4f}, p90 "
        f"{statistics.quantiles(diffs, n=10)[-1]:.4f}, max {max(diffs):.4f}; "
        f"{len(steady)} s of steady overload, max {max(steady, default=float('nan')):.4f}"
    )
    gauge_mean = statistics.fmean(ours[t] for t in span) if span else float("nan")
    rule_mean = statistics.fmean(theirs[t] for t in span) if span else float("nan")
    print(f"steady overload: mean gauge {gauge_mean:.4f}, mean rule {rule_mean:.4f}")
    assert peak > 0.05, "the overload produced no tax to compare"
    assert statistics.median(diffs) <= TOLERANCE_MEDIAN
    # About STEADY_S of them, less the seconds where the gauge has no sample: kvtax's scrape of
    # the busy engine runs late and Prometheus' second passes without one (9 of 77 s, seen on a
    # quiet machine; the longest gap 4 s).
    assert len(steady) >= STEADY_S // 2, f"too few seconds of steady overload: {len(steady)}"
    assert abs(gauge_mean - rule_mean) <= TOLERANCE
