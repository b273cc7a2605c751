"""The usage of a non-streamed response, read from its bytes as they pass. Pure, no I/O.

The proxy relays a non-streamed body chunk by chunk instead of holding it whole, so the body
is never in memory at once. :class:`UsageScanner` watches the chunks for the top-level
``"usage": {`` key, keeps at most :data:`MAX_USAGE` bytes from there, and parses that object with
a real JSON decoder when the body ends. ``"usage"`` with its quotes cannot occur inside a JSON
string (the quotes would be escaped), and vLLM's answers hold one usage object (the last key
of an OpenAI response), so the last match is the one that counts. The object reads as OpenAI's
(:func:`usage_tokens`) unless the scanner is given another reader (:func:`io_usage_tokens`:
Anthropic's and the Responses API's ``input_tokens`` and ``output_tokens``).

Example::

    scan = UsageScanner()
    for chunk in body_chunks:
        scan.feed(chunk)
    scan.tokens()  # (completion_tokens, prompt_tokens) or None
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

__all__ = ["MAX_USAGE", "UsageReader", "UsageScanner", "io_usage_tokens", "usage_tokens"]

_KEY = re.compile(rb'"usage"\s*:\s*\{')
# The pattern's longest form that can straddle two chunks, with room for spaces.
_OVERLAP = 64
# A usage object is under 200 bytes; with details, well under this.
MAX_USAGE = 4096


def usage_tokens(usage: object) -> tuple[int, int] | None:
    """(completion, prompt) tokens from a parsed OpenAI usage object, or None if it is not
    one."""
    return _tokens(usage, "completion_tokens", "prompt_tokens")


def io_usage_tokens(usage: object) -> tuple[int, int] | None:
    """(completion, prompt) tokens from a usage object of ``output_tokens`` and
    ``input_tokens`` (Anthropic's Messages API, OpenAI's Responses API), or None."""
    return _tokens(usage, "output_tokens", "input_tokens")


def _tokens(usage: object, output: str, prompt_key: str) -> tuple[int, int] | None:
    if not isinstance(usage, dict):
        return None
    completion, prompt = usage.get(output), usage.get(prompt_key, 0)
    if type(completion) is not int or type(prompt) is not int or completion < 0 or prompt < 0:
        return None
    return completion, prompt


# How a dialect reads a usage object: (completion, prompt) tokens, or None.
UsageReader = Callable[[object], "tuple[int, int] | None"]


class UsageScanner:
    """Finds and parses the usage object of one response body. See the module docstring."""

    __slots__ = ("_capture", "_read", "_tail")

    def __init__(self, read: UsageReader = usage_tokens) -> None:
        self._read = read
        self._tail = b""
        self._capture: bytearray | None = None

    def feed(self, chunk: bytes) -> None:
        window = self._tail + chunk if self._tail else chunk
        last = None
        for last in _KEY.finditer(window):  # noqa: B007 - only the last match matters
            pass
        if last is not None:
            self._capture = bytearray(window[last.end() - 1 : last.end() - 1 + MAX_USAGE])
        elif self._capture is not None and len(self._capture) < MAX_USAGE:
            self._capture += chunk[: MAX_USAGE - len(self._capture)]
        self._tail = window[-_OVERLAP:]

    def tokens(self) -> tuple[int, int] | None:
        """The usage found, once the whole body went by; None if there was none to read."""
        if self._capture is None:
            return None
        try:
            usage, _ = json.JSONDecoder().raw_decode(self._capture.decode("utf-8", "replace"))
        except ValueError:
            return None
        return self._read(usage)
