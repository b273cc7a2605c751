"""``kvtax rules``: write the generated rule files and Alertmanager example, or check them.

Registered by :mod:`kvtax.cli` (``add_rules_parser`` + ``command("rules")(run_rules)``); this
module does not import it back, so ``python -m kvtax.cli rules`` works too. ``--check`` exits 1
naming every file that differs from the generator's output, the same test CI runs
(:func:`kvtax.generated.write_or_check`, shared with ``kvtax docs`` and ``kvtax dashboards``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvtax.generated import add_output_arguments, write_or_check

from .render import render_files

__all__ = ["add_rules_parser", "run_rules"]


def add_rules_parser(sub: Any) -> None:
    """Add the ``rules`` subcommand to the subparsers object of the ``kvtax`` parser."""
    rules = sub.add_parser(
        "rules",
        help="Write the generated Prometheus rules and Alertmanager example.",
        description="Generate alerts/: alert and recording rules, their PrometheusRule "
        "wrapper and an example Alertmanager config, from exporter/kvtax/rules/config.py.",
    )
    add_output_arguments(rules, Path("alerts"))


def run_rules(args: argparse.Namespace) -> int:
    return write_or_check(render_files(), args.out, check=args.check, command="kvtax rules")
