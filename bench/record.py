"""The benches' results: a Markdown table, and a run's record saved as the pair ``NAME.md`` (the
Markdown the bench generates, for people) and ``NAME.json`` (its figures, for programs and for a
later ``--render``). Every bench writes its tables and its result files through here, so that two
benches' results read alike and a diff of two runs shows figures, not formatting."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

__all__ = ["save", "table"]

# The rule's marker for each letter of ``align``. Left is a bare "---": the committed results
# were written so, and a renderer aligns a column without colons left anyway.
_RULE = {"l": "---", "r": "---:", "c": ":---:"}


def table(header: Sequence[str], rows: Iterable[Sequence[str]], align: str = "") -> str:
    """A Markdown table, without a newline at the end, of ``header`` and ``rows``, whose cells
    the caller has rendered (a number's format is the bench's to choose).

    ``align`` has one letter per column: ``l`` left, ``r`` right, ``c`` centre; empty, every
    column left. An ``align`` or a row of another width than the header raises ValueError: a
    missing cell would shift the ones after it into the wrong columns without a sign.
    """
    marks = align or "l" * len(header)
    if len(marks) != len(header) or not set(marks) <= _RULE.keys():
        raise ValueError(f"align {align!r}: one of l, r, c for each of {len(header)} columns")
    lines = [_line(header), "|" + "|".join(_RULE[m] for m in marks) + "|"]
    for n, row in enumerate(rows, 1):
        if len(row) != len(header):
            raise ValueError(f"row {n} has {len(row)} cells for {len(header)} columns")
        lines.append(_line(row))
    return "\n".join(lines)


def _line(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def save(name: Path, markdown: str | None, figures: Mapping[str, object] | None) -> list[Path]:
    """Save a run's record: ``markdown`` as ``NAME.md``, ending in one newline, and ``figures``
    as ``NAME.json``, indented by 2 with sorted keys (two runs' files diff line by line). The
    folder is created.

    ``name``'s own suffix is replaced, so a flag that names either file names the pair (as
    ``--out gate.md`` does). ``None`` leaves that file alone: a bench whose figures another
    bench renders writes only the JSON, one whose report holds all its figures only the
    Markdown. Returns the files written.
    """
    name.parent.mkdir(parents=True, exist_ok=True)
    written = []
    if markdown is not None:
        written.append(name.with_suffix(".md"))
        written[-1].write_text(markdown.rstrip("\n") + "\n")
    if figures is not None:
        written.append(name.with_suffix(".json"))
        written[-1].write_text(json.dumps(figures, indent=2, sort_keys=True) + "\n")
    return written
