"""The three kvtax dashboards (Overview, Capacity, Fleet), defined panel by panel.

Each board answers its questions in the order a person under pressure asks them: is the engine
thrashing, what is it costing, what should max_num_seqs be. Queries are composed from
:mod:`kvtax.mixin.dashboards.queries` (catalog, vocabulary and recording-rule names only); each
board lives in its own module (:mod:`.overview`, :mod:`.capacity`, :mod:`.fleet`) and shares units
and thresholds through :mod:`.common`. Pure: no I/O.

Example::

    >>> [b.title for b in BOARDS]
    ['Overview', 'Capacity', 'Fleet']
"""

from __future__ import annotations

from kvtax.mixin.dashboards.capacity import CAPACITY
from kvtax.mixin.dashboards.common import THRASH_MAPPINGS
from kvtax.mixin.dashboards.fleet import FLEET
from kvtax.mixin.dashboards.model import Board
from kvtax.mixin.dashboards.overview import OVERVIEW

__all__ = ["BOARDS", "CAPACITY", "FLEET", "OVERVIEW", "THRASH_MAPPINGS"]

BOARDS: tuple[Board, ...] = (OVERVIEW, CAPACITY, FLEET)
