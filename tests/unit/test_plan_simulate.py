"""The V1 scheduler model behind ``kvtax plan --what-if``: what it must do, on small traces."""

from __future__ import annotations

from typing import TypedDict

import pytest

from kvtax.errors import PlanError
from kvtax.tools.plan.profile import LengthProfile, arrivals, trace
from kvtax.tools.plan.simulate import Request, Settings, simulate


class Pool(TypedDict):
    """The pool's share of Settings, spread into it (typed, so each key meets its field)."""

    num_blocks: int
    block_size: int
    max_num_batched_tokens: int


# The testbed's pool: 16 blocks of 128 tokens, one of them vLLM's null block.
POOL: Pool = {"num_blocks": 16, "block_size": 128, "max_num_batched_tokens": 4096}


def overload(n: int = 64, content: int | None = None) -> list[Request]:
    return [Request(prompt=41, output=500, content=content) for _ in range(n)]


def test_a_load_the_pool_holds_never_preempts() -> None:
    # 4 x (41 + 200) tokens need 2 blocks each: 8 of the 15 usable.
    r = simulate([Request(41, 200)] * 4, Settings(max_num_seqs=64, **POOL))
    assert r.preemptions == 0
    assert r.recomputed == 0
    assert r.tax == 0.0
    assert r.generated == 800
    assert r.prompt_computed == 4 * 41


def test_the_overload_preempts_and_recomputes_and_every_request_finishes() -> None:
    r = simulate(overload(), Settings(max_num_seqs=64, **POOL))
    assert r.finished == 64
    assert r.generated == 64 * 500
    assert r.prompt_computed == 64 * 41
    assert r.preemptions > 64
    assert r.resumes == r.preemptions
    assert r.recomputed == r.queried_tokens - r.hit_tokens > 0
    assert r.tax == r.recomputed / (r.prompt_computed + r.generated + r.recomputed)


def test_same_input_same_result() -> None:
    profile = LengthProfile(200, 900, 150, 600)
    reqs = trace(profile, requests=300, seed=7, max_length=15 * 128)
    a = simulate(reqs, Settings(max_num_seqs=32, **POOL), clients=40)
    b = simulate(list(reqs), Settings(max_num_seqs=32, **POOL), clients=40)
    assert a == b
    other = trace(profile, requests=300, seed=8, max_length=15 * 128)
    assert other != reqs


def test_fewer_sequences_fewer_preemptions() -> None:
    by_seqs = {n: simulate(overload(), Settings(max_num_seqs=n, **POOL)) for n in (4, 8, 64)}
    assert by_seqs[4].preemptions < by_seqs[8].preemptions <= by_seqs[64].preemptions
    assert by_seqs[4].tax < by_seqs[64].tax
    # Three 541-token requests fit 15 blocks: two at a time never preempt.
    assert simulate(overload(), Settings(max_num_seqs=2, **POOL)).preemptions == 0


def test_the_victim_is_the_most_recently_admitted() -> None:
    # 3 usable blocks of 4 tokens; A then B, each growing to 8 tokens (2 blocks).
    settings = Settings(num_blocks=4, block_size=4, max_num_seqs=8)
    r = simulate([Request(2, 6), Request(2, 6)], settings)
    # B, admitted second, is preempted when A needs its second block; A never is.
    assert r.preemptions_by_request == (0, 1)


def test_a_victim_finds_its_freed_blocks_in_the_prefix_cache() -> None:
    # One long request runs alone, then a burst preempts it; its early blocks survive.
    reqs = [Request(300, 700, arrival=0)] + [Request(41, 300, arrival=500) for _ in range(8)]
    on = simulate(reqs, Settings(max_num_seqs=16, **POOL))
    off = simulate(reqs, Settings(max_num_seqs=16, enable_prefix_caching=False, **POOL))
    assert on.preemptions > 0
    assert on.hit_tokens > 0
    assert on.hit_tokens % 128 == 0  # only whole blocks are cached
    assert off.hit_tokens == 0
    assert off.recomputed == off.queried_tokens
    assert on.recomputed < off.recomputed


def test_identical_requests_share_blocks_across_requests() -> None:
    own = simulate(overload(), Settings(max_num_seqs=64, **POOL))
    shared = simulate(overload(content=0), Settings(max_num_seqs=64, **POOL))
    assert shared.hit_tokens > own.hit_tokens


def test_a_request_longer_than_the_pool_is_refused_naming_the_limit() -> None:
    with pytest.raises(PlanError, match="--max-model-len"):
        simulate([Request(1000, 1000)], Settings(max_num_seqs=4, **POOL))


def test_bad_settings_name_the_flag() -> None:
    with pytest.raises(PlanError, match="--max-num-seqs"):
        simulate(overload(), Settings(num_blocks=16, block_size=128, max_num_seqs=0))
    with pytest.raises(PlanError, match="--concurrency"):
        simulate(overload(), Settings(max_num_seqs=4, **POOL), clients=0)


def test_closed_loop_keeps_at_most_the_clients_in_flight() -> None:
    reqs = [Request(41, 100)] * 20
    r = simulate(reqs, Settings(max_num_seqs=64, **POOL), clients=2)
    assert r.finished == 20
    assert r.preemptions == 0
    assert r.mean_running <= 2


def test_open_loop_arrivals_spread_the_load() -> None:
    reqs = trace(LengthProfile(41, 41, 500, 500), requests=64, seed=0)
    spread = arrivals(reqs, per_step=0.002, seed=0)  # one request every 500 steps
    burst = simulate(reqs, Settings(max_num_seqs=64, **POOL))
    calm = simulate(spread, Settings(max_num_seqs=64, **POOL))
    assert calm.preemptions < burst.preemptions


def test_ten_thousand_requests_run_to_the_end() -> None:
    reqs = trace(LengthProfile(400, 2000, 150, 700), requests=10_000, seed=1, max_length=8192)
    r = simulate(reqs, Settings(num_blocks=4096, block_size=16, max_num_seqs=128), clients=160)
    assert r.finished == 10_000
    assert r.generated == sum(q.output for q in reqs)
    assert r.preemptions > 0
