"""The queue's order and the Retry-After of a shed request, as pure functions.

FIFO orders by arrival. ``shortest`` orders by worst-case footprint (prompt + max_tokens),
then arrival, so that one long request does not hold many short ones behind it; a long
request can then wait longer, up to ``--gate.max-wait``.

Retry-After divides the requests ahead by the current completion rate, which
:class:`CompletionRate` measures over the last :data:`RATE_RECENT` seconds (the last
:data:`RATE_SPAN` when too few completed in those to say), whatever the rate: a window of a
fixed number of completions spans ever less time as the rate rises, and a rate taken over
more time than it covers reads low (4,096 completions over 60 s made 200/s read 68/s).

Example::

    queue_key("shortest", seq=7, footprint=300)   # (300, 7)
    retry_after(ahead=10, completions=20, span=10.0, limit=60)   # 6
"""

from __future__ import annotations

import math
from collections import deque
from typing import Literal

__all__ = [
    "ORDERS",
    "RATE_RECENT",
    "RATE_SPAN",
    "CompletionRate",
    "Order",
    "queue_key",
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
