"""``docs/configuration.md``, generated from the options table by ``kvtax docs``.

Example::

    Path("docs/configuration.md").write_text(render_markdown())
"""

from __future__ import annotations

from kvtax.serve.config.options import OPTIONS

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


def render_markdown() -> str:
    """The configuration reference: one row per option, with its flag, variable and default."""
    lines = list(_HEADER)
    for o in OPTIONS:
        default = "unset" if o.default is None else f"`{o.default_text}`"
        lines.append(f"| `{o.flag}` | `{o.env}` | {default} | {o.help} |")
    return "\n".join(lines) + "\n"
