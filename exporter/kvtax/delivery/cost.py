"""What relaying costs kvtax itself, counted as it happens, for ``/metrics``. Pure: no I/O.

Users of a sidecar ask what it costs them. :class:`RelayCost` holds the proxy's own answer:

- ``relay``: the seconds from a read of vLLM's bytes arriving to their write to the client,
  one observation per read written (the llhttp parse, the count and the cut, the framing, the
  write call): kvtax's own work on the path of every event;
- ``forward``: the seconds from a request being in kvtax whole (its head, and for an accounted
  one its body) to its write to vLLM, less any wait in the gate's queue (published as
  ``kvtax_gate_queue_wait_seconds``) and for a new connection to vLLM to open (vLLM's accept):
  the per-request work (routing, the body's read, the rewrite, the head);
- ``events``: SSE events relayed on accounted streams, so that
  ``rate(process_cpu_seconds_total) / rate(kvtax_proxy_events_relayed_total)`` reads as CPU
  seconds per event;
- ``schemes``: streams by how their tokens were counted (:mod:`kvtax.delivery.asks`; ``events``:
  ids were asked for and did not come).

Example::

    cost = RelayCost()
    cost.relay.observe(0.000021)
    cost.events += 3
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtax.delivery.ledger import HistogramAccumulator

__all__ = ["FORWARD_BUCKETS", "RELAY_BUCKETS", "STREAM_SCHEMES", "RelayCost"]

# A read costs tens of microseconds; a request's forwarding, hundreds (a new connection, a big
# body: milliseconds).
RELAY_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)
FORWARD_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0)
STREAM_SCHEMES = ("token_ids", "usage", "final_usage", "events")


@dataclass(slots=True)
class RelayCost:
    """The proxy's own cost counters; see the module docstring."""

    relay: HistogramAccumulator = field(default_factory=lambda: HistogramAccumulator(RELAY_BUCKETS))
    forward: HistogramAccumulator = field(
        default_factory=lambda: HistogramAccumulator(FORWARD_BUCKETS)
    )
    events: int = 0
    schemes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STREAM_SCHEMES, 0))
