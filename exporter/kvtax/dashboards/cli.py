"""``kvtax dashboards``: ``generate [--check]`` the committed JSON and ConfigMap, or ``preview``
every dashboard as PNG from a live Prometheus.

Registered by :mod:`kvtax.cli` (``add_dashboards_parser`` + ``command("dashboards")``), like
``kvtax rules``; this module does not import :mod:`kvtax.cli` back, so ``python -m kvtax.cli
dashboards`` works too. ``preview`` runs :func:`kvtax_dev.preview.run_preview`, from a checkout
only (an installed kvtax says how to get one); it needs matplotlib (the ``preview`` extra) and
says so, and exits 1 when any query failed, after drawing every dashboard anyway.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from kvtax.checkout import harness_missing, needs_checkout

from .generate import artifacts

__all__ = ["add_dashboards_parser", "run_dashboards", "stale_files"]

# Enough points for a readable line without asking Prometheus for thousands.
_POINTS = 240


def add_dashboards_parser(sub: Any) -> None:
    """Add ``dashboards`` with ``generate`` and ``preview`` to the ``kvtax`` subparsers."""
    top = sub.add_parser(
        "dashboards",
        help="Generate the Grafana dashboards, or preview them as PNG.",
        description="Grafana dashboards as code: Overview, Capacity and Fleet.",
    )
    actions = top.add_subparsers(dest="dashboards_command", metavar="ACTION", required=True)
    gen = actions.add_parser(
        "generate",
        help="Write dashboards/*.json and the Grafana-sidecar ConfigMap.",
        description="Write each dashboard's JSON and kvtax-dashboards-configmap.yaml "
        '(labelled grafana_dashboard: "1") from exporter/kvtax/dashboards/.',
    )
    gen.add_argument("--out", type=Path, default=Path("dashboards"), help="Folder to write into.")
    gen.add_argument(
        "--check",
        action="store_true",
        help="Exit 1 if the committed files differ instead of writing them.",
    )
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
        help="Set a template variable, e.g. --var model=tiny-llama (default: All, i.e. .*).",
    )
    pre.add_argument(
        "--dashboard",
        action="append",
        default=[],
        metavar="UID",
        help="Only this dashboard (repeatable); default: all.",
    )


def stale_files(out: Path) -> list[Path]:
    """Generated files under ``out`` that are missing or differ from the generator's output."""
    return [
        out / name
        for name, text in artifacts().items()
        if not (out / name).exists() or (out / name).read_text() != text
    ]


def _generate(args: argparse.Namespace) -> int:
    out: Path = args.out
    if args.check:
        stale = stale_files(out)
        if stale:
            names = ", ".join(str(p) for p in stale)
            print(
                f"kvtax dashboards: out of date: {names}; run `kvtax dashboards generate`",
                file=sys.stderr,
            )
            return 1
        return 0
    out.mkdir(parents=True, exist_ok=True)
    for name, text in artifacts().items():
        (out / name).write_text(text)
    return 0


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


def run_dashboards(args: argparse.Namespace) -> int:
    if args.dashboards_command == "generate":
        return _generate(args)
    return _preview(args)
