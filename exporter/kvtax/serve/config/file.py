"""The YAML configuration file (``--config.file``) read into dotted keys.

Nested mappings flatten to the options' dotted keys: ``scrape: {interval: 5s}`` becomes
``{"scrape.interval": "5s"}``. Only reading and shape are checked here; which keys exist and
what their values mean is :mod:`kvtax.serve.config`'s job.

Example::

    read_file(Path("kvtax.yaml"))  # {"scrape.interval": "5s", "window": "10m"}
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from kvtax.errors import ConfigError

__all__ = ["flatten", "read_file"]


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` as ``{"a.b": 1}``."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


def read_file(path: Path) -> dict[str, Any]:
    """The file's settings by dotted key; an empty file has none. Raises ConfigError."""
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"config file {path}: cannot read: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        # Not str(exc): PyYAML quotes the offending line, and it may hold the push token.
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise ConfigError(f"config file {path}: invalid YAML{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"config file {path}: expected a mapping at the top level")
    return flatten(data)
