"""What a sweep does: the load levels, how long each step lasts, the request shapes, the SLOs.

Pure: :func:`parse_levels` and :func:`check_plan` validate the command line's values and raise
:class:`~kvtax.errors.InputError` naming the flag.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import pairwise

from kvtax.errors import InputError
from kvtax.tools.loadtest.distributions import Distribution

__all__ = ["MODES", "LoadPlan", "check_plan", "parse_levels"]

# "concurrency": that many requests in flight at all times (a closed loop);
# "rate": requests arrive at that many per second, Poisson, however many are in flight.
MODES = ("concurrency", "rate")
# A step needs a scrape at each end and one inside to measure anything.
MIN_SCRAPES_PER_STEP = 2


@dataclass(frozen=True, slots=True)
class LoadPlan:
    mode: str
    levels: tuple[float, ...]
    step_seconds: float
    prompt_tokens: Distribution
    output_tokens: Distribution
    scrape_interval: float = 0.5
    drain_seconds: float = 120.0
    # Idle time between steps: the engine settles and no step's edge touches the next one.
    rest_seconds: float = 1.0
    slo_ttft: float = 2.0
    slo_itl: float = 0.2
    stall_factor: float = 5.0
    stall_min: float = 0.05
    seed: int = 0
    # vLLM's extension: generate max_tokens whatever the model says. Servers without it may
    # refuse the field, so it can be left out.
    ignore_eos: bool = True
    max_in_flight: int = 1024


def parse_levels(text: str, *, mode: str, field: str) -> tuple[float, ...]:
    """``1,2,4,8`` or ``1:8`` (every integer) or ``1:16:x2`` (doubling): rising load levels."""
    try:
        if ":" in text:
            levels = _range(text)
        else:
            levels = tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise InputError(field, f"{text!r} is not a list like 1,2,4 or a range like 1:8") from None
    if not levels:
        raise InputError(field, "no load level given")
    if not all(math.isfinite(x) and x > 0 for x in levels):
        raise InputError(field, f"{text!r}: every level must be positive")
    if mode == "concurrency" and not all(x == int(x) for x in levels):
        raise InputError(field, f"{text!r}: concurrency levels must be whole numbers")
    if any(b <= a for a, b in pairwise(levels)):
        raise InputError(field, f"{text!r}: levels must rise from step to step")
    return levels


def _range(text: str) -> tuple[float, ...]:
    parts = text.split(":")
    if len(parts) not in (2, 3):
        raise ValueError(text)
    lo, hi = float(parts[0]), float(parts[1])
    if lo <= 0 or hi < lo:
        raise ValueError(text)
    out: list[float] = []
    x = lo
    if len(parts) == 3 and parts[2].startswith("x"):
        factor = float(parts[2][1:])
        if factor <= 1:
            raise ValueError(text)
        while x <= hi:
            out.append(x)
            x *= factor
    else:
        step = float(parts[2]) if len(parts) == 3 else 1.0
        if step <= 0:
            raise ValueError(text)
        while x <= hi + 1e-9:
            out.append(round(x, 9))
            x += step
    return tuple(out)


def check_plan(plan: LoadPlan) -> LoadPlan:
    """The plan, or an :class:`InputError` naming the flag that makes it unmeasurable."""
    if plan.mode not in MODES:
        raise InputError("--mode", f"{plan.mode!r} is not one of {', '.join(MODES)}")
    if not (math.isfinite(plan.scrape_interval) and plan.scrape_interval > 0):
        raise InputError("--scrape-interval", "must be a positive number of seconds")
    if plan.step_seconds < MIN_SCRAPES_PER_STEP * plan.scrape_interval:
        raise InputError(
            "--step-duration",
            f"{plan.step_seconds:g} s is too short to measure: a step needs at least "
            f"{MIN_SCRAPES_PER_STEP} scrapes ({MIN_SCRAPES_PER_STEP * plan.scrape_interval:g} s "
            f"at --scrape-interval={plan.scrape_interval:g})",
        )
    for name, value in (
        ("--slo-ttft", plan.slo_ttft),
        ("--slo-itl", plan.slo_itl),
        ("--drain-timeout", plan.drain_seconds),
        ("--rest", plan.rest_seconds + 1.0),  # zero is allowed: no rest
    ):
        if not (math.isfinite(value) and value > 0):
            raise InputError(name, f"{value!r} must be a positive number of seconds")
    return plan
