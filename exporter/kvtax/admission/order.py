"""The queue's order and the Retry-After of a shed request, as pure functions.

FIFO orders by arrival. ``shortest`` orders by worst-case footprint (prompt + max_tokens),
then arrival, so that one long request does not hold many short ones behind it; a long
request can then wait longer, up to ``--admission.max-wait``.

Example::

    queue_key("shortest", seq=7, footprint=300)   # (300, 7)
    retry_after(ahead=10, completions=20, span=10.0, limit=60)   # 6
"""

from __future__ import annotations

import math
from typing import Literal

__all__ = ["ORDERS", "Order", "queue_key", "retry_after"]

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
