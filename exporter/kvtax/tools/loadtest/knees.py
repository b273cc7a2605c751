"""The two knees of a sweep and what to set from them. Pure.

- The **preemption knee** is the first step with preemptions whose next step preempted too: one
  step alone can be a stray (a long request of a heavy tail); two in a row is the load level.
  A last step that preempts has no next step to confirm it: it is reported unconfirmed.
- The **throughput knee** is the step after which engine throughput stops rising: the next
  step gains less than ``min_gain`` (5 %) over it.

The recommended gate cap (kvtax's optional gate, a cap on requests in flight) is the
highest load that neither preempted nor sat past the throughput knee.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Knee", "gate_cap", "preemption_knee", "throughput_knee"]

MIN_GAIN = 0.05


@dataclass(frozen=True, slots=True)
class Knee:
    index: int
    confirmed: bool = True


def preemption_knee(preemptions: Sequence[float | None]) -> Knee | None:
    """The first step with preemptions, confirmed by the next one; None if no step preempted."""
    for i, count in enumerate(preemptions):
        if not count:
            continue
        if i + 1 == len(preemptions):
            return Knee(i, confirmed=False)
        if preemptions[i + 1]:
            return Knee(i)
    return None


def throughput_knee(throughputs: Sequence[float | None], min_gain: float = MIN_GAIN) -> Knee | None:
    """The step after which throughput rises by less than ``min_gain``; None while it rises."""
    for i in range(len(throughputs) - 1):
        here, after = throughputs[i], throughputs[i + 1]
        if here is None or after is None or here <= 0:
            continue
        if after < here * (1 + min_gain):
            return Knee(i)
    return None


def gate_cap(
    in_flight: Sequence[float], preemption: Knee | None, throughput: Knee | None
) -> float | None:
    """Requests in flight to allow: the last level before preemption, no higher than the
    throughput knee's. None when the first step already preempted (no safe level measured)."""
    limit = len(in_flight) - 1
    if preemption is not None:
        if preemption.index == 0:
            return None
        limit = preemption.index - 1
    if throughput is not None:
        limit = min(limit, throughput.index)
    return in_flight[limit] if limit >= 0 else None
