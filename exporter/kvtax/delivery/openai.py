"""The one OpenAI-style error body, for every error kvtax answers itself. Pure, no I/O.

OpenAI's clients (the official SDKs, and the many built on them) read an error from
``{"error": {"message", "type", "param", "code"}}``: the message is what their exception says,
the type what callers branch on. kvtax answers in that shape wherever it answers on its own: the
proxy's 413, 502 and 504, the push endpoint's 4xx, and the error event that ends a stream vLLM
did not finish. :func:`error_body` builds the shape once; :func:`sse_error_event` frames it as a
server-sent event. The serve layer wraps :func:`error_body` in its HTTP response. vLLM's own
error bodies are never rebuilt: the proxy relays them as they came.

Example::

    error_body(413, "body exceeds 1000 bytes", "invalid_request_error")
    # {"error": {"message": "body exceeds 1000 bytes", "type": "invalid_request_error",
    #            "param": None, "code": 413}}
"""

from __future__ import annotations

import json

__all__ = ["ErrorBody", "error_body", "responses_error_event", "sse_error_event"]

ErrorBody = dict[str, dict[str, str | int | None]]


def error_body(status: int, message: str, kind: str) -> ErrorBody:
    """The error as OpenAI clients parse it; ``code`` carries the HTTP status."""
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def sse_error_event(status: int, message: str, kind: str) -> bytes:
    """The error as one ``data:`` event: a stream's headers (and its 200) are already sent."""
    body = json.dumps(error_body(status, message, kind), separators=(",", ":"))
    return b"data: " + body.encode() + b"\n\n"


def responses_error_event(message: str, kind: str, *, sequence: int) -> bytes:
    """The error as the Responses API streams it: an ``error`` event (``ResponseErrorEvent``:
    its code, message and param), numbered ``sequence`` after the events before it."""
    event = {"type": "error", "code": kind, "message": message, "param": None}
    body = json.dumps({**event, "sequence_number": sequence}, separators=(",", ":"))
    return b"event: error\ndata: " + body.encode() + b"\n\n"
