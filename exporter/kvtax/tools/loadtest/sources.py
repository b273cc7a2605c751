"""Where annotate reads the engine's history: a recording file, or a Prometheus over HTTP.

The I/O edge of annotation. :func:`record` writes a recording (JSON lines, gzip when the name
ends in ``.gz``) by scraping a metrics URL until stopped; :func:`read_recording` reads one
back; :func:`prometheus_scrapes` rebuilds the same scrapes from a Prometheus's range queries.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import math
import time
import zlib
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, cast

import aiohttp

from kvtax.engine.vocabulary import concept_for
from kvtax.errors import InputError
from kvtax.tools.loadtest.timeline import Scrape, keep_known

__all__ = ["MAX_LINE_CHARS", "prometheus_scrapes", "read_recording", "record"]

# One recorded scrape is one line: a vLLM page cut to the series kvtax reads, kilobytes. A line
# longer than this is not a scrape, and is refused before it fills memory.
MAX_LINE_CHARS = 64 * 2**20


def _open(path: Path, mode: str) -> IO[str]:
    if path.suffix == ".gz":
        return cast(IO[str], gzip.open(path, mode + "t", encoding="utf-8"))
    return path.open(mode, encoding="utf-8")


def read_recording(path: Path, field: str = "--recording") -> list[Scrape]:
    """The scrapes of a recording; :class:`InputError` names the line that is wrong, or the
    file when it cannot be read (not UTF-8, not gzip, cut short). Each line is read with a
    bound, :data:`MAX_LINE_CHARS`, so a file without newlines cannot exhaust memory."""
    scrapes = []
    n = 0
    try:
        with _open(path, "r") as f:
            while line := f.readline(MAX_LINE_CHARS + 1):
                n += 1
                if len(line) > MAX_LINE_CHARS and not line.endswith("\n"):
                    raise InputError(
                        f"{field} line {n}",
                        f"longer than {MAX_LINE_CHARS // 2**20} Mi characters: not a scrape",
                    )
                if line.strip():
                    scrapes.append(_scrape(line, f"{field} line {n}"))
    except OSError as exc:
        raise InputError(field, f"cannot read {path}: {exc.strerror or exc}") from None
    except (EOFError, zlib.error):
        raise InputError(field, f"{path} is cut short or not gzip") from None
    except UnicodeDecodeError as exc:
        # The decoder reads ahead in chunks: the byte is near, not necessarily on, line n + 1.
        raise InputError(field, f"{path} is not UTF-8 text: {exc.reason}") from None
    return scrapes


def _scrape(line: str, where: str) -> Scrape:
    try:
        row = json.loads(line)
        t = float(row["t"])
        page = row["page"]
    except RecursionError:
        raise InputError(where, "JSON nested too deeply to read") from None
    except (ValueError, KeyError, TypeError, OverflowError):
        raise InputError(where, 'not a {"t", "page"} object') from None
    if not math.isfinite(t):
        raise InputError(where, f"t is not a finite time ({t})")
    if not isinstance(page, str):
        raise InputError(where, "page is not text")
    return Scrape(t, page)


async def record(
    metrics_url: str,
    out: Path,
    interval: float,
    progress: Callable[[str], None],
    *,
    duration: float | None = None,
    written: list[int] | None = None,
) -> int:
    """Scrape ``metrics_url`` every ``interval`` into ``out`` until cancelled (or ``duration``
    passes); returns the scrapes written, also kept in ``written[0]`` for a caller that
    cancels. Each line is flushed: a stop loses nothing."""
    count = written if written is not None else [0]
    timeout = aiohttp.ClientTimeout(total=max(5.0, interval * 4))
    began = time.monotonic()
    async with aiohttp.ClientSession(timeout=timeout) as session:
        with _open(out, "w") as f:
            while duration is None or time.monotonic() - began < duration:
                tick = time.monotonic()
                try:
                    async with session.get(metrics_url) as resp:
                        text = await resp.text() if resp.status == 200 else None
                except (aiohttp.ClientError, TimeoutError) as exc:
                    if count[0] == 0:
                        raise InputError(
                            "--metrics-url", f"cannot reach {metrics_url}: {exc}"
                        ) from None
                    text = None
                if text is not None:
                    f.write(json.dumps({"t": time.time(), "page": keep_known(text)}) + "\n")
                    f.flush()
                    count[0] += 1
                    if count[0] % 20 == 0:
                        progress(f"kvtax annotate: {count[0]} scrapes recorded")
                await asyncio.sleep(max(0.0, interval - (time.monotonic() - tick)))
    return count[0]


async def prometheus_scrapes(url: str, start: float, end: float, step: float) -> list[Scrape]:
    """vLLM's series over ``[start, end]`` from a Prometheus, as one scrape per ``step``."""
    query = '{__name__=~"vllm:.+"}'
    params = {"query": query, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"}
    api = url.rstrip("/") + "/api/v1/query_range"
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session,
            session.get(api, params=params) as resp,
        ):
            body: Any = await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise InputError("--prometheus", f"cannot query {api}: {exc}") from None
    except RecursionError:
        raise InputError("--prometheus", f"{api} answered JSON nested too deeply") from None
    if not isinstance(body, dict) or body.get("status") != "success":
        error = body.get("error") if isinstance(body, dict) else body
        raise InputError("--prometheus", f"{api} answered an error: {str(error)[:200]}")
    try:
        return _range_scrapes(body["data"]["result"])
    except (KeyError, TypeError, ValueError, OverflowError, AttributeError):
        raise InputError("--prometheus", f"{api} answered no Prometheus matrix") from None


def _range_scrapes(result: Any) -> list[Scrape]:
    by_time: dict[float, list[str]] = defaultdict(list)
    for series in result:
        labels = dict(series["metric"])
        name = labels.pop("__name__", "")
        if concept_for(name) is None:
            continue
        text = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
        for t, value in series["values"]:
            by_time[float(t)].append(f"{name}{{{text}}} {value}")
    return [Scrape(t, "\n".join(lines) + "\n") for t, lines in sorted(by_time.items())]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
