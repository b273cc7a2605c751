"""The one error type of load tests and annotation: bad input, named by its field."""

from __future__ import annotations

__all__ = ["InputError"]


class InputError(ValueError):
    """Input kvtax cannot use. ``str()`` is one line: ``<field>: <what is wrong>``."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = " ".join(message.split())  # one line, whatever the cause said
        super().__init__(f"{field}: {self.message}")
