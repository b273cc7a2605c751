"""derive: capacity, request-length quantiles, recommended max_num_seqs, thrash state, the tax
and waste with the best method, goodput, coverage and undelivered tokens."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest

from kvtax.delivery.ledger import LedgerTotals
from kvtax.engine.normalize import normalize
from kvtax.engine.snapshot import Histogram
from kvtax.figures.derive import (
    EngineSettings,
    MethodValue,
    ThrashState,
    best_method,
    derive_model,
    kv_capacity_tokens,
    recommended_max_num_seqs,
    tax_ratio,
    thrash_state,
    waste_ratio,
)
from kvtax.figures.window import Point, Window
from tests.unit.conftest import read_fixture

INF = float("inf")


def approx_method(method: str, value: float) -> MethodValue:
    """A MethodValue equal to any of ``method`` whose value is ``value``, as pytest.approx."""
    # pytest.approx stands where the float goes: the dataclass's __eq__ compares it with one.
    return MethodValue(method, pytest.approx(value))  # type: ignore[arg-type]


def point(
    t: float,
    counters: Mapping[str, float] | None = None,
    gauges: Mapping[str, float] | None = None,
    histograms: Mapping[str, Histogram] | None = None,
    info: Mapping[str, str] | None = None,
) -> Point:
    return Point(
        t, dict(counters or {}), dict(gauges or {}), dict(histograms or {}), dict(info or {})
    )


# -- capacity and the recommendation -----------------------------------------------------------


def test_capacity_prefers_kv_cache_size_tokens() -> None:
    info = {"kv_cache_size_tokens": "2048", "num_gpu_blocks": "10", "block_size": "16"}
    assert kv_capacity_tokens(info) == 2048


def test_capacity_from_blocks_times_block_size() -> None:
    assert kv_capacity_tokens({"num_gpu_blocks": "2127", "block_size": "16"}) == 34_032


@pytest.mark.parametrize(
    "info",
    [
        {},
        {"block_size": "16"},
        {"num_gpu_blocks": "None", "block_size": "16"},
        {"num_gpu_blocks": "0", "block_size": "16"},
        {"kv_cache_size_tokens": "nan"},
    ],
)
def test_capacity_unknown_is_none_not_zero(info: dict[str, str]) -> None:
    assert kv_capacity_tokens(info) is None


@pytest.mark.parametrize(
    ("capacity", "target", "p95", "expected"),
    [
        (2048, 0.9, 533.5, 3),  # floor(1843.2 / 533.5) = floor(3.45)
        (34_032, 0.9, 970.0, 31),
        (1000, 1.0, 100.0, 10),  # exact division stays 10
        (1000, 0.5, 100.0, 5),
        (2048, 0.9, 5000.0, 1),  # one request longer than the pool: still at least 1
        (100, 0.9, 100.0, 1),  # floor(0.9) would be 0
    ],
)
def test_recommended_max_num_seqs(
    capacity: float, target: float, p95: float, expected: int
) -> None:
    assert recommended_max_num_seqs(capacity, target, p95) == expected


@pytest.mark.parametrize("p95", [0.0, -3.0])
def test_recommended_max_num_seqs_rejects_a_non_positive_length(p95: float) -> None:
    with pytest.raises(ValueError, match="p95"):
        recommended_max_num_seqs(2048, 0.9, p95)


# -- tax -----------------------------------------------------------------------------------------


def test_tax_ratio_from_the_measured_run_in_the_facts() -> None:
    # 19,093 tokens recomputed against 34,624 useful tokens: a 36 % token tax.
    assert tax_ratio(19_093, 2_624, 32_000) == pytest.approx(19_093 / 53_717)
    assert round(tax_ratio(19_093, 2_624, 32_000), 2) == 0.36


def test_tax_ratio_edge_cases() -> None:
    assert tax_ratio(0, 0, 0) == 0.0
    assert tax_ratio(0, 100, 100) == 0.0
    assert tax_ratio(50, 0, 0) == 1.0


def test_tax_and_recompute_rate_over_a_window() -> None:
    first = point(
        0.0,
        {
            "generation_tokens": 1_000,
            "prompt_computed": 500,
            "recomputed_measured": 0,
            "recomputed_estimated": 100,
        },
    )
    last = point(
        10.0,
        {
            "generation_tokens": 1_600,  # G = 600
            "prompt_computed": 800,  # Pc = 300
            "recomputed_measured": 100,  # R = 100
            "recomputed_estimated": 400,  # R-hat = 300
        },
    )
    f = derive_model([first, last], EngineSettings())
    # Measured is there, so it is the tax: one value, named by its method.
    assert f.tax == approx_method("measured", 100 / (300 + 600 + 100))
    without_measured = [
        point(p.t, {k: v for k, v in p.counters.items() if k != "recomputed_measured"})
        for p in (first, last)
    ]
    f = derive_model(without_measured, EngineSettings())
    assert f.tax == approx_method("estimated", 300 / (300 + 600 + 300))


def test_the_best_method_is_the_first_available_in_a_fixed_order() -> None:
    everything = {
        "recomputed_measured": 1.0,
        "recomputed_estimated": 2.0,
        "recomputed_stall_estimated": 3.0,
    }
    assert best_method(everything) == ("measured", 1.0)
    del everything["recomputed_measured"]
    assert best_method(everything) == ("estimated", 2.0)
    del everything["recomputed_estimated"]
    assert best_method(everything) == ("stall_estimated", 3.0)
    assert best_method({"generation_tokens": 5.0}) is None


def test_a_single_scrape_publishes_no_rate_and_no_tax() -> None:
    # One point spans no time: a rate or a tax of 0 would claim "no tax" before anything is known.
    only = point(0.0, {"generation_tokens": 10, "preemptions": 3, "recomputed_estimated": 30})
    f = derive_model([only], EngineSettings())
    assert f.tax is None
    assert f.waste is None
    assert f.goodput is None
    assert f.totals["generation_tokens"] == 10


def test_no_points_no_figures() -> None:
    f = derive_model([], EngineSettings())
    assert f.totals == {}
    assert f.thrash_state is None
    assert f.recommended_max_num_seqs is None


def test_a_counter_new_in_the_window_counts_from_its_first_sighting() -> None:
    first = point(0.0, {"generation_tokens": 10})
    last = point(5.0, {"generation_tokens": 20, "recomputed_measured": 7})
    f = derive_model([first, last], EngineSettings())
    assert f.tax == MethodValue("measured", 0.0)


# -- request length quantiles and the recommendation on a window -------------------------------


def _h(buckets: Sequence[tuple[float, float]], total: float) -> Histogram:
    return Histogram(tuple(buckets), total, buckets[-1][1])


def test_length_quantiles_and_over_admission_on_a_window() -> None:
    info = {"kv_cache_size_tokens": "2048"}
    prompt0 = _h([(50.0, 0.0), (100.0, 0.0), (INF, 0.0)], 0.0)
    gen0 = _h([(500.0, 0.0), (1000.0, 0.0), (INF, 0.0)], 0.0)
    # 10 prompts all in (0, 50]; 10 generations all in (0, 500].
    prompt1 = _h([(50.0, 10.0), (100.0, 10.0), (INF, 10.0)], 410.0)
    gen1 = _h([(500.0, 10.0), (1000.0, 10.0), (INF, 10.0)], 5000.0)
    points = [
        point(
            0.0, histograms={"request_prompt_tokens": prompt0, "request_generation_tokens": gen0}
        ),
        point(
            5.0,
            histograms={"request_prompt_tokens": prompt1, "request_generation_tokens": gen1},
            info=info,
        ),
    ]
    f = derive_model(points, EngineSettings(configured_max_num_seqs=64))
    assert f.length_p50 == pytest.approx(25 + 250)
    assert f.length_p95 == pytest.approx(47.5 + 475)
    assert f.kv_capacity_tokens == 2048
    assert f.recommended_max_num_seqs == 3  # floor(1843.2 / 522.5)
    assert f.over_admission_ratio == pytest.approx(64 / 3)
    assert derive_model(points, EngineSettings()).over_admission_ratio is None


def test_a_quiet_window_falls_back_to_lifetime_histograms() -> None:
    prompt = _h([(50.0, 10.0), (INF, 10.0)], 410.0)
    gen = _h([(500.0, 10.0), (INF, 10.0)], 5000.0)
    hists = {"request_prompt_tokens": prompt, "request_generation_tokens": gen}
    f = derive_model([point(0.0, histograms=hists), point(5.0, histograms=hists)], EngineSettings())
    assert f.length_p50 == pytest.approx(25 + 250)


def test_no_recommendation_without_capacity_or_lengths() -> None:
    prompt = _h([(50.0, 10.0), (INF, 10.0)], 410.0)
    only_prompt = point(0.0, histograms={"request_prompt_tokens": prompt})
    f = derive_model([only_prompt], EngineSettings(configured_max_num_seqs=8))
    assert f.length_p95 is None
    assert f.recommended_max_num_seqs is None
    assert f.over_admission_ratio is None


# -- histogram quantiles: Prometheus' histogram_quantile semantics ------------------------------


@pytest.mark.parametrize(
    ("q", "expected"),
    [
        (0.5, 2.0),  # rank 20 lands exactly on the top of (1, 2]
        (0.25, 1.0),  # rank 10 on the top of the first bucket
        (0.1, 0.4),  # the first bucket interpolates from 0
        (0.625, 3.0),  # rank 25 in (2, 4]: 2 + 2 * (25 - 20) / 10
        (0.9, 4.0),  # rank 36 in +Inf: the highest finite bound
    ],
)
def test_histogram_quantile_matches_prometheus(q: float, expected: float) -> None:
    h = Histogram(((1.0, 10.0), (2.0, 20.0), (4.0, 30.0), (INF, 40.0)), 100.0, 40.0)
    assert h.quantile(q) == pytest.approx(expected)


def test_histogram_quantile_skips_empty_buckets_like_prometheus() -> None:
    h = Histogram(((1.0, 0.0), (2.0, 0.0), (5.0, 4.0), (INF, 4.0)), 14.0, 4.0)
    assert h.quantile(0.5) == pytest.approx(2.0 + 3.0 * 2.0 / 4.0)
    assert h.quantile(1.0) == 5.0


def test_histogram_quantile_without_observations_is_none() -> None:
    assert Histogram(((1.0, 0.0), (INF, 0.0)), 0.0, 0.0).quantile(0.5) is None
    assert Histogram((), 0.0, 0.0).quantile(0.5) is None


def test_histogram_minus_and_reset() -> None:
    before = Histogram(((1.0, 2.0), (INF, 4.0)), 10.0, 4.0)
    after = Histogram(((1.0, 5.0), (INF, 9.0)), 25.0, 9.0)
    assert after.minus(before) == Histogram(((1.0, 3.0), (INF, 5.0)), 15.0, 5.0)
    assert before.minus(after) == before  # a restart: the newer histogram is the increase


# -- thrash state on constructed windows --------------------------------------------------------


def window(
    usages: Sequence[float],
    preemptions: Sequence[float],
    waiting: Sequence[float] | None = None,
    generated: Sequence[float] | None = None,
    running: Sequence[float] | None = None,
) -> list[Point]:
    n = len(usages)
    waiting = waiting or [0.0] * n
    generated = generated or [100.0 * i for i in range(n)]
    running = running or [4.0] * n
    return [
        point(
            5.0 * i,
            {"preemptions": preemptions[i], "generation_tokens": generated[i]},
            {"kv_usage": usages[i], "requests_waiting": waiting[i], "requests_running": running[i]},
        )
        for i in range(n)
    ]


def test_thrash_ok() -> None:
    pts = window([0.2, 0.4, 0.5], [3.0, 3.0, 3.0])
    assert thrash_state(pts, EngineSettings()) is ThrashState.OK


def test_thrash_at_risk_from_preemptions_alone() -> None:
    pts = window([0.5, 0.6, 0.7], [3.0, 4.0, 6.0])
    assert thrash_state(pts, EngineSettings()) is ThrashState.AT_RISK


def test_thrash_at_risk_from_high_usage_alone() -> None:
    pts = window([0.86, 0.88, 0.87], [3.0, 3.0, 3.0], waiting=[2.0, 2.0, 2.0])
    assert thrash_state(pts, EngineSettings()) is ThrashState.AT_RISK


def test_thrashing_when_full_preempting_and_waiting() -> None:
    pts = window([0.8, 0.97, 1.0], [3.0, 9.0, 20.0], waiting=[0.0, 5.0, 12.0])
    assert thrash_state(pts, EngineSettings()) is ThrashState.THRASHING


def test_thrashing_when_throughput_falls_as_demand_rises() -> None:
    # Nobody waits, but the second half generates slower while more requests run.
    pts = window(
        [0.95] * 6,
        [0.0, 2.0, 4.0, 6.0, 8.0, 10.0],
        generated=[0.0, 1000.0, 2000.0, 3000.0, 3300.0, 3600.0],
        running=[4.0, 4.0, 4.0, 8.0, 12.0, 16.0],
    )
    assert thrash_state(pts, EngineSettings()) is ThrashState.THRASHING
    # The same window with steady throughput is only at risk.
    steady = window(
        [0.95] * 6, [0.0, 2.0, 4.0, 6.0, 8.0, 10.0], running=[4.0, 4.0, 4.0, 8.0, 12.0, 16.0]
    )
    assert thrash_state(steady, EngineSettings()) is ThrashState.AT_RISK


def test_thrash_unknown_without_usage_or_preemption_data() -> None:
    no_usage = [point(0.0, {"preemptions": 1.0}), point(5.0, {"preemptions": 5.0})]
    assert thrash_state(no_usage, EngineSettings()) is None
    no_preemptions = [point(0.0, gauges={"kv_usage": 1.0})]
    assert thrash_state(no_preemptions, EngineSettings()) is None


def test_thrash_thresholds_come_from_settings() -> None:
    pts = window([0.75, 0.8, 0.8], [1.0, 3.0, 5.0], waiting=[1.0, 1.0, 1.0])
    assert thrash_state(pts, EngineSettings()) is ThrashState.AT_RISK
    assert thrash_state(pts, EngineSettings(near_full=0.8)) is ThrashState.THRASHING


# -- on fixtures -------------------------------------------------------------------------------


def test_real_overload_window_is_thrashing_with_capacity_from_the_pool() -> None:
    h = Window(window_seconds=300)
    h.observe(normalize(read_fixture("0.32-idle.prom"), timestamp=0.0))
    h.observe(normalize(read_fixture("0.32-preempting.prom"), timestamp=5.0))
    f = derive_model(h.points("tiny-llama"), EngineSettings(configured_max_num_seqs=64))
    assert f.kv_capacity_tokens == 2048
    assert f.thrash_state is ThrashState.THRASHING
    assert f.recommended_max_num_seqs is not None
    assert f.recommended_max_num_seqs < 64
    assert f.over_admission_ratio is not None
    assert f.over_admission_ratio > 1
    assert f.tax is not None
    assert f.tax.method == "estimated"
    assert 0 < f.tax.value < 1


def test_v0_window_takes_the_measured_tax() -> None:
    h = Window(window_seconds=300)
    h.observe(normalize(read_fixture("0.6.6.prom"), timestamp=0.0))
    h.observe(normalize(read_fixture("0.6.6-later.prom"), timestamp=10.0))
    f = derive_model(h.points("mistralai/Mistral-7B-Instruct-v0.3"), EngineSettings())
    first, last = h.points("mistralai/Mistral-7B-Instruct-v0.3")
    g = last.counters["generation_tokens"] - first.counters["generation_tokens"]
    assert f.tax == approx_method("measured", 2_600 / (6_400 + g + 2_600))
    assert f.kv_capacity_tokens == 2127 * 16
    assert f.thrash_state is ThrashState.THRASHING


# -- the delivery side: goodput, coverage, undelivered, waste -------------------------------------


def _joined(
    t: float,
    engine: Mapping[str, float],
    ledger: LedgerTotals,
    served: float | None,
    joined: float,
) -> Point:
    return Point(t, dict(engine), ledger=ledger, served_requests=served, joined_requests=joined)


def _engine(g: float, pc: float, est: float, stall: float | None = None) -> dict[str, float]:
    totals = {"generation_tokens": g, "prompt_computed": pc, "recomputed_estimated": est}
    if stall is not None:
        totals["recomputed_stall_estimated"] = stall
    return totals


def test_goodput_coverage_and_waste_over_a_window() -> None:
    first = _joined(0.0, _engine(1000, 500, 100, 0), LedgerTotals(), 50, 0)
    ledger = LedgerTotals(delivered=800, joined_requests=10, slo_met_tokens=400)
    last = _joined(10.0, _engine(2000, 700, 300, 600), ledger, 60, 10)
    f = derive_model([first, last], EngineSettings())
    assert f.goodput == pytest.approx(80)
    assert f.slo_goodput_tokens == pytest.approx(40)
    assert f.coverage == pytest.approx(1.0)
    assert f.served_requests_total == 60
    # Full coverage: U = G - D = 200; the estimate is the best method (R = 200).
    assert f.tax == approx_method("estimated", 200 / (200 + 1000 + 200))
    assert f.waste == approx_method("estimated", (200 + 200) / (200 + 1000 + 200))


def test_the_stall_estimate_is_the_tax_only_when_nothing_better_exists() -> None:
    first = _joined(
        0.0, {"generation_tokens": 0, "recomputed_stall_estimated": 0}, LedgerTotals(), 0, 0
    )
    last = _joined(
        5.0, {"generation_tokens": 100, "recomputed_stall_estimated": 50}, LedgerTotals(), 0, 0
    )
    f = derive_model([first, last], EngineSettings())
    assert f.tax == approx_method("stall_estimated", 50 / 150)


def test_coverage_below_one_leaves_undelivered_to_the_ledger() -> None:
    first = _joined(0.0, _engine(0, 0, 0), LedgerTotals(), 0, 0)
    ledger = LedgerTotals(delivered=50, undelivered=5, joined_requests=2)
    last = _joined(5.0, _engine(200, 10, 0), ledger, 4, 2)
    f = derive_model([first, last], EngineSettings())
    assert f.coverage == pytest.approx(0.5)
    # Partial join: U is the ledger's own 5, not G - D = 150.
    assert f.waste == approx_method("estimated", 5 / 210)


def test_no_served_requests_in_the_window_means_no_coverage() -> None:
    first = _joined(0.0, _engine(0, 0, 0), LedgerTotals(), 7, 0)
    last = _joined(5.0, _engine(10, 0, 0), LedgerTotals(joined_requests=1), 7, 1)
    assert derive_model([first, last], EngineSettings()).coverage is None


def test_a_timing_skew_never_makes_coverage_exceed_one() -> None:
    first = _joined(0.0, _engine(0, 0, 0), LedgerTotals(), 0, 0)
    last = _joined(5.0, _engine(10, 0, 0), LedgerTotals(joined_requests=3), 2, 3)
    assert derive_model([first, last], EngineSettings()).coverage == 1.0


def test_waste_ratio_edge_cases() -> None:
    assert waste_ratio(0, 0, 0, 0) == 0.0
    assert waste_ratio(10, 20, 30, 40) == pytest.approx(30 / 80)
