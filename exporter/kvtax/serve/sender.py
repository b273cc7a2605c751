"""Accounted requests on their way to vLLM, until its status line comes back.

:class:`Sender` POSTs an accounted request and waits for vLLM's status line. Two things end
that wait early:

- vLLM can close a pooled keep-alive connection at the instant the proxy reuses it (its event
  loop late under load); the request then fails before vLLM read it, and the client would get
  a 502 that kvtax caused. nginx gives a cached upstream connection's failure a second try for
  the same reason, and so does the sender, once, when the failure came within
  :data:`STALE_WITHIN` of sending. A refused connect (vLLM down), a later failure or any answer
  at all is never sent twice.
- Shutdown's cut (:meth:`Sender.cut`): vLLM sends a non-streamed answer's status line only when
  the generation ends, so a wait still running when the grace period is over is cancelled,
  which closes its connection and makes vLLM abort the request.

Example::

    sender = Sender(lambda: session, "http://127.0.0.1:8000", timeout=300.0)
    upstream = await sender.post(request, body)  # None: the cut ended it first
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable

import aiohttp
from aiohttp import web

from kvtax.serve.upstream import NO_AUTO, read_timeout, request_headers, upload

__all__ = ["STALE_WITHIN", "Sender"]

log = logging.getLogger("kvtax.serve.sender")

# Seconds after sending within which a break is a stale pooled connection, and worth one more
# try. Such a connection fails on the write or on the first read, at once. A break that comes
# later met a vLLM that had the request and ran it (for a non-streamed request the status line
# comes only when the generation ends): sending it again would run it twice.
STALE_WITHIN = 0.5


class Sender:
    """Sends accounted requests to vLLM; ``retries`` counts the second tries."""

    def __init__(
        self, session: Callable[[], aiohttp.ClientSession], upstream: str, timeout: float
    ) -> None:
        self.session = session
        self.upstream = upstream
        self.timeout = timeout
        self.retries = 0
        self._cut = False
        self._waiting: set[asyncio.Task[aiohttp.ClientResponse]] = set()

    async def post(self, request: web.Request, body: bytes) -> aiohttp.ClientResponse | None:
        """vLLM's answer to ``body`` once its status line came; None when the cut came first.

        The POST runs as a task of its own so that :meth:`cut` can cancel it without cancelling
        the handler, which still answers its client.
        """
        task = asyncio.ensure_future(self._send(request, body))
        self._waiting.add(task)
        try:
            upstream = await task
        except asyncio.CancelledError:
            handler = asyncio.current_task()
            if handler is not None and handler.cancelling():
                raise  # the handler itself was cancelled: its client left
            return None  # only the POST was cancelled: the cut
        finally:
            self._waiting.discard(task)
        if self._cut:  # answered just before the cut, resumed after it
            upstream.close()
            return None
        return upstream

    def cut(self) -> None:
        """The grace period is over: end every POST vLLM has not answered yet."""
        self._cut = True
        for task in self._waiting:
            task.cancel()

    async def _send(self, request: web.Request, body: bytes) -> aiohttp.ClientResponse:
        """POST ``body``, once more if a pooled connection turned out stale (see above)."""
        send = functools.partial(
            self.session().post,
            self.upstream + request.rel_url.raw_path_qs,
            headers=request_headers(request.headers, identity=True),
            skip_auto_headers=NO_AUTO,
            allow_redirects=False,
            timeout=read_timeout(self.timeout),
        )
        loop = asyncio.get_running_loop()
        began = loop.time()
        try:
            return await send(data=upload(body))
        except aiohttp.ClientConnectorError:
            raise  # refused or unreachable: vLLM never had it, and a retry would only wait
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            if loop.time() - began > STALE_WITHIN:
                raise  # vLLM had it and ran it: never sent twice
            self.retries += 1
            log.debug("vLLM closed the connection before answering (%s); one more try", exc)
        return await send(data=upload(body))
