"""An upload's multipart form, read as it passes on to vLLM: :class:`FormTap` and :class:`Upload`.

An audio upload is tens of MiB; kvtax must read its small fields (the model, ``stream``, the
stream's usage options, the output limit) without holding it. :class:`FormTap` feeds each read of
the body to python-multipart's streaming parser (the one Starlette, and so vLLM's server, reads
forms with), keeps the value of each field it was asked for (the last of two of one name, as
Starlette keeps it; at most :data:`MAX_VALUE` bytes), and hands every byte on at once but the
last few, which may hold the form's closing delimiter. When the body ends, the fields kvtax sets
are written as parts of their own just before that delimiter (:meth:`FormTap.finish`): after
every field of the client's, so Starlette reads kvtax's.

:class:`Upload` is where the exchange streams the body (a
:class:`~kvtax.serve.proxy.flow.BodyWriter`): through the tap, held (reading paused past
``limit``) until vLLM's connection is attached, then on to it; ready once the form's first file
begins (the fields before it are known: clients send them first) or the body ends.

Example::

    tap = FormTap.of(exchange.head.headers, frozenset({"model", "stream"}))
    upload = Upload(tap, holder=exchange.upstream_holder, limit=256 * 1024, extra=fields_to_set)
    exchange.stream_body(upload)
    await upload.ready
    await upstream.send(head, streamed=upload.attach, chunked=True)
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from kvtax.serve.proxy.flow import BodyWriter, Latch
from kvtax.serve.proxy.wire import Headers, header

__all__ = ["MAX_VALUE", "FormTap", "Upload"]

# The longest field value kvtax keeps (a model name, a flag, a count); a longer one is no value
# kvtax acts on.
MAX_VALUE = 64 * 1024
# What may follow the closing delimiter (a CRLF, an epilogue), held back with it.
_EPILOGUE = 256


class FormTap:
    """One form's fields, read as its bytes pass; see the module docstring."""

    def __init__(self, boundary: bytes, keys: frozenset[str]) -> None:
        self.boundary = boundary
        self.keys = keys
        self.fields: dict[str, str] = {}
        self.file_begun = False  # a part with a filename (the upload itself) began
        self.broken = False  # not a form the parser reads: vLLM answers it, nothing is set
        self._close = b"\r\n--" + boundary + b"--"
        self._keep = len(self._close) + _EPILOGUE
        self._held = bytearray()
        self._header_name = b""
        self._header_value = b""
        self._name: str | None = None  # the part's field name, while it is one to keep
        self._value = bytearray()
        self._parser = MultipartParser(
            boundary,
            callbacks={
                "on_part_begin": self._part_begin,
                "on_header_field": self._header_field,
                "on_header_value": self._header_data,
                "on_header_end": self._header_end,
                "on_headers_finished": self._headers_finished,
                "on_part_data": self._part_data,
                "on_part_end": self._part_end,
            },
        )

    @classmethod
    def of(cls, headers: Headers, keys: frozenset[str]) -> FormTap:
        """The tap of a request's body: a multipart form's, by its Content-Type's boundary;
        for any other, a tap that reads nothing (``broken``: vLLM answers such a body)."""
        value = header(headers, b"content-type") or b""
        kind, options = parse_options_header(value)
        boundary = options.get(b"boundary")
        if kind.lower() != b"multipart/form-data" or not boundary:
            tap = cls(b"no-form", keys)
            tap.broken = True
            return tap
        return cls(boundary, keys)

    def feed(self, data: bytes) -> bytes:
        """Read ``data`` (the body's next bytes); what to send on now."""
        if not self.broken:
            try:
                self._parser.write(data)
            except MultipartParseError:
                self.broken = True
        held = self._held
        held += data
        if len(held) <= self._keep:
            return b""
        out = bytes(held[: -self._keep])
        del held[: -self._keep]
        return out

    def finish(self, extra: Mapping[str, str]) -> tuple[bytes, bool]:
        """The body's last bytes, with ``extra`` written as fields before the closing
        delimiter; whether they were (not for a form that broke, or whose delimiter is not in
        the bytes held back)."""
        tail, self._held = bytes(self._held), bytearray()
        at = tail.rfind(self._close)
        if not extra or self.broken or at < 0:
            return tail, False
        parts = b"".join(
            b'\r\n--%b\r\nContent-Disposition: form-data; name="%b"\r\n\r\n%b'
            % (self.boundary, key.encode(), value.encode())
            for key, value in extra.items()
        )
        return tail[:at] + parts + tail[at:], True

    # -- the parser's callbacks ---------------------------------------------------------------
    def _part_begin(self) -> None:
        self._name = None
        self._value.clear()

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]

    def _header_data(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def _header_end(self) -> None:
        if self._header_name.lower() == b"content-disposition":
            _, options = parse_options_header(self._header_value)
            if b"filename" in options:
                self.file_begun = True
            else:
                name = options.get(b"name", b"").decode("utf-8", "replace")
                self._name = name if name in self.keys else None
        self._header_name = self._header_value = b""

    def _headers_finished(self) -> None:
        pass

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._name is None:
            return
        if len(self._value) + end - start > MAX_VALUE:
            self._name = None  # no value kvtax acts on
            return
        self._value += data[start:end]

    def _part_end(self) -> None:
        if self._name is not None:
            self.fields[self._name] = self._value.decode("utf-8", "replace")
        self._name = None


class Upload:
    """Where an upload's body goes; see the module docstring. ``extra`` is asked, once the body
    ended, for the fields to set (from the tap's fields, all read by then)."""

    def __init__(
        self,
        tap: FormTap,
        *,
        holder: Latch,
        limit: int,
        extra: Callable[[FormTap], Mapping[str, str]],
    ) -> None:
        self.tap = tap
        self.holder = holder
        self.limit = limit
        self.extra = extra
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.ended = False  # the client's body ended
        self.aborted = False
        self.set = False  # the fields were written into the body
        self._pending: list[bytes] = []
        self._pending_size = 0
        self._conn: BodyWriter | None = None
        self._holding = False

    # -- the exchange's side (BodyWriter) -------------------------------------------------------
    def send_body(self, data: bytes) -> None:
        out = self.tap.feed(data)
        if self._conn is not None:
            if out:
                self._conn.send_body(out)
            return
        if out:
            self._pending.append(out)
            self._pending_size += len(out)
        if self.tap.file_begun or self._pending_size > self.limit:
            self._ready()
        if self._pending_size > self.limit and not self._holding:
            self._holding = True
            self.holder.hold()  # until vLLM's connection takes what waits

    def end_body(self) -> None:
        self.ended = True
        self._ready()
        if self._conn is not None:
            self._finish(self._conn)

    def abort_body(self) -> None:
        self.aborted = True
        self._ready()
        if self._conn is not None:
            self._conn.abort_body()

    # -- vLLM's side -------------------------------------------------------------------------
    def attach(self, conn: BodyWriter) -> None:
        """vLLM's connection is made: what waits goes now, the rest as it comes."""
        self._conn = conn
        pending, self._pending, self._pending_size = self._pending, [], 0
        if pending:
            conn.send_body(b"".join(pending))
        if self._holding:
            self._holding = False
            self.holder.release()
        if self.aborted:
            conn.abort_body()
        elif self.ended:
            self._finish(conn)

    def _finish(self, conn: BodyWriter) -> None:
        tail, self.set = self.tap.finish(self.extra(self.tap))
        if tail:
            conn.send_body(tail)
        conn.end_body()

    def _ready(self) -> None:
        if not self.ready.done():
            self.ready.set_result(None)
