"""The scheduler's state between steps, and one step of it: admission, blocks and preemption.

:class:`Scheduler` is the step machinery of :func:`.simulate.simulate`, which feeds it arrivals
and advances the step counter; the model it follows (budget, blocks, preemption, prefix cache)
is described in :mod:`.simulate`. :class:`SimRequest` is one request's progress through it.
Pure: no I/O.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

from kvtax.tools.plan.blockpool import BlockPool
from kvtax.tools.plan.simtypes import Settings

__all__ = ["NEVER", "Scheduler", "SimRequest", "ceil_div"]


@dataclass(slots=True)
class SimRequest:
    """One request's progress through the scheduler; ``index`` is its place in the trace."""

    index: int
    prompt: int
    output: int
    content: int
    generated: int = 0
    computed: int = 0
    synced: int = 0  # the step at whose start `computed` and `generated` are exact
    blocks: list[int] = field(default_factory=list)
    hashed: int = 0  # leading blocks of `blocks` that carry their content hash
    preemptions: int = 0
    scheduled: int = 0
    seq: int = -1  # admission order while running
    version: int = 0  # bumps whenever its pending event is no longer valid

    @property
    def tokens(self) -> int:
        return self.prompt + self.generated


# The arrival of a closed-loop request no client has sent yet, and the step of no event.
NEVER = 2**62


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` in integers: the blocks ``a`` tokens take."""
    return -(-a // b)


class Scheduler:
    """The scheduler's state between steps.

    A running request that is decoding is advanced lazily: ``computed`` and ``generated`` are
    exact as of step ``synced`` and grow by one a step until its next event (it needs a new
    block, or it finishes), which sits in a heap. Only requests with an event, and those still
    prefilling, are handled step by step; the rest cost nothing until their event.
    """

    def __init__(self, pool: BlockPool, settings: Settings, shared: bool) -> None:
        self.pool = pool
        self.settings = settings
        self.bs = settings.block_size
        self.shared = shared
        self.running: dict[int, SimRequest] = {}  # by admission order, the order vLLM serves them
        self.waiting: deque[SimRequest] = deque()
        self.prefilling: set[int] = set()  # seq of running requests that still prefill
        self.events: list[tuple[int, int, int, SimRequest]] = []  # (step, seq, version, request)
        self.seq = 0
        self.admit_blocked = False
        self.blocked_at = -1  # pool.releases when admission last failed for want of blocks
        self.preempted = False
        self.finished = self.preemptions = self.resumes = 0
        self.queried = self.hits = self.prompt_computed = self.generated = 0
        self.cost = 0.0
        self.running_steps = 0

    # -- lazy decode -----------------------------------------------------------------------
    def sync(self, req: SimRequest, step: int) -> None:
        d = step - req.synced
        if d > 0:
            req.computed += d
            req.generated += d
            req.synced = step
        self.register(req)

    def register(self, req: SimRequest, *, freeing: bool = False) -> None:
        """Give ``req``'s full blocks their content hash, so a lookup can find them.

        A request whose content is its own can only be found by itself, after it is preempted,
        so its blocks are hashed then and never while it runs or when it finishes.
        """
        if req.content < 0 and not freeing:
            return
        full = min(req.computed // self.bs, len(req.blocks))
        while req.hashed < full:
            self.pool.register(req.blocks[req.hashed], (req.content, req.hashed))
            req.hashed += 1

    def schedule_event(self, req: SimRequest, step: int) -> None:
        """After step ``step - 1``: when the decoding ``req`` next needs attention."""
        req.version += 1
        block = step + len(req.blocks) * self.bs - req.computed
        finish = step + req.output - req.generated - 1
        heapq.heappush(self.events, (min(block, finish), req.seq, req.version, req))

    def next_event(self) -> int:
        while self.events:
            at, _, version, req = self.events[0]
            if version == req.version and req.seq in self.running:
                return at
            heapq.heappop(self.events)
        return NEVER

    def can_jump(self) -> bool:
        """True when the coming steps are plain decode until the next event."""
        if self.preempted or self.prefilling:
            return False
        s = self.settings
        can_admit = self.waiting and len(self.running) < s.max_num_seqs and not self.admit_blocked
        return not can_admit and len(self.running) <= s.max_num_batched_tokens

    def idle_steps(self, count: int) -> None:
        self.cost += count * (1 + len(self.running) / self.settings.step_knee_tokens)
        self.running_steps += count * len(self.running)

    # -- one step --------------------------------------------------------------------------
    def _due(self, step: int) -> list[SimRequest]:
        due: dict[int, SimRequest] = {}
        while self.events and self.events[0][0] <= step:
            _, seq, version, req = heapq.heappop(self.events)
            if version == req.version and seq in self.running:
                due[seq] = req
        for seq in self.prefilling:
            due[seq] = self.running[seq]
        return [due[k] for k in sorted(due)]

    def _preempt_tail(self, step: int) -> SimRequest:
        seq, victim = self.running.popitem()
        self.prefilling.discard(seq)
        self.sync(victim, step)
        self.register(victim, freeing=True)
        self.pool.release(victim.blocks, victim.computed // self.bs)
        victim.blocks = []
        victim.hashed = 0
        victim.computed = 0
        victim.version += 1
        victim.preemptions += 1
        self.preemptions += 1
        self.preempted = True
        self.waiting.appendleft(victim)
        return victim

    def step(self, step: int) -> int:
        """Schedule and run step ``step``; return how many requests finished in it."""
        bs = self.bs
        decoding = len(self.running) - len(self.prefilling)
        # Decodes take their one token each; prefills share what is left (an approximation of
        # vLLM's in-order budget, exact unless the budget binds).
        budget = self.settings.max_num_batched_tokens - decoding
        self.preempted = False
        worked: list[SimRequest] = []
        for req in self._due(step):
            if req.seq not in self.running:
                continue  # preempted earlier in this step
            self.sync(req, step)
            prefill = req.seq in self.prefilling
            if prefill:
                new = min(req.tokens - req.computed, budget)
                if new <= 0:
                    continue
            else:
                new = 1
            need = ceil_div(req.computed + new, bs) - len(req.blocks)
            while need > len(self.pool.free):
                if self._preempt_tail(step) is req:
                    break
            if req.seq not in self.running:
                continue
            for _ in range(need):
                req.blocks.append(self.pool.take())
            req.scheduled = new
            if prefill:
                budget -= new
            worked.append(req)
        # Decoders with no event this step decode one token each without being visited.
        tokens = len(self.running) - len(self.prefilling)
        tokens -= sum(1 for r in worked if r.seq not in self.prefilling)
        self.admit_blocked = False
        if not self.preempted:
            budget = self._admit(step, budget, worked)
        tokens += sum(r.scheduled for r in worked)

        done = 0
        for req in worked:
            req.computed += req.scheduled
            req.synced = step + 1
            self.register(req)
            if req.computed == req.tokens:
                req.generated += 1
                self.prefilling.discard(req.seq)
                if req.generated >= req.output:
                    self._finish(req)
                    done += 1
                    continue
                self.schedule_event(req, step + 1)
            else:
                self.prefilling.add(req.seq)
        if done:
            self.admit_blocked = False  # freed blocks and slots: admission may work next step
        self.cost += 1 + tokens / self.settings.step_knee_tokens
        self.running_steps += len(self.running) + done
        return done

    def _finish(self, req: SimRequest) -> None:
        del self.running[req.seq]
        req.version += 1
        self.pool.release(req.blocks, req.computed // self.bs)
        req.blocks = []
        self.finished += 1
        self.generated += req.output

    def _admit(self, step: int, budget: int, worked: list[SimRequest]) -> int:
        s = self.settings
        pool = self.pool
        if self.blocked_at == pool.releases:
            # Nothing was freed since the head of the queue last failed: it fails again.
            self.admit_blocked = True
            return budget
        while self.waiting and budget > 0 and len(self.running) < s.max_num_seqs:
            req = self.waiting[0]
            cached: list[int] = []
            # A request that never ran can only find blocks another request with its content made.
            if s.enable_prefix_caching and (req.preemptions or req.content >= 0):
                if self.shared and req.content >= 0:
                    for other in self.running.values():  # their full blocks are findable now
                        if other.content == req.content and other.seq not in self.prefilling:
                            self.sync(other, step)
                # A full hit still recomputes the last token: at most tokens - 1 are reused.
                cached = pool.lookup(req.content, (req.tokens - 1) // self.bs)
            start = len(cached) * self.bs
            new = min(req.tokens - start, budget)
            need = ceil_div(start + new, self.bs) - len(cached)
            evictable = sum(1 for b in cached if pool.ref[b] == 0)
            if need + evictable > len(pool.free):
                self.admit_blocked = True
                self.blocked_at = pool.releases
                break
            self.waiting.popleft()
            for b in cached:
                pool.touch(b)
            req.blocks = list(cached)
            req.hashed = len(cached)
            req.computed = start
            req.synced = step
            for _ in range(need):
                req.blocks.append(pool.take())
            if req.preemptions:
                self.resumes += 1
                self.queried += req.tokens
                self.hits += start
            else:
                self.prompt_computed += req.prompt - start
            req.scheduled = new
            req.seq = self.seq
            self.seq += 1
            req.version += 1
            budget -= new
            self.running[req.seq] = req
            self.prefilling.add(req.seq)
            worked.append(req)
        return budget
