"""vLLM's KV block pool, as the scheduler simulation needs it: the free queue and the hash index.

Free blocks sit in eviction order (the head is reused first); a full block keeps its content
hash after it is freed, until it is reused, so a request resumed after a preemption can find
its early blocks still cached. :mod:`.scheduler` takes, touches, releases and looks up blocks;
the rules it follows are described in :mod:`.simulate`. Pure: no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["BlockPool"]


class BlockPool:
    """The block pool: a free queue in eviction order and the content-hash index."""

    def __init__(self, blocks: int) -> None:
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(blocks))
        self.ref = [0] * blocks
        self.key: list[tuple[int, int] | None] = [None] * blocks
        self.cached: dict[tuple[int, int], set[int]] = {}
        self.releases = 0  # bumps whenever blocks return to the free queue

    def take(self) -> int:
        block, _ = self.free.popitem(last=False)
        key = self.key[block]
        if key is not None:  # evicted: its content is gone
            holders = self.cached[key]
            holders.discard(block)
            if not holders:
                del self.cached[key]
            self.key[block] = None
        self.ref[block] = 1
        return block

    def touch(self, block: int) -> None:
        if self.ref[block] == 0:
            del self.free[block]
        self.ref[block] += 1

    def release(self, blocks: Sequence[int], full: int) -> None:
        """Return a request's blocks; its first ``full`` blocks are full (cacheable).

        As vLLM's block pool does: full blocks join the tail of the free queue, the request's
        last block first, so its prefix survives longest (LRU); a partial block, which no
        lookup can match, goes to the head and is reused first.
        """
        self.releases += 1
        first: list[int] = []
        last: list[int] = []
        for i in range(len(blocks) - 1, -1, -1):
            block = blocks[i]
            self.ref[block] -= 1
            if self.ref[block] == 0:
                (last if i < full or self.key[block] is not None else first).append(block)
        for block in reversed(first):
            self.free[block] = None
            self.free.move_to_end(block, last=False)
        for block in last:
            self.free[block] = None

    def register(self, block: int, key: tuple[int, int]) -> None:
        if self.key[block] is None:
            self.key[block] = key
            self.cached.setdefault(key, set()).add(block)

    def lookup(self, content: int, limit: int) -> list[int]:
        found: list[int] = []
        for i in range(limit):
            holders = self.cached.get((content, i))
            if not holders:
                break
            found.append(min(holders))
        return found
