"""``docs/configuration.md``, generated from the options table by ``kvtax docs``.

Example::

    from pathlib import Path
    Path("docs/configuration.md").write_text(render_markdown())
"""

from __future__ import annotations

from kvtax.serve.config.option import env_name, flag_name
from kvtax.serve.config.options import OPTIONS, RENAMED, RUNTIME_SWITCHES

__all__ = ["render_markdown"]

_HEADER = [
    "# kvtax configuration reference",
    "",
    "Generated from `exporter/kvtax/serve/config/options.py` by `kvtax docs`; do not edit by hand.",
    "",
    "Precedence: command-line flag, then environment variable, then the YAML file given by",
    "`--config.file` (nested keys: `scrape: {interval: 5s}`), then the default.",
    "Durations accept `500ms`, `5s`, `5m`, `1h` or plain seconds.",
    "",
    "| flag | environment | default | meaning |",
    "|---|---|---|---|",
]


_RENAMED_HEADER = [
    "",
    "## Renamed settings",
    "",
    "The old spellings still work, each with a warning at start naming the new one. Given both",
    "ways in one place (two flags, two variables or two YAML keys), the new one wins. Precedence",
    "is as above: an old flag beats a new variable. `kvtax serve --help` shows only the new ones.",
    "",
    "| old | new |",
    "|---|---|",
]


_SWITCHES_HEADER = [
    "",
    "## Other environment variables",
    "",
    "Read at run time, with no flag or YAML key.",
    "",
    "| variable | meaning |",
    "|---|---|",
]


def render_markdown() -> str:
    """The configuration reference: one row per option, with its flag, variable and default,
    then the renamed settings' old spellings, then the variables that are not settings."""
    lines = list(_HEADER)
    for o in OPTIONS:
        default = "unset" if o.default is None else f"`{o.default_text}`"
        lines.append(f"| `{o.flag}` | `{o.env}` | {default} | {o.help} |")
    if RENAMED:
        lines += _RENAMED_HEADER
        lines += [f"| {_spellings(old)} | {_spellings(new)} |" for old, new in RENAMED.items()]
    lines += _SWITCHES_HEADER
    lines += [f"| `{name}` | {meaning} |" for name, meaning in RUNTIME_SWITCHES.items()]
    return "\n".join(lines) + "\n"


def _spellings(prefix: str) -> str:
    """A key prefix's flags, variables and YAML keys: ``--gate.*``, ``KVTAX_GATE_*``, ``gate:``."""
    return f"`{flag_name(prefix)}.*`, `{env_name(prefix)}_*`, YAML `{prefix}:`"
