"""Client-visible timing of one stream: TTFT, gaps between token writes, stalls and the SLO verdict.

A stall is a gap far above the stream's running median (``factor`` times it, and at least
``floor`` seconds): the client-visible face of a preemption, when vLLM freed the request's KV and
prefilled it again. The context length at the stall's start (prompt + tokens delivered so far)
is what the engine had to recompute, the input of the stall-based recompute estimate in
vllm-facts.md. Pure: the caller passes the clock readings.

Example::

    t = StreamTiming(started=0.0, factor=5.0, floor=0.05)
    t.tokens_written(0.2, context=10)  # first token: TTFT 0.2 s
    t.tokens_written(0.21, context=11)
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

__all__ = ["SloTargets", "StreamTiming", "meets_slo_unstreamed"]

# Gaps needed before a median means anything; earlier gaps are never flagged.
_MIN_GAPS = 4


@dataclass(frozen=True, slots=True)
class SloTargets:
    ttft: float
    itl: float


class StreamTiming:
    """Timing of the token-carrying writes of one streamed response."""

    __slots__ = ("_last", "_sorted", "factor", "floor", "gaps", "stalls", "started", "ttft")

    def __init__(self, started: float, factor: float, floor: float) -> None:
        self.started = started
        self.factor = factor
        self.floor = floor
        self.ttft: float | None = None
        self.gaps: list[float] = []
        self.stalls: list[tuple[float, int]] = []
        self._sorted: list[float] = []
        self._last = started

    def tokens_written(self, now: float, context: int) -> None:
        """A write that carried new tokens finished at ``now``; ``context`` is the prompt plus
        the tokens delivered before this write."""
        if self.ttft is None:
            self.ttft = now - self.started
        else:
            gap = now - self._last
            if len(self._sorted) >= _MIN_GAPS:
                median = self._sorted[len(self._sorted) // 2]
                if gap > max(self.factor * median, self.floor):
                    self.stalls.append((gap, context))
            self.gaps.append(gap)
            bisect.insort(self._sorted, gap)
        self._last = now

    @property
    def max_gap(self) -> float:
        return max(self.gaps, default=0.0)

    def meets(self, slo: SloTargets) -> bool:
        """DistServe's criterion: first token within the TTFT SLO and no gap above the ITL SLO."""
        return self.ttft is not None and self.ttft <= slo.ttft and self.max_gap <= slo.itl


def meets_slo_unstreamed(duration: float, completion_tokens: int, slo: SloTargets) -> bool:
    """A non-streamed response meets the SLOs when it arrived no later than a stream that just
    met both would have finished: TTFT plus one ITL per further token."""
    return duration <= slo.ttft + slo.itl * max(0, completion_tokens - 1)
