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

Example:

    >>> from_mapping({"tax_warning": 0.1, "slo_unit": "tokens"}).slo_unit
    'tokens'
    >>> from_mapping({"tax_for": "soon"}, source="rules.yaml")
    Traceback (most recent call last):
    ...
    kvtax.errors.RulesConfigError: rules.yaml: tax_for: expected a Prometheus duration such as ...

A file is read the same way (``read(Path("rules.yaml"))``), for the generators::

    from kvtax.mixin.rules.render import render_files
    files = render_files(read(Path("rules.yaml")))
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import fields, replace
from itertools import pairwise
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from kvtax.delivery.ledger import OUTCOMES
from kvtax.errors import RulesConfigError
from kvtax.mixin.rules.config import (
    CHOICES,
    DEFAULT,
    MAX_DURATION,
    MAX_DURATION_MS,
    RulesConfig,
    duration_ms,
    threshold_problem,
)

__all__ = [
    "MAX_DURATION",
    "MAX_DURATION_MS",
    "RulesConfigError",
    "document_of",
    "duration_ms",
    "from_mapping",
    "read",
]

SEVERITIES = ("critical", "warning", "info")
_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
# Fields holding a Prometheus duration: every rate window, every for: and the budget's period.
_DURATIONS = frozenset(
    f.name for f in fields(RulesConfig) if f.name.endswith(("_for", "_window", "_period"))
)
# The burn-rate alerts' window pairs: a long window, then a short one.
_PAIRS = ("slo_fast_windows", "slo_slow_windows", "slo_ticket_windows")
_BURNS = {
    "slo_fast_windows": "slo_fast_burn",
    "slo_slow_windows": "slo_slow_burn",
    "slo_ticket_windows": "slo_ticket_burn",
}


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
    if name in _DURATIONS and duration_ms(raw) == 0 and not name.endswith("_for"):
        raise ValueError(f"a window must be longer than 0, not {raw!r}")
    if name in CHOICES and raw not in CHOICES[name]:
        raise ValueError(f"expected one of {', '.join(CHOICES[name])}, not {raw!r}")
    if name == "cluster_label" and raw and not _LABEL.fullmatch(raw):
        raise ValueError("expected a Prometheus label name such as cluster")
    if name == "runbook_url_base" and not raw.startswith(("http://", "https://")):
        raise ValueError("expected an http:// or https:// URL")
    return raw


def _severities(raw: Any) -> Mapping[str, str]:
    from kvtax.mixin.rules.alerts import (
        every_alert_name,  # alerts read this module's config: import late
    )

    if not isinstance(raw, Mapping):
        raise ValueError("expected a mapping of alert name to severity")
    # Either choice of slo_alerting's alerts: the file may say which after the overrides.
    known = every_alert_name()
    for alert, severity in raw.items():
        if alert not in known:
            raise ValueError(f"{alert!r} is not one of kvtax's alerts ({', '.join(known)})")
        if severity not in SEVERITIES:
            raise ValueError(f"{alert}: {severity!r} is not one of {', '.join(SEVERITIES)}")
    return MappingProxyType({str(k): str(v) for k, v in raw.items()})


def _windows(name: str, raw: Any) -> tuple[str, ...]:
    """A list of windows, each a Prometheus duration above 0, strictly growing (a pair: long,
    then short)."""
    pair = name in _PAIRS
    if not isinstance(raw, list | tuple) or not raw:
        raise ValueError(
            "expected a list of two windows, the long one first, such as [1h, 5m]"
            if pair
            else "expected a list of windows, shortest first, such as [5m, 30m, 1h]"
        )
    windows = tuple(_text("slo_window", w) for w in raw)
    lengths = [duration_ms(w) for w in windows]
    if 0 in lengths:
        raise ValueError(f"a window must be longer than 0, not {windows[lengths.index(0)]!r}")
    if pair:
        if len(windows) != 2 or lengths[0] <= lengths[1]:
            raise ValueError(
                f"expected two windows, the long one first, such as [1h, 5m], not {list(windows)}"
            )
    elif any(a >= b for a, b in pairwise(lengths)):
        raise ValueError(
            f"expected windows shortest first, each longer than the last: {list(windows)}"
        )
    return windows


def _outcomes(raw: Any) -> tuple[str, ...]:
    if not isinstance(raw, list | tuple) or not all(isinstance(o, str) for o in raw):
        raise ValueError("expected a list of request outcomes, such as [upstream_4xx, too_large]")
    for outcome in raw:
        if outcome not in OUTCOMES:
            raise ValueError(f"{outcome!r} is not one of kvtax's outcomes ({', '.join(OUTCOMES)})")
        if outcome == "completed":
            raise ValueError("completed requests are the ones that can meet the objective")
    return tuple(raw)


def _value(name: str, kind: Any, raw: Any) -> Any:
    if name == "severity_overrides":
        return _severities(raw)
    if name == "slo_excluded_outcomes":
        return _outcomes(raw)
    if name.endswith("_windows"):
        return _windows(name, raw)
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
    problem = _objective_problem(config)
    if problem is not None:
        raise RulesConfigError(f"{source}: {problem}")
    return config


def _objective_problem(config: RulesConfig) -> str | None:
    """What makes the objective's settings disagree with each other, naming the key; None when
    they agree."""
    recorded = set(config.slo_windows)
    for pair in _PAIRS:
        missing = [w for w in getattr(config, pair) if w not in recorded]
        if missing:
            return (
                f"{pair}: {', '.join(missing)} is not among slo_windows "
                f"({', '.join(config.slo_windows)}); the alerts read only recorded windows"
            )
        burn = getattr(config, _BURNS[pair])
        # The error ratio is at most 1: a factor whose threshold lies above it never fires.
        if burn * (1 - config.slo_objective) > 1:
            return (
                f"{_BURNS[pair]}: {burn:g} x (1 - slo_objective {config.slo_objective:g}) is "
                f"above 1, an error ratio no burn can reach: lower the factor or raise the "
                "objective"
            )
    longest = max(config.slo_windows, key=duration_ms)
    if duration_ms(config.slo_period) < duration_ms(longest):
        return f"slo_period: {config.slo_period} is shorter than the longest window, {longest}"
    return None


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


def document_of(config: RulesConfig) -> dict[str, Any]:
    """The YAML document of ``config``'s settings that differ from the defaults, which
    :func:`read` reads back to ``config``: a profile built in code (the end-to-end tests' short
    one, say) handed to a command that takes ``--config``."""
    document: dict[str, Any] = {}
    for f in fields(RulesConfig):
        value = getattr(config, f.name)
        if value == getattr(DEFAULT, f.name):
            continue
        if isinstance(value, tuple):
            value = list(value)
        elif isinstance(value, Mapping):
            value = dict(value)
        document[f.name] = value
    return document
