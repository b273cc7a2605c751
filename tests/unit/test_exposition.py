"""kvtax's own /metrics: rendered from the catalog only, promtool-clean, absent means absent."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvtax.expose.catalog import METRICS, PROCESS_METRICS
from kvtax.expose.exposition import ReportCollector, build_families
from kvtax.expose.samples import HistogramSample, Sample
from kvtax.serve.config import Config
from kvtax.serve.scrape.job import ScrapeJob
from tests.unit.conftest import one, parse_exposition, read_fixture, web_port

INF = float("inf")


def render(samples: Sequence[Sample | HistogramSample]) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ReportCollector(lambda: samples))
    return generate_latest(registry).decode()


def fed(fixtures: Sequence[str], *, max_num_seqs: int | None = None, step: float = 5.0) -> str:
    """kvtax's /metrics after ingesting the fixtures in order, ``step`` seconds apart."""
    job = ScrapeJob(Config(max_num_seqs=max_num_seqs))
    for i, name in enumerate(fixtures):
        job.ingest(read_fixture(name), 1_000.0 + step * i)
    return generate_latest(web_port(job).registry).decode()


REAL = ["0.32-idle.prom", "0.32-preempting.prom", "0.32-after-overload.prom"]


def test_unknown_metric_is_refused() -> None:
    with pytest.raises(KeyError, match="kvtax_made_up"):
        build_families([Sample("kvtax_made_up", (), 1.0)])


def test_wrong_label_count_is_refused() -> None:
    with pytest.raises(ValueError, match="kvtax_thrash_state"):
        build_families([Sample("kvtax_thrash_state", ("m", "extra"), 1.0)])


def test_families_come_out_in_catalog_order() -> None:
    families = build_families(
        [
            Sample("kvtax_thrash_state", ("m",), 2.0),
            Sample("kvtax_vllm_up", (), 1.0),
            Sample("kvtax_thrash_state", ("n",), 0.0),
        ]
    )
    order = list(METRICS)
    names = [f.name for f in families]
    assert names == ["kvtax_vllm_up", "kvtax_thrash_state"]
    assert order.index("kvtax_vllm_up") < order.index("kvtax_thrash_state")
    assert len(families[1].samples) == 2


def test_counters_histograms_and_info_render_with_their_types() -> None:
    text = render(
        [
            Sample("kvtax_build_info", ("1.2.3", "3.11.7"), 1.0),
            Sample("kvtax_scrapes_total", (), 7.0),
            HistogramSample("kvtax_client_ttft_seconds", ("m",), ((0.5, 2.0), (INF, 3.0)), 1.25),
        ]
    )
    samples = parse_exposition(text)
    assert one(samples, "kvtax_build_info", version="1.2.3", python_version="3.11.7") == 1.0
    assert one(samples, "kvtax_scrapes_total") == 7.0
    assert one(samples, "kvtax_client_ttft_seconds_bucket", model_name="m", le="0.5") == 2.0
    assert one(samples, "kvtax_client_ttft_seconds_bucket", model_name="m", le="+Inf") == 3.0
    assert one(samples, "kvtax_client_ttft_seconds_count", model_name="m") == 3.0
    assert one(samples, "kvtax_client_ttft_seconds_sum", model_name="m") == 1.25
    assert "# TYPE kvtax_scrapes_total counter" in text
    assert "# TYPE kvtax_client_ttft_seconds histogram" in text


def _promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.fail("promtool is not on PATH: install it with scripts/setup-system.sh")
    return found


def test_sidecar_output_on_real_captures_passes_promtool() -> None:
    text = fed(REAL, max_num_seqs=64)
    done = subprocess.run(
        [_promtool(), "check", "metrics"],
        input=text,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
    # The check ran on a full page, not on an empty one.
    assert "kvtax_over_admission_ratio" in text
    assert "kvtax_preemption_tax_ratio" in text


@pytest.mark.parametrize(
    "fixtures",
    [REAL, ["0.6.6.prom", "0.6.6-later.prom"], ["0.8.2.prom", "0.8.5.prom"], ["0.10.1.prom"]],
)
def test_every_emitted_name_is_in_the_catalog(fixtures: list[str]) -> None:
    text = fed(fixtures, max_num_seqs=32)
    families = list(text_string_to_metric_families(text))
    assert families
    process = {name.removesuffix("_total"): kind for name, kind, _ in PROCESS_METRICS}
    assert {f.name for f in families} >= set(process)  # the process collector is registered
    for family in families:
        if family.name in process:
            assert family.type == process[family.name]
            continue
        # The text format has no info type: an info family reads back as a gauge named *_info.
        spec = next((s for s in METRICS.values() if family.name in (s.name, s.family_name)), None)
        assert spec is not None, family.name
        assert family.type == ("gauge" if spec.type == "info" else spec.type)
        for sample in family.samples:
            assert sample.name.startswith(spec.family_name)
            assert set(sample.labels) - {"le"} == set(spec.labels)


# -- what each version yields in kvtax's output: present where computable, absent otherwise ----

ALWAYS = {
    "kvtax_engine_generation_tokens_total",
    "kvtax_engine_prompt_computed_tokens_total",
    "kvtax_engine_preemptions_total",
    "kvtax_recomputed_tokens_estimated_total",
    "kvtax_recomputed_tokens_stall_estimated_total",
    "kvtax_kv_cache_usage_ratio",
    "kvtax_requests_running",
    "kvtax_requests_waiting",
    "kvtax_kv_capacity_tokens",
    "kvtax_request_length_p50_tokens",
    "kvtax_request_length_p95_tokens",
    "kvtax_recommended_max_num_seqs",
    "kvtax_thrash_state",
}


def _methods(samples: dict[str, dict[frozenset[tuple[str, str]], float]], name: str) -> set[str]:
    return {dict(labels)["method"] for labels in samples.get(name, {})}


@pytest.mark.parametrize(
    ("fixtures", "model", "best"),
    [
        (["0.6.6.prom", "0.6.6-later.prom"], "mistralai/Mistral-7B-Instruct-v0.3", "measured"),
        (["0.8.2.prom", "0.8.5.prom"], "meta-llama/Llama-3.1-8B-Instruct", "estimated"),
        (["0.10.1.prom", "0.10.1.prom"], "Qwen/Qwen2.5-7B-Instruct", "estimated"),
        (REAL, "tiny-llama", "estimated"),
    ],
)
def test_rendered_figures_per_version(fixtures: list[str], model: str, best: str) -> None:
    samples = parse_exposition(fed(fixtures))
    for name in ALWAYS:
        assert set(samples.get(name, {})) == {frozenset({("model_name", model)})}, name
    # Only V0 (prompt-counter excess) or the plugin measure recompute; the estimate is universal.
    measured = "kvtax_recomputed_tokens_measured_total" in samples
    assert measured == (best == "measured")
    # One tax and one waste series per model, named by the best method available.
    assert _methods(samples, "kvtax_preemption_tax_ratio") == {best}
    assert _methods(samples, "kvtax_waste_ratio") == {best}
    # No window gauge that nothing reads, and no per-method sum that counts tokens twice.
    for gone in ("kvtax_recomputed_tokens_total", "kvtax_engine_generation_tokens_per_second"):
        assert gone not in samples, gone
    # No --max-num-seqs given: no over-admission ratio, and no zero standing in for it.
    assert "kvtax_over_admission_ratio" not in samples
    assert "kvtax_configured_max_num_seqs" not in samples


def test_v0_measured_tax_is_rendered_from_the_prompt_excess() -> None:
    samples = parse_exposition(fed(["0.6.6.prom", "0.6.6-later.prom"], step=10.0))
    model = "mistralai/Mistral-7B-Instruct-v0.3"
    assert one(samples, "kvtax_recomputed_tokens_measured_total", model_name=model) > 0
    tax = one(samples, "kvtax_preemption_tax_ratio", model_name=model, method="measured")
    # 2,600 tokens recomputed in the window (see test_history), of Pc 6,400 + G + R.
    assert 0 < tax < 2_600 / (6_400 + 2_600)
    assert one(samples, "kvtax_kv_capacity_tokens", model_name=model) == 2127 * 16


def test_one_scrape_renders_no_rate_and_no_tax() -> None:
    samples = parse_exposition(fed(["0.32-preempting.prom"]))
    assert "kvtax_engine_generation_tokens_total" in samples
    assert "kvtax_preemption_tax_ratio" not in samples
    assert "kvtax_waste_ratio" not in samples


def test_missing_sources_are_absent_not_zero() -> None:
    # A scrape with usage and counters but no cache_config_info and no request histograms.
    text = (
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm:kv_cache_usage_perc{model_name="m"} 0.5\n'
        "# TYPE vllm:generation_tokens_total counter\n"
        'vllm:generation_tokens_total{model_name="m"} 10\n'
    )
    job = ScrapeJob(Config(max_num_seqs=8))
    job.ingest(text, 0.0)
    job.ingest(text.replace(" 10\n", " 30\n"), 5.0)
    samples = parse_exposition(generate_latest(web_port(job).registry).decode())
    assert one(samples, "kvtax_engine_generation_tokens_total", model_name="m") == 30.0
    for name in (
        "kvtax_kv_capacity_tokens",
        "kvtax_request_length_p95_tokens",
        "kvtax_recommended_max_num_seqs",
        "kvtax_over_admission_ratio",
        "kvtax_engine_prompt_computed_tokens_total",
        "kvtax_engine_preemptions_total",
        "kvtax_thrash_state",
        "kvtax_recomputed_tokens_measured_total",
        "kvtax_recomputed_tokens_estimated_total",
        "kvtax_recomputed_tokens_stall_estimated_total",
        "kvtax_preemption_tax_ratio",
        "kvtax_requests_waiting",
    ):
        assert name not in samples, name
    assert one(samples, "kvtax_configured_max_num_seqs", model_name="m") == 8.0


def test_each_recompute_method_has_its_catalog_counter_in_the_order_rules_use() -> None:
    from kvtax.expose.catalog import METRICS
    from kvtax.expose.publish import RECOMPUTED_COUNTERS
    from kvtax.figures.recompute import METHODS
    from kvtax.mixin.rules.recording import METHOD_PREFERENCE, RECOMPUTE_COUNTERS

    # The documented order of "the tax" (docs/tax.md), the same for the gauge and the rules.
    assert tuple(method for method, _ in METHODS) == ("measured", "estimated", "stall_estimated")
    assert METHOD_PREFERENCE == ("measured", "estimated", "stall_estimated")
    assert RECOMPUTE_COUNTERS == RECOMPUTED_COUNTERS
    for method in METHOD_PREFERENCE:
        spec = METRICS[RECOMPUTED_COUNTERS[method]]
        assert spec.type == "counter"
        assert spec.labels == ("model_name",)
