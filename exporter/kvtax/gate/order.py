"""The queue's order and the Retry-After of a shed request, as pure functions.

FIFO orders by arrival. ``shortest`` orders by worst-case footprint (prompt + max_tokens),
then arrival, so that one long request does not hold many short ones behind it; a long
request can then wait longer, up to ``--gate.max-wait``.

Retry-After divides the requests ahead by the current completion rate, which
:class:`CompletionRate` measures over the last :data:`RATE_RECENT` seconds (the last
:data:`RATE_SPAN` when too few completed in those to say), whatever the rate: a window of a
fixed number of completions spans ever less time as the rate rises, and a rate taken over
more time than it covers reads low (4,096 completions over 60 s made 200/s read 68/s).

Fail fast: a request that must queue is refused at once when :func:`foretold_wait` says it
would wait past :data:`FORETOLD_SHARE` of ``--gate.max-wait``; its client hears "no" now, not
once the wait has been spent. That wait comes from the requests' service time, not from the
completion rate: :class:`ServiceTime` keeps the time from admission to leave of the last
:data:`SERVICE_SAMPLES` requests, and each request in flight frees its slot after what the
recent requests that lasted longer than its age took past it. The completion rate measures
the traffic as much as the engine (a quiet gate completes one request a minute however fast
each is), and a new backlog needs many completions to measure its own, which a slow engine
takes longer than the wait to give; a service time is known after :data:`SERVICE_ENOUGH`
requests of any traffic.

Example:

    >>> queue_key("shortest", seq=7, footprint=300)
    (300, 7)
    >>> retry_after(ahead=10, completions=20, span=10.0, limit=60)
    6
    >>> foretold_wait(ahead=2, ages=[0.0, 0.0, 0.0], cap=3, samples=32, durations=[], mean=10.0)
    10.0
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from typing import Literal

__all__ = [
    "FORETOLD_SHARE",
    "ORDERS",
    "RATE_RECENT",
    "RATE_SPAN",
    "SERVICE_ENOUGH",
    "SERVICE_SAMPLES",
    "CompletionRate",
    "Order",
    "ServiceTime",
    "foretold_wait",
    "queue_key",
    "residual",
    "retry_after",
]

Order = Literal["fifo", "shortest"]
ORDERS: tuple[Order, ...] = ("fifo", "shortest")


def queue_key(order: Order, *, seq: int, footprint: int) -> tuple[int, int]:
    """Sort key of a waiting request: smaller goes first."""
    return (footprint, seq) if order == "shortest" else (seq, seq)


def retry_after(*, ahead: int, completions: int, span: float, limit: float) -> int:
    """Seconds a shed client should wait: the time the gate needs to finish the ``ahead``
    requests before it, plus one, at the completion rate of the last ``span`` seconds; at most
    ``limit``, at least 1. With no completion seen yet, ``limit``."""
    if completions <= 0 or span <= 0:
        return max(1, math.ceil(limit))
    rate = completions / span
    return max(1, min(math.ceil(limit), math.ceil((ahead + 1) / rate)))


# The share of --gate.max-wait a foretold wait may fill and still queue. The wait is foretold
# from means (the recent requests' service time), so half the requests let in on a wait near
# the bound would wait past it, and be refused once they had: the slowest refusals, minutes of
# p99. Cold at 2x and 4x on the prefill-heavy engine, with --gate.max-wait=5s (budget mode),
# the whole bound let 5 of 54 and 5 of 139 refusals wait out the 5 s; half of it let 1 and 0,
# delivered 97 % and 105 % of the ungated tokens (98 % and 104 % before), and raised SLO
# goodput from 3.6x to 4.9x and 2.5x to 3.1x ungated: a request foretold to wait 3-5 s misses
# a 2 s TTFT objective anyway, and the queue still keeps the engine full.
FORETOLD_SHARE = 0.5


# A request in flight longer than every recent one is expected to need this share of the mean
# service time more: it is near its end (or an outlier whose end nothing foretells), and none
# frees its slot at once.
OUTLIVED_SHARE = 0.25


def residual(age: float, durations: Sequence[float], mean: float) -> float:
    """Seconds a request admitted ``age`` seconds ago should still hold its slot: the mean of
    what the recent requests (``durations``) that lasted longer than ``age`` took past it. With
    no durations (the service time is vLLM's own mean), ``mean - age``. At least
    :data:`OUTLIVED_SHARE` of ``mean`` either way."""
    longer = [d - age for d in durations if d > age]
    left = math.fsum(longer) / len(longer) if longer else mean - age
    return max(left, OUTLIVED_SHARE * mean)


def foretold_wait(
    *,
    ahead: int,
    ages: Sequence[float],
    cap: int,
    samples: int,
    durations: Sequence[float],
    mean: float,
) -> float | None:
    """Seconds until the request behind ``ahead`` queued ones is let in: the requests in flight
    (admitted ``ages`` seconds ago) leave at their :func:`residual` times, each request let in
    after them holds its slot ``mean`` seconds (the service time, of ``samples`` requests), and
    the queue enters while fewer than ``cap`` are in flight.

    None, the wait unknown, with fewer than :data:`SERVICE_ENOUGH` samples: none at all says
    nothing (a gate that has served nobody refuses nobody on a guess), and one or two may be an
    outlier. The caller refuses nobody on an unknown wait: the queue and ``wait_expired`` then
    bound it.

    Little's law, slots freed at ``in_flight / mean`` a second from now on, reads the requests
    in flight as half done on average. They are not when a burst has just filled the cap:
    requests admitted together leave together, a whole service time later. A gate that foretold
    waits that way let requests queue that then waited out ``--gate.max-wait`` (3 of 61
    refusals, 5 s after arrival, in a cold run at twice the sustained rate). The ages also count
    a cap cut below the requests in flight, whose first leaves let nobody in."""
    if samples < SERVICE_ENOUGH or not math.isfinite(mean) or mean < 0:
        return None
    leaving = sorted(residual(age, durations, mean) for age in ages)
    in_flight, entered, now = len(leaving), 0, 0.0
    while True:
        while in_flight < max(1, cap):
            entered += 1
            if entered > ahead:
                return now
            in_flight += 1
            heapq.heappush(leaving, now + mean)
        # At least max(1, cap) in flight, each with its leave in the heap: never empty here.
        now = heapq.heappop(leaving)
        in_flight -= 1


# The service time is the mean of the last SERVICE_SAMPLES requests' times from admission to
# leave, known once SERVICE_ENOUGH have left. 32: the mean of 32 has about a sixth of one
# request's spread as its error (1/sqrt(32)), and a change in the requests (a new client, longer
# answers) replaces it within 32 leaves. 3: one outlier is then a third of the mean, not all of
# it; and with 3 or more in flight, 3 leave within about one service time of the cap filling,
# inside the first --gate.max-wait (10-20 s requests against 30 s), where waiting for 10
# completions of a new backlog took 30-60 s on such an engine.
SERVICE_SAMPLES = 32
SERVICE_ENOUGH = 3


class ServiceTime:
    """The mean time from admission to leave of the last :data:`SERVICE_SAMPLES` requests.

    A window of durations with their running total: :meth:`add` and :meth:`reading` are O(1)
    and the memory is bounded. The total is summed afresh (exactly, :func:`math.fsum`) once per
    :data:`SERVICE_SAMPLES` adds, so that the rounding of adding and taking away durations for
    ever cannot drift it: O(1) amortized. A mean of the last N, not a moving average, so that a
    request stops counting once N have left after it, and the mean, not the median, since
    Little's law needs the mean (slots free at the mean's pace when lengths are mixed).

    Until :data:`SERVICE_ENOUGH` requests have left, the reading is vLLM's own mean request
    latency as the last scrape showed it (:meth:`seed`; its lifetime mean at kvtax's first
    scrape), when there is one: a gate started under load (a rollout, an eviction) knows its
    waits from the first request, not after three have finished.
    """

    def __init__(self) -> None:
        self._durations: deque[float] = deque(maxlen=SERVICE_SAMPLES)
        self._total = 0.0
        self._adds = 0
        self._seed: float | None = None

    def seed(self, mean: float) -> None:
        """vLLM's mean request latency, seconds, as a scrape showed it."""
        if math.isfinite(mean) and mean >= 0:
            self._seed = mean

    def add(self, duration: float) -> None:
        """One request left ``duration`` seconds after its admission."""
        duration = max(0.0, duration)
        durations = self._durations
        if len(durations) == durations.maxlen:
            self._total -= durations[0]
        durations.append(duration)
        self._total += duration
        self._adds += 1
        if self._adds % SERVICE_SAMPLES == 0:
            self._total = math.fsum(durations)

    def durations(self) -> tuple[float, ...]:
        """The window's durations, oldest first (none while only vLLM's seed is known)."""
        return tuple(self._durations)

    def reading(self) -> tuple[int, float]:
        """The durations in the window and their mean (0 with none); before enough have left,
        the seed counts as enough, when vLLM gave one."""
        n = len(self._durations)
        if n < SERVICE_ENOUGH and self._seed is not None:
            return SERVICE_ENOUGH, self._seed
        return n, (self._total / n if n else 0.0)


# The completion rate is that of the last RATE_RECENT seconds, or of the last RATE_SPAN when
# fewer than RATE_ENOUGH completions fell in the recent window.
RATE_RECENT = 10.0
RATE_SPAN = 60.0
RATE_ENOUGH = 10
# Completions are counted in slots of this many seconds: memory and the work of a reading are
# bounded by the slots of RATE_SPAN, whatever the rate.
RATE_SLOT = 0.25


class CompletionRate:
    """Completions counted by time slot over the last :data:`RATE_SPAN` seconds.

    :meth:`add` is O(1) (amortized: expired slots are dropped as new ones open);
    :meth:`reading` sums at most ``RATE_SPAN / RATE_SLOT`` slots.
    """

    def __init__(self, started: float) -> None:
        self.started = started
        self._slots: deque[list[int]] = deque()  # [slot number, completions], oldest first

    def add(self, now: float) -> None:
        """One completion at ``now``."""
        slot = math.floor(now / RATE_SLOT)
        slots = self._slots
        if slots and slots[-1][0] == slot:
            slots[-1][1] += 1
        else:
            slots.append([slot, 1])
        self._expire(now)

    def _expire(self, now: float) -> None:
        oldest = math.floor((now - RATE_SPAN) / RATE_SLOT)
        slots = self._slots
        while slots and slots[0][0] < oldest:
            slots.popleft()

    def reading(self, now: float) -> tuple[int, float]:
        """Completions and the seconds they span: the recent window when it holds enough, else
        the whole span (neither longer than the time since ``started``)."""
        self._expire(now)
        recent_from = math.floor((now - RATE_RECENT) / RATE_SLOT)
        recent = total = 0
        for slot, count in self._slots:
            total += count
            if slot >= recent_from:
                recent += count
        since = max(0.0, now - self.started)
        if recent >= RATE_ENOUGH:
            return recent, min(RATE_RECENT, since)
        return total, min(RATE_SPAN, since)
