"""``--config FILE.yaml`` of ``kvtax rules`` and ``kvtax dashboards``: RulesConfig without Python.

The file is a flat YAML mapping whose keys are :class:`~kvtax.mixin.rules.config.RulesConfig`'s
fields; every field may be set, none must be. Values are checked against the field's type and range
(a finite number for thresholds, from 0 to 1 for shares (:data:`~kvtax.mixin.rules.config.SHARES`);
a Prometheus duration for windows and ``*_for``, no longer than Prometheus can hold,
:data:`MAX_DURATION`; a label name for ``cluster_label``; a mapping of alert name to severity for
``severity_overrides``), and an error names the file and the key. The same file drives the rules and
the dashboards, so a threshold line on a panel and its alert cannot disagree::

    cluster_label: cluster
    kvtax_selector: 'job="kvtax"'
    runbook_url_base: https://wiki.example.com/kvtax/runbooks.md
    tax_warning: 0.1
    tax_for: 30m
    severity_overrides: {KvtaxQueueGrowing: info}

:func:`from_mapping` is pure; :func:`read` reads the file.

Example::

    config = read(Path("rules.yaml"))
    render_files(config)
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import fields, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from kvtax.errors import RulesConfigError
from kvtax.mixin.rules.config import DEFAULT, RulesConfig, threshold_problem

__all__ = [
    "MAX_DURATION",
    "MAX_DURATION_MS",
    "RulesConfigError",
    "duration_ms",
    "from_mapping",
    "read",
]

SEVERITIES = ("critical", "warning", "info")
# Prometheus's own duration grammar (prometheus/common model.ParseDuration): each unit at most
# once, largest first; "0" alone is allowed.
_DURATION = re.compile(
    r"^(?:([0-9]+)y)?(?:([0-9]+)w)?(?:([0-9]+)d)?(?:([0-9]+)h)?"
    r"(?:([0-9]+)m)?(?:([0-9]+)s)?(?:([0-9]+)ms)?$"
)
_UNIT_MS = (365 * 86_400_000, 7 * 86_400_000, 86_400_000, 3_600_000, 60_000, 1000, 1)
# Prometheus holds a duration as Go's time.Duration, int64 nanoseconds, and refuses a longer
# one ("duration out of range"): the longest it parses is 106751d23h47m16s854ms, about 292
# years (checked with promtool 2.42).
MAX_DURATION_MS = (2**63 - 1) // 1_000_000
MAX_DURATION = "106751d23h47m16s854ms"
_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
# Fields holding a Prometheus duration: every rate window and every for:.
_DURATIONS = frozenset(f.name for f in fields(RulesConfig) if f.name.endswith(("_for", "_window")))


def duration_ms(text: str) -> int:
    """Milliseconds of a Prometheus duration; ValueError if Prometheus would refuse it.

    >>> duration_ms("1h30m")
    5400000
    """
    if text == "0":  # the one duration without a unit
        return 0
    match = _DURATION.fullmatch(text)
    if not text or match is None:
        raise ValueError(
            f"expected a Prometheus duration such as 30s, 5m or 1h30m (units y, w, d, h, m, s, "
            f"ms, each once and largest first), not {text!r}"
        )
    groups = match.groups()
    # More than 19 digits is out of range in any unit (and int() refuses thousands of them).
    too_long = any(n is not None and len(n.lstrip("0")) > 19 for n in groups)
    total = 0 if too_long else sum(int(n) * u for n, u in zip(groups, _UNIT_MS, strict=True) if n)
    if too_long or total > MAX_DURATION_MS:
        shown = text if len(text) <= 40 else text[:37] + "..."
        raise ValueError(
            f"{shown} is longer than Prometheus can hold: at most {MAX_DURATION} (about 292 "
            "years; Prometheus keeps durations as int64 nanoseconds)"
        )
    return total


def _float(name: str, raw: Any) -> float:
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        raise ValueError("expected a number")
    try:
        value = float(raw)
    except OverflowError:  # a YAML integer of hundreds of digits
        raise ValueError("expected a finite number, not one that large") from None
    problem = threshold_problem(name, value)
    if problem is not None:
        raise ValueError(problem)
    return value


def _text(name: str, raw: Any) -> str:
    if not isinstance(raw, str):
        raise ValueError("expected text")
    # A window is a range selector, which PromQL refuses at 0; a for: of 0 fires at once.
    if name in _DURATIONS and duration_ms(raw) == 0 and name.endswith("_window"):
        raise ValueError(f"a window must be longer than 0, not {raw!r}")
    if name == "cluster_label" and raw and not _LABEL.fullmatch(raw):
        raise ValueError("expected a Prometheus label name such as cluster")
    if name == "runbook_url_base" and not raw.startswith(("http://", "https://")):
        raise ValueError("expected an http:// or https:// URL")
    return raw


def _severities(raw: Any) -> Mapping[str, str]:
    from kvtax.mixin.rules.alerts import (
        alert_names,  # alerts read this module's config: import late
    )

    if not isinstance(raw, Mapping):
        raise ValueError("expected a mapping of alert name to severity")
    known = alert_names()
    for alert, severity in raw.items():
        if alert not in known:
            raise ValueError(f"{alert!r} is not one of kvtax's alerts ({', '.join(known)})")
        if severity not in SEVERITIES:
            raise ValueError(f"{alert}: {severity!r} is not one of {', '.join(SEVERITIES)}")
    return MappingProxyType({str(k): str(v) for k, v in raw.items()})


def _value(name: str, kind: Any, raw: Any) -> Any:
    if name == "severity_overrides":
        return _severities(raw)
    if kind in (float, "float"):
        return _float(name, raw)
    return _text(name, raw)


def from_mapping(
    document: Mapping[str, Any], *, source: str = "config", base: RulesConfig = DEFAULT
) -> RulesConfig:
    """``base`` with the document's keys set; RulesConfigError names ``source`` and the key."""
    types = {f.name: f.type for f in fields(RulesConfig)}
    changes: dict[str, Any] = {}
    for key, raw in document.items():
        if key not in types:
            raise RulesConfigError(f"{source}: {key}: not a rules setting (see docs/rules.md)")
        try:
            changes[key] = _value(key, types[key], raw)
        except ValueError as exc:
            raise RulesConfigError(f"{source}: {key}: {exc}") from None
    config = replace(base, **changes)
    if config.tax_critical < config.tax_warning:
        raise RulesConfigError(f"{source}: tax_critical: must not be below tax_warning")
    if config.yield_critical > config.yield_warning:
        raise RulesConfigError(f"{source}: yield_critical: must not be above yield_warning")
    return config


def read(path: Path) -> RulesConfig:
    """The RulesConfig of a YAML file (an empty file gives the defaults)."""
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise RulesConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise RulesConfigError(f"{path}: not YAML: {' '.join(str(exc).split())}") from None
    except RecursionError:
        raise RulesConfigError(f"{path}: not YAML that kvtax can read: nested too deeply") from None
    if document is None:
        return DEFAULT
    if not isinstance(document, Mapping):
        raise RulesConfigError(f"{path}: expected a mapping of settings")
    return from_mapping(document, source=str(path))
