"""The gate's cap: how many requests (or KV blocks) may be in flight, stepped once a scrape.

:func:`initial` gives the cap before any scrape; :func:`step` gives the next state from the
current one and one scrape's :class:`Signals`. Both are pure, so a recorded or synthetic
sequence of signals replays exactly.

Modes:

- ``static``: the configured cap, always.
- ``budget``: requests are admitted by their worst-case KV footprint against the whole
  pool (``budget_blocks``); the count cap is the ceiling.
- ``auto``: floor(capacity x target usage / p95 request length), the recommended
  ``max_num_seqs`` (:func:`kvtax.figures.derive.recommended_max_num_seqs`). It moves only when
  the new value differs by more than the hysteresis and has held for ``confirm`` scrapes.
- ``adaptive``: starts where ``auto`` first lands (or at the floor), then AIMD: when
  preemptions or recompute appear, a multiplicative cut from what is in flight; when KV usage
  passes the target, one step down (either at most once per ``cooldown`` scrapes). +1 after
  ``raise_after`` scrapes in a row with usage below the target less a margin, requests queued
  and the cap in full use, but never past the requests of p95 length the whole pool holds,
  and not back up to the concurrency of the last cut until ``probe_after`` quiet scrapes have
  passed: the sawtooth does not keep probing into thrash.
- ``off``: the gate does not act; the state still tracks what ``auto`` would set (the advice).

Cold start: before the engine has length statistics, the cap comes from the footprint of the
requests the proxy has seen (the budget rule in request-count form), and before that from the
floor. It is never unlimited. Every cap stays within [floor, ceiling].

Blocks are vLLM's own: ``--gate.block-size`` when given, else the ``block_size`` of vLLM's
cache_config_info as the scrape last saw it (:attr:`Signals.block_size`), else
:data:`DEFAULT_BLOCK_SIZE` (:func:`block_size_of`).

Example (an adaptive gate starts at its floor and, preempted, holds there; what the pool holds
at the p95 length, 6 here, is the advice it publishes):

    >>> settings = CapSettings(mode="adaptive")
    >>> state = initial(settings)
    >>> state = step(state, Signals(capacity_tokens=2048, length_p95=300, preemptions=4), settings)
    >>> state.cap, state.source, state.advice
    (2, 'floor', 6)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from kvtax.figures.derive import recommended_max_num_seqs

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "MODES",
    "SOURCES",
    "CapSettings",
    "CapState",
    "Mode",
    "Signals",
    "block_size_of",
    "initial",
    "step",
]

Mode = Literal["off", "static", "budget", "auto", "adaptive"]
MODES: tuple[Mode, ...] = ("off", "static", "budget", "auto", "adaptive")
# How the current cap was chosen (the ``source`` label of kvtax_gate_cap).
SOURCES = ("static", "floor", "cold_start", "formula", "budget", "cut", "raise")
# vLLM's default --block-size on GPUs: the blocks counted before a scrape shows vLLM's own, and
# with a vLLM whose cache_config_info has no block_size.
DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class CapSettings:
    mode: Mode = "off"
    static_cap: int = 16
    floor: int = 2
    ceiling: int = 256
    target_usage: float = 0.9
    # --gate.block-size; None: vLLM's own (Signals.block_size), see block_size_of.
    block_size: int | None = None
    # auto: a new formula value must differ by more than this fraction (and by at least one)
    # and hold for `confirm` scrapes in a row before the cap follows it.
    hysteresis: float = 0.2
    confirm: int = 2
    # adaptive
    cut_factor: float = 0.5
    cooldown: int = 2
    raise_after: int = 2
    usage_margin: float = 0.1
    # Scrapes without trouble before a raise may reach the cap at which trouble was last seen.
    probe_after: int = 30

    def __post_init__(self) -> None:
        if self.floor < 1 or self.ceiling < self.floor:
            raise ValueError(f"need 1 <= floor <= ceiling, got {self.floor}, {self.ceiling}")
        if not 0 < self.cut_factor < 1:
            raise ValueError(f"cut_factor must be in (0, 1), got {self.cut_factor}")

    def bound(self, cap: int) -> int:
        return max(self.floor, min(self.ceiling, cap))


@dataclass(frozen=True, slots=True)
class Signals:
    """One scrape's view. Counts are increases since the previous scrape."""

    capacity_tokens: float | None = None
    length_p95: float | None = None  # the engine's prompt + generation p95
    footprint_p95: float | None = None  # p95 of prompt + max_tokens the proxy saw
    kv_usage: float | None = None  # 0-1
    preemptions: float = 0.0
    recomputed: float = 0.0
    # Requests vLLM's own queue caps (--max-num-queued-reqs/-tokens) refused with a 503.
    refused: float = 0.0
    queued: int = 0
    in_flight: int = 0
    block_size: int | None = None  # vLLM's KV block size, tokens (cache_config_info)
    # vLLM's mean request latency, seconds: of the requests it finished since the previous
    # scrape, or over its lifetime at the first one (None: it has finished none).
    service_time: float | None = None


@dataclass(frozen=True, slots=True)
class CapState:
    cap: int
    source: str
    budget_blocks: int | None = None
    advice: int | None = None  # what auto would set, whatever the mode
    pending: int | None = None  # auto: the value waiting to be confirmed
    pending_for: int = 0
    cooldown: int = 0
    good: int = 0
    bad: int | None = None  # adaptive: the concurrency at the last cut
    memory: int = 0  # scrapes left before raises may reach `bad` again
    raises: int = 0
    cuts: int = 0


def initial(settings: CapSettings) -> CapState:
    """The cap before any scrape: static's number, else the floor (never unlimited)."""
    if settings.mode == "static":
        return CapState(max(1, settings.static_cap), "static")
    return CapState(settings.floor, "floor")


def formula(signals: Signals, settings: CapSettings) -> tuple[int, str] | None:
    """The auto cap and its source: the engine's p95 length when known (``formula``), else the
    footprint of the requests seen (``cold_start``); None before either exists."""
    if signals.capacity_tokens is None or signals.capacity_tokens <= 0:
        return None
    if signals.length_p95 is not None and signals.length_p95 > 0:
        length, source = signals.length_p95, "formula"
    elif signals.footprint_p95 is not None and signals.footprint_p95 > 0:
        length, source = signals.footprint_p95, "cold_start"
    else:
        return None
    cap = recommended_max_num_seqs(signals.capacity_tokens, settings.target_usage, length)
    return settings.bound(cap), source


def block_size_of(settings: CapSettings, seen: int | None) -> int:
    """The KV block size, in tokens, the gate counts in: ``--gate.block-size`` when given (the
    operator's word wins, e.g. for a vLLM whose page lacks it), else vLLM's own as last
    ``seen`` on its page, else :data:`DEFAULT_BLOCK_SIZE`."""
    if settings.block_size is not None:
        return settings.block_size
    return seen if seen is not None and seen > 0 else DEFAULT_BLOCK_SIZE


def budget_blocks(signals: Signals, settings: CapSettings) -> int | None:
    """Whole KV blocks the budget mode may hand out: the whole pool. Each request is counted
    at its worst case (every token of its ``max_tokens``), so worst cases that fit the pool
    cannot make vLLM preempt; a margin below it would count that safety twice. On the
    prefill-heavy bench engine cold at 2x, 90 % of the pool let two requests in where three
    often fit, and delivered 88 % of the ungated tokens; the whole pool delivered 91 %, with
    no preemption (bench/results/gate-cap.md)."""
    if signals.capacity_tokens is None or signals.capacity_tokens <= 0:
        return None
    size = block_size_of(settings, signals.block_size)
    return max(1, math.floor(signals.capacity_tokens / size))


def step(state: CapState, signals: Signals, settings: CapSettings) -> CapState:
    """The state after one scrape's signals."""
    found = formula(signals, settings)
    state = replace(state, advice=found[0] if found else state.advice)
    mode = settings.mode
    if mode == "static":
        return state
    if mode == "budget":
        blocks = budget_blocks(signals, settings)
        if blocks is None:
            return replace(state, cap=settings.floor, source="floor", budget_blocks=None)
        return replace(state, cap=settings.ceiling, source="budget", budget_blocks=blocks)
    if mode == "adaptive":
        if state.source == "floor" and found is not None:
            first = _first_step(found, signals, settings)
            return state if first is None else _moved(state, *first)
        return _aimd(state, signals, settings)
    if found is None or mode == "off":
        return state
    return _follow(state, found, settings)


def _first_step(
    found: tuple[int, str], signals: Signals, settings: CapSettings
) -> tuple[int, str] | None:
    """adaptive's one jump from the floor, or None to stay there: the formula's cap, or the one
    the gate's own requests allow if that is lower, and no jump before the gate has seen a
    request. vLLM's length histogram counts requests that ended early (aborted, cut by EOS) at
    the length they reached, and it can receive an idle engine's aborts late; its p95 then read
    58 tokens while the requests about to come asked for 537, and the jump 2 -> 31 thrashed the
    engine for ten scrapes (tests/e2e/test_gate_e2e.py after the shutdown test's aborted
    streams). Raises past the jump are AIMD's, on evidence."""
    footprint = signals.footprint_p95
    if footprint is None or footprint <= 0:
        return None
    if found[1] != "formula":
        return found
    # The requests' own cap: the formula on their footprint alone (source "cold_start").
    own = formula(replace(signals, length_p95=None), settings)
    return own if own is not None and own[0] < found[0] else found


def _follow(state: CapState, found: tuple[int, str], settings: CapSettings) -> CapState:
    """auto (and adaptive until it has the engine's figure): follow the formula, damped."""
    target, source = found
    if state.source in ("floor", "cold_start") and source != state.source:
        # The first value of a better kind replaces a weaker one at once.
        return _moved(state, target, source)
    if target == state.cap or abs(target - state.cap) <= settings.hysteresis * state.cap:
        return replace(state, source=source, pending=None, pending_for=0)
    same_side = state.pending is not None and (state.pending > state.cap) == (target > state.cap)
    held = state.pending_for + 1 if same_side else 1
    if held >= settings.confirm:
        return _moved(state, target, source)
    return replace(state, pending=target, pending_for=held)


def _moved(state: CapState, cap: int, source: str) -> CapState:
    ups = state.raises + (cap > state.cap)
    downs = state.cuts + (cap < state.cap)
    return replace(
        state, cap=cap, source=source, pending=None, pending_for=0, raises=ups, cuts=downs
    )


def _pool_holds(signals: Signals) -> int:
    """Requests of p95 length the whole pool holds: no raise goes past it, whatever KV usage
    says (young requests hold few blocks, so usage reads low just after admission)."""
    length = signals.length_p95 or signals.footprint_p95
    if signals.capacity_tokens is None or not length:
        return 1 << 30
    return max(1, math.floor(signals.capacity_tokens / length))


def _aimd(state: CapState, signals: Signals, settings: CapSettings) -> CapState:
    cooldown = max(0, state.cooldown - 1)
    usage = signals.kv_usage
    preempting = signals.preemptions > 0 or signals.recomputed > 0
    over = usage is not None and usage > settings.target_usage
    refused = signals.refused > 0
    if preempting or over or refused:
        if cooldown > 0:
            return replace(state, cooldown=cooldown, good=0)
        if preempting:
            # Cut from what is in use, not from a cap far above it.
            base = min(state.cap, max(1, signals.in_flight))
            cap = settings.bound(math.floor(base * settings.cut_factor))
        elif refused:
            # vLLM's own queue cap turned requests away: it holds fewer than are in flight.
            base = min(state.cap, max(1, signals.in_flight))
            cap = settings.bound(base - 1)
        else:  # full but not yet preempting: one step down
            base = state.cap
            cap = settings.bound(state.cap - 1)
        # Remember where it hurt: raises stop below it until `probe_after` quiet scrapes pass.
        held = replace(
            state, cooldown=settings.cooldown, good=0, bad=base, memory=settings.probe_after
        )
        return _moved(held, cap, "cut") if cap < state.cap else held
    memory = max(0, state.memory - 1)
    limit = settings.ceiling if memory == 0 or state.bad is None else state.bad - 1
    limit = min(limit, _pool_holds(signals))
    room = usage is not None and usage < settings.target_usage - settings.usage_margin
    wanted = signals.queued > 0 and signals.in_flight >= state.cap
    if not (room and wanted) or state.cap >= limit:
        return replace(state, cooldown=cooldown, good=0, memory=memory)
    good = state.good + 1
    if good < settings.raise_after:
        return replace(state, cooldown=cooldown, good=good, memory=memory)
    raised = _moved(state, state.cap + 1, "raise")
    return replace(raised, cooldown=cooldown, good=0, memory=memory)
