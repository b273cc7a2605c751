"""The delivery ledger, stream timing, push/gateway intake and the join with the engine, on plain
values."""

from __future__ import annotations

import tracemalloc

import pytest

from kvtax.delivery.adapters import AdapterError, ServedNames, served_from_models
from kvtax.delivery.intake import PushError, gateway_totals, parse_push
from kvtax.delivery.ledger import (
    ITL_BUCKETS,
    DeliveryCounts,
    DeliveryLedger,
    HistogramAccumulator,
    LedgerTotals,
    ModelNames,
    RequestRecord,
)
from kvtax.delivery.timing import WINDOW, SloTargets, StreamTiming, meets_slo_unstreamed
from kvtax.engine.snapshot import ModelMetrics, VllmSnapshot
from kvtax.expose.publish import ledger_samples, model_samples
from kvtax.expose.samples import HistogramSample, Sample
from kvtax.figures.derive import EngineSettings, MethodValue, derive_all
from kvtax.figures.window import Window


def _ledger() -> DeliveryLedger:
    names = ModelNames()
    names.update(["m"])
    return DeliveryLedger(names)


def _values(samples: object) -> dict[tuple[str, tuple[str, ...]], float]:
    return {(s.metric, s.labels): s.value for s in samples if isinstance(s, Sample)}  # type: ignore[attr-defined]


def test_unknown_models_share_the_other_label() -> None:
    ledger = _ledger()
    for name in ("m", "x", "y", "other"):
        ledger.settle(RequestRecord(name, "completed", delivered_tokens=2))
    assert ledger.models() == ["m", "other"]
    assert ledger.totals()["other"].delivered == 6


def test_a_request_naming_no_model_counts_under_vllms_default_model() -> None:
    # Protection: vLLM serves a request without `model` with its default model, but kvtax
    # counted it as `other`, away from the engine series that did the work.
    ledger = _ledger()  # one model on vLLM's /metrics: it is the default
    ledger.settle(RequestRecord(None, "completed", delivered_tokens=2))
    assert ledger.models() == ["m"]
    names = ModelNames()
    names.update(["a", "b"])  # two models and no /v1/models yet: nothing says which
    assert names.label(None) == "other"
    names.set_served("b", {})
    assert names.label(None) == "b"


def test_served_name_aliases_count_under_the_name_vllms_metrics_use() -> None:
    # Protection: `--served-model-name llama chat` made `chat` a label of its own, with no
    # engine series to join (vLLM's metrics say model_name="llama" for both).
    names = ModelNames()
    names.learn("chat")  # vLLM answered 2xx for the alias before /v1/models was read
    names.set_served("llama", {"chat": "llama"})
    names.set_adapters({"sql-lora": "chat"})  # an adapter whose parent is an alias
    ledger = DeliveryLedger(names)
    for name in ("llama", "chat", None, "sql-lora", "nope"):
        ledger.settle(RequestRecord(name, "completed", delivered_tokens=1))
    names.learn("chat")
    assert ledger.models() == ["llama", "other"]
    assert ledger.totals()["llama"].delivered == 4
    assert ledger.adapter_counts() == {("llama", "sql-lora"): 1.0}
    assert "chat" not in names


def test_settle_counts_outcomes_tokens_slo_and_stalls() -> None:
    ledger = _ledger()
    ledger.settle(
        RequestRecord(
            "m",
            "completed",
            delivered_tokens=10,
            prompt_tokens=4,
            ttft=0.1,
            itl=HistogramAccumulator.of(ITL_BUCKETS, (0.01, 0.02)),
            stalls=((0.5, 40),),
            duration=1.0,
            slo_met=True,
        )
    )
    ledger.settle(
        RequestRecord("m", "client_disconnected", delivered_tokens=3, undelivered_tokens=2)
    )
    ledger.settle(RequestRecord("m", "too_large", forwarded=False))
    t = ledger.totals()["m"]
    assert (t.delivered, t.prompt, t.undelivered) == (13, 4, 2)
    assert (t.joined_requests, t.slo_met_requests, t.slo_met_tokens) == (2, 1, 10)
    assert (t.stalls, t.stall_context) == (1, 40)
    v = _values(ledger_samples(ledger.counts()))
    assert v[("kvtax_requests_total", ("m", "client_disconnected"))] == 1
    assert v[("kvtax_requests_total", ("m", "upstream_error"))] == 0
    itl = next(
        s
        for s in ledger_samples(ledger.counts())
        if isinstance(s, HistogramSample) and s.metric == "kvtax_client_itl_seconds"
    )
    assert itl.buckets[-1] == (float("inf"), 2.0)
    assert itl.sum == pytest.approx(0.03)


def test_other_sources_are_labelled() -> None:
    ledger = _ledger()
    ledger.add("m", DeliveryCounts(delivered_tokens=5, requests={"completed": 2}), "push")
    ledger.add("m", DeliveryCounts(delivered_tokens=7), "gateway")
    v = _values(ledger_samples(ledger.counts()))
    assert v[("kvtax_delivered_tokens_total", ("m", "push"))] == 5
    assert v[("kvtax_delivered_tokens_total", ("m", "gateway"))] == 7
    assert ledger.totals()["m"].joined_requests == 2
    with pytest.raises(ValueError, match="source"):
        ledger.add("m", DeliveryCounts(), "carrier-pigeon")


def test_stalls_are_gaps_far_above_the_running_median() -> None:
    t = StreamTiming(started=0.0, factor=5.0, floor=0.05)
    now = 0.3
    t.tokens_written(now, context=10)
    for i in range(6):
        now += 0.02
        t.tokens_written(now, context=11 + i)
    now += 0.5
    t.tokens_written(now, context=17)
    assert t.ttft == pytest.approx(0.3)
    # pytest.approx stands where the float goes (approx takes no list of tuples).
    assert t.stalls == [(pytest.approx(0.5), 17)]  # type: ignore[comparison-overlap]
    assert not t.meets(SloTargets(ttft=1.0, itl=0.2))
    assert t.meets(SloTargets(ttft=1.0, itl=0.6))


def test_a_stall_is_judged_against_the_streams_recent_pace() -> None:
    """A stream that ran at 100 ms a token, then sped up to 10 ms (vLLM's batch shrank): a
    200 ms gap is 20x its pace now, a stall, though the median of its whole life (100 ms)
    would pass it."""
    t = StreamTiming(0.0, 5.0, 0.05)
    now = 0.0
    for gap in [0.1] * 3000 + [0.01] * 1500:
        now += gap
        t.tokens_written(now, 1)
    assert t.stalls == []
    t.tokens_written(now + 0.2, 2)
    assert t.stalls == [(pytest.approx(0.2), 2)]  # type: ignore[comparison-overlap]


def test_a_long_stream_holds_no_more_than_its_window() -> None:
    """32,000 tokens: the timing holds the last WINDOW gaps and a few counts, not every gap
    (1.3 MB when it kept and sorted them all), and the ITL buckets count every one."""
    t = StreamTiming(0.0, 5.0, 0.05)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        now = 0.0
        for i in range(32_000):
            now += 0.01 + (i % 7) * 0.001
            t.tokens_written(now, i)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 100 * WINDOW  # about 64 bytes a windowed gap; 40 a gap kept before
    assert t.itl.count == 31_999
    assert t.gaps is None
    assert t.max_gap == pytest.approx(0.016)


def test_the_ledger_counts_a_streams_gaps_as_its_itl_buckets_did() -> None:
    ledger = _ledger()
    gaps = (0.004, 0.02, 0.02, 0.3, 7.0)
    ledger.settle(RequestRecord("m", "completed", itl=HistogramAccumulator.of(ITL_BUCKETS, gaps)))
    ledger.settle(RequestRecord("m", "completed", itl=HistogramAccumulator.of(ITL_BUCKETS, gaps)))
    alone = HistogramAccumulator.of(ITL_BUCKETS, gaps * 2)
    itl = ledger.counts()["m"].itl
    assert itl.buckets == alone.counts().buckets
    assert itl.sum == pytest.approx(alone.counts().sum)
    with pytest.raises(ValueError, match="bounds"):
        alone.add(HistogramAccumulator((1.0,)))


def test_early_gaps_are_never_stalls() -> None:
    t = StreamTiming(0.0, 5.0, 0.05)
    for now in (0.1, 0.11, 2.0):
        t.tokens_written(now, 1)
    assert t.stalls == []


def test_unstreamed_slo_allows_one_itl_per_further_token() -> None:
    slo = SloTargets(ttft=1.0, itl=0.1)
    assert meets_slo_unstreamed(1.9, 10, slo)
    assert not meets_slo_unstreamed(2.0, 10, slo)


def test_push_parsing_names_the_problem() -> None:
    [(model, counts)] = parse_push(
        b'{"model": "m", "delivered_tokens": 3, "requests": {"completed": 1}}'
    )
    assert (model, counts.delivered_tokens, dict(counts.requests)) == ("m", 3, {"completed": 1})
    for body, message in (
        (b"{", "not valid JSON"),
        (b"[]", "empty"),
        (b'{"model": "m"}', "delivered_tokens is required"),
        (b'{"model": "m", "delivered_tokens": -1}', "negative"),
        (b'{"model": "m", "delivered_tokens": "3"}', "must be a number"),
        (b'{"model": "", "delivered_tokens": 1}', "model"),
        (b'{"model": "m", "delivered_tokens": 1, "tokens": 2}', "unknown field 'tokens'"),
        (b'{"model": "m", "delivered_tokens": 1, "requests": {"won": 1}}', "not an outcome"),
    ):
        with pytest.raises(PushError, match=message):
            parse_push(body)


LITELLM = """# TYPE litellm_output_tokens_metric counter
litellm_output_tokens_metric_total{model="m",team="a"} 10
litellm_output_tokens_metric_total{model="m",team="b"} 5
litellm_output_tokens_metric_total{model="z"} 1
"""
ENVOY = """# TYPE gen_ai_client_token_usage histogram
gen_ai_client_token_usage_bucket{gen_ai_request_model="m",gen_ai_token_type="output",le="+Inf"} 3
gen_ai_client_token_usage_sum{gen_ai_request_model="m",gen_ai_token_type="output"} 42
gen_ai_client_token_usage_count{gen_ai_request_model="m",gen_ai_token_type="output"} 3
gen_ai_client_token_usage_sum{gen_ai_request_model="m",gen_ai_token_type="input"} 99
"""


def test_gateway_counters_litellm_and_envoy() -> None:
    assert gateway_totals(LITELLM, "litellm_output_tokens_metric_total", "model") == {
        "m": 15,
        "z": 1,
    }
    envoy = gateway_totals(
        ENVOY,
        "gen_ai_client_token_usage",
        "gen_ai_request_model",
        (("gen_ai_token_type", "output"),),
    )
    assert envoy == {"m": 42}


def _scrape(t: float, g: float, pc: float, pre: float, served: float) -> VllmSnapshot:
    values = {"generation_tokens": g, "prompt_tokens": pc, "preemptions": pre}
    split = {"http_requests": {"/v1/completions": served}}
    return VllmSnapshot(t, {"m": ModelMetrics(values, split)})


def test_the_join_pairs_engine_and_ledger_in_one_window() -> None:
    window = Window(window_seconds=100)
    window.observe(_scrape(0.0, 1000, 500, 10, 50), {"m": LedgerTotals()})
    ledger = LedgerTotals(
        delivered=800,
        joined_requests=10,
        slo_met_requests=5,
        slo_met_tokens=400,
        stalls=2,
        stall_context=300,
    )
    window.observe(_scrape(10.0, 2000, 700, 14, 60), {"m": ledger})
    f = derive_all(window, EngineSettings())["m"]
    assert f.goodput == pytest.approx(80)
    assert f.slo_goodput_tokens == pytest.approx(40)
    assert f.coverage == pytest.approx(1.0)
    # Stall estimate: 4 preemptions x 150 mean context = 600. No L-hat: the estimate is 0,
    # and it is still the best method available (measured is not).
    assert f.totals["recomputed_stall_estimated"] == pytest.approx(600)
    assert f.tax == MethodValue("estimated", 0.0)
    # Full coverage: U = G - D = 200, over Pc + G = 200 + 1000.
    # pytest.approx stands where the float goes: the dataclass's __eq__ compares it with one.
    assert f.waste == MethodValue("estimated", pytest.approx(200 / 1200))  # type: ignore[arg-type]
    page = _values(model_samples({"m": f}, None))
    assert page[("kvtax_recomputed_tokens_stall_estimated_total", ("m",))] == pytest.approx(600)
    assert page[("kvtax_preemption_tax_ratio", ("m", "estimated"))] == 0.0
    assert page[("kvtax_goodput_tokens_per_second", ("m",))] == pytest.approx(80)
    assert ("kvtax_join_coverage_ratio", ("m",)) in page


def test_the_join_survives_a_vllm_restart() -> None:
    window = Window(window_seconds=100)
    window.observe(_scrape(0.0, 0, 0, 0, 100), {})
    window.observe(_scrape(5.0, 10, 0, 0, 3), {"m": LedgerTotals(joined_requests=3)})
    assert derive_all(window, EngineSettings())["m"].coverage == pytest.approx(1.0)


def test_served_names_come_from_vllms_model_list() -> None:
    # vLLM 0.32 with `--served-model-name llama chat` and one LoRA adapter: every served name
    # is its own entry with the model's path as root; the first is the metrics' model_name.
    document = {
        "object": "list",
        "data": [
            {"id": "llama", "root": "/models/llama", "parent": None},
            {"id": "chat", "root": "/models/llama", "parent": None},
            {"id": "sql-lora", "root": "/adapters/sql", "parent": "llama"},
            {"id": "bare"},  # no root: stands for itself
            "junk",
        ],
    }
    served = served_from_models(document)
    assert served == ServedNames("llama", {"chat": "llama"})
    assert served_from_models({"data": []}) == ServedNames(None, {})
    with pytest.raises(AdapterError):
        served_from_models({"models": []})
