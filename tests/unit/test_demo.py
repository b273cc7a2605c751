"""The demo's pure parts: phase figures from kvtax's counters, and what it prints."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtax_dev.demo_view import PhaseResult, phase_result, render_status, render_summary

M = 'model_name="tiny-llama"'


def _page(**values: float) -> dict[str, float]:
    names = {
        "gen": f"kvtax_engine_generation_tokens_total{{{M}}}",
        "pc": f"kvtax_engine_prompt_computed_tokens_total{{{M}}}",
        "pre": f"kvtax_engine_preemptions_total{{{M}}}",
        "rm": f"kvtax_recomputed_tokens_measured_total{{{M}}}",
        "re": f"kvtax_recomputed_tokens_estimated_total{{{M}}}",
        "rs": f"kvtax_recomputed_tokens_stall_estimated_total{{{M}}}",
        "d": f'kvtax_delivered_tokens_total{{{M},source="proxy"}}',
    }
    return {names[k]: v for k, v in values.items()}


def test_phase_uses_measured_recompute_when_the_plugin_is_there() -> None:
    before = _page(gen=100, pc=50, pre=1, rm=10, re=99, d=100)
    after = _page(gen=1100, pc=150, pre=11, rm=410, re=5000, d=1000)
    r = phase_result("overload", 5.0, before, after)
    assert r.method == "measured"
    assert r.recomputed == 400
    assert r.preemptions == 10
    assert r.delivered == 900
    assert r.tax == pytest.approx(400 / (100 + 1000 + 400))


def test_phase_falls_back_to_the_estimate_and_zero_work_is_zero_tax() -> None:
    page = _page(gen=10, pc=5, pre=0, re=0)
    r = phase_result("calm", 1.0, page, page)
    assert r.method == "estimated"
    assert r.tax == 0.0
    assert r.delivered is None


def test_phase_takes_the_stall_estimate_only_when_nothing_better_exists() -> None:
    before = _page(gen=0, pc=0, rs=0)
    after = _page(gen=100, pc=0, rs=50)
    r = phase_result("overload", 1.0, before, after)
    assert r.method == "stall_estimated"
    assert r.tax == pytest.approx(50 / 150)


def test_status_lines_show_the_figures_that_exist() -> None:
    metrics = {
        "kvtax_vllm_up": 1.0,
        f'kvtax_preemption_tax_ratio{{method="measured",{M}}}': 0.267,
        f"kvtax_recomputed_tokens_measured_total{{{M}}}": 5.0,
        f"kvtax_thrash_state{{{M}}}": 2.0,
        f"kvtax_kv_cache_usage_ratio{{{M}}}": 1.0,
    }
    text = "\n".join(render_status(metrics, "overload", 8.0))
    assert "26.7 % (measured)" in text
    assert "THRASHING" in text
    assert "KV usage 100 %" in text
    assert "goodput          -" in text  # absent, not zero


def test_summary_names_the_recommendation_and_where_things_are() -> None:
    results = [
        PhaseResult("overload", 11.7, 223, 32000, 32000, 12590, "measured", 0.267),
        PhaseResult("calm", 1.2, 0, 1600, 1600, 0, "measured", 0.0),
    ]
    last = {
        f"kvtax_recommended_max_num_seqs{{{M}}}": 3.0,
        f"kvtax_kv_capacity_tokens{{{M}}}": 2048.0,
        f"kvtax_request_length_p95_tokens{{{M}}}": 533.0,
    }
    text = render_summary(results, "http://127.0.0.1:1/metrics", Path("/tmp/p"), 64, last)
    assert "26.7%" in text
    assert "0.0%" in text
    assert "--max-num-seqs=3" in text
    assert "http://127.0.0.1:1/metrics" in text
    assert "/tmp/p" in text
