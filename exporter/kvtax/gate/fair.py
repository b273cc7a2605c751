"""Fair shares of the gate's queue: priority bands served strictly, and the keys of a band (a
tenant, a team, an API key) in turn. Pure, no I/O.

Opt-in (``--gate.fairness-header``, ``--gate.priority-header``): a request names its key and its
band in headers. Within a band, the queue serves keys round-robin by start-time fair queuing
with equal weights: each request is given a round, one past its key's last one but never behind
the band's current round (the round of the last request let through), and the queue sorts by
band, then round, then its own order (``--gate.order``). A key that bursts queues its requests
in rounds ahead of it; a key that sends one now and then finds its next round at the band's
current one, and goes before the burst's later requests. A key seen for the first time, or
again after a while, starts at the current round: no credit for having been quiet.

The keys remembered are bounded (:data:`MAX_KEYS`, the least recently seen forgotten first: a
forgotten key starts at the current round, as a new one does), and so is a key's length
(:data:`MAX_KEY_BYTES`): a client cannot grow kvtax by inventing keys.

Example::

    shares = FairShares()
    band, key = shares.classify(headers, fairness=b"x-tenant", priority=b"x-priority")
    turn = shares.turn(band, key)   # sort by (-band, turn, ...)
    shares.served(band, turn)       # once it is let through
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["MAX_KEYS", "MAX_KEY_BYTES", "PRIORITY_RANGE", "FairShares"]

MAX_KEYS = 4096
MAX_KEY_BYTES = 256
# A priority is an integer in this range; outside it, or not an integer, it is 0.
PRIORITY_RANGE = (-1000, 1000)


class FairShares:
    """The rounds of a gate's queue; see the module docstring."""

    def __init__(self, max_keys: int = MAX_KEYS) -> None:
        self.max_keys = max_keys
        self._last: OrderedDict[tuple[int, bytes], int] = OrderedDict()
        self._current: dict[int, int] = {}

    def classify(
        self,
        headers: Sequence[tuple[bytes, bytes]],
        *,
        fairness: bytes | None,
        priority: bytes | None,
    ) -> tuple[int, bytes]:
        """A request's band and key from its headers (names lower case): band 0 and the
        empty key when a header is absent, unset or not read."""
        band, key = 0, b""
        for name, value in headers:
            lowered = name.lower()
            if fairness is not None and lowered == fairness:
                key = value.strip()[:MAX_KEY_BYTES]
            elif priority is not None and lowered == priority:
                band = _priority(value)
        return band, key

    def turn(self, band: int, key: bytes) -> int:
        """The round of a request of ``key`` in ``band``, queued now."""
        current = self._current.get(band, 0)
        slot = (band, key)
        turn = max(current, self._last.get(slot, current - 1) + 1)
        self._last[slot] = turn
        self._last.move_to_end(slot)
        while len(self._last) > self.max_keys:
            self._last.popitem(last=False)
        return turn

    def served(self, band: int, turn: int) -> None:
        """A request of ``band`` queued for round ``turn`` was let through."""
        if turn > self._current.get(band, 0):
            self._current[band] = turn

    @property
    def keys(self) -> int:
        return len(self._last)


def _priority(value: bytes) -> int:
    try:
        read = int(value.strip())
    except ValueError:
        return 0
    low, high = PRIORITY_RANGE
    return read if low <= read <= high else 0
