"""Accounted requests on their way to vLLM, until its status line comes back.

:class:`Sender` POSTs an accounted request and waits for vLLM's status line. vLLM can close a
pooled keep-alive connection at the instant the proxy reuses it (its event loop late under
load); the request then fails before vLLM read it, and the client would get a 502 that kvtax
caused. nginx gives a cached upstream connection's failure a second try for the same reason,
and so does the sender: only a break with no status line is retried, once. A refused connect
(vLLM down) or any answer at all is never sent twice.

Example::

    sender = Sender(lambda: session, "http://127.0.0.1:8000", timeout=300.0)
    upstream = await sender.post(request, body)
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import aiohttp
from aiohttp import web

from kvtax.serve.upstream import NO_AUTO, read_timeout, request_headers, upload

__all__ = ["Sender"]

log = logging.getLogger("kvtax.serve.sender")


class Sender:
    """Sends accounted requests to vLLM; ``retries`` counts the second tries."""

    def __init__(
        self, session: Callable[[], aiohttp.ClientSession], upstream: str, timeout: float
    ) -> None:
        self.session = session
        self.upstream = upstream
        self.timeout = timeout
        self.retries = 0

    async def post(self, request: web.Request, body: bytes) -> aiohttp.ClientResponse:
        """POST ``body``; a connection that breaks before any answer gets one more try."""
        send = functools.partial(
            self.session().post,
            self.upstream + request.rel_url.raw_path_qs,
            headers=request_headers(request.headers, identity=True),
            skip_auto_headers=NO_AUTO,
            allow_redirects=False,
            timeout=read_timeout(self.timeout),
        )
        try:
            return await send(data=upload(body))
        except aiohttp.ClientConnectorError:
            raise  # refused or unreachable: vLLM never had it, and a retry would only wait
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            self.retries += 1
            log.debug("vLLM closed the connection before answering (%s); one more try", exc)
        return await send(data=upload(body))
