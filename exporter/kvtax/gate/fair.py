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

Reserved slots (``--gate.fair-reserve``, :class:`Holdings`): the queue's order cannot help a
request that must wait for the requests already in flight, so a key that sends now and then can
still wait behind a burst that fills the cap. With reserve on, a key that already has requests
in flight does not take the last free slots while other keys of its band, seen in the last
:data:`RECENT_S` seconds, have none: one slot is kept free for each of them, and their next
request is let in at once. A key with nothing in flight may take any free slot. The price is a
slot held back while a quiet key is quiet; the busy key keeps the rest of the cap.

Example::

    shares = FairShares()
    band, key = shares.classify(headers, fairness=b"x-tenant", priority=b"x-priority")
    turn = shares.turn(band, key)   # sort by (-band, turn, ...)
    shares.served(band, turn)       # once it is let through
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["MAX_KEYS", "MAX_KEY_BYTES", "PRIORITY_RANGE", "RECENT_S", "FairShares", "Holdings"]

MAX_KEYS = 4096
MAX_KEY_BYTES = 256
# A priority is an integer in this range; outside it, or not an integer, it is 0.
PRIORITY_RANGE = (-1000, 1000)
# A key seen this recently keeps its share of the cap reserved (--gate.fair-reserve).
RECENT_S = 60.0
# How long a band's count of recent keys is reused: counting walks the keys seen lately.
_RECOUNT_S = 1.0


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


Slot = tuple[int, bytes]  # (band, key)


class Holdings:
    """The requests each key has in flight, and the slots kept free for the keys seen lately
    that have none; see the module docstring. Keys are remembered as :class:`FairShares`
    remembers them (bounded)."""

    def __init__(self, *, recent: float = RECENT_S, max_keys: int = MAX_KEYS) -> None:
        self.recent = recent
        self.max_keys = max_keys
        self._holding: dict[Slot, int] = {}
        self._holders: dict[int, int] = {}  # band -> keys with requests in flight
        self._seen: OrderedDict[Slot, float] = OrderedDict()
        self._counted: dict[int, tuple[float, int]] = {}  # band -> (when, keys seen lately)

    def seen(self, slot: Slot, now: float) -> None:
        """A request of ``slot``'s key arrived at ``now``."""
        last = self._seen.get(slot)
        if last is None or now - last >= self.recent:
            self._counted.pop(slot[0], None)  # one more key seen lately: count them again
        self._seen[slot] = now
        self._seen.move_to_end(slot)
        while len(self._seen) > self.max_keys:
            self._seen.popitem(last=False)

    def may_take(self, slot: Slot, *, cap: int, in_flight: int, now: float) -> bool:
        """``slot``'s key may take a free slot, ``in_flight`` of ``cap`` being taken: always
        when it holds none, else only if a slot stays free for each other key seen lately that
        holds none. The keys holding some are counted as seen lately (a request in flight
        longer than :data:`RECENT_S` leaves one slot fewer kept free, not more)."""
        if self._holding.get(slot, 0) == 0:
            return True
        band = slot[0]
        idle = self._recent_keys(band, now) - self._holders.get(band, 0)
        return in_flight + 1 + max(0, idle) <= cap

    def took(self, slot: Slot) -> None:
        held = self._holding.get(slot, 0)
        if held == 0:
            self._holders[slot[0]] = self._holders.get(slot[0], 0) + 1
        self._holding[slot] = held + 1

    def gave(self, slot: Slot) -> None:
        held = self._holding.get(slot, 0)
        if held > 1:
            self._holding[slot] = held - 1
        elif held == 1:
            del self._holding[slot]
            self._holders[slot[0]] -= 1

    def _recent_keys(self, band: int, now: float) -> int:
        counted = self._counted.get(band)
        if counted is not None and now - counted[0] < _RECOUNT_S:
            return counted[1]
        since, keys = now - self.recent, 0
        for (seen_band, _), at in reversed(self._seen.items()):
            if at < since:
                break  # the rest were seen earlier still
            keys += seen_band == band
        keys = max(1, keys)
        self._counted[band] = (now, keys)
        return keys


def _priority(value: bytes) -> int:
    try:
        read = int(value.strip())
    except ValueError:
        return 0
    low, high = PRIORITY_RANGE
    return read if low <= read <= high else 0
