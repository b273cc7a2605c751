"""The Overview's "What kvtax itself costs" row: the sidecar's own CPU and latency, live.

A sidecar on the path of every event must say what it costs. kvtax publishes its own time per
read relayed (``kvtax_proxy_relay_seconds``: a read of vLLM's bytes arriving to its write to the
client), per request forwarded (``kvtax_proxy_forward_seconds``), and the events it relayed
(``kvtax_proxy_events_relayed_total``), beside the standard ``process_cpu_seconds_total``; this
row draws them (docs/delivery.md, "What kvtax itself costs"), and the proxy workers running and
restarted (``--proxy.workers``). Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import replace

from kvtax.mixin.dashboards.model import Panel, Row, Target
from kvtax.mixin.dashboards.queries import by, histogram_quantile, kvtax, process_rate, rate

__all__ = ["SELF_COST_ROW"]

_PER_POD = "namespace, pod"
_own_cpu = by(_PER_POD, "sum", process_rate("process_cpu_seconds_total"))
# With --proxy.workers above 1 the relay's CPU is the workers'; a kvtax before them has no such
# series, and its own process is all there is.
_workers_cpu = by(_PER_POD, "sum", rate(kvtax("kvtax_proxy_worker_cpu_seconds_total")))
_cpu = f"(({_own_cpu} + {_workers_cpu}) or {_own_cpu})"
_events = by(_PER_POD, "sum", rate(kvtax("kvtax_proxy_events_relayed_total")))

_cpu_per_event = Panel(
    "kvtax CPU per event",
    "timeseries",
    (Target(f"1e6 * {_cpu} / {_events}", "{{pod}}"),),
    "µs",
    "kvtax's own CPU time (its process_cpu_seconds_total: the relay, the scrape, /metrics; and "
    "its proxy workers', kvtax_proxy_worker_cpu_seconds_total, with --proxy.workers) over "
    "the SSE events it relayed on accounted streams, in microseconds per event. nginx costs "
    "about 20-35 µs to relay one on the machines bench/results/relay.md was measured on; kvtax's "
    "scrape and /metrics are in the figure too, so it reads high when few events pass. Empty "
    "while no stream runs.",
    "KvtaxSidecarDown",
    width=12,
    min=0,
)

_latency = Panel(
    "kvtax's own latency",
    "timeseries",
    (
        Target(
            histogram_quantile(0.5, kvtax("kvtax_proxy_relay_seconds", part="_bucket"), "pod"),
            "per read, p50 {{pod}}",
        ),
        Target(
            histogram_quantile(0.99, kvtax("kvtax_proxy_relay_seconds", part="_bucket"), "pod"),
            "per read, p99 {{pod}}",
        ),
        Target(
            histogram_quantile(0.99, kvtax("kvtax_proxy_forward_seconds", part="_bucket"), "pod"),
            "per request, p99 {{pod}}",
        ),
    ),
    "s",
    "What kvtax adds on the path: per read of vLLM's bytes, from their arrival to their write "
    "to the client (the parse, the count, the cut, the write call: tens of microseconds), and "
    "per request, from the request being in kvtax whole to its write to vLLM, less any wait in "
    "the gate's queue and for a new connection to vLLM to open (the body's read, the rewrite, "
    "the head). Neither counts time the request or the answer spends in the network or in "
    "vLLM.",
    "KvtaxSidecarDown",
    width=12,
    min=0,
)

_workers = Panel(
    "Proxy workers",
    "timeseries",
    (
        Target(by(_PER_POD, "sum", kvtax("kvtax_proxy_workers")), "running {{pod}}"),
        Target(
            "60 * " + by(_PER_POD, "sum", rate(kvtax("kvtax_proxy_worker_restarts_total"))),
            "started again per minute {{pod}}",
        ),
    ),
    "short",
    "kvtax's proxy processes (--proxy.workers) running, and how many a minute are started again "
    "after one crashed or stopped answering (its clients' streams broke). 0 running: kvtax's "
    "own process relays.",
    "KvtaxProxyWorkerRestarting",
    width=8,
    min=0,
    no_data="A kvtax older than --proxy.workers",
)

SELF_COST_ROW = Row(
    "What kvtax itself costs",
    (replace(_cpu_per_event, width=8), replace(_latency, width=8), _workers),
)
