"""``kvtax annotate``: record the engine during a benchmark, or annotate a benchmark's report.

Two uses:

- ``kvtax annotate --record run.jsonl.gz --metrics-url URL`` scrapes until Ctrl-C (or
  ``--duration``), while the benchmark runs;
- ``kvtax annotate REPORT --recording run.jsonl.gz`` (or ``--prometheus URL``) writes
  ``<stem>-kvtax.json``, ``.md`` and PNG plots with the engine's figures per step.

REPORT is guidellm's JSON, AIPerf's ``profile_export_aiperf.json`` (or a directory holding one
per run, as an AIPerf sweep writes), or ``vllm bench serve --save-result`` output (one object,
or one per line with ``--append-result``, or a JSON array of them).
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import signal
import sys
import zlib
from pathlib import Path
from typing import Any

from kvtax.errors import InputError
from kvtax.figures.derive import EngineSettings
from kvtax.tools.loadtest.annotate import (
    annotate_steps,
    annotation_json,
    annotation_table,
    pick_model,
)
from kvtax.tools.loadtest.output import write_report
from kvtax.tools.loadtest.timeline import Scrape, Timeline
from kvtax.tools.loadtest.tools import FORMATS, read_report

__all__ = ["MAX_REPORT_BYTES", "add_parser", "run"]

GIB = 2**30
# The most JSON a report may hold, decompressed: guidellm's reports are megabytes, and reading a
# gzip bomb whole would end in MemoryError. Read in a stream, and refused past this, naming it.
# For a directory of AIPerf exports, the bound is on all of them together.
MAX_REPORT_BYTES = GIB
# The export AIPerf writes for each run; a sweep's artifact directory holds one per run.
AIPERF_EXPORT = "profile_export_aiperf.json"


def add_parser(sub: Any, help: str) -> None:
    p = sub.add_parser(
        "annotate",
        help=help,
        description="Annotate every step of a benchmark tool's report with the engine's "
        "figures over that step's time span, from a recording kvtax made during the run "
        "(--recording) or a Prometheus (--prometheus); or make such a recording (--record).",
    )
    p.add_argument(
        "report",
        nargs="?",
        type=Path,
        metavar="REPORT",
        help="The tool's JSON report: guidellm 0.8's, AIPerf 0.13's "
        f"{AIPERF_EXPORT} (or a directory of them, one per run of a sweep), or "
        "vllm bench serve --save-result's (one object per line with --append-result); "
        ".json, .jsonl or .gz; at most 1 GiB of JSON once decompressed.",
    )
    p.add_argument(
        "--format",
        choices=("auto", *FORMATS),
        default="auto",
        help="The tool that wrote REPORT (default: told by its fields).",
    )
    p.add_argument(
        "--recording",
        type=Path,
        metavar="FILE",
        help="A recording made with --record during the run.",
    )
    p.add_argument(
        "--prometheus",
        metavar="URL",
        help="A Prometheus that scraped vLLM during the run, e.g. http://prom:9090.",
    )
    p.add_argument(
        "--prometheus-step",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="Resolution of the range queries (default 1; use the scrape interval).",
    )
    p.add_argument("--model", help="The model to read, when the source has several.")
    p.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="Where <stem>-kvtax.json/.md and the plots go (default: REPORT's dir).",
    )
    p.add_argument(
        "--record",
        type=Path,
        metavar="FILE",
        help="Record --metrics-url into FILE (JSON lines; gzip if it ends in .gz) "
        "until Ctrl-C or --duration.",
    )
    p.add_argument(
        "--metrics-url",
        metavar="URL",
        help="The vLLM metrics page to record, e.g. http://127.0.0.1:8000/metrics.",
    )
    p.add_argument(
        "--interval",
        type=float,
        default=0.5,
        metavar="SECONDS",
        help="Seconds between recorded scrapes (default 0.5).",
    )
    p.add_argument(
        "--duration",
        type=float,
        metavar="SECONDS",
        help="Stop recording after this long (default: at Ctrl-C).",
    )


def _err(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    # An InputError (a bad report, recording or flag) reaches kvtax.cli.main: one line, exit 2.
    if args.record is not None:
        return _record(args)
    return _annotate(args)


def _record(args: argparse.Namespace) -> int:
    if not args.metrics_url:
        raise InputError("--metrics-url", "is needed with --record")
    if not args.interval > 0:
        raise InputError("--interval", "must be a positive number of seconds")
    _err(f"kvtax annotate: recording {args.metrics_url} into {args.record}; Ctrl-C stops")
    written = asyncio.run(_record_until_stopped(args))
    _err(f"kvtax annotate: stopped; {args.record} holds {written} scrapes")
    return 0


async def _record_until_stopped(args: argparse.Namespace) -> int:
    """Record until ``--duration``, SIGINT or SIGTERM; the file is closed properly either way.

    The handlers are installed here, not left to Python's defaults: a recorder started in the
    background of a script inherits an ignored SIGINT, and SIGTERM would leave the gzip stream
    unfinished."""
    from kvtax.tools.loadtest.sources import record

    count = [0]
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, _cancel, task)
    try:
        return await record(
            args.metrics_url,
            args.record,
            args.interval,
            _err,
            duration=args.duration,
            written=count,
        )
    except asyncio.CancelledError:
        return count[0]
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def _cancel(task: asyncio.Task[Any] | None) -> None:
    if task is not None:
        task.cancel()


def _load_report(path: Path) -> Any:
    """The report's JSON, read (and gunzipped, streaming) up to :data:`MAX_REPORT_BYTES`; for
    a directory, the list of the AIPerf exports under it, within the same bound."""
    if not path.is_dir():
        return _load_json(path, MAX_REPORT_BYTES)[0]
    files = sorted(
        p
        for p in path.rglob(AIPERF_EXPORT + "*")
        if p.name in (AIPERF_EXPORT, AIPERF_EXPORT + ".gz")
    )
    if not files:
        raise InputError("REPORT", f"{path} is a directory without a {AIPERF_EXPORT}")
    exports, left = [], MAX_REPORT_BYTES
    for file in files:
        export, size = _load_json(file, left)
        exports.append(export)
        left -= size
    return exports


def _load_json(path: Path, limit: int) -> tuple[Any, int]:
    """The JSON in ``path`` and its size, or the objects of a JSON-lines file as a list."""
    try:
        with gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb") as f:
            raw = f.read(limit + 1)
    except (OSError, EOFError, zlib.error) as exc:
        why = getattr(exc, "strerror", None) or exc
        raise InputError("REPORT", f"cannot read {path}: {why}") from None
    if len(raw) > limit:
        raise InputError(
            "REPORT",
            f"{path} holds more than {_size(MAX_REPORT_BYTES)} of JSON"
            f"{' once decompressed' if path.suffix == '.gz' else ''}, kvtax annotate's limit",
        )
    try:
        return json.loads(raw), len(raw)
    except RecursionError:
        raise InputError("REPORT", f"{path} is JSON nested too deeply to read") from None
    except json.JSONDecodeError as exc:
        if exc.msg != "Extra data":
            raise InputError("REPORT", f"{path} is not JSON: {exc}") from None
    except ValueError as exc:
        raise InputError("REPORT", f"{path} is not JSON: {exc}") from None
    return _json_lines(raw, path), len(raw)


def _json_lines(raw: bytes, path: Path) -> list[Any]:
    """One JSON value per line (``vllm bench serve --append-result``)."""
    values = []
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            values.append(json.loads(line))
        except RecursionError:
            raise InputError("REPORT", f"{path} line {n} is JSON nested too deeply") from None
        except ValueError as exc:
            raise InputError("REPORT", f"{path} line {n} is not JSON: {exc}") from None
    return values


def _size(n: int) -> str:
    for unit, name in ((GIB, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= unit:
            return f"{n / unit:g} {name}"
    return f"{n} bytes"


def _annotate(args: argparse.Namespace) -> int:
    if args.report is None:
        raise InputError("REPORT", "give a report to annotate (or --record FILE to record)")
    if (args.recording is None) == (args.prometheus is None):
        raise InputError("--recording", "give exactly one of --recording FILE or --prometheus URL")
    tool = read_report(_load_report(args.report), args.format)
    steps = tool.steps
    scrapes: list[Scrape]
    if args.recording is not None:
        from kvtax.tools.loadtest.sources import read_recording

        field, source = "--recording", str(args.recording)
        scrapes = read_recording(args.recording)
    else:
        from kvtax.tools.loadtest.sources import prometheus_scrapes

        if not args.prometheus_step > 0:
            raise InputError("--prometheus-step", "must be a positive number of seconds")
        field, source = "--prometheus", args.prometheus
        start = min(s.start for s in steps) - 60
        end = max(s.end for s in steps) + 60
        scrapes = asyncio.run(prometheus_scrapes(args.prometheus, start, end, args.prometheus_step))
    timeline = Timeline(scrapes, field=field)
    model = pick_model(timeline, args.model, field)
    engine = annotate_steps(
        steps, timeline, model, EngineSettings(), field, step_field=tool.step_field
    )
    table = annotation_table(steps, engine, throughput_label=tool.throughput_label)
    out = annotation_json(
        tool.document, steps, engine, table, source=source, model=model, tool=tool.tool
    )
    name = args.report.name
    for suffix in (".gz", ".json", ".jsonl"):
        name = name.removesuffix(suffix)
    stem = name + "-kvtax"
    intro = [
        f"{tool.name} report {args.report.name}, annotated with the engine's figures for model "
        f"{model} from {source}.",
        "",
        f"Throughput is {tool.name}'s output tokens/s; preemptions, tax, KV and thrash are the "
        "engine's over each benchmark's span.",
    ]
    write_report(
        args.out or (args.report if args.report.is_dir() else args.report.parent),
        stem,
        out,
        title=f"{tool.name} run with the engine's side",
        intro=intro,
        table=table,
    )
    return 0
