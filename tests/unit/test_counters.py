"""CounterTracker: monotonic totals from raw counters that fall back to zero on a restart."""

from __future__ import annotations

import random

import pytest

from kvtax.engine.counters import CounterTracker


def test_first_reading_is_the_starting_total_not_an_increase() -> None:
    t = CounterTracker()
    assert t.update("g", 100.0) == 0.0
    assert t.total("g") == 100.0


def test_increases_add_up() -> None:
    t = CounterTracker()
    t.update("g", 100.0)
    assert t.update("g", 130.0) == 30.0
    assert t.update("g", 130.0) == 0.0
    assert t.total("g") == 130.0
    assert t.resets == 0


def test_a_drop_is_a_restart_and_the_new_raw_value_is_the_increase() -> None:
    # Prometheus' increase() over [1000, 5]: 5, not -995 and not 0.
    t = CounterTracker()
    t.update("g", 1_000.0)
    assert t.update("g", 5.0) == 5.0
    assert t.total("g") == 1_005.0
    assert t.resets == 1
    assert t.update("g", 12.0) == 7.0
    assert t.total("g") == 1_012.0


def test_a_restart_to_exactly_zero_adds_nothing() -> None:
    t = CounterTracker()
    t.update("g", 50.0)
    assert t.update("g", 0.0) == 0.0
    assert t.total("g") == 50.0
    assert t.resets == 1


@pytest.mark.parametrize("seed", range(5))
def test_totals_never_fall_and_increases_are_never_negative(seed: int) -> None:
    rnd = random.Random(seed)
    t = CounterTracker()
    raw = 0.0
    previous_total = None
    for _ in range(200):
        raw = rnd.uniform(0, 20) if rnd.random() < 0.1 else raw + rnd.uniform(0, 50)
        increase = t.update("c", raw)
        assert increase >= 0.0
        total = t.total("c")
        assert total is not None
        if previous_total is not None:
            assert total == pytest.approx(previous_total + increase)
        previous_total = total


def test_keys_are_independent() -> None:
    t = CounterTracker()
    t.update("a", 10.0)
    t.update("b", 500.0)
    t.update("a", 2.0)
    t.update("b", 510.0)
    assert t.totals() == {"a": 12.0, "b": 510.0}
    assert t.resets == 1


def test_add_grows_a_total_without_a_raw_counter() -> None:
    t = CounterTracker()
    assert t.total("r") is None
    t.add("r", 0.0)
    assert t.total("r") == 0.0
    t.add("r", 25.0)
    t.add("r", 5.0)
    assert t.total("r") == 30.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), -1.0])
def test_a_reading_that_is_no_counter_value_is_rejected_not_a_restart(bad: float) -> None:
    t = CounterTracker()
    t.update("g", 5_000.0)
    assert t.update("g", bad) == 0.0
    assert t.total("g") == 5_000.0  # the last good total, not NaN and not a restart
    assert t.resets == 0
    # The next good reading continues from the last good one.
    assert t.update("g", 5_010.0) == 10.0
    assert t.total("g") == 5_010.0


def test_a_first_reading_that_is_nan_starts_nothing() -> None:
    t = CounterTracker()
    t.update("g", float("nan"))
    assert t.total("g") is None
    t.update("g", 7.0)
    assert t.total("g") == 7.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -3.0])
def test_add_rejects_what_is_no_amount(bad: float) -> None:
    t = CounterTracker()
    t.add("r", 10.0)
    t.add("r", bad)
    assert t.total("r") == 10.0
