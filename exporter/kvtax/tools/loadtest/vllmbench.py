"""vLLM's own benchmark, ``vllm bench serve --save-result``, read as steps. Pure.

One ``vllm bench serve`` run is one load level, so a sweep is several runs: written into one
file with ``--append-result`` (one JSON object per line), collected by ``vllm bench sweep`` (a
JSON array), or given one at a time. Each object is one step.

The fields used, as vLLM 0.32 writes them (``vllm/benchmarks/serve.py``, ``main_async`` and
``benchmark``; checked against a real run, ``tests/fixtures/vllm-bench``):

- ``date``: ``YYYYMMDD-HHMMSS``, the local time read right after the run's last response
  (``datetime.now()``, whole seconds, no zone);
- ``duration``: the run's measured length in seconds (first request sent to last response);
- ``max_concurrency`` (null when unbounded) and ``request_rate`` (a number, or ``"inf"``);
- ``request_throughput``, ``output_throughput``: requests/s and output tokens/s achieved;
- ``median_ttft_ms``, ``p99_ttft_ms``, ``median_itl_ms``, ``p99_itl_ms``: present when those
  percentiles were asked for (``--metric-percentiles``, default 99; the median always is).

The report holds no exact wall-clock start: its request times are ``time.perf_counter()``
values, which name no date. The span is therefore rebuilt from ``date`` and ``duration``. The
run ended at most a moment before ``datetime.now()`` was read, which lies within the second
``date`` names, so the measured span lies inside ``[date - duration - 1 s, date + 1 s]``; that
window is the step (:data:`SLACK_S` each side). vLLM's benchmark sends nothing in that slack:
before the span it loads the tokenizer and samples prompts, after it only summarizes.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from datetime import datetime, tzinfo
from typing import Any

from kvtax.errors import InputError
from kvtax.tools.loadtest.finite import finite
from kvtax.tools.loadtest.guidellm import ToolStep

__all__ = ["SLACK_S", "is_vllm_bench", "read_vllm_bench", "vllm_bench_results"]

# The rounding of ``date`` to whole seconds, plus the moment between the last response and
# reading the clock: the window added to each side of the measured span.
SLACK_S = 1.0
_DATE_FORMAT = "%Y%m%d-%H%M%S"


def is_vllm_bench(result: Any) -> bool:
    """Whether one JSON object looks like a ``vllm bench serve`` result."""
    return (
        isinstance(result, Mapping)
        and "date" in result
        and "duration" in result
        and ("endpoint_type" in result or "backend" in result)
    )


def vllm_bench_results(report: Any) -> list[Any] | None:
    """The results in ``report`` (one object, or a list of them), or None when it is no
    ``vllm bench serve`` report."""
    if is_vllm_bench(report):
        return [report]
    if isinstance(report, list) and report and all(is_vllm_bench(r) for r in report):
        return list(report)
    return None


def _ms(result: Mapping[str, Any], key: str) -> float | None:
    value = finite(result.get(key))
    return None if value is None else value * 1e-3


def _end(date: Any, where: str, tz: tzinfo | None) -> float:
    if not isinstance(date, str):
        raise InputError(f"{where}.date", "missing or not text")
    try:
        when = datetime.strptime(date, _DATE_FORMAT)
    except ValueError:
        shown = date if len(date) <= 40 else date[:37] + "..."
        raise InputError(f"{where}.date", f"{shown!r} is not YYYYMMDD-HHMMSS") from None
    # Naive: the local zone of this process (``TZ``), as vLLM wrote it.
    return (when if tz is None else when.replace(tzinfo=tz)).timestamp()


def read_vllm_bench(
    results: Sequence[Any], field: str = "REPORT", tz: tzinfo | None = None
) -> list[ToolStep]:
    """The steps of ``vllm bench serve`` results, in the given order; :class:`InputError` names
    the first field that is wrong. ``tz`` is the zone ``date`` was written in (default: this
    process's local zone)."""
    if not results:
        raise InputError(field, "holds no vllm bench serve result")
    steps = []
    for i, result in enumerate(results):
        where = f"{field} result[{i}]"
        if not isinstance(result, Mapping):
            raise InputError(where, "is not an object")
        duration = finite(result.get("duration"))
        if duration is None or duration <= 0:
            raise InputError(f"{where}.duration", "missing or not a positive number of seconds")
        end = _end(result.get("date"), where, tz)
        concurrency = finite(result.get("max_concurrency"))
        rate = finite(result.get("request_rate"))  # "inf" is no rate: all at once
        if concurrency is not None:
            label = f"concurrency@{concurrency:g}"
        elif rate is not None:
            label = f"rate@{rate:g}/s"
        else:
            label = f"burst@{result.get('num_prompts', '?')}"[:40]
        steps.append(
            ToolStep(
                index=i,
                label=label,
                start=end - duration - SLACK_S,
                end=end + SLACK_S,
                concurrency=concurrency,
                rate=rate,
                requests_per_s=finite(result.get("request_throughput")),
                output_tokens_per_s=finite(result.get("output_throughput")),
                ttft_p50=_ms(result, "median_ttft_ms"),
                ttft_p99=_ms(result, "p99_ttft_ms"),
                itl_p50=_ms(result, "median_itl_ms"),
                itl_p99=_ms(result, "p99_itl_ms"),
            )
        )
    ordered = sorted(steps, key=lambda s: s.start)
    for before, after in itertools.pairwise(ordered):
        if after.start < before.end:
            raise InputError(
                f"{field} result[{after.index}]",
                f"step {after.label} overlaps step {before.label} (with {SLACK_S:g} s each "
                "side for the rounded date): each run must start after the one before ended",
            )
    return steps
