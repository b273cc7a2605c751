"""The load test's pure parts: length distributions, load levels, knees, the report page."""

from __future__ import annotations

import random
import statistics

import pytest

from kvtax.errors import InputError
from kvtax.tools.loadtest.distributions import parse_distribution
from kvtax.tools.loadtest.knees import Knee, gate_cap, preemption_knee, throughput_knee
from kvtax.tools.loadtest.measure import (
    EngineStep,
    RequestRecord,
    StepResult,
    measure_step,
    quantile,
)
from kvtax.tools.loadtest.plan import LoadPlan, check_plan, parse_levels
from kvtax.tools.loadtest.table import loadtest_json, loadtest_table, markdown


def test_distributions_sample_within_their_bounds() -> None:
    rng = random.Random(3)
    assert {parse_distribution("const:7", field="f").sample(rng) for _ in range(20)} == {7}
    uni = parse_distribution("uniform:5-9", field="f")
    assert {uni.sample(rng) for _ in range(500)} == {5, 6, 7, 8, 9}
    capped = parse_distribution("pareto:50,1.5,max=400", field="f")
    values = [capped.sample(rng) for _ in range(2000)]
    assert min(values) >= 50
    assert max(values) == 400


def test_the_lognormal_tail_is_heavy() -> None:
    rng = random.Random(1)
    dist = parse_distribution("lognormal:200,0.9", field="f")
    values = sorted(dist.sample(rng) for _ in range(5000))
    median = statistics.median(values)
    assert 170 < median < 230
    # The p99 sits far above the median: a few requests are several times the typical one.
    assert values[int(0.99 * len(values))] > 5 * median
    assert dist.upper is None


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("zipf:3", "KIND:ARGS"),
        ("const", "KIND:ARGS"),
        ("uniform:9-5", "high end"),
        ("normal:100", "takes 2"),
        ("lognormal:abc,1", "not a number"),
        ("pareto:10,-1", "positive"),
        ("const:1.5", "whole"),
        ("const:10,max=x", "max="),
    ],
)
def test_a_bad_distribution_names_its_flag(spec: str, words: str) -> None:
    with pytest.raises(InputError) as err:
        parse_distribution(spec, field="--output-tokens")
    assert str(err.value).startswith("--output-tokens: ")
    assert words in str(err.value)
    assert "\n" not in str(err.value)


def test_levels_from_lists_and_ranges() -> None:
    assert parse_levels("1,2,4", mode="concurrency", field="--levels") == (1, 2, 4)
    assert parse_levels("1:4", mode="concurrency", field="--levels") == (1, 2, 3, 4)
    assert parse_levels("1:16:x2", mode="concurrency", field="--levels") == (1, 2, 4, 8, 16)
    assert parse_levels("0.5:2:0.5", mode="rate", field="--levels") == (0.5, 1, 1.5, 2)
    for bad in ("", "4,2", "1.5,2", "a,b", "0,1", "1:8:x1"):
        with pytest.raises(InputError, match=r"^--levels: "):
            parse_levels(bad, mode="concurrency", field="--levels")


def _plan(**kw: object) -> LoadPlan:
    base: dict[str, object] = {
        "mode": "concurrency",
        "levels": (1.0,),
        "step_seconds": 10.0,
        "prompt_tokens": parse_distribution("const:4", field="p"),
        "output_tokens": parse_distribution("const:4", field="o"),
    }
    base.update(kw)
    return LoadPlan(**base)  # type: ignore[arg-type]


def test_a_step_too_short_to_measure_is_refused() -> None:
    assert check_plan(_plan()).step_seconds == 10.0
    with pytest.raises(InputError, match=r"^--step-duration: 0.5 s is too short to measure"):
        check_plan(_plan(step_seconds=0.5))
    with pytest.raises(InputError, match=r"^--slo-itl: "):
        check_plan(_plan(slo_itl=0.0))


def test_the_preemption_knee_needs_a_second_step_to_confirm_it() -> None:
    assert preemption_knee([0, 0, 3, 9]) == Knee(2)
    # A stray preemption at one step, none at the next: not the knee.
    assert preemption_knee([0, 1, 0, 4, 5]) == Knee(3)
    assert preemption_knee([0, 0, 0, 2]) == Knee(3, confirmed=False)
    assert preemption_knee([0, 0, None]) is None
    assert preemption_knee([]) is None


def test_the_throughput_knee_is_where_gains_stop() -> None:
    assert throughput_knee([100, 190, 350, 360, 340]) == Knee(2)
    assert throughput_knee([100, 200, 400]) is None
    assert throughput_knee([None, 100, 101]) == Knee(1)


def test_the_gate_cap_stays_below_both_knees() -> None:
    levels = [1.0, 2.0, 4.0, 8.0, 16.0]
    assert gate_cap(levels, Knee(3), None) == 4.0
    assert gate_cap(levels, Knee(3), Knee(1)) == 2.0
    assert gate_cap(levels, None, None) == 16.0
    assert gate_cap(levels, Knee(0), None) is None


def test_quantile_is_the_nearest_rank_a_value_had() -> None:
    assert quantile([], 0.5) is None
    assert quantile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.0  # two of four at or below it
    assert quantile([4.0, 1.0, 3.0, 2.0], 0.51) == 3.0
    assert quantile([float(i) for i in range(1, 101)], 0.99) == 99.0
    assert quantile([float(i) for i in range(1, 51)], 0.99) == 50.0  # the top of 50
    assert quantile([5.0], 0.99) == quantile([5.0], 0.0) == 5.0


def _step(index: int, level: float, preemptions: float, generated: float) -> StepResult:
    records = [
        RequestRecord(0.0, 1.0, True, 50, ttft=0.1, gaps=(0.01, 0.02), slo_met=True),
        RequestRecord(0.0, 1.0, True, 50, ttft=0.3, gaps=(0.01, 0.9), stalls=1),
        RequestRecord(0.0, 1.0, False, 0, error="HTTP 400: too long"),
    ]
    engine = EngineStep(
        scrapes=5,
        generation_tokens=generated,
        preemptions=preemptions,
        tax=0.1 * preemptions,
        tax_method="estimated",
        kv_usage_max=0.5 + 0.1 * index,
    )
    return measure_step(index, level, start=100.0, end=110.0, records=records, engine=engine)


def test_a_step_and_its_report() -> None:
    steps = [_step(0, 1, 0, 1000), _step(1, 2, 0, 1950), _step(2, 4, 3, 2000), _step(3, 8, 7, 2010)]
    s = steps[0]
    assert s.ok == 2
    assert s.failed == 1
    assert s.goodput == 10.0
    assert s.slo_goodput == 5.0
    assert s.throughput == 100.0
    assert s.stalls == 1
    assert s.errors == ("HTTP 400: too long",)
    table = loadtest_table("concurrency", steps)
    assert table.preemption_knee == Knee(2)
    assert table.throughput_knee == Knee(1)
    report = loadtest_json(
        url="u",
        metrics_url="m",
        model="x",
        plan=_plan(levels=(1.0, 2.0, 4.0, 8.0)),
        steps=steps,
        recommended_max_num_seqs=3,
        interrupted=False,
    )
    assert report["knees"]["preemption"] == {"step": 2, "level": 4, "confirmed": True}
    assert report["recommendations"] == {"max_num_seqs": 3, "gate_cap": 2}
    assert report["plan"]["output_tokens"] == "const:4"
    page = markdown("t", ["intro"], table, ["report-throughput.png"])
    assert "preemption knee: step 2, concurrency 4" in page
    assert "| 2 (P) | 4 |" in page
    assert "30.0% est." in page
    assert "![report-throughput.png](report-throughput.png)" in page
