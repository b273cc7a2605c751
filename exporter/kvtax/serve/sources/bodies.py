"""Read an HTTP body to its end, with a bound on its size.

``StreamReader.read(n)`` returns what has arrived so far, not the whole body: a report sent in
two writes, or with chunked transfer encoding, comes back cut short. :func:`read_bounded` reads
until the end of the body and stops as soon as it grows past ``limit``, whether or not the sender
gave a Content-Length, so a hostile sender cannot make kvtax hold more than ``limit`` bytes.

Example::

    try:
        body = await read_bounded(request.content, 1024 * 1024, request.content_length)
    except BodyTooLarge as exc:
        return web.Response(status=413, text=str(exc))
"""

from __future__ import annotations

from aiohttp import StreamReader

from kvtax.errors import RequestError

__all__ = ["BodyTooLarge", "read_bounded"]


class BodyTooLarge(RequestError):
    """A body is larger than the limit; the message gives the limit."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"body exceeds {limit} bytes")
        self.limit = limit


async def read_bounded(stream: StreamReader, limit: int, declared: int | None = None) -> bytes:
    """The whole body of ``stream``; :class:`BodyTooLarge` once it exceeds ``limit`` bytes.

    ``declared`` is the Content-Length, if any: a body announced as too large is refused before
    a byte of it is read.
    """
    if declared is not None and declared > limit:
        raise BodyTooLarge(limit)
    parts: list[bytes] = []
    size = 0
    async for chunk in stream.iter_any():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        parts.append(chunk)
    return b"".join(parts)
