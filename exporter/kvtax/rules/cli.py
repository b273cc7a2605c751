"""``kvtax rules``: write the generated rule files and Alertmanager example, or check them.

Registered by :mod:`kvtax.cli` (``add_rules_parser`` + ``command("rules")(run_rules)``); this
module does not import it back, so ``python -m kvtax.cli rules`` works too. ``--check`` exits 1
naming every file that differs from the generator's output, the same test CI runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from .render import render_files

__all__ = ["add_rules_parser", "run_rules", "stale_files"]


def add_rules_parser(sub: Any) -> None:
    """Add the ``rules`` subcommand to the subparsers object of the ``kvtax`` parser."""
    rules = sub.add_parser(
        "rules",
        help="Write the generated Prometheus rules and Alertmanager example.",
        description="Generate alerts/: alert and recording rules, their PrometheusRule "
        "wrapper and an example Alertmanager config, from exporter/kvtax/rules/config.py.",
    )
    rules.add_argument("--out", type=Path, default=Path("alerts"), help="Folder to write into.")
    rules.add_argument(
        "--check",
        action="store_true",
        help="Exit 1 if the committed files differ instead of writing them.",
    )


def stale_files(out: Path) -> list[Path]:
    """Generated files under ``out`` that are missing or differ from the generator's output."""
    return [
        out / name
        for name, text in render_files().items()
        if not (out / name).exists() or (out / name).read_text() != text
    ]


def run_rules(args: argparse.Namespace) -> int:
    out: Path = args.out
    if args.check:
        stale = stale_files(out)
        if stale:
            names = ", ".join(str(p) for p in stale)
            print(f"kvtax rules: out of date: {names}; run `kvtax rules`", file=sys.stderr)
            return 1
        return 0
    out.mkdir(parents=True, exist_ok=True)
    for name, text in render_files().items():
        (out / name).write_text(text)
    return 0
