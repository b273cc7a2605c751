"""``kvtax dashboards``: ``generate [--check]`` the committed JSON and ConfigMap, or ``preview``
every dashboard as PNG from a live Prometheus.

Registered by :mod:`kvtax.cli.main` (``add_dashboards_parser`` + ``command("dashboards")``), like
``kvtax rules``; this module does not import :mod:`kvtax.cli.main` back, so ``python -m
kvtax.cli.main
dashboards`` works too. ``preview`` runs :func:`kvtax_dev.preview.run_preview`, from a checkout
only (an installed kvtax says how to get one); it needs matplotlib (the ``preview`` extra) and
says so, and exits 1 when any query failed, after drawing every dashboard anyway.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from kvtax.cli.checkout import harness_missing, needs_checkout
from kvtax.cli.generated import add_output_arguments, write_or_check
from kvtax.cli.rules import add_config_argument, config_of
from kvtax.mixin.dashboards.generate import artifacts

__all__ = ["add_parser", "run"]

# Enough points for a readable line without asking Prometheus for thousands.
_POINTS = 240


def add_parser(sub: Any, help: str) -> None:
    """Add ``dashboards`` with ``generate`` and ``preview`` to the ``kvtax`` subparsers."""
    top = sub.add_parser(
        "dashboards",
        help=help,
        description="Grafana dashboards as code: Overview, Capacity and Fleet.",
    )
    actions = top.add_subparsers(dest="dashboards_command", metavar="ACTION", required=True)
    gen = actions.add_parser(
        "generate",
        help="Write dashboards/*.json and the Grafana-sidecar ConfigMap.",
        description="Write each dashboard's JSON and kvtax-dashboards-configmap.yaml "
        '(labelled grafana_dashboard: "1") from exporter/kvtax/mixin/dashboards/, with the '
        "thresholds, runbook links and cluster label of --config.",
    )
    add_output_arguments(gen, Path("dashboards"))
    add_config_argument(gen)
    _add_preview_parser(actions)


def _add_preview_parser(actions: Any) -> None:
    """Add ``preview``, whose flags are read by :func:`kvtax_dev.preview.run_preview`."""
    pre = actions.add_parser(
        "preview",
        help="Render every dashboard's panels as PNG from a Prometheus.",
        description="Run every panel's queries against PROMETHEUS and draw each dashboard as "
        "one PNG (OUT/<uid>.png) in its Grafana layout. Needs matplotlib: "
        "pip install 'kvtax[preview]'. Runs from a checkout of the kvtax repository.",
    )
    # The renderer (kvtax_dev.preview) reads the default resolution from here, its one home.
    pre.set_defaults(points=_POINTS)
    pre.add_argument("--prometheus", required=True, metavar="URL", help="Prometheus base URL.")
    pre.add_argument("--out", type=Path, required=True, help="Folder for the PNG files.")
    pre.add_argument(
        "--range",
        dest="time_range",
        default="1h",
        metavar="DURATION",
        help="Show the last DURATION, ending now or at --to (default 1h).",
    )
    pre.add_argument("--from", dest="start", metavar="TIME", help="Start: unix seconds or ISO.")
    pre.add_argument("--to", dest="end", metavar="TIME", help="End: unix seconds or ISO.")
    pre.add_argument("--step", metavar="DURATION", help=f"Resolution (default range/{_POINTS}).")
    pre.add_argument(
        "--scrape-interval",
        default="15s",
        metavar="DURATION",
        help="Prometheus' scrape interval, for $__rate_interval (default 15s).",
    )
    pre.add_argument(
        "--var",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="Set a template variable, e.g. --var model_name=tiny-llama (default: All, i.e. .*).",
    )
    pre.add_argument(
        "--dashboard",
        action="append",
        default=[],
        metavar="UID",
        help="Only this dashboard (repeatable); default: all.",
    )
    pre.add_argument(
        "--config",
        dest="rules_config",
        type=Path,
        metavar="FILE.yaml",
        help="The rules settings the dashboards are built with (the windows their queries "
        "read, as `kvtax dashboards generate --config` builds them): the ones the "
        "Prometheus being read records. Default: the built-in settings.",
    )


def _generate(args: argparse.Namespace) -> int:
    return write_or_check(
        artifacts(config_of(args)),
        args.out,
        check=args.check,
        command="kvtax dashboards",
        fix="kvtax dashboards generate",
    )


def _preview(args: argparse.Namespace) -> int:
    # The renderer and its Prometheus client are development harness: not in the wheel.
    try:
        from kvtax_dev.preview import run_preview
    except ModuleNotFoundError as exc:
        if not harness_missing(exc):
            raise
        how = (
            "pip install -e '.[preview]' && "
            "PYTHONPATH=exporter kvtax dashboards preview --prometheus URL --out DIR"
        )
        print(needs_checkout("kvtax dashboards preview", how), file=sys.stderr)
        return 2
    return run_preview(args)


def run(args: argparse.Namespace) -> int:
    if args.dashboards_command == "generate":
        return _generate(args)
    return _preview(args)
