"""``kvtax rules``: write the generated rule files and Alertmanager example, or check them.

Registered by :mod:`kvtax.cli.main` (``add_rules_parser`` + ``command("rules")(run_rules)``); this
module does not import it back, so ``python -m kvtax.cli.main rules`` works too. ``--check`` exits 1
naming every file that differs from the generator's output, the same test CI runs
(:func:`kvtax.cli.generated.write_or_check`, shared with ``kvtax docs`` and ``kvtax dashboards``).
``--config FILE.yaml`` sets any :class:`~kvtax.mixin.rules.config.RulesConfig` field
(:mod:`kvtax.mixin.rules.configfile`); a bad file exits 2 with one line naming the key.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvtax.cli.generated import add_output_arguments, write_or_check
from kvtax.mixin.rules.config import DEFAULT, RulesConfig
from kvtax.mixin.rules.configfile import read
from kvtax.mixin.rules.render import render_files

__all__ = ["add_config_argument", "add_parser", "config_of", "run"]


def add_config_argument(parser: argparse.ArgumentParser) -> None:
    """``--config FILE.yaml``: RulesConfig's settings, shared by ``rules`` and ``dashboards``."""
    parser.add_argument(
        "--config",
        dest="rules_config",
        type=Path,
        metavar="FILE.yaml",
        help="YAML file setting any rules setting (thresholds, for: durations, windows, "
        "selectors, cluster_label, runbook_url_base, release_label, severity_overrides); "
        "see docs/rules.md. Default: the built-in settings.",
    )


def config_of(args: argparse.Namespace) -> RulesConfig:
    """The RulesConfig ``--config`` names (the defaults without it). A bad file raises
    :class:`kvtax.errors.RulesConfigError`, which :func:`kvtax.cli.main.main` prints as one line
    naming the file and the key, exiting 2."""
    path: Path | None = getattr(args, "rules_config", None)
    return DEFAULT if path is None else read(path)


def add_parser(sub: Any, help: str) -> None:
    """Add the ``rules`` subcommand to the subparsers object of the ``kvtax`` parser."""
    rules = sub.add_parser(
        "rules",
        help=help,
        description="Generate alerts/: alert and recording rules, their PrometheusRule "
        "wrapper and an example Alertmanager config, from exporter/kvtax/mixin/rules/config.py "
        "or the settings of --config.",
    )
    add_output_arguments(rules, Path("alerts"))
    add_config_argument(rules)


def run(args: argparse.Namespace) -> int:
    config = config_of(args)
    return write_or_check(render_files(config), args.out, check=args.check, command="kvtax rules")
