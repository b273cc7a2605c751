"""What bench/gate/gate.py sends, and when: workloads, request sizes and Poisson arrival times.

Pure functions of a seed, so every arm at one load level sees the same requests at the same
moments (only the prompts' token ids differ between arms, see :func:`prompt_ids`), and unit
tests can check the schedule without an engine.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

# The prefill-heavy model's vocabulary is 512 tokens; ids 0-2 are <s>, </s> and <pad>.
FIRST_ORDINARY_ID = 3
VOCAB_SIZE = 512


@dataclass(frozen=True)
class Workload:
    """The request mix: a share of long prompts, the rest short, outputs in one range."""

    name: str
    long_prompt: tuple[int, int]
    short_prompt: tuple[int, int]
    output: tuple[int, int]
    long_share: float

    def describe(self) -> str:
        long = f"{self.long_prompt[0]}-{self.long_prompt[1]}-token prompts"
        out = f"{self.output[0]}-{self.output[1]} output tokens (ignore_eos)"
        if self.long_share >= 1.0:
            return f"{long}, {out}"
        short = f"{self.short_prompt[0]}-{self.short_prompt[1]}-token prompts"
        return f"{100 * self.long_share:.0f} % {long}, the rest {short}; {out}"

    @property
    def largest(self) -> int:
        """The largest prompt + max_tokens a request of this workload can ask for."""
        longest = self.long_prompt[1] if self.long_share > 0 else self.short_prompt[1]
        return longest + self.output[1]


WORKLOADS: dict[str, Workload] = {
    "long": Workload("long", (800, 1500), (32, 128), (64, 256), 1.0),
    "mixed": Workload("mixed", (800, 1500), (32, 128), (64, 256), 0.5),
}


@dataclass(frozen=True)
class Spec:
    """One request: when it is sent (seconds after the arm starts), and its size."""

    index: int
    at: float
    prompt_tokens: int
    max_tokens: int
    long: bool


def blocks_of(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def held_concurrency(workload: Workload, blocks: int, block_size: int) -> int:
    """Requests of the workload's largest size the pool holds at once: at this concurrency the
    engine cannot preempt, whatever sizes are drawn."""
    return max(1, blocks // blocks_of(workload.largest, block_size))


def _draw(rng: random.Random, workload: Workload, index: int, at: float) -> Spec:
    long = rng.random() < workload.long_share
    low, high = workload.long_prompt if long else workload.short_prompt
    return Spec(
        index=index,
        at=at,
        prompt_tokens=rng.randint(low, high),
        max_tokens=rng.randint(*workload.output),
        long=long,
    )


def poisson_arrivals(rate: float, duration: float, seed: int) -> list[float]:
    """Arrival times in [0, duration) of a Poisson process of ``rate`` per second."""
    if rate <= 0 or duration <= 0:
        return []
    rng = random.Random(f"arrivals/{seed}")
    times: list[float] = []
    now = rng.expovariate(rate)
    while now < duration:
        times.append(now)
        now += rng.expovariate(rate)
    return times


def open_loop_plan(rate: float, duration: float, workload: Workload, seed: int) -> list[Spec]:
    """The requests of one open-loop arm: Poisson arrivals, sizes drawn from the workload.
    Sizes come from their own stream, so the n-th request has the same size at every rate."""
    sizes = random.Random(f"sizes/{workload.name}/{seed}")
    return [
        _draw(sizes, workload, i, at) for i, at in enumerate(poisson_arrivals(rate, duration, seed))
    ]


def closed_loop_specs(workload: Workload, seed: int) -> Iterator[Spec]:
    """An endless stream of request sizes for closed-loop clients (``at`` is 0: a client sends
    as soon as its previous request ended); the same sizes as :func:`open_loop_plan`'s."""
    sizes = random.Random(f"sizes/{workload.name}/{seed}")
    index = 0
    while True:
        yield _draw(sizes, workload, index, 0.0)
        index += 1


def prompt_ids(spec: Spec, salt: str) -> list[int]:
    """The prompt's token ids: random, a function of the request and ``salt`` (the arm and load).
    Arms that share an engine must not send the same prompts, or the later ones would prefill
    from vLLM's prefix cache what the earlier ones computed."""
    rng = random.Random(f"prompt/{salt}/{spec.index}")
    return [rng.randrange(FIRST_ORDINARY_ID, VOCAB_SIZE) for _ in range(spec.prompt_tokens)]


def mean_rate(times: list[float], duration: float) -> float:
    """The schedule's realised rate (arrivals per second over the window)."""
    return len(times) / duration if duration > 0 else math.nan
