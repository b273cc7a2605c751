"""The window: reset-corrected totals per model, the three recompute totals, points, trimming."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from kvtax.delivery.ledger import LedgerTotals
from kvtax.engine.normalize import normalize
from kvtax.engine.snapshot import Histogram, ModelMetrics, VllmSnapshot
from kvtax.figures.recompute import computed_prompt_raw, mean_context
from kvtax.figures.window import WINDOW_HISTOGRAMS, Point, Window
from tests.unit.conftest import read_fixture

V0_MODEL = "mistralai/Mistral-7B-Instruct-v0.3"


def hist(mean: float, count: float = 10.0) -> Histogram:
    return Histogram(((float("inf"), count),), mean * count, count)


def snap(
    t: float,
    values: Mapping[str, float],
    *,
    histograms: Mapping[str, Histogram] | None = None,
    marks: frozenset[str] = frozenset(),
    model: str = "m",
) -> VllmSnapshot:
    return VllmSnapshot(
        t, {model: ModelMetrics(dict(values), {}, dict(histograms or {}), {})}, marks
    )


def latest(h: Window, model: str = "m") -> Point:
    return h.points(model)[-1]


def increase(h: Window, key: str, model: str = "m") -> float:
    points = h.points(model)
    return points[-1].counters[key] - points[0].counters[key]


def test_v0_recompute_is_the_prompt_counter_excess_over_the_request_histogram() -> None:
    h = Window(window_seconds=300)
    h.observe(normalize(read_fixture("0.6.6.prom"), timestamp=0.0))
    h.observe(normalize(read_fixture("0.6.6-later.prom"), timestamp=10.0))
    assert increase(h, "prompt_tokens", V0_MODEL) == 9_000
    assert increase(h, "prompt_computed", V0_MODEL) == 6_400
    assert increase(h, "recomputed_measured", V0_MODEL) == 2_600
    assert increase(h, "preemptions", V0_MODEL) == 8


def test_v1_has_no_measured_recompute_without_the_plugin() -> None:
    h = Window(window_seconds=300)
    h.observe(normalize(read_fixture("0.32-idle.prom"), timestamp=0.0))
    h.observe(normalize(read_fixture("0.32-preempting.prom"), timestamp=5.0))
    last = latest(h, "tiny-llama")
    assert "recomputed_measured" not in last.counters
    assert "recomputed_estimated" in last.counters


def test_plugin_counter_feeds_measured_recompute() -> None:
    h = Window(window_seconds=300)
    h.observe(snap(0.0, {"recomputed_tokens": 100.0}))
    h.observe(snap(5.0, {"recomputed_tokens": 350.0}))
    assert increase(h, "recomputed_measured") == 250


def test_a_restart_between_real_captures_never_makes_a_total_fall() -> None:
    after = normalize(read_fixture("0.32-after-overload.prom"), timestamp=0.0)
    idle = normalize(read_fixture("0.32-idle.prom"), timestamp=5.0)
    h = Window(window_seconds=300)
    h.observe(after)
    h.observe(idle)
    assert h.restarts == 1
    first, last = h.points("tiny-llama")
    for key, total in first.counters.items():
        assert last.counters[key] >= total, key
    # The restarted counter's raw value is the whole increase, like increase().
    raw_after = after.models["tiny-llama"].values["generation_tokens"]
    raw_idle = idle.models["tiny-llama"].values["generation_tokens"]
    assert raw_idle < raw_after
    assert last.counters["generation_tokens"] == raw_after + raw_idle


def test_first_scrape_after_a_restart_counts_the_new_raw_value() -> None:
    h = Window(window_seconds=300)
    h.observe(snap(0.0, {"generation_tokens": 1_000.0, "preemptions": 40.0}))
    h.observe(snap(5.0, {"generation_tokens": 30.0, "preemptions": 2.0}))
    h.observe(snap(10.0, {"generation_tokens": 90.0, "preemptions": 2.0}))
    totals = [p.counters["generation_tokens"] for p in h.points("m")]
    assert totals == [1_000.0, 1_030.0, 1_090.0]
    assert [p.counters["preemptions"] for p in h.points("m")] == [40.0, 42.0, 42.0]
    # Two counters dropped at t=5: one restart, not two.
    assert h.restarts == 1


def test_restarts_count_once_per_scrape_that_saw_one() -> None:
    h = Window(window_seconds=300)
    for t, raw in enumerate((500.0, 10.0, 20.0, 3.0)):
        h.observe(snap(float(t), {"generation_tokens": raw}))
    assert h.restarts == 2


def test_estimated_recompute_is_preemptions_times_mean_context() -> None:
    # L-hat = mean prompt + half the mean generation = 100 + 200 / 2.
    hists = {"request_prompt_tokens": hist(100.0), "request_generation_tokens": hist(200.0)}
    h = Window(window_seconds=300)
    h.observe(snap(0.0, {"preemptions": 10.0}, histograms=hists))
    h.observe(snap(5.0, {"preemptions": 14.0}, histograms=hists))
    totals = [p.counters["recomputed_estimated"] for p in h.points("m")]
    assert totals == [10 * 200.0, 14 * 200.0]


def test_preemptions_seen_before_any_request_histogram_are_estimated_later() -> None:
    hists = {"request_prompt_tokens": hist(50.0), "request_generation_tokens": hist(100.0)}
    h = Window(window_seconds=300)
    h.observe(snap(0.0, {"preemptions": 3.0}))
    h.observe(snap(5.0, {"preemptions": 5.0}))
    assert h.points("m")[-1].counters["recomputed_estimated"] == 0.0
    h.observe(snap(10.0, {"preemptions": 6.0}, histograms=hists))
    assert h.points("m")[-1].counters["recomputed_estimated"] == 6 * 100.0


def test_window_keeps_one_point_at_or_before_its_start() -> None:
    h = Window(window_seconds=10)
    for t in range(0, 25, 5):
        h.observe(snap(float(t), {"generation_tokens": float(t)}))
    times = [p.t for p in h.points("m")]
    assert times == [10.0, 15.0, 20.0]


def test_points_are_bounded_by_max_points() -> None:
    h = Window(window_seconds=10_000, max_points=3)
    for t in range(6):
        h.observe(snap(float(t), {"generation_tokens": float(t)}))
    assert [p.t for p in h.points("m")] == [3.0, 4.0, 5.0]


def test_models_are_kept_apart() -> None:
    h = Window(window_seconds=300)
    both = VllmSnapshot(
        0.0,
        {
            "a": ModelMetrics({"generation_tokens": 10.0, "kv_usage": 0.5}),
            "b": ModelMetrics({"generation_tokens": 99.0}),
        },
    )
    h.observe(both)
    assert h.models() == ["a", "b"]
    a, b = latest(h, "a"), latest(h, "b")
    assert a.counters["generation_tokens"] == 10.0
    assert a.gauges == {"kv_usage": 0.5}
    assert b.gauges == {}
    assert h.points("nope") == ()


def test_computed_prompt_prefers_the_most_exact_source() -> None:
    pk = {"prefill_kv_computed": Histogram(((float("inf"), 2.0),), 70.0, 2.0)}
    rp = {"request_prompt_tokens": Histogram(((float("inf"), 2.0),), 80.0, 2.0)}
    values = {
        "prompt_tokens_local_compute": 60.0,
        "prompt_tokens": 100.0,
        "prefix_cache_hits": 30.0,
    }
    assert computed_prompt_raw(ModelMetrics(values, {}, {**pk, **rp}), v0=False) == 60.0
    no_source = {k: v for k, v in values.items() if k != "prompt_tokens_local_compute"}
    assert computed_prompt_raw(ModelMetrics(no_source, {}, {**pk, **rp}), v0=False) == 70.0
    assert computed_prompt_raw(ModelMetrics(no_source, {}, rp), v0=True) == 80.0
    # V1 without newer sources: prompt tokens minus prefix-cache hits.
    assert computed_prompt_raw(ModelMetrics(no_source, {}, rp), v0=False) == 70.0
    assert computed_prompt_raw(ModelMetrics({"prompt_tokens": 100.0}), v0=False) == 100.0
    assert computed_prompt_raw(ModelMetrics({}), v0=False) is None


def test_mean_context_counts_the_prompt_tokens_computed_where_vllm_says() -> None:
    # 0.13+: of a 512-token prompt the first prefill computed 128 (384 were a shared prefix,
    # still cached when a victim resumes), so L-hat is 128 + 300 / 2, not 512 + 150.
    both = {
        "request_prompt_tokens": hist(512.0),
        "request_generation_tokens": hist(300.0),
        "prefill_kv_computed": hist(128.0),
    }
    assert mean_context(both) == pytest.approx(128 + 150)
    # Before 0.13, the whole prompt.
    del both["prefill_kv_computed"]
    assert mean_context(both) == pytest.approx(512 + 150)


def test_mean_context_needs_both_histograms() -> None:
    both = {"request_prompt_tokens": hist(41.0), "request_generation_tokens": hist(500.0)}
    assert mean_context(both) == pytest.approx(41 + 250)
    assert mean_context({"request_prompt_tokens": hist(41.0)}) is None
    empty = Histogram(((float("inf"), 0.0),), 0.0, 0.0)
    assert mean_context({**both, "request_generation_tokens": empty}) is None


def test_points_keep_only_what_derive_reads_and_share_what_did_not_change() -> None:
    # Points live for a whole window per model; see bench/README.md for the memory this saves.
    h = Window(window_seconds=300)
    h.observe(normalize(read_fixture("0.32-idle.prom"), timestamp=0.0))
    h.observe(normalize(read_fixture("0.32-preempting.prom"), timestamp=5.0))
    h.observe(normalize(read_fixture("0.32-preempting.prom"), timestamp=10.0))
    idle, busy, same = h.points("tiny-llama")
    assert set(busy.histograms) == set(WINDOW_HISTOGRAMS)
    assert "ttft" not in busy.histograms
    assert same.histograms["request_prompt_tokens"] is busy.histograms["request_prompt_tokens"]
    assert busy.histograms["request_prompt_tokens"] != idle.histograms["request_prompt_tokens"]
    assert same.info is busy.info
    assert busy.info["kv_cache_size_tokens"] == "2048"


# -- the ledger side of each point, and the stall estimate --------------------------------------


def test_each_point_pairs_the_engine_with_the_ledger_at_the_same_scrape() -> None:
    h = Window(window_seconds=300)
    h.observe(snap(0.0, {"generation_tokens": 10.0}), {"m": LedgerTotals(delivered=3.0)})
    h.observe(snap(5.0, {"generation_tokens": 40.0}), {"m": LedgerTotals(delivered=30.0)})
    assert [(p.counters["generation_tokens"], p.ledger.delivered) for p in h.points("m")] == [
        (10.0, 3.0),
        (40.0, 30.0),
    ]


def test_requests_the_ledger_could_not_attribute_still_count_as_joined() -> None:
    h = Window(window_seconds=300)
    ledger = {"m": LedgerTotals(joined_requests=2.0), "other": LedgerTotals(joined_requests=5.0)}
    h.observe(snap(0.0, {"generation_tokens": 1.0}), ledger)
    assert latest(h).joined_requests == 7.0
    assert h.models() == ["m"]  # "other" is no model


def test_the_stall_estimate_counts_new_preemptions_times_the_mean_stall_context() -> None:
    h = Window(window_seconds=300)
    # Preemptions before kvtax's ledger saw anything are not attributable to its stalls.
    h.observe(snap(0.0, {"preemptions": 10.0}), {"m": LedgerTotals()})
    assert latest(h).counters["recomputed_stall_estimated"] == 0.0
    # 4 new preemptions; no stall yet: they wait.
    h.observe(snap(5.0, {"preemptions": 14.0}), {"m": LedgerTotals()})
    assert latest(h).counters["recomputed_stall_estimated"] == 0.0
    # Two stalls of 300 context tokens in all: 4 x 150.
    stalls = LedgerTotals(stalls=2.0, stall_context=300.0)
    h.observe(snap(10.0, {"preemptions": 14.0}), {"m": stalls})
    assert latest(h).counters["recomputed_stall_estimated"] == 600.0


def test_no_preemption_counter_means_no_estimate_of_either_kind() -> None:
    h = Window(window_seconds=300)
    h.observe(snap(0.0, {"generation_tokens": 1.0}), {"m": LedgerTotals(stalls=1.0)})
    assert not {"recomputed_estimated", "recomputed_stall_estimated"} & set(latest(h).counters)


def test_served_requests_are_reset_corrected_like_every_total() -> None:
    def served(t: float, n: float) -> VllmSnapshot:
        split = {"http_requests": {"/v1/completions": n, "/metrics": 99.0}}
        return VllmSnapshot(t, {"m": ModelMetrics({"generation_tokens": 1.0}, split)})

    h = Window(window_seconds=300)
    for t, n in ((0.0, 100.0), (5.0, 3.0), (10.0, 7.0)):
        h.observe(served(t, n))
    assert [p.served_requests for p in h.points("m")] == [100.0, 103.0, 107.0]
