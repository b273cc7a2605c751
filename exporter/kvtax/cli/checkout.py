"""Where ``kvtax`` commands that need the development harness say how to get it.

``kvtax demo`` and ``kvtax dashboards preview`` run code from ``kvtax_dev``, a package that lives
only in a checkout of the kvtax repository (``exporter/kvtax_dev/``): the wheel and the image
carry what runs in the pod and nothing else. Those commands import it lazily and, when it is
absent, print :func:`needs_checkout`'s message and exit 2 instead of a traceback.

Example::

    try:
        from kvtax_dev.demo import run_demo
    except ModuleNotFoundError as exc:
        if not harness_missing(exc):
            raise
        print(needs_checkout("kvtax demo", "scripts/demo"), file=sys.stderr)
        return 2
"""

from __future__ import annotations

__all__ = ["DEV_PACKAGE", "harness_missing", "needs_checkout"]

DEV_PACKAGE = "kvtax_dev"


def harness_missing(exc: ModuleNotFoundError) -> bool:
    """True if ``exc`` means the harness package itself is absent. A module missing *inside* a
    checkout (say aiohttp) is a broken environment, and must not read as "clone the repo"."""
    return exc.name == DEV_PACKAGE


def needs_checkout(command: str, how: str) -> str:
    """The message for ``command`` run from an installed kvtax: what is missing and, in ``how``,
    the command to run from the root of a clone instead."""
    return (
        f"{command}: this runs from a checkout of the kvtax repository;\n"
        "the installed kvtax package holds only the sidecar. Clone the repository, then run\n"
        f"from its root:\n  {how}"
    )
