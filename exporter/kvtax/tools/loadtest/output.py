"""Writes a report's files: ``<stem>.json``, ``<stem>.md`` and the PNG plots beside them."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtax.tools.loadtest.plots import PlotsUnavailable, write_plots
from kvtax.tools.loadtest.table import Table, markdown

__all__ = ["write_report"]


def write_report(
    out: Path,
    stem: str,
    report: dict[str, Any],
    *,
    title: str,
    intro: Sequence[str],
    table: Table,
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    notes: list[str] = []
    try:
        plots = [p.name for p in write_plots(table, out, stem)] if table.x else []
    except PlotsUnavailable as exc:
        plots = []
        notes.append(str(exc))
        print(f"kvtax: {exc}", file=sys.stderr)
    (out / f"{stem}.md").write_text(markdown(title, intro, table, plots, notes))
    done = f"kvtax: wrote {out / (stem + '.json')}, {out / (stem + '.md')}"
    print(done + (f" and {len(plots)} plots" if plots else ""), file=sys.stderr, flush=True)
