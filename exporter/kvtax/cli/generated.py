"""Write generated files, or check the committed ones: the one ``--check`` of every generator.

``kvtax docs``, ``kvtax rules`` and ``kvtax dashboards generate`` each render their files into
memory (file name -> text) and hand them to :func:`write_or_check`. Without ``--check`` it writes
them under the output folder; with it, it writes nothing, names every file that is missing or
differs, says which command regenerates them, and returns exit status 1. CI runs the checks, so
a change to a generator that is not followed by its committed output fails the build.

Stdlib only, and in no layer: the generators in ``kvtax.mixin.rules`` and
``kvtax.mixin.dashboards`` and the
top-level :mod:`kvtax.cli.main` all import it.

Example (inside a subcommand's run(args))::

    from kvtax.mixin.rules.render import render_files
    return write_or_check(render_files(), args.out, check=args.check, command="kvtax rules")
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path

__all__ = ["add_output_arguments", "stale_files", "write_or_check"]


def add_output_arguments(parser: argparse.ArgumentParser, out: Path) -> None:
    """Add ``--out`` (default ``out``) and ``--check`` to a generator's subcommand."""
    parser.add_argument("--out", type=Path, default=out, help="Folder to write into.")
    parser.add_argument(
        "--check",
        action="store_true",
        help="Exit 1 if the committed files differ instead of writing them.",
    )


def stale_files(files: Mapping[str, str], out: Path) -> list[Path]:
    """The paths under ``out`` that are missing or differ from ``files``, in ``files``' order."""
    return [
        out / name
        for name, text in files.items()
        if not (out / name).exists() or (out / name).read_text() != text
    ]


def write_or_check(
    files: Mapping[str, str], out: Path, *, check: bool, command: str, fix: str | None = None
) -> int:
    """Write ``files`` under ``out`` and return 0, or with ``check`` compare them and return 1
    when any is stale, after printing ``<command>: out of date: <paths>; run `<fix>```.

    ``fix`` is the command that regenerates the files; it defaults to ``command``.
    """
    if check:
        stale = stale_files(files, out)
        if not stale:
            return 0
        names = ", ".join(str(path) for path in stale)
        print(f"{command}: out of date: {names}; run `{fix or command}`", file=sys.stderr)
        return 1
    for name, text in files.items():
        path = out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return 0
