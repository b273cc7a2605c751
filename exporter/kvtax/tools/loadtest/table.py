"""Reports: the JSON of a sweep, and the table both the Markdown page and the plots draw. Pure.

A :class:`Table` is the common shape of ``kvtax loadtest`` and ``kvtax annotate`` results: one
row per step, load on the x axis, named columns, and the two knees. The Markdown page prints it
and links the plots :mod:`kvtax.tools.loadtest.plots` draws from it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvtax.tools.loadtest.knees import Knee, gate_cap, preemption_knee, throughput_knee
from kvtax.tools.loadtest.measure import StepResult
from kvtax.tools.loadtest.plan import LoadPlan

__all__ = [
    "COLUMNS",
    "REPORT_KIND",
    "Table",
    "knee_json",
    "loadtest_json",
    "loadtest_table",
    "markdown",
]

REPORT_KIND = "kvtax-loadtest"
# Column -> (heading, format). Plots and the Markdown page read the same names.
COLUMNS: Mapping[str, tuple[str, str]] = {
    "throughput": ("throughput tok/s", "{:,.0f}"),
    "goodput": ("goodput tok/s", "{:,.0f}"),
    "slo_goodput": ("SLO goodput tok/s", "{:,.0f}"),
    "requests_per_s": ("requests/s", "{:.2f}"),
    "preemptions": ("preemptions", "{:,.0f}"),
    "tax": ("tax", "{:.1%}"),
    "kv_usage_max": ("KV max", "{:.0%}"),
    "thrash_state": ("thrash", "{}"),
    "ttft_p50": ("TTFT p50 s", "{:.3f}"),
    "ttft_p99": ("TTFT p99 s", "{:.3f}"),
    "itl_p50": ("ITL p50 s", "{:.3f}"),
    "itl_p99": ("ITL p99 s", "{:.3f}"),
    "stalls": ("stalls", "{:,.0f}"),
}

Cell = float | str | None


@dataclass(frozen=True, slots=True)
class Table:
    x_label: str
    x: tuple[float, ...]
    columns: Mapping[str, tuple[Cell, ...]]
    preemption_knee: Knee | None = None
    throughput_knee: Knee | None = None
    # "measured" or "estimated" per row: the recompute method behind the tax.
    tax_method: tuple[str | None, ...] = field(default_factory=tuple)
    # What the "throughput" column holds, for the plot's legend.
    throughput_label: str = "engine throughput"

    def numbers(self, column: str) -> list[float | None]:
        return [v if isinstance(v, int | float) else None for v in self.columns.get(column, ())]


def loadtest_table(mode: str, steps: Sequence[StepResult]) -> Table:
    engine = [s.engine for s in steps]
    preempt = [e.preemptions for e in engine]
    throughput = [s.throughput for s in steps]
    return Table(
        x_label="concurrency" if mode == "concurrency" else "requests/s offered",
        x=tuple(s.level for s in steps),
        columns={
            "throughput": tuple(throughput),
            "goodput": tuple(s.goodput for s in steps),
            "slo_goodput": tuple(s.slo_goodput for s in steps),
            "preemptions": tuple(preempt),
            "tax": tuple(e.tax for e in engine),
            "kv_usage_max": tuple(e.kv_usage_max for e in engine),
            "thrash_state": tuple(e.thrash_state for e in engine),
            "ttft_p50": tuple(s.ttft_p50 for s in steps),
            "ttft_p99": tuple(s.ttft_p99 for s in steps),
            "itl_p50": tuple(s.itl_p50 for s in steps),
            "itl_p99": tuple(s.itl_p99 for s in steps),
            "stalls": tuple(float(s.stalls) for s in steps),
        },
        preemption_knee=preemption_knee(preempt),
        throughput_knee=throughput_knee(throughput),
        tax_method=tuple(e.tax_method for e in engine),
    )


def knee_json(knee: Knee | None, x: Sequence[float]) -> dict[str, Any] | None:
    if knee is None:
        return None
    return {"step": knee.index, "level": x[knee.index], "confirmed": knee.confirmed}


def _clean(value: Any) -> Any:
    """JSON has no NaN or infinity: those become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def loadtest_json(
    *,
    url: str,
    metrics_url: str,
    model: str,
    plan: LoadPlan,
    steps: Sequence[StepResult],
    recommended_max_num_seqs: int | None,
    interrupted: bool,
) -> dict[str, Any]:
    table = loadtest_table(plan.mode, steps)
    in_flight = [
        s.level if plan.mode == "concurrency" else (s.engine.running_max or 0.0) for s in steps
    ]
    cap = gate_cap(in_flight, table.preemption_knee, table.throughput_knee)
    rows = []
    for s in steps:
        row = asdict(s)
        row.update(
            span=s.span, throughput=s.throughput, goodput=s.goodput, slo_goodput=s.slo_goodput
        )
        rows.append(row)
    plan_json = asdict(plan)
    plan_json["prompt_tokens"] = plan.prompt_tokens.describe()
    plan_json["output_tokens"] = plan.output_tokens.describe()
    cleaned: dict[str, Any] = _clean(
        {
            "kind": REPORT_KIND,
            "version": 1,
            "target": {"url": url, "metrics_url": metrics_url, "model": model},
            "plan": plan_json,
            "interrupted": interrupted,
            "steps": rows,
            "knees": {
                "preemption": knee_json(table.preemption_knee, table.x),
                "throughput": knee_json(table.throughput_knee, table.x),
            },
            "recommendations": {
                "max_num_seqs": recommended_max_num_seqs,
                "gate_cap": cap,
            },
        }
    )
    return cleaned


def _cell(column: str, value: Cell) -> str:
    if value is None:
        return "-"
    return COLUMNS[column][1].format(value)


def markdown(
    title: str,
    intro: Sequence[str],
    table: Table,
    plots: Sequence[str],
    notes: Sequence[str] = (),
) -> str:
    """The report page: intro lines, the knees, one row per step, the plots, notes."""
    names = [c for c in COLUMNS if c in table.columns]
    lines = [f"# {title}", "", *intro, ""]
    lines += [
        f"- {_knee_line('preemption', table.preemption_knee, table)}",
        f"- {_knee_line('throughput', table.throughput_knee, table)}",
        "",
    ]
    lines.append(
        "| step | " + table.x_label + " | " + " | ".join(COLUMNS[c][0] for c in names) + " |"
    )
    lines.append("|" + "---|" * (len(names) + 2))
    for i, x in enumerate(table.x):
        marks = []
        if table.preemption_knee and table.preemption_knee.index == i:
            marks.append("P")
        if table.throughput_knee and table.throughput_knee.index == i:
            marks.append("T")
        label = f"{i}" + (f" ({','.join(marks)})" if marks else "")
        cells = [_cell(c, table.columns[c][i]) for c in names]
        if "tax" in names and table.tax_method and table.tax_method[i] not in (None, "measured"):
            j = names.index("tax")
            if cells[j] != "-":
                cells[j] += " est."
        lines.append(f"| {label} | {x:g} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "P: preemption knee; T: throughput knee; est.: tax estimated from "
        "preemptions x mean context (no recompute counter: kvtax's plugin is not loaded).",
        "",
    ]
    lines += [f"![{p}]({p})" for p in plots]
    if notes:
        lines += ["", *notes]
    return "\n".join(lines) + "\n"


def _knee_line(name: str, knee: Knee | None, table: Table) -> str:
    if knee is None:
        return f"{name} knee: none in this sweep"
    state = "" if knee.confirmed else " (last step, not confirmed by a next one)"
    return f"{name} knee: step {knee.index}, {table.x_label} {table.x[knee.index]:g}{state}"
