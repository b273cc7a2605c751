"""guidellm's JSON report (``GenerativeBenchmarksReport``, metadata version 2, guidellm 0.8), read
as steps. Pure.

The fields used, as guidellm 0.8.1 writes them (checked against the installed package's
pydantic models in ``guidellm/benchmark/schemas``):

- ``benchmarks[i].start_time`` / ``end_time``: the measured span, Unix seconds;
- ``benchmarks[i].config.strategy``: ``type_`` (synchronous, concurrent, throughput, constant,
  poisson) with ``streams`` or ``rate``;
- ``benchmarks[i].metrics.<name>.successful``: a distribution summary with ``mean``, ``median``
  and ``percentiles.p99``: ``output_tokens_per_second``, ``requests_per_second``,
  ``time_to_first_token_ms``, ``inter_token_latency_ms``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvtax.errors import InputError
from kvtax.tools.loadtest.finite import finite

__all__ = ["ToolStep", "read_guidellm"]

_RATE_KINDS = ("constant", "poisson", "async")


@dataclass(frozen=True, slots=True)
class ToolStep:
    index: int
    label: str
    start: float
    end: float
    concurrency: float | None
    rate: float | None
    requests_per_s: float | None
    output_tokens_per_s: float | None
    ttft_p50: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p99: float | None


def _summary(
    metrics: Mapping[str, Any], name: str, path: Sequence[str], scale: float = 1.0
) -> float | None:
    node: Any = metrics.get(name)
    if not isinstance(node, Mapping):
        return None
    node = node.get("successful")
    for key in path:
        if not isinstance(node, Mapping):
            return None
        node = node.get(key)
    value = finite(node)
    return None if value is None else value * scale


def _number(value: Any, field: str) -> float:
    number = finite(value)
    if number is None:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise InputError(field, f"missing or not a finite number ({shown})")
    return number


def read_guidellm(report: Any, field: str = "REPORT") -> list[ToolStep]:
    """The steps of a guidellm report; :class:`InputError` names the first field that is wrong."""
    if not isinstance(report, Mapping):
        raise InputError(field, "is not a JSON object")
    benchmarks = report.get("benchmarks")
    if not isinstance(benchmarks, list) or not benchmarks:
        raise InputError(f"{field} benchmarks", "missing or empty: not a guidellm report")
    steps = []
    for i, bench in enumerate(benchmarks):
        where = f"{field} benchmarks[{i}]"
        if not isinstance(bench, Mapping):
            raise InputError(where, "is not an object")
        start = _number(bench.get("start_time"), f"{where}.start_time")
        end = _number(bench.get("end_time"), f"{where}.end_time")
        if end <= start:
            raise InputError(f"{where}.end_time", f"{end} is not after start_time {start}")
        config = bench.get("config") or {}
        if not isinstance(config, Mapping):
            raise InputError(f"{where}.config", "is not an object")
        strategy = config.get("strategy") or {}
        if not isinstance(strategy, Mapping):
            raise InputError(f"{where}.config.strategy", "is not an object")
        kind = str(strategy.get("type_", "?"))[:40]
        streams = strategy.get("streams")
        rate = finite(strategy.get("rate"))
        concurrency = finite(streams)
        if kind == "synchronous":
            concurrency = 1.0
        label = kind
        if concurrency is not None:
            label = f"{kind}@{concurrency:g}"
        elif kind in _RATE_KINDS and rate is not None:
            label = f"{kind}@{rate:g}/s"
        metrics = bench.get("metrics")
        if not isinstance(metrics, Mapping):
            raise InputError(f"{where}.metrics", "missing or not an object")
        steps.append(
            ToolStep(
                index=i,
                label=label,
                start=start,
                end=end,
                concurrency=concurrency,
                rate=rate,
                requests_per_s=_summary(metrics, "requests_per_second", ("mean",)),
                output_tokens_per_s=_summary(metrics, "output_tokens_per_second", ("mean",)),
                ttft_p50=_summary(metrics, "time_to_first_token_ms", ("median",), 1e-3),
                ttft_p99=_summary(metrics, "time_to_first_token_ms", ("percentiles", "p99"), 1e-3),
                itl_p50=_summary(metrics, "inter_token_latency_ms", ("median",), 1e-3),
                itl_p99=_summary(metrics, "inter_token_latency_ms", ("percentiles", "p99"), 1e-3),
            )
        )
    return steps
