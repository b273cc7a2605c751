"""normalize() on every fixture: concepts present where the version has them, absent otherwise."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from kvtax.engine.normalize import ParseError, normalize, prefix_cache_counts_blocks
from kvtax.engine.snapshot import ModelMetrics
from tests.unit.conftest import read_fixture

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm"
V0_MODEL = "mistralai/Mistral-7B-Instruct-v0.3"
V08_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
V010_MODEL = "Qwen/Qwen2.5-7B-Instruct"

# Concepts every version since 0.6 exposes.
COMMON = {
    "kv_usage",
    "requests_running",
    "requests_waiting",
    "preemptions",
    "prompt_tokens",
    "generation_tokens",
    "request_success",
    "http_requests",
    "ttft",
    "itl",
    "e2e_latency",
    "request_prompt_tokens",
    "request_generation_tokens",
    "cache_config",
}
V0_ONLY = {
    "requests_swapped",
    "prefix_cache_hit_rate",
    "v0_prompt_throughput",
    "v0_generation_throughput",
}
NEWER_THAN_0_10 = {
    "prompt_tokens_local_compute",  # 0.16
    "prefill_kv_computed",  # 0.13
    "request_tpot",  # 0.11
    "request_preemptions",  # 0.30
    "requests_waiting_by_reason",  # 0.20
    "admission_rejections",  # 0.32
}
PLUGIN = {
    "recomputed_tokens",
    "preempted_queried_tokens",
    "preempted_hit_tokens",
    "preempted_connector_hit_tokens",
    "preempted_resumes",
}
PREFIX_COUNTERS = {"prefix_cache_queries", "prefix_cache_hits"}

CASES = [
    ("0.6.6.prom", V0_MODEL, COMMON | V0_ONLY, PREFIX_COUNTERS | NEWER_THAN_0_10 | PLUGIN),
    ("0.6.6-later.prom", V0_MODEL, COMMON | V0_ONLY, PREFIX_COUNTERS | NEWER_THAN_0_10 | PLUGIN),
    ("0.8.2.prom", V08_MODEL, COMMON | PREFIX_COUNTERS, V0_ONLY | NEWER_THAN_0_10 | PLUGIN),
    ("0.8.5.prom", V08_MODEL, COMMON | PREFIX_COUNTERS, V0_ONLY | NEWER_THAN_0_10 | PLUGIN),
    ("0.10.1.prom", V010_MODEL, COMMON | PREFIX_COUNTERS, V0_ONLY | NEWER_THAN_0_10 | PLUGIN),
    (
        "0.32-preempting.prom",
        "tiny-llama",
        COMMON | PREFIX_COUNTERS | NEWER_THAN_0_10,
        V0_ONLY | PLUGIN,
    ),
    (
        "0.33-definitions.prom",
        "tiny-llama",
        COMMON | PREFIX_COUNTERS | NEWER_THAN_0_10,
        V0_ONLY | PLUGIN,
    ),
]


def _has(m: ModelMetrics, concept: str) -> bool:
    """The concept is in one of the snapshot's mappings (cache_config: its info labels)."""
    in_info = concept == "cache_config" and bool(m.info)
    return concept in m.values or concept in m.split or concept in m.histograms or in_info


def _model(name: str, model: str, version: str | None = None) -> ModelMetrics:
    snap = normalize(read_fixture(name), timestamp=0.0, version=version)
    assert list(snap.models) == [model]
    return snap.models[model]


@pytest.mark.parametrize(("fixture", "model", "present", "absent"), CASES)
def test_each_version_has_its_concepts_and_lacks_the_others(
    fixture: str, model: str, present: set[str], absent: set[str]
) -> None:
    m = _model(fixture, model)
    assert {c for c in present if not _has(m, c)} == set()
    assert {c for c in absent if _has(m, c)} == set()
    # Absent means absent from every mapping, not a zero somewhere.
    for concept in absent:
        assert concept not in m.values
        assert concept not in m.split
        assert concept not in m.histograms


def test_fingerprints_date_each_scrape() -> None:
    marks = {
        name: normalize(read_fixture(name), timestamp=0.0).marks
        for name in ("0.6.6.prom", "0.8.2.prom", "0.8.5.prom", "0.10.1.prom", "0.32-idle.prom")
    }
    assert marks["0.6.6.prom"] == {"v0"}
    assert marks["0.8.2.prom"] == frozenset()
    assert marks["0.8.5.prom"] == {"engine_label"}
    assert marks["0.10.1.prom"] == {"engine_label", "0.9.2+"}
    assert {"engine_label", "0.9.2+", "0.16+", "0.30+"} <= marks["0.32-idle.prom"]
    assert "v0" not in marks["0.32-idle.prom"]


def test_v0_values_and_names() -> None:
    snap = normalize(read_fixture("0.6.6.prom"), timestamp=12.0)
    assert snap.is_v0
    assert snap.timestamp == 12.0
    m = snap.models[V0_MODEL]
    assert m.values["kv_usage"] == pytest.approx(0.9034)
    assert m.values["prompt_tokens"] == 52_939
    assert m.values["preemptions"] == 37
    assert m.values["v0_generation_throughput"] == pytest.approx(702.4)
    assert m.histograms["request_prompt_tokens"].sum == 48_459
    assert snap.names["kv_usage"] == "vllm:gpu_cache_usage_perc"
    assert snap.names["itl"] == "vllm:time_per_output_token_seconds"
    assert m.info["block_size"] == "16"
    assert m.info["num_gpu_blocks"] == "2127"


def test_series_without_model_name_are_ignored() -> None:
    # The V0 fixture carries vllm:num_requests_waiting{server=...} 41 beside the model's 2.
    assert _model("0.6.6.prom", V0_MODEL).values["requests_waiting"] == 2
    # 0.10.1 carries vllm:num_requests_running{server=...} 99 beside the engines' 17 + 26.
    assert _model("0.10.1.prom", V010_MODEL).values["requests_running"] == 43


def test_a_scrape_with_only_router_series_has_no_models() -> None:
    text = (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{server="http://10.0.0.1:8000"} 3\n'
    )
    assert normalize(text, timestamp=0.0).models == {}


def test_newest_name_wins_when_a_scrape_carries_both() -> None:
    snap = normalize(read_fixture("0.10.1.prom"), timestamp=0.0)
    assert snap.names["kv_usage"] == "vllm:kv_cache_usage_perc"
    assert snap.names["prefix_cache_queries"] == "vllm:prefix_cache_queries_total"
    assert snap.names["prefix_cache_hits"] == "vllm:prefix_cache_hits_total"


def test_newest_name_wins_even_when_the_values_differ() -> None:
    text = (
        "# TYPE vllm:gpu_cache_usage_perc gauge\n"
        'vllm:gpu_cache_usage_perc{model_name="m"} 0.25\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm:kv_cache_usage_perc{model_name="m"} 0.75\n'
        "# TYPE vllm:inter_token_latency_seconds histogram\n"
        'vllm:inter_token_latency_seconds_bucket{le="0.1",model_name="m"} 3\n'
        'vllm:inter_token_latency_seconds_bucket{le="+Inf",model_name="m"} 4\n'
        'vllm:inter_token_latency_seconds_sum{model_name="m"} 0.5\n'
        'vllm:inter_token_latency_seconds_count{model_name="m"} 4\n'
        "# TYPE vllm:time_per_output_token_seconds histogram\n"
        'vllm:time_per_output_token_seconds_bucket{le="0.1",model_name="m"} 30\n'
        'vllm:time_per_output_token_seconds_bucket{le="+Inf",model_name="m"} 40\n'
        'vllm:time_per_output_token_seconds_sum{model_name="m"} 5\n'
        'vllm:time_per_output_token_seconds_count{model_name="m"} 40\n'
    )
    m = normalize(text, timestamp=0.0).models["m"]
    assert m.values["kv_usage"] == 0.75
    assert m.histograms["itl"].count == 4
    assert m.histograms["itl"].buckets == ((0.1, 3.0), (float("inf"), 4.0))


def test_kv_usage_across_two_engines_is_the_max_and_counters_sum() -> None:
    m = _model("0.10.1.prom", V010_MODEL)
    assert m.values["kv_usage"] == pytest.approx(0.9307)  # not 0.7133 + 0.9307
    assert m.values["preemptions"] == 11 + 17
    assert m.values["requests_waiting"] == 0 + 5
    # Histograms add bucket by bucket across engines.
    prompt = m.histograms["request_prompt_tokens"]
    assert prompt.count == 220 + 260
    assert prompt.buckets[-1] == (float("inf"), prompt.count)
    # cache_config_info is one per engine with equal labels; the first is kept.
    assert m.info["num_gpu_blocks"] == "3120"
    assert "engine" not in m.info


def _strip_engine(text: str) -> str:
    return re.sub(r',?engine="\d+"', "", text).replace("{,", "{")


@pytest.mark.parametrize("fixture", ["0.8.5.prom", "0.32-preempting.prom"])
def test_engine_label_present_or_absent_gives_the_same_numbers(fixture: str) -> None:
    text = read_fixture(fixture)
    stripped = _strip_engine(text)
    assert 'engine="' not in stripped
    with_label = normalize(text, timestamp=0.0)
    without = normalize(stripped, timestamp=0.0)
    assert "engine_label" in with_label.marks
    assert "engine_label" not in without.marks
    assert with_label.models == without.models


@pytest.mark.parametrize("version", [None, "0.8.2", "0.8.5"])
def test_prefix_cache_blocks_become_tokens_in_0_8(version: str | None) -> None:
    m = _model("0.8.2.prom", V08_MODEL, version=version)
    # 6,040 query blocks and 1,510 hit blocks of 16 tokens.
    assert m.values["prefix_cache_queries"] == 6_040 * 16
    assert m.values["prefix_cache_hits"] == 1_510 * 16


def test_prefix_cache_tokens_stay_tokens_from_0_9() -> None:
    # Same names, but a /version of 0.9 or later means the counters are already in tokens.
    m = _model("0.8.2.prom", V08_MODEL, version="0.9.1")
    assert m.values["prefix_cache_queries"] == 6_040
    tokens = _model("0.10.1.prom", V010_MODEL)
    assert tokens.values["prefix_cache_queries"] == tokens.values["prompt_tokens"]


def test_blocks_heuristic_without_a_version() -> None:
    gpu_names = {"prefix_cache_queries": "vllm:gpu_prefix_cache_queries_total"}
    new_names = {"prefix_cache_queries": "vllm:prefix_cache_queries_total"}
    none: frozenset[str] = frozenset()
    assert prefix_cache_counts_blocks(None, none, gpu_names, 16_000.0, 1_000.0)
    assert not prefix_cache_counts_blocks(None, none, gpu_names, 16_000.0, 15_000.0)
    assert not prefix_cache_counts_blocks(None, frozenset({"0.9.2+"}), gpu_names, 16_000.0, 1.0)
    assert not prefix_cache_counts_blocks(None, none, new_names, 16_000.0, 1_000.0)
    assert not prefix_cache_counts_blocks(None, none, gpu_names, None, 1_000.0)
    # An unparsable version falls back to the heuristic.
    assert prefix_cache_counts_blocks("main", none, gpu_names, 16_000.0, 1_000.0)


def test_v1_0_32_capture() -> None:
    m = _model("0.32-preempting.prom", "tiny-llama")
    assert m.info["kv_cache_size_tokens"] == "2048"
    assert m.values["kv_usage"] <= 1.0
    assert m.values["preemptions"] > 0
    assert m.values["prompt_tokens_local_compute"] <= m.values["prompt_tokens"]
    assert set(m.split["request_success"]) >= {"stop", "length", "abort"}
    assert m.split["requests_waiting_by_reason"]["capacity"] == m.values["requests_waiting"]


def test_histograms_are_cumulative_and_end_at_inf() -> None:
    for fixture, model in (("0.6.6.prom", V0_MODEL), ("0.32-after-overload.prom", "tiny-llama")):
        for hist in _model(fixture, model).histograms.values():
            les = [le for le, _ in hist.buckets]
            counts = [c for _, c in hist.buckets]
            assert les == sorted(les)
            assert les[-1] == float("inf")
            assert counts == sorted(counts)
            assert counts[-1] == hist.count


@pytest.mark.parametrize(
    "body",
    [
        "<html><body>Bad gateway</body></html>\n",
        'vllm:num_requests_running{model_name="m"} not-a-number\n',
        "\x00\x01garbage {{{\n",
    ],
)
def test_garbage_raises_parse_error(body: str) -> None:
    with pytest.raises(ParseError):
        normalize(body, timestamp=0.0)


def test_empty_body_is_an_empty_snapshot() -> None:
    snap = normalize("", timestamp=3.0)
    assert snap.models == {}
    assert snap.marks == frozenset()


# -- hostile pages ---------------------------------------------------------------------------

_GEN = "# TYPE vllm:generation_tokens counter\n"


def _gen_page(*values: str, usage: str = "0.5") -> str:
    lines = [_GEN]
    lines += [
        f'vllm:generation_tokens_total{{engine="{i}",model_name="m"}} {v}\n'
        for i, v in enumerate(values)
    ]
    lines += ["# TYPE vllm:kv_cache_usage_perc gauge\n"]
    lines += [f'vllm:kv_cache_usage_perc{{model_name="m"}} {usage}\n']
    return "".join(lines)


@pytest.mark.parametrize(
    ("value", "reason"),
    [("NaN", "non_finite"), ("+Inf", "non_finite"), ("-Inf", "non_finite"), ("-5", "negative")],
)
def test_a_counter_that_is_no_number_is_left_out_and_counted(value: str, reason: str) -> None:
    snap = normalize(_gen_page(value), timestamp=0.0)
    m = snap.models["m"]
    assert "generation_tokens" not in m.values
    assert m.values["kv_usage"] == 0.5  # the rest of the page is still good
    assert snap.rejected[reason] == 1


def test_one_bad_engine_leaves_the_model_sum_out_rather_than_halving_it() -> None:
    # Summing only the good engine would look like a counter drop, i.e. a restart.
    snap = normalize(_gen_page("500", "NaN"), timestamp=0.0)
    assert "generation_tokens" not in snap.models["m"].values
    assert snap.rejected == {"non_finite": 1, "negative": 0}


@pytest.mark.parametrize("usage", ["NaN", "+Inf"])
def test_a_gauge_that_is_not_finite_is_left_out(usage: str) -> None:
    m = normalize(_gen_page("5", usage=usage), timestamp=0.0).models["m"]
    assert "kv_usage" not in m.values
    assert m.values["generation_tokens"] == 5


def test_a_nan_histogram_sum_leaves_the_histogram_out() -> None:
    text = read_fixture("0.32-preempting.prom")
    line = next(x for x in text.splitlines() if x.startswith("vllm:request_prompt_tokens_sum"))
    bad = text.replace(line, line.rsplit(" ", 1)[0] + " NaN")
    m = normalize(bad, timestamp=0.0).models["tiny-llama"]
    assert "request_prompt_tokens" not in m.histograms
    assert "request_generation_tokens" in m.histograms


def test_a_good_page_rejects_nothing() -> None:
    snap = normalize(read_fixture("0.32-preempting.prom"), timestamp=0.0)
    assert snap.rejected == {"non_finite": 0, "negative": 0}


def test_a_page_cut_mid_number_is_truncated() -> None:
    page = _gen_page("5000")
    cut = page[: page.index("5000") + 2]  # ...} 50  with no final newline
    with pytest.raises(ParseError) as caught:
        normalize(cut, timestamp=0.0)
    assert caught.value.reason == "truncated"


def test_a_page_with_more_series_than_allowed_is_refused_before_parsing() -> None:
    lines = [f'vllm:num_requests_running{{model_name="m{i}"}} 1\n' for i in range(101)]
    text = "# TYPE vllm:num_requests_running gauge\n" + "".join(lines)
    assert len(normalize(text, timestamp=0.0, max_series=101).models) == 101
    with pytest.raises(ParseError) as caught:
        normalize(text, timestamp=0.0, max_series=100)
    assert caught.value.reason == "too_many_series"


def test_parse_error_keeps_its_reason_across_processes() -> None:
    import pickle

    again = pickle.loads(pickle.dumps(ParseError("cut", "truncated")))
    assert (str(again), again.reason) == ("cut", "truncated")


def test_engines_whose_sum_overflows_leave_the_value_out() -> None:
    snap = normalize(_gen_page("1.7e308", "1.7e308"), timestamp=0.0)
    assert "generation_tokens" not in snap.models["m"].values


# -- vLLM 0.33: the wheel's definitions on a page ------------------------------------------


def _families(name: str) -> set[str]:
    return {
        line.split()[2]
        for line in read_fixture(name).splitlines()
        if line.startswith("# TYPE vllm:")
    }


def test_the_0_33_page_carries_every_family_the_wheel_defines() -> None:
    defined = {
        line.split()[0]
        for line in read_fixture("0.33-definitions.txt").splitlines()
        if line and not line.startswith("#")
    }
    on_page = _families("0.33-definitions.prom")
    assert defined <= on_page
    # ... and the families the 0.32 capture lacks are really added, with the 0.33 labels.
    added = defined - _families("0.32-preempting.prom")
    assert {
        "vllm:watermark_requests_total",
        "vllm:num_requests_kv_fetch_by_stage",
        "vllm:spec_decode_num_drafts_total",
        "vllm:lora_requests_info",
    } <= added
    page = read_fixture("0.33-definitions.prom")
    for stage in ("waiting_to_start", "in_progress", "completed_waiting"):
        assert (
            f'vllm:num_requests_kv_fetch_by_stage{{engine="0",model_name="tiny-llama",stage="{stage}"}}'
            in page
        )
    for status in ("watermarked", "skipped", "not_watermarked"):
        assert (
            f'vllm:watermark_requests_total{{engine="0",model_name="tiny-llama",status="{status}"}}'
            in page
        )


def test_the_0_33_page_reads_exactly_as_the_0_32_capture_it_extends() -> None:
    """Every family 0.33 adds to the 0.32 capture is ignored: same concepts, values, names."""
    base = normalize(read_fixture("0.32-preempting.prom"), timestamp=0.0)
    page = normalize(read_fixture("0.33-definitions.prom"), timestamp=0.0)
    assert page.models == base.models
    assert page.marks == base.marks
    assert page.names == base.names
    assert page.rejected == {"non_finite": 0, "negative": 0}
    m = page.models["tiny-llama"]
    assert m.values["preemptions"] == 30
    assert m.values["requests_waiting"] == 50
    assert m.split["requests_waiting_by_reason"] == {"capacity": 50, "deferred": 0}
    # Split concepts keep only their own label: no watermark status or KV-fetch stage leaks in.
    for split in m.split.values():
        assert not set(split) & {"watermarked", "in_progress", "waiting_to_start"}


def test_the_0_33_page_is_what_its_build_script_makes() -> None:
    """README.md's recipe is the page: rebuilding from the capture and the list changes nothing."""
    script = FIXTURES / "build_definitions_page.py"
    spec = importlib.util.spec_from_file_location("build_definitions_page", script)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.build() == read_fixture("0.33-definitions.prom")
