"""AIPerf's JSON export (``profile_export_aiperf.json``, schema 1.4, AIPerf 0.13), read as steps.
Pure.

AIPerf writes one export per run. A sweep (``--concurrency 2,8,32``, ``--request-rate ...``)
is one run per level, each in its own folder of the artifact directory; ``kvtax annotate``
reads every export under a directory it is given. Each export is one step, and the steps are
taken in the order they ran.

The fields used, as AIPerf 0.13.0 writes them (checked against the package's
``aiperf/common/models/export_models.py`` ``JsonExportData`` and
``aiperf/exporters/metrics_json_exporter.py``, and a real run, ``tests/fixtures/aiperf``):

- ``start_time`` / ``end_time``: the profiling phase's span, ISO 8601 without a zone:
  ``datetime.fromtimestamp(ns / 1e9)``, the local time of the machine that ran AIPerf, to the
  microsecond (a zone, when one is written, is honoured);
- ``input_config.phases[]``: the phase named ``profiling`` (else the last), with its ``type``
  (``concurrency``, ``poisson``, ``constant``, ...) and ``concurrency`` or ``rate``;
- per metric, ``{"unit", "avg", "p50", "p99", ...}``: ``request_throughput``
  (requests/sec), ``output_token_throughput`` (tokens/sec), ``time_to_first_token`` and
  ``inter_token_latency`` (``ms``; the unit is read, not assumed);
- ``aiperf_version`` or ``schema_version`` tells an export from other JSON.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from datetime import datetime, tzinfo
from typing import Any

from kvtax.errors import InputError
from kvtax.tools.loadtest.finite import finite
from kvtax.tools.loadtest.guidellm import ToolStep

__all__ = ["aiperf_exports", "is_aiperf", "read_aiperf"]

_SECONDS = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
_RATE_TYPES = ("poisson", "gamma", "constant", "user_centric", "user-centric")


def is_aiperf(export: Any) -> bool:
    """Whether one JSON object looks like an AIPerf ``profile_export_aiperf.json``."""
    return isinstance(export, Mapping) and (
        "aiperf_version" in export or ("schema_version" in export and "input_config" in export)
    )


def aiperf_exports(report: Any) -> list[Any] | None:
    """The exports in ``report`` (one, or a list of them), or None when it is no AIPerf
    export."""
    if is_aiperf(report):
        return [report]
    if isinstance(report, list) and report and all(is_aiperf(r) for r in report):
        return list(report)
    return None


def _stat(export: Mapping[str, Any], name: str, stat: str, seconds: bool = False) -> float | None:
    metric = export.get(name)
    if not isinstance(metric, Mapping):
        return None
    value = finite(metric.get(stat))
    if value is None or not seconds:
        return value
    scale = _SECONDS.get(str(metric.get("unit", "")).strip().lower())
    return None if scale is None else value * scale


def _time(value: Any, field: str, tz: tzinfo | None) -> float:
    if not isinstance(value, str):
        raise InputError(field, "missing or not an ISO 8601 time")
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        shown = value if len(value) <= 40 else value[:37] + "..."
        raise InputError(field, f"{shown!r} is not an ISO 8601 time") from None
    if when.tzinfo is None and tz is not None:
        when = when.replace(tzinfo=tz)
    # Naive and no tz: the local zone of this process (``TZ``), as AIPerf wrote it.
    return when.timestamp()


def _profiling_phase(export: Mapping[str, Any]) -> Mapping[str, Any]:
    config = export.get("input_config")
    phases = config.get("phases") if isinstance(config, Mapping) else None
    if not isinstance(phases, list):
        return {}
    named = [p for p in phases if isinstance(p, Mapping) and p.get("name") == "profiling"]
    if named:
        return named[0]
    rest = [p for p in phases if isinstance(p, Mapping) and p.get("name") != "warmup"]
    return rest[-1] if rest else {}


def read_aiperf(
    exports: Sequence[Any], field: str = "REPORT", tz: tzinfo | None = None
) -> tuple[list[ToolStep], list[int]]:
    """The steps of AIPerf exports in the order they ran, and for each step the position of
    its export in ``exports``; :class:`InputError` names the first field that is wrong. ``tz``
    is the zone the times were written in (default: this process's local zone)."""
    if not exports:
        raise InputError(field, "holds no AIPerf export")
    spans = []
    for i, export in enumerate(exports):
        where = f"{field} run[{i}]"
        if not isinstance(export, Mapping):
            raise InputError(where, "is not an object")
        start = _time(export.get("start_time"), f"{where}.start_time", tz)
        end = _time(export.get("end_time"), f"{where}.end_time", tz)
        if end <= start:
            raise InputError(f"{where}.end_time", f"{end} is not after start_time {start}")
        spans.append((start, end, i))
    spans.sort()
    for (_, end, i), (start, _, j) in itertools.pairwise(spans):
        if start < end:
            raise InputError(
                f"{field} run[{j}]", f"overlaps run[{i}]: the runs of one sweep run one by one"
            )
    steps = []
    for index, (start, end, i) in enumerate(spans):
        export = exports[i]
        phase = _profiling_phase(export)
        kind = str(phase.get("type", "?"))[:40]
        concurrency = finite(phase.get("concurrency"))
        rate = finite(phase.get("rate"))
        if kind == "concurrency" and concurrency is None:
            concurrency = 1.0  # AIPerf's default for a concurrency phase
        if kind in _RATE_TYPES and rate is not None:
            label = f"{kind}@{rate:g}/s"
            if concurrency is not None:
                label += f",max {concurrency:g}"
        elif concurrency is not None:
            label = f"{kind}@{concurrency:g}"
        else:
            label = kind
        steps.append(
            ToolStep(
                index=index,
                label=label,
                start=start,
                end=end,
                concurrency=concurrency if kind not in _RATE_TYPES else None,
                rate=rate,
                requests_per_s=_stat(export, "request_throughput", "avg"),
                output_tokens_per_s=_stat(export, "output_token_throughput", "avg"),
                ttft_p50=_stat(export, "time_to_first_token", "p50", seconds=True),
                ttft_p99=_stat(export, "time_to_first_token", "p99", seconds=True),
                itl_p50=_stat(export, "inter_token_latency", "p50", seconds=True),
                itl_p99=_stat(export, "inter_token_latency", "p99", seconds=True),
            )
        )
    return steps, [i for _, _, i in spans]
