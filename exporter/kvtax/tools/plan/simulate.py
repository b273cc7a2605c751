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

from collections import deque
from collections.abc import Sequence

from kvtax.errors import PlanError
from kvtax.tools.plan.blockpool import BlockPool
from kvtax.tools.plan.scheduler import NEVER, Scheduler, SimRequest, ceil_div
from kvtax.tools.plan.simtypes import Request, Result, Settings

__all__ = ["Request", "Result", "Settings", "simulate"]


def simulate(trace: Sequence[Request], settings: Settings, *, clients: int | None = None) -> Result:
    """Run ``trace`` through the scheduler model until every request has finished.

    With ``clients``, the load is a closed loop instead: that many requests at step 0, and each
    finish sends the next request of the trace (in order) at the next step; arrivals are ignored.
    """
    settings.check()
    _check_load(trace, settings, clients)
    load = _Load(trace, clients)
    usable = settings.num_blocks - 1  # vLLM keeps one block as the null block
    shared = any(r.content is not None for r in trace)
    sim = Scheduler(BlockPool(usable), settings, shared)
    steps = _run(sim, load, len(trace))
    return _result(settings, len(trace), sim, steps, load.everyone)


def _check_load(trace: Sequence[Request], settings: Settings, clients: int | None) -> None:
    """Refuse what vLLM would refuse, before any step runs: errors name the flag to change."""
    if clients is not None and clients <= 0:
        raise PlanError("--concurrency", f"must be a positive integer, not {clients}")
    bs = settings.block_size
    usable = settings.num_blocks - 1
    for i, r in enumerate(trace):
        if r.prompt <= 0 or r.output <= 0:
            raise PlanError("trace", f"request {i} needs positive prompt and output lengths")
        if ceil_div(r.prompt + r.output, bs) > usable:
            raise PlanError(
                "--max-model-len",
                f"a request of {r.prompt + r.output} tokens cannot fit the pool of "
                f"{usable} usable blocks of {bs}: vLLM would refuse it",
            )


class _Load:
    """The requests not yet handed to the scheduler, in arrival order, and when each arrives.

    Open loop (``clients`` None): a request arrives at its own ``arrival`` step. Closed loop:
    the first ``clients`` requests arrive at step 0 and the others at NEVER, until a finish
    releases the next one for the following step.
    """

    def __init__(self, trace: Sequence[Request], clients: int | None) -> None:
        order = sorted(range(len(trace)), key=lambda i: (0 if clients else trace[i].arrival, i))
        self.pending = deque(
            SimRequest(i, trace[i].prompt, trace[i].output, _content(trace[i].content, i))
            for i in order
        )
        # Every request, kept for the per-request preemption counts of the result.
        self.everyone = list(self.pending)
        self.clients = clients
        if clients is None:
            self.arrivals = [trace[i].arrival for i in order]
        else:
            self.arrivals = [0 if n < clients else NEVER for n in range(len(order))]
        self.released = min(clients or 0, len(order))
        self.next = 0  # index in `arrivals` of the next request to arrive

    def deliver(self, step: int, waiting: deque[SimRequest]) -> None:
        """Append every request that has arrived by ``step`` to the scheduler's queue."""
        while self.next < len(self.arrivals) and self.arrivals[self.next] <= step:
            waiting.append(self.pending.popleft())
            self.next += 1

    def upcoming(self) -> int:
        """The step of the next arrival; NEVER once every request has arrived."""
        return self.arrivals[self.next] if self.next < len(self.arrivals) else NEVER

    def finished(self, done: int, step: int) -> None:
        """In a closed loop, each of ``done`` finishes in ``step`` sends the next request."""
        if self.clients is None:
            return
        for _ in range(done):
            if self.released < len(self.arrivals):
                self.arrivals[self.released] = step + 1  # the client sends its next request
                self.released += 1


def _run(sim: Scheduler, load: _Load, total: int) -> int:
    """Step ``sim`` until ``total`` requests have finished; return the steps taken."""
    step = 0
    while sim.finished < total:
        load.deliver(step, sim.waiting)
        if not sim.running and not sim.waiting:
            step = load.upcoming()  # idle until the next arrival
            continue
        done = sim.step(step)
        load.finished(done, step)
        step += 1
        if sim.can_jump():
            # Plain decode steps until the next event or arrival: advance them in one go.
            target = min(sim.next_event(), load.upcoming())
            if step < target < NEVER:
                sim.idle_steps(target - step)
                step = target
    return step


def _result(
    settings: Settings, requests: int, sim: Scheduler, steps: int, everyone: list[SimRequest]
) -> Result:
    return Result(
        settings=settings,
        requests=requests,
        finished=sim.finished,
        preemptions=sim.preemptions,
        resumes=sim.resumes,
        queried_tokens=sim.queried,
        hit_tokens=sim.hits,
        recomputed=sim.queried - sim.hits,
        prompt_computed=sim.prompt_computed,
        generated=sim.generated,
        steps=steps,
        cost=sim.cost,
        mean_running=sim.running_steps / steps if steps else 0.0,
        preemptions_by_request=tuple(
            r.preemptions for r in sorted(everyone, key=lambda r: r.index)
        ),
    )


def _content(content: int | None, index: int) -> int:
    # Negative keys for requests whose content is their own, so they never meet a shared one.
    return content if content is not None else -1 - index
