"""vLLM V1's scheduler, step by step, on a trace of requests: preemptions and the token tax.

The model follows what ``vllm/v1/core/sched/scheduler.py`` and the KV block pool do (0.8 to
0.32), reduced to what decides preemption:

- **One step** has a token budget (``max_num_batched_tokens``). Running requests are served
  first, in admission order: a decoding one needs 1 token, a prefilling one the rest of its
  prompt (chunked to the budget).
- **Blocks**: a request holds ``ceil(tokens / block_size)`` blocks. When a running request needs
  a block and none is free, the most recently admitted running request is preempted (recompute
  mode): its blocks go back to the free queue and it goes to the *front* of the waiting queue.
  That may be the request itself, which then waits. One block of the pool is vLLM's null block
  and never holds KV.
- **Waiting** requests are admitted, front first, only in a step that preempted nobody, while
  fewer than ``max_num_seqs`` run and the budget and free blocks allow.
- **Prefix cache**: a full block keeps its content hash after it is freed until the block is
  reused. Freed full blocks join the tail of the free queue (a request's last block first) and a
  freed partial block its head; new blocks come from the head, so a victim's early blocks
  survive longest. A resumed request
  finds the full blocks still cached and prefills only the rest: that rest is the recompute.
  Requests with the same ``content`` key share blocks (identical token streams, as with greedy
  decoding of one prompt); otherwise each request's blocks are its own.
- After each step a request whose KV covers all its tokens samples one output token; it finishes
  when it has ``output`` tokens, and frees its blocks (cached, like a victim's).

Stretches of plain decode steps in which no request needs a block, finishes or arrives are
advanced in one jump, which is what makes a 10,000-request trace take seconds. Everything is
deterministic: the same trace and settings give the same result.

Example::

    >>> trace = [Request(prompt=41, output=500, arrival=0) for _ in range(64)]
    >>> r = simulate(trace, Settings(num_blocks=16, block_size=128, max_num_seqs=4))
    >>> r.generated
    32000
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from .errors import PlanError

__all__ = ["Request", "Result", "Settings", "simulate"]


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a trace: lengths in tokens, ``arrival`` in scheduler steps.

    ``content`` groups requests whose token streams are identical (their blocks hash alike);
    None makes the request's content its own.
    """

    prompt: int
    output: int
    arrival: int = 0
    content: int | None = None


@dataclass(frozen=True, slots=True)
class Settings:
    """The engine settings a simulation runs with (vLLM's flag names)."""

    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    # Step cost model for relative throughput: a step costs 1 + scheduled tokens / knee, so a
    # step of `knee` tokens costs twice a bare decode step of a small batch.
    step_knee_tokens: float = 2048.0

    def check(self) -> None:
        for name, value in (
            ("--num-blocks", self.num_blocks),
            ("--block-size", self.block_size),
            ("--max-num-seqs", self.max_num_seqs),
            ("--max-num-batched-tokens", self.max_num_batched_tokens),
        ):
            if value <= 0:
                raise PlanError(name, f"must be a positive integer, not {value}")
        if self.num_blocks < 2:
            raise PlanError("--num-blocks", "must be at least 2 (one block is vLLM's null block)")


@dataclass(frozen=True, slots=True)
class Result:
    """What one simulated run did. Token counts follow kvtax's tax definition (docs/tax.md)."""

    settings: Settings
    requests: int
    finished: int
    preemptions: int
    resumes: int
    queried_tokens: int  # tokens of resumed requests looked up in the prefix cache
    hit_tokens: int  # of which found cached
    recomputed: int  # queried - hit: prefilled again
    prompt_computed: int  # first prefills, minus prefix-cache hits
    generated: int
    steps: int
    cost: float  # steps weighted by the step cost model
    mean_running: float
    preemptions_by_request: tuple[int, ...] = ()  # in trace order

    @property
    def tax(self) -> float:
        """recomputed / (computed prompt + generated + recomputed)."""
        total = self.prompt_computed + self.generated + self.recomputed
        return self.recomputed / total if total else 0.0

    @property
    def preemptions_per_request(self) -> float:
        return self.preemptions / self.requests if self.requests else 0.0

    @property
    def useful_per_cost(self) -> float:
        """Useful tokens (computed prompt + generated) per unit of step cost."""
        return (self.prompt_computed + self.generated) / self.cost if self.cost else 0.0


@dataclass(slots=True)
class _Req:
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


class _Pool:
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


_NEVER = 2**62  # the arrival of a closed-loop request no client has sent yet


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def simulate(trace: Sequence[Request], settings: Settings, *, clients: int | None = None) -> Result:
    """Run ``trace`` through the scheduler model until every request has finished.

    With ``clients``, the load is a closed loop instead: that many requests at step 0, and each
    finish sends the next request of the trace (in order) at the next step; arrivals are ignored.
    """
    settings.check()
    if clients is not None and clients <= 0:
        raise PlanError("--concurrency", f"must be a positive integer, not {clients}")
    bs = settings.block_size
    usable = settings.num_blocks - 1  # vLLM keeps one block as the null block
    for i, r in enumerate(trace):
        if r.prompt <= 0 or r.output <= 0:
            raise PlanError("trace", f"request {i} needs positive prompt and output lengths")
        if _ceil_div(r.prompt + r.output, bs) > usable:
            raise PlanError(
                "--max-model-len",
                f"a request of {r.prompt + r.output} tokens cannot fit the pool of "
                f"{usable} usable blocks of {bs}: vLLM would refuse it",
            )
    pool = _Pool(usable)
    order = sorted(range(len(trace)), key=lambda i: (0 if clients else trace[i].arrival, i))
    pending = deque(
        _Req(i, trace[i].prompt, trace[i].output, _content(trace[i].content, i)) for i in order
    )
    if clients is None:
        arrivals = [trace[i].arrival for i in order]
    else:
        arrivals = [0 if n < clients else _NEVER for n in range(len(order))]
    released = min(clients or 0, len(order))
    shared = any(r.content is not None for r in trace)
    everyone = list(pending)
    sim = _Sim(pool, settings, shared)
    next_arrival = 0
    step = 0

    while sim.finished < len(trace):
        while next_arrival < len(arrivals) and arrivals[next_arrival] <= step:
            sim.waiting.append(pending.popleft())
            next_arrival += 1
        if not sim.running and not sim.waiting:
            step = arrivals[next_arrival]  # idle until the next arrival
            continue
        done = sim.step(step)
        if clients is not None:
            for _ in range(done):
                if released < len(arrivals):
                    arrivals[released] = step + 1  # the client sends its next request
                    released += 1
        step += 1
        if sim.can_jump():
            target = sim.next_event()
            if next_arrival < len(arrivals):
                target = min(target, arrivals[next_arrival])
            if step < target < _NEVER:
                sim.idle_steps(target - step)
                step = target

    return Result(
        settings=settings,
        requests=len(trace),
        finished=sim.finished,
        preemptions=sim.preemptions,
        resumes=sim.resumes,
        queried_tokens=sim.queried,
        hit_tokens=sim.hits,
        recomputed=sim.queried - sim.hits,
        prompt_computed=sim.prompt_computed,
        generated=sim.generated,
        steps=step,
        cost=sim.cost,
        mean_running=sim.running_steps / step if step else 0.0,
        preemptions_by_request=tuple(
            r.preemptions for r in sorted(everyone, key=lambda r: r.index)
        ),
    )


def _content(content: int | None, index: int) -> int:
    # Negative keys for requests whose content is their own, so they never meet a shared one.
    return content if content is not None else -1 - index


class _Sim:
    """The scheduler's state between steps.

    A running request that is decoding is advanced lazily: ``computed`` and ``generated`` are
    exact as of step ``synced`` and grow by one a step until its next event (it needs a new
    block, or it finishes), which sits in a heap. Only requests with an event, and those still
    prefilling, are handled step by step; the rest cost nothing until their event.
    """

    def __init__(self, pool: _Pool, settings: Settings, shared: bool) -> None:
        self.pool = pool
        self.settings = settings
        self.bs = settings.block_size
        self.shared = shared
        self.running: dict[int, _Req] = {}  # by admission order, the order vLLM serves them
        self.waiting: deque[_Req] = deque()
        self.prefilling: set[int] = set()  # seq of running requests that still prefill
        self.events: list[tuple[int, int, int, _Req]] = []  # (step, seq, version, request)
        self.seq = 0
        self.admit_blocked = False
        self.blocked_at = -1  # pool.releases when admission last failed for want of blocks
        self.preempted = False
        self.finished = self.preemptions = self.resumes = 0
        self.queried = self.hits = self.prompt_computed = self.generated = 0
        self.cost = 0.0
        self.running_steps = 0

    # -- lazy decode -----------------------------------------------------------------------
    def sync(self, req: _Req, step: int) -> None:
        d = step - req.synced
        if d > 0:
            req.computed += d
            req.generated += d
            req.synced = step
        self.register(req)

    def register(self, req: _Req, *, freeing: bool = False) -> None:
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

    def schedule_event(self, req: _Req, step: int) -> None:
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
        return _NEVER

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
    def _due(self, step: int) -> list[_Req]:
        due: dict[int, _Req] = {}
        while self.events and self.events[0][0] <= step:
            _, seq, version, req = heapq.heappop(self.events)
            if version == req.version and seq in self.running:
                due[seq] = req
        for seq in self.prefilling:
            due[seq] = self.running[seq]
        return [due[k] for k in sorted(due)]

    def _preempt_tail(self, step: int) -> _Req:
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
        worked: list[_Req] = []
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
            need = _ceil_div(req.computed + new, bs) - len(req.blocks)
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

    def _finish(self, req: _Req) -> None:
        del self.running[req.seq]
        req.version += 1
        self.pool.release(req.blocks, req.computed // self.bs)
        req.blocks = []
        self.finished += 1
        self.generated += req.output

    def _admit(self, step: int, budget: int, worked: list[_Req]) -> int:
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
            need = _ceil_div(start + new, self.bs) - len(cached)
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
