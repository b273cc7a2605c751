"""Typed, frozen configuration, validated once at start.

One table, :data:`OPTIONS` (the fields of :class:`Config`, in :mod:`kvtax.serve.config.options`),
defines every setting: its dotted key, type, default, help and check. From it come the
``kvtax serve`` flags (``--scrape.interval``), the environment variables
(``KVTAX_SCRAPE_INTERVAL``), the YAML keys (``scrape: {interval: 5s}``) and
``docs/configuration.md``. Precedence: flags, then environment, then the YAML file, then defaults.
A bad value raises :class:`ConfigError` naming the key, where it came from, and the value.
A renamed setting (:data:`RENAMED`) still answers to its old flag, variable and YAML key, with a
warning; within one source the new name wins over the old.

This module merges the sources and checks settings against each other; the value parsers are in
:mod:`kvtax.serve.config.values`, the YAML reader in :mod:`kvtax.serve.config.file` and the
reference page in :mod:`kvtax.serve.config.docs`. Everything public is re-exported here.

Example:

    >>> cfg = load_config({"vllm.url": "http://127.0.0.1:8000"}, env={}, file=None)
    >>> cfg.scrape_interval
    5.0
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvtax.errors import ConfigError
from kvtax.serve.config.docs import render_markdown
from kvtax.serve.config.file import read_file
from kvtax.serve.config.option import flag_name
from kvtax.serve.config.options import (
    OPTIONS,
    RENAMED,
    RENAMED_KEYS,
    RUNTIME_SWITCHES,
    Config,
    Option,
    env_name,
)
from kvtax.serve.config.values import parse_address, parse_duration, token

__all__ = [
    "OPTIONS",
    "RENAMED",
    "RENAMED_KEYS",
    "Config",
    "ConfigError",
    "Option",
    "env_name",
    "flag_name",
    "load_config",
    "parse_address",
    "parse_duration",
    "render_markdown",
    "unknown_env",
]


def load_config(
    flags: Mapping[str, Any],
    *,
    env: Mapping[str, str],
    file: Path | None,
    warnings: list[str] | None = None,
) -> Config:
    """Merge flags > environment > YAML file > defaults and validate every value.

    ``flags`` is by dotted key, None for a flag not given. A setting given by its old name
    (:data:`RENAMED_KEYS`) counts as its new one in the same source; each old name given adds
    one line to ``warnings``, for the caller to log once logging is set up.
    """
    notes: list[str] = []
    given_flags = {key: value for key, value in flags.items() if value is not None}
    by_flag = _renamed(given_flags, spell=str, show=flag_name, source="", notes=notes)
    by_env = _renamed(
        env, spell=env_name, show=env_name, source="environment variable ", notes=notes
    )
    from_file = _renamed(
        _read_known_keys(file), spell=str, show=str, source=f"config file {file}: key ", notes=notes
    )
    if warnings is not None:
        warnings.extend(notes)
    values: dict[str, Any] = {}
    for option in OPTIONS:
        given = _given(option, by_flag, by_env, from_file, file)
        if given is not None:  # else Config's own default, parsed from the table, holds
            values[option.field] = _parse(option, *given)
    config = _with_token_file(Config(**values))
    _check_together(config)
    return config


def _read_known_keys(file: Path | None) -> dict[str, Any]:
    if file is None:
        return {}
    from_file = read_file(file)
    known = {o.key for o in OPTIONS} | RENAMED_KEYS.keys()
    for key in from_file:
        if key not in known:
            raise ConfigError(f"config file {file}: unknown key {key!r}")
    return from_file


def _renamed(
    given: Mapping[str, Any],
    *,
    spell: Callable[[str], str],
    show: Callable[[str], str],
    source: str,
    notes: list[str],
) -> dict[str, Any]:
    """One source's settings (by ``spell(key)``) with each old name moved to its new one, and a
    note for each old name given, naming both as ``show`` spells them; the old one is dropped
    when the new one is given too."""
    moved = dict(given)
    for old_key, option in RENAMED_KEYS.items():
        old, new = spell(old_key), spell(option.key)
        if old not in moved:
            continue
        value = moved.pop(old)
        if new in given:
            notes.append(
                f"{source}{show(old_key)} is ignored: it is the deprecated name of "
                f"{show(option.key)}, which is given too and wins"
            )
        else:
            moved[new] = value
            notes.append(f"{source}{show(old_key)} is deprecated: use {show(option.key)}")
    return moved


def _given(
    option: Option,
    flags: Mapping[str, Any],
    env: Mapping[str, str],
    from_file: Mapping[str, Any],
    file: Path | None,
) -> tuple[Any, str] | None:
    """The raw value of ``option`` from the first source that sets it, and that source's name;
    None when no source does."""
    if flags.get(option.key) is not None:
        return flags[option.key], option.flag
    if option.env in env:
        return env[option.env], option.env
    if option.key in from_file:
        return from_file[option.key], f"{file}: {option.key}"
    return None


def _parse(option: Option, raw: Any, source: str) -> Any:
    try:
        return option.parse(raw)
    except (ValueError, TypeError) as exc:
        shown = "<hidden>" if option.secret else repr(raw)
        raise ConfigError(f"{source}={shown} is invalid: {exc}") from None


def _check_together(config: Config) -> None:
    """Checks that involve two settings, after each is valid on its own."""
    if config.effective_timeout >= config.scrape_interval:
        raise ConfigError(
            f"--scrape.timeout={config.scrape_timeout} is invalid: must be below "
            f"--scrape.interval={config.scrape_interval}"
        )
    if config.window < 2 * config.scrape_interval:
        raise ConfigError(
            f"--window={config.window} is invalid: must be at least two scrape intervals "
            f"({2 * config.scrape_interval}s)"
        )
    if config.gate_floor > config.gate_ceiling:
        raise ConfigError(
            f"--gate.floor={config.gate_floor} is invalid: must not exceed "
            f"--gate.ceiling={config.gate_ceiling}"
        )
    if config.gate_fair_reserve and config.gate_fairness_header is None:
        raise ConfigError(
            "--gate.fair-reserve=true is invalid: it reserves shares of fairness keys; "
            "set --gate.fairness-header too"
        )


def _with_token_file(config: Config) -> Config:
    """The config with the push token read from ``--push.token-file``, if one is given."""
    path = config.push_token_file
    if path is None:
        return config
    flag = f"--push.token-file={str(path)!r}"
    if config.push_token is not None:
        raise ConfigError(f"{flag} is invalid: --push.token is set too; give one")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ConfigError(f"{flag} is invalid: {reason}") from None
    try:
        found = token(text)
    except ValueError as exc:
        raise ConfigError(f"{flag} is invalid: {exc}") from None
    if found is None:
        raise ConfigError(f"{flag} is invalid: the file is empty")
    return replace(config, push_token=found)


# KVTAX_* variables that are not settings: the repository's own scripts, test suite and
# testbed read them, and they are exported into the environment `kvtax serve` runs in.
_TOOL_VARIABLES = frozenset(
    {
        "KVTAX_ALERTMANAGER_BIN",
        "KVTAX_CACHE",
        "KVTAX_DEV_VENV",
        "KVTAX_PROMETHEUS_BIN",
        "KVTAX_PYTHON",
        "KVTAX_RESULTS_DIR",
        "KVTAX_SAVE_PREVIEW",
        "KVTAX_SKIP_E2E",
        "KVTAX_VLLM_VENV",
    }
)


def unknown_env(env: Mapping[str, str]) -> list[str]:
    """A warning for each ``KVTAX_*`` variable that kvtax does not know, naming the closest.

    A warning rather than an error: the project's own tools export KVTAX_* variables of their
    own, a newer manifest may set a variable an older image lacks, and push fails closed, so a
    misspelled token variable leaves push refused, not open.
    """
    settings = sorted({o.env for o in OPTIONS} | {"KVTAX_CONFIG_FILE"})
    # Old names of renamed settings: load_config warns about those itself.
    renamed = {env_name(key) for key in RENAMED_KEYS}
    warnings = []
    for name in sorted(env):
        known = (*settings, *renamed, *_TOOL_VARIABLES, *RUNTIME_SWITCHES)
        if not name.startswith("KVTAX_") or name in known:
            continue
        close = difflib.get_close_matches(name, settings, n=1, cutoff=0.8)
        hint = f"did you mean {close[0]}?" if close else "see docs/configuration.md"
        warnings.append(
            f"environment variable {name} is not a kvtax setting and is ignored; {hint}"
        )
    return warnings
