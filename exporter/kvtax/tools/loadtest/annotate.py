"""A benchmark tool's steps with the engine's side added: preemptions, tax, KV usage, thrash. Pure.

Each step's engine figures come from :func:`kvtax.tools.loadtest.measure.engine_step` over the
timeline's slice for the step (:meth:`~kvtax.tools.loadtest.timeline.Timeline.span`), so they are
the numbers ``kvtax loadtest`` and the dashboards compute. The x axis of the table is the tool's
concurrency when every step has one, else the request rate it achieved. The tool is any whose
report :mod:`kvtax.tools.loadtest.tools` reads: guidellm, AIPerf, ``vllm bench serve``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from kvtax.errors import InputError
from kvtax.figures.derive import EngineSettings
from kvtax.tools.loadtest.guidellm import ToolStep
from kvtax.tools.loadtest.knees import preemption_knee, throughput_knee
from kvtax.tools.loadtest.measure import EngineStep, engine_step
from kvtax.tools.loadtest.table import Table, knee_json
from kvtax.tools.loadtest.timeline import Timeline

__all__ = ["annotate_steps", "annotation_json", "annotation_table", "pick_model"]


def pick_model(timeline: Timeline, model: str | None, field: str) -> str:
    models = timeline.models()
    if model is not None:
        if model not in models:
            raise InputError("--model", f"{model!r} is not in {field} (it has {models or 'none'})")
        return model
    if len(models) != 1:
        raise InputError("--model", f"{field} has {len(models)} models ({models}); name one")
    return models[0]


def annotate_steps(
    steps: Sequence[ToolStep],
    timeline: Timeline,
    model: str,
    settings: EngineSettings,
    field: str,
    *,
    step_field: str = "REPORT benchmarks",
) -> list[EngineStep]:
    out = []
    for step in steps:
        points = timeline.span(model, step.start, step.end)
        if len(points) < 2:
            raise InputError(
                f"{step_field}[{step.index}]",
                f"step {step.label} ({step.start:.3f} to {step.end:.3f}) is not covered by "
                f"{field}: too short to measure, or recorded outside its span",
            )
        out.append(engine_step(points, settings))
    return out


def annotation_table(
    steps: Sequence[ToolStep],
    engine: Sequence[EngineStep],
    *,
    throughput_label: str = "guidellm output tokens/s",
) -> Table:
    by_concurrency = all(s.concurrency is not None for s in steps)
    x = tuple(
        (s.concurrency if by_concurrency else s.requests_per_s) or float(s.index) for s in steps
    )
    preempt = [e.preemptions for e in engine]
    tool = [s.output_tokens_per_s for s in steps]
    return Table(
        x_label="concurrency" if by_concurrency else "requests/s achieved",
        x=x,
        columns={
            "throughput": tuple(tool),
            "requests_per_s": tuple(s.requests_per_s for s in steps),
            "preemptions": tuple(preempt),
            "tax": tuple(e.tax for e in engine),
            "kv_usage_max": tuple(e.kv_usage_max for e in engine),
            "thrash_state": tuple(e.thrash_state for e in engine),
            "ttft_p50": tuple(s.ttft_p50 for s in steps),
            "ttft_p99": tuple(s.ttft_p99 for s in steps),
            "itl_p50": tuple(s.itl_p50 for s in steps),
            "itl_p99": tuple(s.itl_p99 for s in steps),
        },
        preemption_knee=preemption_knee(preempt),
        throughput_knee=throughput_knee(tool),
        tax_method=tuple(e.tax_method for e in engine),
        throughput_label=throughput_label,
    )


def annotation_json(
    report: dict[str, Any],
    steps: Sequence[ToolStep],
    engine: Sequence[EngineStep],
    table: Table,
    *,
    source: str,
    model: str,
    tool: str = "guidellm",
) -> dict[str, Any]:
    """The tool's report with ``kvtax`` added to each benchmark and at the top (``report`` is
    a :attr:`kvtax.tools.loadtest.tools.ToolReport.document`: its ``benchmarks`` are the steps)."""
    out = dict(report)
    benches = [dict(b) for b in report["benchmarks"]]
    for bench, step, e in zip(benches, steps, engine, strict=True):
        bench["kvtax"] = {"label": step.label, **asdict(e)}
    out["benchmarks"] = benches
    out["kvtax"] = {
        "tool": tool,
        "source": source,
        "model": model,
        "x": table.x_label,
        "knees": {
            "preemption": knee_json(table.preemption_knee, table.x),
            # The tool's output tokens/s over the steps, by kvtax's rule (5 % gain).
            "throughput": knee_json(table.throughput_knee, table.x),
        },
    }
    return out
