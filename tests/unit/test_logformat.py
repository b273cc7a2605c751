"""``--log.format``: logfmt by default, JSON on request, one line per record."""

from __future__ import annotations

import json
import logging
import re

import pytest

from kvtax.cli.main import build_parser
from kvtax.serve.config import load_config
from kvtax.serve.logformat import JsonFormatter, LogfmtFormatter, formatter


def record(msg: str, *args: object, exc: bool = False) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError("boom")
        except ValueError:
            import sys

            exc_info = sys.exc_info()
    return logging.LogRecord("kvtax.serve.sidecar", logging.WARNING, "f.py", 1, msg, args, exc_info)


def test_logfmt_is_the_default() -> None:
    assert load_config({}, env={}, file=None).log_format == "logfmt"
    assert isinstance(formatter("logfmt"), LogfmtFormatter)


def test_logfmt_quotes_values_with_spaces_quotes_and_equals() -> None:
    line = LogfmtFormatter().format(record('scrape of %s failed: "a=b"', "http://x"))
    assert re.fullmatch(
        r"time=\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z level=warning "
        r'logger=kvtax\.serve\.sidecar msg="scrape of http://x failed: \\"a=b\\""',
        line,
    ), line


def test_logfmt_keeps_a_traceback_on_one_line() -> None:
    line = LogfmtFormatter().format(record("failed", exc=True))
    assert "\n" not in line
    assert 'exc="Traceback' in line
    assert "ValueError: boom" in line


def test_a_proxy_workers_lines_name_the_worker() -> None:
    one = record("proxy on %s", ":8001")
    one.worker = 1
    assert " logger=kvtax.serve.sidecar worker=1 msg=" in LogfmtFormatter().format(one)
    assert json.loads(JsonFormatter().format(one))["worker"] == 1
    assert "worker" not in LogfmtFormatter().format(record("proxy on %s", ":8001"))


def test_json_is_one_object_per_line() -> None:
    line = JsonFormatter().format(record("vLLM at %s is up", "http://x", exc=True))
    assert "\n" not in line
    doc = json.loads(line)
    assert doc["level"] == "warning"
    assert doc["logger"] == "kvtax.serve.sidecar"
    assert doc["msg"] == "vLLM at http://x is up"
    assert "ValueError: boom" in doc["exc"]


def test_the_flag_takes_logfmt_or_json_and_names_itself_otherwise() -> None:
    args = build_parser().parse_args(["serve", "--log.format=json"])
    assert getattr(args, "log.format") == "json"
    assert load_config({"log.format": "JSON"}, env={}, file=None).log_format == "json"
    with pytest.raises(Exception, match=r"--log\.format='xml' is invalid"):
        load_config({"log.format": "xml"}, env={}, file=None)


def test_install_configures_a_bare_root_once_and_leaves_configured_logging_alone() -> None:
    from kvtax.serve.logformat import install

    root = logging.getLogger()
    before, level = list(root.handlers), root.level
    try:
        # Configured by someone else (pytest here): nothing changes.
        install("debug", "json")
        assert root.handlers == before
        assert root.level == level
        # A bare root, as in `kvtax serve`: one handler, replaced by a second call.
        for handler in before:
            root.removeHandler(handler)
        install("info", "json")
        install("debug", "logfmt")
        assert len(root.handlers) == 1
        assert isinstance(root.handlers[0].formatter, LogfmtFormatter)
        assert root.level == logging.DEBUG
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in before:
            root.addHandler(handler)
        root.setLevel(level)
