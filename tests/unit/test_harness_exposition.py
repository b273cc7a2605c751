"""The harness's one /metrics reader (kvtax_dev.exposition): a hand-written page, a capture."""

from __future__ import annotations

from kvtax_dev.exposition import labels_of, read_samples, read_series, series_key, total
from tests.unit.conftest import read_fixture

PAGE = """\
# HELP demo_requests_total Requests.
# TYPE demo_requests_total counter
demo_requests_total{engine="0",outcome="ok"} 3
demo_requests_total{engine="1",outcome="ok"} 4
demo_requests_total{engine="1",outcome="error"} 1
# HELP demo_latency_seconds Latency.
# TYPE demo_latency_seconds histogram
demo_latency_seconds_bucket{le="0.5"} 2
demo_latency_seconds_bucket{le="+Inf"} 5
demo_latency_seconds_count 5
demo_latency_seconds_sum 3.25
# HELP demo_up Up.
# TYPE demo_up gauge
demo_up 1
"""


def test_samples_are_grouped_by_sample_name_and_exact_label_set() -> None:
    page = read_samples(PAGE)
    assert page["demo_requests_total"][frozenset({("engine", "1"), ("outcome", "error")})] == 1
    assert page["demo_latency_seconds_bucket"][frozenset({("le", "+Inf")})] == 5
    assert page["demo_latency_seconds_sum"] == {frozenset(): 3.25}
    assert page["demo_up"] == {frozenset(): 1.0}


def test_total_sums_every_label_set_and_is_zero_when_absent() -> None:
    page = read_samples(PAGE)
    assert total(page, "demo_requests_total") == 8
    assert total(page, "demo_missing_total") == 0


def test_series_keys_sort_labels_so_a_key_can_be_written_by_hand() -> None:
    series = read_series(PAGE)
    assert series['demo_requests_total{engine="1",outcome="error"}'] == 1
    assert series[series_key("demo_requests_total", {"outcome": "ok", "engine": "0"})] == 3
    assert series["demo_up"] == 1
    assert len(series) == 8


def test_a_real_capture_reads_its_counters_and_info_labels() -> None:
    page = read_samples(read_fixture("0.32-preempting.prom"))
    assert total(page, "vllm:num_preemptions_total") == 30
    [info] = labels_of(page, "vllm:cache_config_info")
    assert (info["block_size"], info["num_gpu_blocks"]) == ("128", "16")
