"""The parse worker process: reads pages on stdin, answers snapshots on stdout.

Started by :class:`~kvtax.serve.scrape.parsepool.ParsePool` as ``python -m
kvtax.serve.scrape.parseworker``. It
imports only
the pure parsing modules (about 24 MiB RSS, where a ``multiprocessing`` spawn worker re-imports
the whole CLI and adds a resource-tracker process: 53 MiB in all). Frames are an 8-byte
big-endian length and a pickle; both ends are this package, so pickle is trusted here. The worker
runs at a lower CPU priority: in a pod's CPU quota, the event loop that relays streams comes
first. It exits when its stdin closes, i.e. when the sidecar stops or dies.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
from typing import IO

from kvtax.engine.normalize import ParseError, normalize
from kvtax.figures.window import candidates

__all__ = ["main", "receive_frame", "send_frame"]

_HEADER = 8


def send_frame(stream: IO[bytes], payload: bytes) -> None:
    stream.write(len(payload).to_bytes(_HEADER, "big"))
    stream.write(payload)
    stream.flush()


def receive_frame(stream: IO[bytes]) -> bytes | None:
    """One frame, or None at a clean end of stream. A frame cut short raises EOFError."""
    header = stream.read(_HEADER)
    if not header:
        return None
    if len(header) != _HEADER:
        raise EOFError("frame header cut short")
    size = int.from_bytes(header, "big")
    payload = stream.read(size)  # a buffered read: loops until size bytes or the end
    if len(payload) != size:
        raise EOFError(f"frame cut short: {len(payload)} of {size} bytes")
    return payload


def main() -> None:
    # Ctrl-C reaches the whole process group; the parent decides when the worker stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(OSError):
        os.nice(10)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while (frame := receive_frame(stdin)) is not None:
        text, timestamp, version, max_series, tracked, max_models = pickle.loads(frame)
        reply: tuple[str, object]
        try:
            snap = normalize(text, timestamp=timestamp, version=version, max_series=max_series)
        except ParseError as exc:
            reply = ("error", exc)
        else:
            # Only models the sidecar could track cross back: unpickling thousands of them
            # would hold the GIL of the sidecar's event loop.
            reply = ("ok", snap if max_models is None else candidates(snap, tracked, max_models))
        del text, frame
        send_frame(stdout, pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))


if __name__ == "__main__":
    main()
