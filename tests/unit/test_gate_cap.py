"""The gate's cap controller on synthetic signal sequences: deterministic, no sleeps."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable

import pytest

from kvtax.figures.derive import recommended_max_num_seqs
from kvtax.gate.cap import CapSettings, CapState, Signals, initial, step

POOL = 2048.0


def _run(settings: CapSettings, signals: Iterable[Signals]) -> list[CapState]:
    state = initial(settings)
    states = []
    for s in signals:
        state = step(state, s, settings)
        states.append(state)
    return states


def test_static_holds_its_number_whatever_the_signals() -> None:
    settings = CapSettings(mode="static", static_cap=7)
    states = _run(settings, [Signals(POOL, 300, preemptions=9, kv_usage=1.0)] * 5)
    assert {s.cap for s in states} == {7}
    assert initial(settings).cap == 7


@pytest.mark.parametrize("mode", ["auto", "adaptive", "budget"])
def test_cold_start_is_the_floor_never_unlimited(mode: str) -> None:
    settings = CapSettings(mode=mode, floor=2, ceiling=64)  # type: ignore[arg-type]
    assert initial(settings).cap == 2
    # vLLM down or not yet scraped: nothing known, the floor holds.
    (state,) = _run(settings, [Signals()])
    assert state.cap == 2
    assert state.source == "floor"


def test_cold_start_uses_the_budget_rule_before_length_statistics() -> None:
    settings = CapSettings(mode="auto", floor=1, ceiling=64)
    # Capacity known, no engine length histogram yet; the proxy saw prompt + max_tokens.
    (state,) = _run(settings, [Signals(POOL, footprint_p95=512)])
    assert state.cap == recommended_max_num_seqs(POOL, 0.9, 512) == 3
    assert state.source == "cold_start"


def test_auto_converges_to_the_capacity_formula() -> None:
    settings = CapSettings(mode="auto", floor=1, ceiling=64)
    expected = recommended_max_num_seqs(POOL, 0.9, 180.0)
    states = _run(settings, [Signals(POOL, footprint_p95=900)] + [Signals(POOL, 180.0)] * 4)
    assert states[0].cap == 2
    assert states[-1].cap == expected == 10
    assert states[-1].source == "formula"
    assert states[-1].advice == expected


def test_auto_follows_a_lasting_change_only_after_it_is_confirmed() -> None:
    settings = CapSettings(mode="auto", floor=1, ceiling=64, confirm=2)
    seq = [Signals(POOL, 180.0)] * 2 + [Signals(POOL, 360.0)] * 3
    caps = [s.cap for s in _run(settings, seq)]
    assert caps == [10, 10, 10, 5, 5]


def test_auto_does_not_flap_under_noisy_lengths() -> None:
    rng = random.Random(12)
    settings = CapSettings(mode="auto", floor=1, ceiling=64)
    # p95 jitters +-15% around 180 tokens, scrape after scrape.
    seq = [Signals(POOL, 180.0 * rng.uniform(0.85, 1.15)) for _ in range(200)]
    states = _run(settings, seq)
    changes = states[-1].raises + states[-1].cuts
    assert changes <= 1
    assert 9 <= states[-1].cap <= 11


def _thrash_then_calm(cuts: int, calm: int) -> list[Signals]:
    hot = Signals(POOL, 180.0, kv_usage=0.99, preemptions=5, queued=20, in_flight=10)
    cool = Signals(POOL, 180.0, kv_usage=0.5, queued=20, in_flight=99)
    return [hot] * cuts + [cool] * calm


def test_adaptive_cuts_on_preemption_and_recovers() -> None:
    settings = CapSettings(
        mode="adaptive", floor=1, ceiling=64, cooldown=2, raise_after=2, probe_after=4
    )
    states = _run(settings, [Signals(POOL, 180.0, footprint_p95=180.0), *_thrash_then_calm(6, 20)])
    assert states[0].cap == 10
    after_first_cut = states[1]
    assert after_first_cut.cap == 5
    assert after_first_cut.source == "cut"
    low = min(s.cap for s in states)
    assert low < 5
    # Then it climbs one step every `raise_after` calm scrapes while requests queue.
    assert states[-1].cap > low
    assert states[-1].source == "raise"
    steps = [b.cap - a.cap for a, b in itertools.pairwise(states[7:])]
    assert set(steps) <= {0, 1}


def test_adaptive_does_not_raise_back_into_the_cap_that_preempted_until_it_probes() -> None:
    settings = CapSettings(mode="adaptive", floor=1, ceiling=64, raise_after=1, probe_after=20)
    hurt = Signals(POOL, 180.0, preemptions=2, in_flight=4)
    calm = Signals(POOL, 180.0, kv_usage=0.5, queued=9, in_flight=99)
    states = _run(settings, [Signals(POOL, 180.0, footprint_p95=180.0), hurt, *[calm] * 40])
    assert states[1].cap == 2  # half of the four in flight
    caps = [s.cap for s in states[2:]]
    assert max(caps[:18]) == 3  # below the four that preempted
    assert caps[-1] > 4  # after probe_after quiet scrapes it may try again


def test_adaptive_steps_down_by_one_when_usage_passes_the_target() -> None:
    settings = CapSettings(mode="adaptive", floor=1, ceiling=64)
    full = Signals(POOL, 180.0, kv_usage=0.95, in_flight=10)
    states = _run(settings, [Signals(POOL, 180.0, footprint_p95=180.0), full])
    assert states[1].cap == 9


def test_adaptive_cuts_on_recompute_or_usage_past_the_target() -> None:
    settings = CapSettings(mode="adaptive", floor=1, ceiling=64)
    base = Signals(POOL, 180.0, footprint_p95=180.0)
    for hot in (
        Signals(POOL, 180.0, recomputed=100.0, in_flight=10),
        Signals(POOL, 180.0, kv_usage=0.95, in_flight=10),
    ):
        states = _run(settings, [base, hot])
        assert states[1].cap < states[0].cap


def test_adaptive_cuts_from_what_is_in_use() -> None:
    settings = CapSettings(mode="adaptive", floor=1, ceiling=64)
    states = _run(
        settings,
        [Signals(POOL, 18.0, footprint_p95=18.0), Signals(POOL, 18.0, preemptions=1, in_flight=8)],
    )
    assert states[0].cap == 64  # a short-request formula hits the ceiling
    assert states[1].cap == 4


def test_adaptive_steps_below_what_is_in_flight_when_vllms_queue_cap_refuses() -> None:
    """vLLM's own --max-num-queued-reqs turned requests away: it holds fewer than the gate let
    in, so the cap goes to one below the requests in flight, and no raise returns to it until
    the probe."""
    settings = CapSettings(mode="adaptive", floor=1, ceiling=64, raise_after=1, probe_after=20)
    room = Signals(POOL, 18.0, kv_usage=0.1, queued=5, in_flight=64)
    states = _run(
        settings,
        [Signals(POOL, 18.0, footprint_p95=18.0), Signals(POOL, 18.0, refused=3, in_flight=12)]
        + [room] * 5,
    )
    assert states[0].cap == 64
    assert (states[1].cap, states[1].source) == (11, "cut")
    assert max(s.cap for s in states[2:]) == 11


def test_adaptive_does_not_raise_without_demand() -> None:
    settings = CapSettings(mode="adaptive", floor=1, ceiling=64)
    idle = Signals(POOL, 180.0, kv_usage=0.1, queued=0, in_flight=2)
    states = _run(settings, [Signals(POOL, 180.0, footprint_p95=180.0)] + [idle] * 20)
    assert {s.cap for s in states} == {10}


def test_adaptive_holds_still_under_noisy_usage_inside_the_band() -> None:
    rng = random.Random(3)
    settings = CapSettings(mode="adaptive", floor=1, ceiling=64, usage_margin=0.1)
    noisy = [
        Signals(POOL, 180.0, kv_usage=rng.uniform(0.81, 0.9), queued=5, in_flight=10)
        for _ in range(200)
    ]
    states = _run(settings, [Signals(POOL, 180.0, footprint_p95=180.0), *noisy])
    assert {s.cap for s in states} == {10}


def test_cap_never_leaves_its_bounds() -> None:
    rng = random.Random(7)
    for mode in ("auto", "adaptive"):
        settings = CapSettings(mode=mode, floor=3, ceiling=12)
        seq = [
            Signals(
                rng.choice([None, POOL, 10 * POOL]),
                rng.choice([None, 1.0, 50.0, 5000.0]),
                footprint_p95=rng.choice([None, 2.0, 9000.0]),
                kv_usage=rng.choice([None, rng.random()]),
                preemptions=rng.choice([0.0, 0.0, 3.0]),
                queued=rng.randint(0, 50),
                in_flight=rng.randint(0, 50),
            )
            for _ in range(500)
        ]
        for state in _run(settings, seq):
            assert 3 <= state.cap <= 12


def test_budget_mode_hands_out_the_whole_pool_in_blocks() -> None:
    settings = CapSettings(mode="budget", floor=2, ceiling=64, block_size=16)
    states = _run(settings, [Signals(), Signals(POOL)])
    assert states[0].budget_blocks is None
    assert states[0].cap == 2
    assert states[1].budget_blocks == 128  # 2048 / 16
    assert states[1].cap == 64


def test_off_publishes_the_advice_and_holds_nothing() -> None:
    settings = CapSettings(mode="off")
    (state,) = _run(settings, [Signals(POOL, 180.0)])
    assert state.advice == 10


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="floor"):
        CapSettings(floor=5, ceiling=2)


def test_adaptive_never_raises_past_what_the_whole_pool_holds() -> None:
    # Young requests hold few blocks: usage reads low, but four of 550 tokens overflow 2,048.
    settings = CapSettings(mode="adaptive", floor=1, ceiling=64, raise_after=1)
    calm = Signals(POOL, 550.0, kv_usage=0.3, queued=9, in_flight=99)
    states = _run(settings, [Signals(POOL, 550.0, footprint_p95=550.0), *[calm] * 10])
    assert states[0].cap == 3
    assert {s.cap for s in states} == {3}


def test_adaptive_first_step_takes_the_gates_own_requests_when_the_engine_says_shorter() -> None:
    # Protection: vLLM's length histogram counts requests that ended early at the length they
    # reached; after many aborted ones its p95 read 59 tokens while the gate's requests asked
    # for 541, and the jump 2 -> 31 thrashed the engine (tests/e2e/test_gate_e2e.py, after the
    # shutdown test's aborted streams).
    settings = CapSettings(mode="adaptive", floor=2, ceiling=64)
    (state,) = _run(settings, [Signals(POOL, 59.0, footprint_p95=541.0)])
    assert state.cap == recommended_max_num_seqs(POOL, settings.target_usage, 541.0) == 3
    assert state.source == "cold_start"
    # When the engine's figure is the longer one it is the one taken, as before.
    (state,) = _run(settings, [Signals(POOL, 541.0, footprint_p95=59.0)])
    assert (state.cap, state.source) == (3, "formula")


def test_adaptive_stays_at_the_floor_until_the_gate_has_seen_a_request() -> None:
    # The engine's p95 alone (here from earlier, aborted requests) is no reason to leave it.
    settings = CapSettings(mode="adaptive", floor=2, ceiling=64)
    states = _run(settings, [Signals(POOL, 58.0), Signals(POOL, 58.0, footprint_p95=537.0)])
    assert [(s.cap, s.source) for s in states] == [(2, "floor"), (3, "cold_start")]
