"""The raw transport's server: :class:`RawUpstream`, an asyncio server on ``127.0.0.1:0`` (the
kernel's port, read back) standing in for vLLM, with every byte it answers the test's.

Each request the proxy sends is parsed with h11 (strict RFC 9112, so a request kvtax writes
badly is caught here) and recorded as a :class:`~kvtax_dev.fakevllm.raw.Seen`. Its answer is a
:data:`~kvtax_dev.fakevllm.raw.Script`; scripts run in order per connection, from the moment a
request's head is complete, so a script can watch the body arrive (``await
seen.complete.wait()`` to wait for all of it). With no script of the test's it answers as
:class:`~kvtax_dev.fakevllm.vllmlike.VllmLike`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque

import h11

from kvtax_dev.fakevllm.raw import WAIT, Link, Script, Seen
from kvtax_dev.fakevllm.vllmlike import VllmLike

__all__ = ["RawUpstream"]

# A request head the recorder reads whole (h11's default is 16 KiB; the proxy allows 64 KiB).
_MAX_HEAD = 1024**2


class RawUpstream:
    """The scriptable stand-in for vLLM; see the module docstring.

    ``script`` answers every request unless :meth:`then` queued one-shot scripts, which answer
    the next requests in the order they arrive. ``seen`` holds every request in arrival order,
    ``links`` every connection.
    """

    def __init__(self, script: Script | None = None) -> None:
        self.script: Script = script or VllmLike()
        self.queued: deque[Script] = deque()
        self.seen: list[Seen] = []
        self.links: list[Link] = []
        self.server: asyncio.Server | None = None
        self.port = 0
        self._serving: set[asyncio.Task[None]] = set()
        self._answering: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def forget(self) -> None:
        """Drop what was recorded so far, and the connections already closed: a long run of
        examples (the differential) keeps only what the next one needs."""
        self.seen.clear()
        self.links = [link for link in self.links if not link.lost.is_set()]

    def then(self, *scripts: Script) -> None:
        """Answer the next requests with these scripts, one each, then ``script`` again."""
        self.queued.extend(scripts)

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = int(self.server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        for link in self.links:
            link.abort()
        # Scripts still waiting are ours to cancel; each connection's own task (asyncio's
        # callback) ends as its reader sees the close.
        for task in list(self._answering):
            task.cancel()
        pending = list(self._answering | self._serving)
        if pending:
            await asyncio.wait(pending, timeout=WAIT)
        if self.server is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._serving.add(task)
        link = Link(len(self.links), reader, writer)
        self.links.append(link)
        requests: asyncio.Queue[Seen | None] = asyncio.Queue()
        answering = asyncio.create_task(self._answer(link, requests))
        self._answering.add(answering)
        try:
            await self._read(link, requests)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            link.lost.set()
            requests.put_nowait(None)
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await answering
            self._answering.discard(answering)
            writer.close()
            self._serving.discard(task)

    async def _read(self, link: Link, requests: asyncio.Queue[Seen | None]) -> None:
        parser = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEAD)
        current: Seen | None = None
        while True:
            data = await link.reader.read(256 * 1024)
            link.received += data
            parser.receive_data(data)
            while True:
                try:
                    event = parser.next_event()
                except h11.RemoteProtocolError as exc:
                    # The proxy wrote a request h11 refuses: recorded, answered, dropped.
                    link.error = f"{exc} after {bytes(link.received[-200:])!r}"
                    link.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                    link.close()
                    return
                if isinstance(event, h11.Request):
                    current = Seen(
                        event.method,
                        event.target,
                        event.http_version,
                        list(event.headers.raw_items()),
                        link,
                    )
                    self.seen.append(current)
                    requests.put_nowait(current)
                elif isinstance(event, h11.Data):
                    assert current is not None
                    current.body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    assert current is not None
                    current.trailers = list(event.headers.raw_items())
                    current.complete.set()
                    current = None
                    # The next request on this connection: a fresh parser for what is left
                    # (h11 would wait for our response, which scripts write raw).
                    leftover, _ = parser.trailing_data
                    parser = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEAD)
                    if leftover:  # (b"" would tell h11 the connection closed)
                        parser.receive_data(leftover)
                elif event is h11.NEED_DATA or event is h11.PAUSED:
                    break
                elif isinstance(event, h11.ConnectionClosed):
                    return
            if not data:
                return

    async def _answer(self, link: Link, requests: asyncio.Queue[Seen | None]) -> None:
        while (seen := await requests.get()) is not None:
            script = self.queued.popleft() if self.queued else self.script
            try:
                await script(seen, link)
            except (ConnectionError, asyncio.IncompleteReadError):
                return
