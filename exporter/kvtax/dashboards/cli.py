"""``kvtax dashboards``: ``generate [--check]`` the committed JSON and ConfigMap, or ``preview``
every dashboard as PNG from a live Prometheus.

Registered by :mod:`kvtax.cli` (``add_dashboards_parser`` + ``command("dashboards")``), like
``kvtax rules``; this module does not import :mod:`kvtax.cli` back, so ``python -m kvtax.cli
dashboards`` works too. ``preview`` needs matplotlib (the ``preview`` extra) and says so; it
exits 1 when any query failed, after drawing every dashboard anyway.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from ..config import parse_duration
from .generate import artifacts, dashboards

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
        "pip install 'kvtax[preview]'.",
    )
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


def _time(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return datetime.fromisoformat(text).timestamp()


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
    from .preview import PreviewUnavailableError, draw, fetch, rate_interval, require_matplotlib
    from .promapi import PrometheusApi

    try:
        require_matplotlib()
    except PreviewUnavailableError as exc:
        print(f"kvtax: {exc}", file=sys.stderr)
        return 2

    try:
        end = _time(args.end) if args.end else time.time()
        start = _time(args.start) if args.start else end - parse_duration(args.time_range)
        step = parse_duration(args.step) if args.step else max(1.0, (end - start) / _POINTS)
        scrape = parse_duration(args.scrape_interval)
        values = dict(v.split("=", 1) for v in args.var)
    except ValueError as exc:
        print(f"kvtax dashboards preview: {exc}", file=sys.stderr)
        return 2
    if not start < end:
        print("kvtax dashboards preview: --from must be before --to", file=sys.stderr)
        return 2
    api = PrometheusApi(args.prometheus)
    chosen = {
        name: doc
        for name, doc in dashboards().items()
        if not args.dashboard or doc["uid"] in args.dashboard
    }
    interval = rate_interval(math.ceil(step), scrape)
    failed = 0
    for doc in chosen.values():
        data = fetch(
            doc, api, start=start, end=end, step=step, rate_interval=interval, values=values
        )
        path = draw(doc, data, args.out / f"{doc['uid']}.png", start=start, end=end)
        errors = [d.error for rows in data.values() for d in rows if d.error]
        empty = sum(1 for rows in data.values() for d in rows if not d.series and not d.error)
        print(f"{path}: {len(errors)} query errors, {empty} queries without data")
        if errors:
            print(f"kvtax dashboards preview: first error: {errors[0]}", file=sys.stderr)
        failed += len(errors)
    # The pictures are written either way (a bug report wants them); the status tells CI.
    return 1 if failed else 0


def run_dashboards(args: argparse.Namespace) -> int:
    if args.dashboards_command == "generate":
        return _generate(args)
    return _preview(args)
