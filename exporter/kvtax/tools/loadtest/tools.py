"""Which benchmark tool wrote a report, and its steps: guidellm, AIPerf or ``vllm bench serve``.
Pure.

Each tool has its reader (:mod:`~kvtax.tools.loadtest.guidellm`,
:mod:`~kvtax.tools.loadtest.aiperf`,
:mod:`~kvtax.tools.loadtest.vllmbench`); this module tells the reports apart by their fields and
returns one shape for annotation: the steps, and a *document* whose ``benchmarks`` list holds
each step's object as the tool wrote it, in step order, for the annotation to extend. For
guidellm the document is the report itself; for the others, whose reports are one object per
run, it is ``{"tool": ..., "benchmarks": [...]}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import tzinfo
from typing import Any

from kvtax.errors import InputError
from kvtax.tools.loadtest.aiperf import aiperf_exports, read_aiperf
from kvtax.tools.loadtest.guidellm import ToolStep, read_guidellm
from kvtax.tools.loadtest.vllmbench import read_vllm_bench, vllm_bench_results

__all__ = ["FORMATS", "ToolReport", "detect_format", "read_report"]

FORMATS = ("guidellm", "aiperf", "vllm-bench")
_NAMES = {"guidellm": "guidellm", "aiperf": "AIPerf", "vllm-bench": "vllm bench serve"}


@dataclass(frozen=True, slots=True)
class ToolReport:
    tool: str
    steps: list[ToolStep]
    document: dict[str, Any]
    # How errors name step i: f"{step_field}[{i}]".
    step_field: str

    @property
    def name(self) -> str:
        return _NAMES[self.tool]

    @property
    def throughput_label(self) -> str:
        return f"{self.name} output tokens/s"


def detect_format(report: Any) -> str | None:
    """The tool that wrote ``report``, by its fields, or None."""
    if isinstance(report, Mapping) and isinstance(report.get("benchmarks"), list):
        return "guidellm"
    if aiperf_exports(report) is not None:
        return "aiperf"
    if vllm_bench_results(report) is not None:
        return "vllm-bench"
    return None


def read_report(
    report: Any, fmt: str = "auto", *, field: str = "REPORT", tz: tzinfo | None = None
) -> ToolReport:
    """``report`` (one JSON value, or a list of a tool's per-run objects) read as ``fmt``, or
    as the tool :func:`detect_format` finds; ``tz`` is the zone of the times AIPerf and vLLM
    write without one (default: this process's local zone)."""
    tool = detect_format(report) if fmt == "auto" else fmt
    if tool is None:
        raise InputError(
            field,
            "is not a report kvtax reads: not guidellm's (benchmarks[]), AIPerf's "
            "(profile_export_aiperf.json) or vllm bench serve's (--save-result); "
            "--format names the tool",
        )
    if tool == "guidellm":
        if not isinstance(report, Mapping):
            raise InputError(field, "is not a JSON object")
        steps = read_guidellm(report, field)
        return ToolReport(tool, steps, dict(report), f"{field} benchmarks")
    if tool == "aiperf":
        exports = aiperf_exports(report)
        if exports is None:
            raise InputError(field, "is not an AIPerf export (no aiperf_version)")
        steps, order = read_aiperf(exports, field, tz)
        document = {"tool": tool, "benchmarks": [exports[i] for i in order]}
        return ToolReport(tool, steps, document, f"{field} run")
    if tool == "vllm-bench":
        results = vllm_bench_results(report)
        if results is None:
            raise InputError(field, "is not a vllm bench serve result (no date and duration)")
        steps = read_vllm_bench(results, field, tz)
        return ToolReport(tool, steps, {"tool": tool, "benchmarks": results}, f"{field} result")
    raise InputError("--format", f"{tool!r} is not one of {', '.join(FORMATS)}")
