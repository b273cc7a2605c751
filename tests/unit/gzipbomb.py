"""Gzip bodies for tests of what kvtax does with compressed requests, and a count of every
byte zlib inflates in the process, whoever asks for it (aiohttp, gzip, kvtax).

A bomb is many copies of one gzip member of zeros (RFC 1952 allows members back to back), so a
bomb of hundreds of megabytes costs the test a few kilobytes of compression.

Example::

    inflation = Inflation(monkeypatch)
    body = bomb(256 * 1024**2)   # ~256 KiB on the wire
    ...
    assert inflation.bytes == 0
"""

from __future__ import annotations

import functools
import gzip
import zlib
from typing import Any

import pytest

__all__ = ["Inflation", "bomb"]

_MEMBER = 4 * 1024**2


@functools.cache
def _member() -> bytes:
    return gzip.compress(b"\0" * _MEMBER, compresslevel=9)


def bomb(inflated: int) -> bytes:
    """A gzip body that inflates to ``inflated`` bytes (rounded up to 4 MiB) of zeros."""
    return _member() * -(-inflated // _MEMBER)


class Inflation:
    """Counts the bytes zlib.decompressobj and zlib.decompress produce while patched."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.bytes = 0
        self.calls = 0
        real_object, real_decompress = zlib.decompressobj, zlib.decompress
        outer = self

        class Counting:
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                self._inner = real_object(*args, **kwargs)

            def decompress(self, data: bytes, max_length: int = 0) -> bytes:
                out = self._inner.decompress(data, max_length)
                outer.calls += 1
                outer.bytes += len(out)
                return out

            def flush(self, *args: Any) -> bytes:
                out = self._inner.flush(*args)
                outer.bytes += len(out)
                return out

            def __getattr__(self, name: str) -> Any:
                return getattr(self._inner, name)

        def decompress(data: bytes, *args: Any, **kwargs: Any) -> bytes:
            out = real_decompress(data, *args, **kwargs)
            outer.calls += 1
            outer.bytes += len(out)
            return out

        monkeypatch.setattr(zlib, "decompressobj", Counting)
        monkeypatch.setattr(zlib, "decompress", decompress)
