"""How one setting is declared: :class:`Option` and :func:`option`, the building blocks of the
options table in :mod:`kvtax.serve.config.options`, and :func:`options_of`, which reads a table
back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from dataclasses import field as dataclass_field
from typing import Any

__all__ = ["Option", "env_name", "flag_name", "option", "options_of", "renamed_keys"]


@dataclass(frozen=True, slots=True)
class Option:
    """One setting. ``key`` is dotted; the Config field is the key with dots as underscores."""

    key: str
    # As a user would write it; None means unset. Config's default is this, parsed.
    default: Any
    parse: Callable[[Any], Any]
    help: str
    metavar: str = "VALUE"
    # A secret's value never appears in an error message (or anywhere else kvtax prints).
    secret: bool = False

    @property
    def switch(self) -> bool:
        """A true/false setting: its flag may be given bare, meaning true."""
        return self.metavar == "BOOL"

    @property
    def field(self) -> str:
        return self.key.replace(".", "_")

    @property
    def flag(self) -> str:
        """The command-line flag: ``--web.listen-address`` for ``web.listen_address``."""
        return flag_name(self.key)

    @property
    def env(self) -> str:
        """The environment variable: ``KVTAX_WEB_LISTEN_ADDRESS``."""
        return env_name(self.key)

    @property
    def default_text(self) -> str:
        """The default as ``--help`` and the docs show it."""
        return "unset" if self.default is None else str(self.default)

    def default_value(self) -> Any:
        """The typed default: what ``Config()`` holds when nothing sets this option."""
        return None if self.default is None else self.parse(self.default)


def env_name(key: str) -> str:
    return "KVTAX_" + key.replace(".", "_").upper()


def flag_name(key: str) -> str:
    return "--" + key.replace("_", "-")


def option(
    key: str,
    default: Any,
    parse: Callable[[Any], Any],
    help: str,
    metavar: str = "VALUE",
    *,
    secret: bool = False,
) -> Any:
    """A :class:`Config` field for one setting; its default is ``default`` parsed.

    An invalid default fails here, when the class is defined, not at a user's first start.
    """
    spec = Option(key, default, parse, help, metavar, secret)
    return dataclass_field(default=spec.default_value(), repr=not secret, metadata={"option": spec})


def options_of(config_class: type) -> tuple[Option, ...]:
    """The options of a dataclass declared with :func:`option`, in declaration order.

    Raises TypeError for a field declared without option() (its default would live outside the
    table) or under another option's key.
    """
    table = []
    for f in fields(config_class):
        spec = f.metadata.get("option")
        # A raise, not an assert: `python -O` would strip an assert.
        if not isinstance(spec, Option):
            raise TypeError(f"{config_class.__name__}.{f.name} is not declared with option()")
        if spec.field != f.name:
            raise TypeError(f"{config_class.__name__}.{f.name} is declared as {spec.key!r}")
        table.append(spec)
    return tuple(table)


def renamed_keys(options: tuple[Option, ...], renamed: Mapping[str, str]) -> dict[str, Option]:
    """The old keys of renamed settings, each with the option it now names.

    ``renamed`` maps an old key prefix to the new one (``{"admission": "gate"}``): every option
    under ``gate.`` then has an old key under ``admission.`` (``admission.max_queue`` for
    ``gate.max_queue``), whose flag, variable and YAML key are spelled as for any key.
    """
    return {
        f"{old}.{o.key.removeprefix(new + '.')}": o
        for old, new in renamed.items()
        for o in options
        if o.key.startswith(new + ".")
    }
