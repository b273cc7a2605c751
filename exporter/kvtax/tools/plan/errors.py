"""The one exception of ``kvtax plan``: bad input, named by the field it came from.

The command line prints it as a single line (``kvtax plan: <field>: <message>``) and exits 2, so
every check below raises it with the flag or config key a user would have to fix.
"""

from __future__ import annotations

__all__ = ["PlanError"]


class PlanError(ValueError):
    """Input ``plan`` cannot use. ``field`` names the flag, key or file at fault.

    >>> str(PlanError("--kv-dtype", "unknown dtype 'fp7'"))
    "--kv-dtype: unknown dtype 'fp7'"
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
