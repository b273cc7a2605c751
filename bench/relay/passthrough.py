"""A bare TCP pass-through, the floor that :mod:`bench.relay` measures beside kvtax and nginx.

Each client connection gets its own upstream connection to a fixed address, and the bytes read
on one side are written to the other as they arrive, in one ``transport.write`` each, with no
HTTP parsing at all. When one side's write buffer is full (``pause_writing``), the other side
stops reading until it drains (``resume_writing``). A relay does at least this much, so its
cost on uvloop is what plain Python pays to relay a stream::

    python -m bench.relay.passthrough --port 8001 --upstream-port 8000
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable
from typing import cast

import uvloop

__all__ = ["serve"]


class _Side(asyncio.Protocol):
    """One connection of a spliced pair: what it reads, its peer writes."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: _Side | None = None
        self.closed = False
        # Until link(), what arrives waits here (uvloop may deliver a read already under way
        # when connection_made pauses reading).
        self.early: list[bytes] = []
        self.write: Callable[[bytes], object] = self.early.append

    def link(self, peer: _Side) -> None:
        assert peer.transport is not None
        self.peer, self.write = peer, peer.transport.write
        for data in self.early:
            self.write(data)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's: duck-typed, no subclass

    def data_received(self, data: bytes) -> None:
        # (uvloop binds data_received once, so link() replaces write, not this method.)
        self.write(data)

    def pause_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()

    # EOF: returning None lets the transport close, and connection_lost closes the peer, which
    # flushes what it still holds first. HTTP/1.1 needs no half-closed connections.
    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()


class _Client(_Side):
    """The client's side: reads nothing until its upstream connection is up."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        super().__init__()
        self.upstream = upstream

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        assert self.transport is not None
        self.transport.pause_reading()
        self.connecting = asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        assert self.transport is not None
        loop = asyncio.get_running_loop()
        try:
            transport, peer = await loop.create_connection(_Side, *self.upstream)
        except OSError:
            self.transport.close()
            return
        if self.closed:  # the client left while we connected
            transport.close()
            return
        peer.link(self)
        self.link(peer)
        self.transport.resume_reading()


async def serve(port: int, upstream: tuple[str, int], host: str = "127.0.0.1") -> None:
    """Accept on ``host:port`` and splice each connection to ``upstream``, until cancelled."""
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Client(upstream), host, port, backlog=4096)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True, help="Port to accept clients on.")
    parser.add_argument("--upstream-port", type=int, required=True, help="Port to relay to.")
    parser.add_argument("--upstream-host", default="127.0.0.1", help="Host to relay to.")
    args = parser.parse_args()
    uvloop.run(serve(args.port, (args.upstream_host, args.upstream_port)))


if __name__ == "__main__":
    main()
