"""The JSON files ``kvtax plan`` reads from a model directory, read so that no file can crash it.

``config.json`` and ``model.safetensors.index.json`` are small; a file larger than
:data:`MAX_JSON_BYTES`, nested deeper than Python's parser goes, or holding an integer of
thousands of digits is refused with a one-line :class:`PlanError` naming the file, never a
MemoryError or RecursionError.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvtax.errors import PlanError

__all__ = ["MAX_JSON_BYTES", "parse_json", "read_json"]

# A config.json is a few kilobytes, a sharded checkpoint's index a few megabytes.
MAX_JSON_BYTES = 64 * 2**20


def parse_json(data: bytes | str, source: str, what: str = "not a readable JSON file") -> Any:
    """``data`` parsed; a one-line :class:`PlanError` naming ``source`` when it is not JSON
    Python can read (bad syntax or UTF-8, too deeply nested, too long an integer)."""
    try:
        return json.loads(data)
    except RecursionError:
        raise PlanError(source, f"{what}: nested too deeply") from None
    except ValueError as exc:
        message = " ".join(str(exc).split())
        if message.startswith("Exceeds the limit"):  # Python's guard on int() of huge text
            message = "it holds an integer of thousands of digits"
        raise PlanError(source, f"{what}: {message}") from None


def read_json(file: Path, limit: int | None = None) -> Any:
    """The JSON file ``file`` of at most ``limit`` bytes (default :data:`MAX_JSON_BYTES`),
    parsed (see :func:`parse_json`)."""
    limit = MAX_JSON_BYTES if limit is None else limit
    try:
        with file.open("rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise PlanError(str(file), f"not a readable JSON file: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise PlanError(str(file), f"larger than {limit // 2**20} MiB: not a model's JSON file")
    return parse_json(data, str(file))
