"""The demo's pure half: a phase's figures from kvtax's counters, and the lines it prints.

Every number comes from kvtax: its counters on ``/metrics``, its window gauges, and the tax
formula and best-method rule of :mod:`kvtax.figures.derive`. Nothing here is computed twice.
The live view and the summary show a phase's figures the same way, from counter deltas since the
phase began; kvtax's sliding-window gauges appear only under the window's own label. The live
view pairs numbers taken at one instant: delivered as of vLLM's page
(``kvtax_join_delivered_tokens_total``) beside generated from that same page, never the live
ledger, which leads the engine's last scrape and would show more delivered than generated.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtax.expose.publish import RECOMPUTED_COUNTERS
from kvtax.figures.derive import best_method, tax_ratio
from kvtax.figures.recompute import METHODS

__all__ = [
    "PhaseResult",
    "phase_result",
    "render_empty_panels",
    "render_status",
    "render_summary",
    "window_holds",
]

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


def phase_result(
    name: str,
    seconds: float,
    before: Mapping[str, float],
    after: Mapping[str, float],
    *,
    as_of_page: bool = False,
) -> PhaseResult:
    """A phase's figures from kvtax's counters before and after it. ``as_of_page``: delivered
    as of kvtax's last scrape of vLLM, the instant the engine's counters are of (the live
    view's); else the ledger's own count (the summary's, taken once both have settled)."""

    def delta(metric: str, **labels: str) -> float:
        return (_get(after, metric, **labels) or 0.0) - (_get(before, metric, **labels) or 0.0)

    method = _tax_method(after)
    recomputed = delta(RECOMPUTED_COUNTERS[method])
    generated = delta("kvtax_engine_generation_tokens_total")
    computed = delta("kvtax_engine_prompt_computed_tokens_total")
    delivered_series = (
        "kvtax_join_delivered_tokens_total" if as_of_page else "kvtax_delivered_tokens_total"
    )
    delivered = delta(delivered_series) if _get(after, delivered_series) is not None else None
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


def window_holds(previous: str | None, since_previous_end: float, window_s: float) -> str | None:
    """The earlier phase kvtax's sliding window still holds, if any.

    ``since_previous_end`` is the time since the demo last read the previous phase's counters
    (after its settle): once a whole window has passed since then, the window holds this phase
    alone, and before the first phase it holds nothing but an idle engine.
    """
    if previous is None or since_previous_end >= window_s:
        return None
    return previous


def render_status(
    phase: str,
    elapsed: float,
    before: Mapping[str, float],
    now: Mapping[str, float],
    *,
    window_s: float,
    holds: str | None = None,
) -> list[str]:
    """The live view's lines for one poll of kvtax's /metrics.

    Each line names the span its figures cover. The phase's own figures come from counter
    deltas since the phase began, by :func:`phase_result`, exactly as the summary computes
    them; kvtax's sliding-window judgements (thrash state, recommended ``max_num_seqs``) are
    labelled with their window, and the thrash state is left out while the window still
    ``holds`` an earlier phase, so that a calm phase never shows the overload's verdict.
    """
    r = phase_result(phase, elapsed, before, now, as_of_page=True)
    state = _get(now, "kvtax_thrash_state")
    usage = _get(now, "kvtax_kv_cache_usage_ratio")
    rate = None if r.delivered is None or elapsed <= 0 else r.delivered / elapsed
    # No recompute counter on the page yet (no engine data): no tax, rather than a 0.
    published = _get(now, RECOMPUTED_COUNTERS[r.method]) is not None
    tax = f"{r.tax * 100:.1f} % ({r.method})" if published else "-"
    # While the window still holds an earlier phase, its verdict is that phase's, not this one's.
    shown = None if holds is not None else state
    thrash = THRASH.get(int(shown), "?") if shown is not None else "-"
    lines = [
        f"phase {phase:<9} {elapsed:5.0f}s   vLLM up: "
        f"{'yes' if _get(now, 'kvtax_vllm_up') == 1.0 else 'no'}"
        f"   KV usage now {_fmt(None if usage is None else usage * 100, ' %')}",
        f"  {phase}, last {elapsed:.1f} s: tax {tax}   recomputed {_fmt(r.recomputed, ' tok')}",
        f"    preemptions {_fmt(r.preemptions)}   generated {_fmt(r.generated, ' tok')}"
        f"   delivered {_fmt(r.delivered, ' tok')} ({_fmt(rate, ' tok/s')})",
        f"  kvtax, last {window_s:.0f} s: recommended max_num_seqs "
        f"{_fmt(_get(now, 'kvtax_recommended_max_num_seqs'))}   thrash state {thrash}",
    ]
    if holds is not None:
        lines.append(f"    (the window still holds {holds}: its thrash state is not {phase}'s)")
    return lines


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


def render_empty_panels(records: Sequence[Mapping[str, object]]) -> list[str]:
    """The panels the previews drew without data, from the ``panels.json`` records the
    preview wrote, each with the reason its dashboard gives (or none): a reader then knows
    whether an empty panel is expected (the gate off) or a gap worth a bug report."""
    lines = []
    for record in records:
        empty = record.get("no_data") or {}
        assert isinstance(empty, Mapping)
        for panel, why in empty.items():
            lines.append(f"  {record.get('title')} / {panel}: {why or 'no data'}")
    return lines or ["  (none: every panel of every preview had data)"]
