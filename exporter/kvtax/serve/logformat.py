"""``--log.format``: log lines as logfmt (the default) or JSON, as Prometheus' own tools write them.

logfmt is one line of ``key=value`` pairs, values quoted when they hold a space, a quote or an
equals sign::

    time=2026-12-01T11:22:05.123Z level=info logger=kvtax.serve.scrape.job msg="vLLM at ... is up"

JSON is one object per line with the same keys, for log pipelines that parse JSON. An exception
adds ``exc``, the traceback in one value. :func:`formatter` returns the :class:`logging.Formatter`
for a format name; :func:`install` puts it on the root logger.

Example::

    install("info", "json")
    logging.getLogger("kvtax").info("ready")  # {"time": "...", "level": "info", ...}
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

__all__ = ["FORMATS", "JsonFormatter", "LogfmtFormatter", "formatter", "install"]

FORMATS = ("logfmt", "json")


def _timestamp(record: logging.LogRecord) -> str:
    """RFC 3339 in UTC with milliseconds, as Prometheus logs it."""
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    return f"{seconds}.{int(record.msecs):03d}Z"


def _fields(record: logging.LogRecord, fmt: logging.Formatter) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "time": _timestamp(record),
        "level": record.levelname.lower(),
        "logger": record.name,
    }
    worker = getattr(record, "worker", None)
    if worker is not None:  # a proxy worker's line (--proxy.workers): which one
        fields["worker"] = worker
    fields["msg"] = record.getMessage()
    if record.exc_info:
        fields["exc"] = fmt.formatException(record.exc_info)
    return fields


def _logfmt_value(value: Any) -> str:
    text = str(value)
    if text and not any(c in text for c in ' "=\\\n\t') and text.isprintable():
        return text
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return '"' + escaped.replace("\t", "\\t") + '"'


class LogfmtFormatter(logging.Formatter):
    """``time=... level=... logger=... msg=...`` on one line."""

    def format(self, record: logging.LogRecord) -> str:
        return " ".join(f"{k}={_logfmt_value(v)}" for k, v in _fields(record, self).items())


class JsonFormatter(logging.Formatter):
    """One JSON object per line."""

    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(_fields(record, self), ensure_ascii=False)


def formatter(name: str) -> logging.Formatter:
    """The formatter for ``name`` (logfmt or json); ValueError for anything else."""
    if name == "logfmt":
        return LogfmtFormatter()
    if name == "json":
        return JsonFormatter()
    raise ValueError(f"unknown log format {name!r}; expected one of {', '.join(FORMATS)}")


class _Handler(logging.StreamHandler):  # type: ignore[type-arg]
    """kvtax's stderr handler, told apart from handlers others installed (a test runner's)."""


class _Worker(logging.Filter):
    """Stamps each record with the proxy worker that logged it."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def filter(self, record: logging.LogRecord) -> bool:
        record.worker = self.index
        return True


def install(level: str, name: str, *, worker: int | None = None) -> None:
    """Log to stderr at ``level`` in format ``name``; a second call replaces the first.
    ``worker``: this is that proxy worker (``--proxy.workers``), and each line says so.

    Like :func:`logging.basicConfig`, it leaves logging alone when someone else configured it
    already (a test runner, a program that embeds kvtax): their handlers and level stay.
    """
    root = logging.getLogger()
    if any(not isinstance(h, _Handler) for h in root.handlers):
        return
    handler = _Handler()
    handler.setFormatter(formatter(name))
    if worker is not None:
        handler.addFilter(_Worker(worker))
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
