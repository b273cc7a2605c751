"""Weight bytes of a model directory, from safetensors headers: the tensors are never read.

A ``.safetensors`` file starts with an 8-byte little-endian header length and a JSON header
that gives every tensor's byte range. :func:`header_bytes` sums those ranges from the header
alone; :func:`weight_bytes` prefers the sharded index's ``metadata.total_size`` and otherwise
reads only the first ``8 + header`` bytes of each file, so a 140 GB checkpoint costs a few
kilobytes of reading.

Example::

    >>> import json, struct
    >>> head = json.dumps({"w": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}}).encode()
    >>> header_bytes(struct.pack("<Q", len(head)) + head, "x.safetensors")
    4
"""

from __future__ import annotations

import struct
from pathlib import Path

from kvtax.errors import PlanError
from kvtax.tools.plan.files import parse_json, read_json
from kvtax.tools.plan.modelcfg import show_number

__all__ = ["INDEX_NAME", "MAX_HEADER_BYTES", "MAX_MODEL_BYTES", "header_bytes", "weight_bytes"]

INDEX_NAME = "model.safetensors.index.json"
# safetensors itself refuses headers above 100 MB; a bigger length means a corrupt file.
MAX_HEADER_BYTES = 100_000_000
# A byte count or offset above 1 PiB is a corrupt file, not a model: refused, so that no size
# reaches float arithmetic as an integer too large for it.
MAX_MODEL_BYTES = 2**50


def header_bytes(prefix: bytes, source: str) -> int:
    """Tensor bytes described by a safetensors ``prefix`` (the length word and JSON header)."""
    if len(prefix) < 8:
        raise PlanError(source, "not a safetensors file: shorter than its 8-byte header length")
    (length,) = struct.unpack("<Q", prefix[:8])
    if length > MAX_HEADER_BYTES or len(prefix) < 8 + length:
        raise PlanError(source, f"not a safetensors file: header length {length} is invalid")
    header = parse_json(prefix[8 : 8 + length], source, "safetensors header is not JSON")
    if not isinstance(header, dict):
        raise PlanError(source, "safetensors header is not a JSON object")
    total = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2):
            raise PlanError(source, f"tensor {_short(name)!r} has no data_offsets")
        start, end = offsets
        if not (_is_size(start) and _is_size(end) and start <= end):
            raise PlanError(
                source,
                f"tensor {_short(name)!r} has data_offsets {show_number(start)}, "
                f"{show_number(end)}: not two byte offsets from 0 to {MAX_MODEL_BYTES:,}",
            )
        total += end - start
    return total


def _is_size(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_MODEL_BYTES


def _short(name: str) -> str:
    return name if len(name) <= 80 else name[:77] + "..."


def _read_prefix(path: Path) -> bytes:
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return head
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER_BYTES:
            return head
        return head + f.read(length)


def weight_bytes(directory: Path) -> int | None:
    """Bytes of the weights in ``directory``; None when it holds no safetensors at all."""
    index = directory / INDEX_NAME
    if index.is_file():
        document = read_json(index)
        meta = document.get("metadata") if isinstance(document, dict) else None
        size = meta.get("total_size") if isinstance(meta, dict) else None
        if isinstance(size, int | float) and not isinstance(size, bool):
            if not 0 <= size <= MAX_MODEL_BYTES:  # NaN too
                raise PlanError(
                    str(index),
                    f"metadata.total_size must be a byte count from 0 to {MAX_MODEL_BYTES:,}, "
                    f"not {show_number(size)}",
                )
            return int(size)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for path in files:
        try:
            total += header_bytes(_read_prefix(path), str(path))
        except OSError as exc:
            raise PlanError(str(path), f"unreadable: {exc.strerror or exc}") from exc
    return total
