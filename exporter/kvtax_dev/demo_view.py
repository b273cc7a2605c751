"""The demo's pure half: a phase's figures from kvtax's counters, and the lines it prints.

Every number comes from kvtax: its counters on ``/metrics``, its window gauges, and the tax
formula and best-method rule of :mod:`kvtax.figures.derive`. Nothing here is computed twice.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvtax.expose.publish import RECOMPUTED_COUNTERS
from kvtax.figures.derive import best_method, tax_ratio
from kvtax.figures.recompute import METHODS

__all__ = ["PhaseResult", "phase_result", "render_status", "render_summary"]

THRASH = {0: "ok", 1: "at risk", 2: "THRASHING"}


@dataclass(frozen=True, slots=True)
class PhaseResult:
    name: str
    seconds: float
    preemptions: float
    generated: float
    delivered: float | None
    recomputed: float
    method: str
    tax: float


def _get(metrics: Mapping[str, float], name: str, **labels: str) -> float | None:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total, found = 0.0, False
    for key, value in metrics.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
            found = True
    return total if found else None


def _tax_method(metrics: Mapping[str, float]) -> str:
    """The best recompute method kvtax publishes, in kvtax's own order of preference."""
    totals = {key: _get(metrics, RECOMPUTED_COUNTERS[method]) for method, key in METHODS}
    best = best_method({key: total for key, total in totals.items() if total is not None})
    return best[0] if best is not None else "estimated"


def _published_tax(metrics: Mapping[str, float]) -> tuple[float | None, str | None]:
    """kvtax's own window tax gauge (one series per model) and the method it names."""
    for key, value in metrics.items():
        base, _, rest = key.partition("{")
        if base == "kvtax_preemption_tax_ratio":
            method = rest.partition('method="')[2].partition('"')[0]
            return value, method or None
    return None, None


def phase_result(
    name: str, seconds: float, before: Mapping[str, float], after: Mapping[str, float]
) -> PhaseResult:
    """A phase's figures from kvtax's counters before and after it."""

    def delta(metric: str, **labels: str) -> float:
        return (_get(after, metric, **labels) or 0.0) - (_get(before, metric, **labels) or 0.0)

    method = _tax_method(after)
    recomputed = delta(RECOMPUTED_COUNTERS[method])
    generated = delta("kvtax_engine_generation_tokens_total")
    computed = delta("kvtax_engine_prompt_computed_tokens_total")
    delivered = (
        delta("kvtax_delivered_tokens_total")
        if _get(after, "kvtax_delivered_tokens_total") is not None
        else None
    )
    return PhaseResult(
        name=name,
        seconds=seconds,
        preemptions=delta("kvtax_engine_preemptions_total"),
        generated=generated,
        delivered=delivered,
        recomputed=recomputed,
        method=method,
        tax=tax_ratio(recomputed, computed, generated),
    )


def _fmt(value: float | None, unit: str = "", digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}{unit}"


def render_status(metrics: Mapping[str, float], phase: str, elapsed: float) -> list[str]:
    """The live view's lines for one poll of kvtax's /metrics."""
    tax, method = _published_tax(metrics)
    state = _get(metrics, "kvtax_thrash_state")
    usage = _get(metrics, "kvtax_kv_cache_usage_ratio")
    return [
        f"phase {phase:<9} {elapsed:5.0f}s   vLLM up: "
        f"{'yes' if _get(metrics, 'kvtax_vllm_up') == 1.0 else 'no'}",
        f"  goodput          {_fmt(_get(metrics, 'kvtax_goodput_tokens_per_second'), ' tok/s')}"
        f"   engine generated "
        f"{_fmt(_get(metrics, 'kvtax_engine_generation_tokens_total'), ' tok')}",
        f"  preemption tax   {_fmt(None if tax is None else tax * 100, ' %', 1)} ({method or '-'})"
        f"   KV usage {_fmt(None if usage is None else usage * 100, ' %')}",
        f"  preemptions      {_fmt(_get(metrics, 'kvtax_engine_preemptions_total'))}"
        f"   recommended max_num_seqs "
        f"{_fmt(_get(metrics, 'kvtax_recommended_max_num_seqs'))}"
        f"   thrash state {THRASH.get(int(state), '?') if state is not None else '-'}",
    ]


def render_summary(
    results: list[PhaseResult],
    metrics_url: str,
    previews: Path | None,
    configured: int,
    last: Mapping[str, float],
) -> str:
    """The closing summary: each phase's figures, then what to change."""
    lines = ["", "== kvtax demo summary =="]
    lines.append(
        f"{'phase':<10}{'seconds':>8}{'preemptions':>13}{'generated':>11}"
        f"{'delivered':>11}{'recomputed':>12}{'tax':>9}"
    )
    for r in results:
        lines.append(
            f"{r.name:<10}{r.seconds:>8.1f}{r.preemptions:>13,.0f}{r.generated:>11,.0f}"
            f"{_fmt(r.delivered):>11}{r.recomputed:>12,.0f}{r.tax * 100:>8.1f}%"
        )
    method = results[0].method if results else "estimated"
    lines += ["", f"tax = recomputed / (computed prompt + generated + recomputed), {method}."]
    recommended = _get(last, "kvtax_recommended_max_num_seqs")
    capacity = _get(last, "kvtax_kv_capacity_tokens")
    p95 = _get(last, "kvtax_request_length_p95_tokens")
    if recommended is not None and capacity is not None and p95 is not None:
        lines.append(
            f"The engine ran with max_num_seqs={configured}; its {capacity:,.0f}-token KV pool "
            f"holds {recommended:.0f} requests of the p95 length ({p95:,.0f} tokens) at 90 % "
            f"usage, so kvtax recommends --max-num-seqs={recommended:.0f}."
        )
    lines.append(f"kvtax's metrics were served at {metrics_url} (stopped with the demo).")
    if previews is not None:
        lines.append(f"Dashboard previews (PNG): {previews}")
    else:
        lines.append("Run with --with-prometheus for alerts and dashboard previews.")
    return "\n".join(lines)
