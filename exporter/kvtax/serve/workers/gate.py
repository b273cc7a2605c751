"""A proxy worker's gate: one gate for every worker, the parent's.

With ``--proxy.workers`` above 1 and the gate on, the cap on requests in flight, the KV blocks
they hold, the queue and its order and the fair shares must stay one, or N workers would let in
N times the cap. So each worker's :class:`RemoteGate` does what needs only the request and the
settings, exactly as the parent's gate would: it reads the request's shape, estimates its
prompt, and applies the token budget (refusing, or clamping ``max_tokens`` in the body it
holds). Then it asks the parent (:class:`~kvtax.serve.workers.frames.Ask`: the prompt's size,
the completion limit, the fairness headers) and waits for its
:class:`~kvtax.serve.workers.frames.Answer`. The parent's
:class:`~kvtax.serve.proxy.gatekeeper.Gate` issues the ticket and admits it, queues it or
sheds it, as for a request of its own. A request that ends, or whose client leaves while it
waits, sends :class:`~kvtax.serve.workers.frames.Leave`; the parent frees its slot or takes it
out of the queue. The refusals a worker decides (over the budget, vLLM's own 503) are counted
by the parent too (:class:`~kvtax.serve.workers.frames.Rejected`).

bench/results/workers-ipc.md measured an ask and its answer at about 8 µs of CPU across both
processes.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence

from kvtax.serve.proxy.gatekeeper import CLOSED, Gate, GateSettings, Ticket
from kvtax.serve.workers.frames import Answer, Ask, Leave, Rejected, ToParent

__all__ = ["RemoteGate"]


class RemoteGate(Gate):
    """A worker's gate: budgets here, admits in the parent; see the module docstring."""

    def __init__(self, settings: GateSettings, send: Callable[[ToParent], None]) -> None:
        super().__init__(settings)
        self._send = send
        self._ids = itertools.count(1)
        self._asks: dict[int, asyncio.Future[Answer]] = {}
        self._out: set[int] = set()  # let in and not yet left
        self._retry_after = 1
        # The fairness and priority headers, the only ones the parent's ticket reads.
        self._named = {h for h in (settings.fairness_header, settings.priority_header) if h}

    async def let_in(
        self,
        prompt: int,
        limit: int | None,
        *,
        prompts: int,
        n: int,
        headers: Sequence[tuple[bytes, bytes]],
        carried: bool,
    ) -> tuple[Ticket, str | None]:
        ask = next(self._ids)
        ticket = Ticket(seq=ask, footprint=0, blocks=0, arrived=self.clock())
        if self.closed and not carried:
            return ticket, CLOSED
        waiter: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._asks[ask] = waiter
        named = [(k, v) for k, v in headers if k.lower() in self._named]
        self._send(Ask(ask, prompt, limit, prompts, n, named, carried))
        try:
            answer = await waiter
        except asyncio.CancelledError:
            self._send(Leave(ask))  # the client left: out of the parent's queue, or its slot
            raise
        finally:
            self._asks.pop(ask, None)
        if answer.reason is None:
            self._out.add(ask)
        else:
            self._retry_after = answer.retry_after
        return ticket, answer.reason

    def answered(self, answer: Answer) -> None:
        """The parent's answer to an ask (one whose client left is already gone: ignored)."""
        waiter = self._asks.get(answer.id)
        if waiter is not None and not waiter.done():
            waiter.set_result(answer)

    def leave(self, ticket: Ticket) -> None:
        if ticket.seq in self._out:  # only the first call frees it
            self._out.discard(ticket.seq)
            self._send(Leave(ticket.seq))

    def retry_after(self) -> int:
        return self._retry_after

    def rejected(self, reason: str) -> None:
        self._send(Rejected(reason))

    def close(self) -> None:
        """The worker stops: nothing more is asked, and asks still waiting are turned away
        (the parent's gate, closed first, answers them so too)."""
        self.closed = True
        for ask, waiter in list(self._asks.items()):
            if not waiter.done():
                waiter.set_result(Answer(ask, CLOSED, 0))
