"""Parsers for setting values: text as a user writes it into the typed value kvtax runs with.

Each parser takes what a flag, an environment variable or a YAML key holds (a string, or a YAML
scalar) and returns the typed value, or raises ``ValueError`` with a message that says what was
expected. They do not know which setting they parse: :mod:`kvtax.serve.config` adds the key, the
source and the bad value, and raises :class:`kvtax.errors.ConfigError`.

Example:

    >>> parse_duration("500ms")
    0.5
    >>> parse_address(":10059")
    ('0.0.0.0', 10059)
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kvtax.serve.logformat import FORMATS

__all__ = [
    "boolean",
    "cores_allowed",
    "endpoint_url",
    "fraction",
    "log_level",
    "nonnegative_duration",
    "optional_address",
    "optional_duration",
    "optional_path",
    "optional_positive_int",
    "optional_url",
    "parse_address",
    "parse_duration",
    "positive",
    "positive_duration",
    "selector",
    "size",
    "text",
    "token",
    "url",
    "workers",
]


# Values that mean "not set" for an optional setting, however they were written.
_UNSET = (None, "", "none")

_DURATION = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(text: str | float | int) -> float:
    """Seconds from ``5``, ``2.5s``, ``500ms``, ``5m`` or ``1h``."""
    if isinstance(text, bool):
        raise ValueError("expected a duration such as 5s, 500ms or 5m")
    if isinstance(text, int | float):
        return float(text)
    match = _DURATION.match(text)
    if not match:
        raise ValueError("expected a duration such as 5s, 500ms or 5m")
    return float(match.group(1)) * _UNIT[match.group(2)]


def parse_address(text: str) -> tuple[str, int]:
    """``host:port`` or ``:port`` (all interfaces) into a (host, port) pair."""
    host, sep, port = str(text).rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError("expected host:port or :port with a port in 1-65535")
    return (host.strip("[]") or "0.0.0.0", int(port))


def url(value: Any) -> str:
    """An http(s) URL, without a trailing slash (kvtax appends paths such as /metrics)."""
    return endpoint_url(value).rstrip("/")


def endpoint_url(value: Any) -> str:
    """An http(s) URL that kvtax reads as given, trailing slash and all: LiteLLM serves its page
    at ``/metrics/`` and answers ``/metrics`` with a redirect, which kvtax does not follow."""
    parts = urlsplit(str(value))
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError("expected an http:// or https:// URL")
    return str(value)


def positive(kind: Callable[[Any], float]) -> Callable[[Any], float]:
    """``kind``'s parser, refusing zero and negative numbers."""

    def check(value: Any) -> float:
        number = kind(value)
        if not number > 0:
            raise ValueError("must be greater than 0")
        return number

    return check


positive_duration = positive(parse_duration)


def optional_duration(value: Any) -> float | None:
    return None if value in (None, "") else positive_duration(value)


def nonnegative_duration(value: Any) -> float:
    number = parse_duration(value)
    if number < 0:
        raise ValueError("must not be negative")
    return number


def fraction(value: Any) -> float:
    number = float(value)
    if not 0 < number <= 1:
        raise ValueError("must be in (0, 1]")
    return number


def optional_positive_int(value: Any) -> int | None:
    if value in _UNSET:
        return None
    number = int(value)
    if number <= 0:
        raise ValueError("must be a positive integer")
    return number


def workers(value: Any) -> int:
    """A count of proxy workers: a positive integer, or ``auto`` for :func:`cores_allowed`."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return cores_allowed()
    if isinstance(value, bool):
        raise ValueError("expected a positive integer or auto")
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError("expected a positive integer or auto") from None
    if number <= 0:
        raise ValueError("must be a positive integer or auto")
    return number


def cores_allowed(cgroup: Path = Path("/sys/fs/cgroup/cpu.max")) -> int:
    """The cores this process may use: its cgroup's CPU limit rounded up (cgroup v2
    ``cpu.max``: quota and period), else the CPUs it may run on."""
    cpus = len(os.sched_getaffinity(0))
    try:
        quota, period = cgroup.read_text().split()[:2]
    except (OSError, ValueError):
        return cpus
    if quota == "max":
        return cpus
    try:
        limit = -(-int(quota) // int(period))  # a ceiling: 1.5 cores can feed two workers
    except (ValueError, ZeroDivisionError):
        return cpus
    return max(1, min(cpus, limit))


def optional_address(value: Any) -> tuple[str, int] | None:
    if value in (*_UNSET, "off", False):
        return None
    return parse_address(str(value))


def optional_url(value: Any) -> str | None:
    """A full endpoint URL (``--gateway.url``), or None."""
    return None if value in (None, "") else endpoint_url(value)


def optional_path(value: Any) -> Path | None:
    return None if value in (None, "") else Path(str(value))


def text(value: Any) -> str:
    return str(value)


_SIZE = re.compile(r"^\s*(\d+)\s*(B|KiB|MiB|GiB|KB|MB|GB)?\s*$")
_SIZE_UNIT = {
    None: 1,
    "B": 1,
    "KiB": 1024,
    "MiB": 1024**2,
    "GiB": 1024**3,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
}


def size(value: Any) -> int:
    """Bytes from ``1048576``, ``512KiB`` or ``32MiB`` (KB/MB/GB are powers of 1000)."""
    match = _SIZE.match(str(value))
    if not match or int(match.group(1)) <= 0:
        raise ValueError("expected a positive size such as 1048576, 512KiB or 32MiB")
    return int(match.group(1)) * _SIZE_UNIT[match.group(2)]


def boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    word = str(value).strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true or false")


def token(value: Any) -> str | None:
    """A bearer token, or None when empty. The message never quotes the value."""
    stripped = "" if value is None else str(value).strip()
    if not stripped:
        return None
    # It travels in an Authorization header, so it must be a single run of visible ASCII.
    if not all("!" <= char <= "~" for char in stripped):
        raise ValueError("a token must be visible ASCII without spaces (value not shown)")
    return stripped


_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")


def optional_header(value: Any) -> str | None:
    """An HTTP header name (a token, RFC 9110 5.6.2), lower case; None when empty."""
    stripped = "" if value is None else str(value).strip()
    if not stripped:
        return None
    if not _HEADER_NAME.match(stripped):
        raise ValueError(f"{stripped!r} is not an HTTP header name")
    return stripped.lower()


def selector(value: Any) -> tuple[tuple[str, str], ...]:
    """Label matches from ``a=b,c="d"`` or a YAML mapping, as (name, value) pairs."""
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), str(v)) for k, v in value.items()))
    pairs = []
    for part in str(value or "").split(","):
        if not part.strip():
            continue
        name, sep, wanted = part.partition("=")
        if not sep or not name.strip():
            raise ValueError("expected label=value pairs separated by commas")
        pairs.append((name.strip(), wanted.strip().strip('"')))
    return tuple(pairs)


_LOG_LEVELS = ("debug", "info", "warning", "error")


def log_level(value: Any) -> str:
    level = str(value).lower()
    if level not in _LOG_LEVELS:
        raise ValueError(f"expected one of {', '.join(_LOG_LEVELS)}")
    return level


def log_format(value: Any) -> str:
    fmt = str(value).lower()
    if fmt not in FORMATS:
        raise ValueError(f"expected one of {', '.join(FORMATS)}")
    return fmt


# Paths of the web port that the telemetry path may not take over.
RESERVED_PATHS = ("/healthz", "/readyz", "/api/v1/delivered")


def telemetry_path(value: Any) -> str:
    """An absolute URL path such as ``/metrics``; not one of kvtax's other routes."""
    path = str(value).strip()
    if not path.startswith("/") or any(c in path for c in "?#% \t") or "//" in path:
        raise ValueError("expected an absolute URL path such as /metrics")
    if path.rstrip("/") in RESERVED_PATHS or path == "/":
        raise ValueError(
            f"{path} is taken; choose a path other than /, {', '.join(RESERVED_PATHS)}"
        )
    return path


def one_of(*choices: str) -> Callable[[Any], str]:
    """A parser accepting exactly one of ``choices``."""

    def check(value: Any) -> str:
        chosen = str(value).strip().lower()
        if chosen not in choices:
            raise ValueError("must be one of " + ", ".join(choices))
        return chosen

    return check
