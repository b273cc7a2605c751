"""The demo's pure parts: phase figures from kvtax's counters, and what it prints."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtax_dev.demo_view import (
    PhaseResult,
    phase_result,
    render_empty_panels,
    render_status,
    render_summary,
    window_holds,
)

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
        "j": f"kvtax_join_delivered_tokens_total{{{M}}}",
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


def _window(tax: float, state: float, **values: float) -> dict[str, float]:
    """A /metrics page: counters, plus kvtax's sliding-window gauges as given."""
    return {
        **_page(**values),
        "kvtax_vllm_up": 1.0,
        f'kvtax_preemption_tax_ratio{{method="measured",{M}}}': tax,
        f"kvtax_thrash_state{{{M}}}": state,
        f"kvtax_kv_cache_usage_ratio{{{M}}}": 1.0,
        f"kvtax_recommended_max_num_seqs{{{M}}}": 3.0,
    }


def test_status_lines_show_the_phase_figures_and_label_the_window() -> None:
    before = _window(0.0, 0.0, gen=0, pc=0, pre=0, rm=0, d=0, j=0)
    now = _window(0.267, 2.0, gen=1000, pc=100, pre=10, rm=400, d=900, j=800)
    text = "\n".join(render_status("overload", 8.0, before, now, window_s=20))
    assert "overload, last 8.0 s:" in text
    assert f"tax {400 / 1500 * 100:.1f} % (measured)" in text  # the phase's own, not the gauge
    assert "preemptions 10" in text
    assert "delivered 800 tok (100 tok/s)" in text
    assert "kvtax, last 20 s:" in text
    assert "thrash state THRASHING" in text  # the window holds this phase only
    assert "recommended max_num_seqs 3" in text
    assert "KV usage now 100 %" in text


def test_status_shows_absent_figures_as_absent_not_zero() -> None:
    page = {"kvtax_vllm_up": 0.0}
    text = "\n".join(render_status("overload", 1.0, page, page, window_s=20))
    assert "vLLM up: no" in text
    assert "delivered - (-)" in text
    assert "KV usage now -" in text
    assert "tax -" in text
    assert "thrash state -" in text


def test_calm_after_overload_never_shows_the_overloads_tax_or_thrashing() -> None:
    """Issue 21 item 16: kvtax's window still holds the overload while the calm phase runs."""
    start = _window(0.0, 0.0, gen=0, pc=0, pre=0, rm=0, d=0, j=0)
    overload_end = _window(0.288, 2.0, gen=32000, pc=1000, pre=224, rm=13416, d=32000, j=32000)
    overload = render_status("overload", 14.5, start, overload_end, window_s=20)
    assert any("THRASHING" in line for line in overload)
    summary = phase_result("overload", 14.5, start, overload_end)
    assert f"tax {summary.tax * 100:.1f} %" in "\n".join(overload)  # the screen is the summary

    # The calm phase: its own counters move (no recompute, no preemption) while every
    # sliding-window gauge still carries the overload, poll after poll.
    frames = []
    for i, elapsed in enumerate((1.0, 2.0, 4.5)):
        now = _window(
            0.288, 2.0, gen=32000 + 400 * (i + 1), pc=1000 + 50 * (i + 1), pre=224, rm=13416,
            d=32000 + 400 * (i + 1), j=32000 + 400 * (i + 1),
        )  # fmt: skip
        holds = window_holds("overload", elapsed, 20)
        frames.append(render_status("calm", elapsed, overload_end, now, window_s=20, holds=holds))
        assert phase_result("calm", elapsed, overload_end, now).recomputed == 0
    for frame in frames:
        text = "\n".join(frame)
        assert "THRASHING" not in text
        assert "tax 0.0 % (measured)" in text
        assert "28.8" not in text
        assert "thrash state -" in text
        assert "the window still holds overload" in text


def test_the_window_holds_the_previous_phase_until_a_whole_window_has_passed() -> None:
    assert window_holds(None, 0.0, 20) is None  # the first phase: nothing before it
    assert window_holds("overload", 0.0, 20) == "overload"
    assert window_holds("overload", 19.9, 20) == "overload"
    assert window_holds("overload", 20.0, 20) is None


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


def test_the_live_line_pairs_delivered_and_generated_of_one_instant() -> None:
    """Mid-overload the live ledger leads vLLM's last page (18,500 delivered beside 2,888
    generated was seen); the live line shows delivered as of that page, which cannot pass what
    the same page says was generated."""
    start = _window(0.0, 0.0, gen=0, pc=0, pre=0, rm=0, d=0, j=0)
    now = _window(0.1, 1.0, gen=2888, pc=500, pre=1, rm=50, d=18500, j=2800)
    text = "\n".join(render_status("overload", 6.0, start, now, window_s=20))
    assert "generated 2,888 tok" in text
    assert "delivered 2,800 tok" in text
    assert "18,500" not in text
    live = phase_result("overload", 6.0, start, now, as_of_page=True)
    assert live.delivered is not None
    assert live.delivered <= live.generated


def test_the_demo_names_each_empty_panel_with_its_reason() -> None:
    records = [
        {"title": "kvtax / Fleet", "no_data": {}},
        {"title": "kvtax / Overview", "no_data": {"Gate queue": "The gate is off", "Odd": ""}},
    ]
    assert render_empty_panels(records) == [
        "  kvtax / Overview / Gate queue: The gate is off",
        "  kvtax / Overview / Odd: no data",
    ]
    assert render_empty_panels([{"title": "kvtax / Fleet", "no_data": {}}]) == [
        "  (none: every panel of every preview had data)"
    ]
