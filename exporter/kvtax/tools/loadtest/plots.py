"""PNG plots of a :class:`~kvtax.tools.loadtest.table.Table`, drawn with matplotlib when installed.

matplotlib is the optional extra ``kvtax[report]``; without it :func:`write_plots` raises
:class:`PlotsUnavailable` with a one-line message, and the reports are written without plots.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtax.errors import KvtaxError
from kvtax.tools.loadtest.table import Table

__all__ = ["PLOT_NAMES", "PlotsUnavailable", "write_plots"]

PLOT_NAMES = ("throughput", "tax", "latency")


class PlotsUnavailable(KvtaxError, RuntimeError):
    """matplotlib, the optional extra ``kvtax[report]``, is not installed."""


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotsUnavailable(
            "plots: matplotlib is not installed (pip install 'kvtax[report]'); "
            "the report is written without plots"
        ) from None
    return plt


def _knees(ax: Any, table: Table) -> None:
    for knee, colour, name in (
        (table.preemption_knee, "tab:red", "preemption knee"),
        (table.throughput_knee, "tab:green", "throughput knee"),
    ):
        if knee is not None:
            style = "-" if knee.confirmed else ":"
            ax.axvline(table.x[knee.index], color=colour, linestyle=style, label=name)


def _line(ax: Any, table: Table, column: str, label: str, **kw: Any) -> None:
    pairs = [(x, y) for x, y in zip(table.x, table.numbers(column), strict=False) if y is not None]
    if pairs:
        xs, ys = zip(*pairs, strict=True)
        ax.plot(xs, ys, marker="o", label=label, **kw)


def write_plots(table: Table, directory: Path, prefix: str) -> list[Path]:
    """Write ``<prefix>-throughput.png``, ``-tax.png`` and ``-latency.png``; return the paths."""
    plt = _pyplot()
    directory.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    panels: Sequence[tuple[str, str, Sequence[tuple[str, str]]]] = (
        (
            "throughput",
            "tokens/s",
            (
                ("throughput", table.throughput_label),
                ("goodput", "goodput"),
                ("slo_goodput", "SLO goodput"),
            ),
        ),
        ("tax", "share of engine token work", (("tax", "preemption tax"),)),
        (
            "latency",
            "seconds",
            (
                ("ttft_p50", "TTFT p50"),
                ("ttft_p99", "TTFT p99"),
                ("itl_p50", "ITL p50"),
                ("itl_p99", "ITL p99"),
            ),
        ),
    )
    for name, y_label, series in panels:
        fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
        for column, label in series:
            _line(ax, table, column, label)
        if name == "tax":
            twin = ax.twinx()
            _line(twin, table, "preemptions", "preemptions", color="tab:gray", linestyle="--")
            twin.set_ylabel("preemptions per step")
            twin.legend(loc="upper right", fontsize="small")
        if name == "latency" and any(v for v in table.numbers("ttft_p99")):
            ax.set_yscale("log")
        _knees(ax, table)
        ax.set_xlabel(table.x_label)
        ax.set_ylabel(y_label)
        ax.set_title(f"{name} against load")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize="small")
        fig.tight_layout()
        path = directory / f"{prefix}-{name}.png"
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths
