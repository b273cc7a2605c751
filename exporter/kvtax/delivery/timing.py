"""Client-visible timing of one stream: TTFT, gaps between token writes, stalls and the SLO verdict.

A stall is a gap far above the stream's running median (``factor`` times it, and at least
``floor`` seconds): the client-visible face of a preemption, when vLLM freed the request's KV and
prefilled it again. The context length at the stall's start (prompt + tokens delivered so far)
is what the engine had to recompute, the input of the stall-based recompute estimate in
vllm-facts.md. Pure: the caller passes the clock readings.

What a stream holds stays bounded however long it runs: the median is of its last
:data:`WINDOW` gaps (a stream's pace changes as vLLM's batch does, and a gap is judged against
the pace of the moment), and its gaps are counted into the ledger's ITL buckets as they come
(``itl``), not kept. A 32,000-token answer held 1.3 MB here when every gap was kept and sorted,
and took each new gap in time growing with the answer's length. ``keep_gaps`` keeps them too,
for the load tester's own quantiles.

Example::

    t = StreamTiming(started=0.0, factor=5.0, floor=0.05)
    t.tokens_written(0.2, context=10)  # first token: TTFT 0.2 s
    t.tokens_written(0.21, context=11)
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import deque
from dataclasses import dataclass

from kvtax.delivery.ledger import ITL_BUCKETS, HistogramAccumulator

__all__ = ["WINDOW", "SloTargets", "StreamTiming", "meets_slo_unstreamed"]

# Gaps needed before a median means anything; earlier gaps are never flagged.
_MIN_GAPS = 4
# The gaps the running median is taken over: the stream's last ones.
WINDOW = 1024


@dataclass(frozen=True, slots=True)
class SloTargets:
    ttft: float
    itl: float


class StreamTiming:
    """Timing of the token-carrying writes of one streamed response."""

    __slots__ = (
        "_last",
        "_recent",
        "_sorted",
        "factor",
        "floor",
        "gaps",
        "itl",
        "max_gap",
        "stalls",
        "started",
        "ttft",
    )

    def __init__(
        self, started: float, factor: float, floor: float, *, keep_gaps: bool = False
    ) -> None:
        self.started = started
        self.factor = factor
        self.floor = floor
        self.ttft: float | None = None
        # Every gap, in order, only when asked for (keep_gaps).
        self.gaps: list[float] | None = [] if keep_gaps else None
        self.itl = HistogramAccumulator(ITL_BUCKETS)
        self.max_gap = 0.0
        self.stalls: list[tuple[float, int]] = []
        self._recent: deque[float] = deque()  # the last WINDOW gaps, oldest first
        self._sorted: list[float] = []  # the same, sorted
        self._last = started

    def tokens_written(self, now: float, context: int) -> None:
        """A write that carried new tokens finished at ``now``; ``context`` is the prompt plus
        the tokens delivered before this write."""
        last, self._last = self._last, now
        if self.ttft is None:
            self.ttft = now - self.started
            return
        gap = now - last
        ordered = self._sorted
        n = len(ordered)
        # The floor first: most gaps are under it, and then the median is not looked at.
        if gap > self.floor and n >= _MIN_GAPS and gap > self.factor * ordered[n // 2]:
            self.stalls.append((gap, context))
        self.itl.observe(gap)
        self.max_gap = max(self.max_gap, gap)
        if self.gaps is not None:
            self.gaps.append(gap)
        recent = self._recent
        recent.append(gap)
        insort(ordered, gap)
        if n >= WINDOW:
            del ordered[bisect_left(ordered, recent.popleft())]

    def meets(self, slo: SloTargets) -> bool:
        """DistServe's criterion: first token within the TTFT SLO and no gap above the ITL SLO."""
        return self.ttft is not None and self.ttft <= slo.ttft and self.max_gap <= slo.itl


def meets_slo_unstreamed(duration: float, completion_tokens: int, slo: SloTargets) -> bool:
    """A non-streamed response meets the SLOs when it arrived no later than a stream that just
    met both would have finished: TTFT plus one ITL per further token."""
    return duration <= slo.ttft + slo.itl * max(0, completion_tokens - 1)
