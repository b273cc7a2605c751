"""The proxy's own answers, in the error shape of the request's API: what kvtax says when vLLM
does not.

A body over ``--proxy.max-body`` (:func:`too_large`), a vLLM that could not be reached or did
not answer in time (:func:`upstream_failure`), a stream it compressed past reading
(:func:`undecodable`), the gate's refusals (:func:`over_budget`,
:func:`shed`), and the 503 of a request kvtax ends unanswered because it is shutting down
(:func:`shutting_down`). Nothing of the request is echoed back: the messages name limits and
flags only. vLLM's own statuses and error bodies pass through the relay unchanged.

An answer to an accounted request takes its API's shape (``dialect``:
:meth:`~kvtax.delivery.dialects.base.Dialect.error_body`), so that the API's SDK raises its own
exception for the status: Anthropic's ``{"type": "error", "error": {...}}`` on ``/v1/messages``,
OpenAI's ``{"error": {...}}`` everywhere else and on every other path.

Example::

    exchange.answer(too_large(4 * 1024**2, MESSAGES))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from kvtax.delivery.dialects import Dialect
from kvtax.delivery.openai import error_body
from kvtax.serve.proxy.wire import Answer, Headers, header

__all__ = [
    "DROPPED_REASON",
    "SHUTTING_DOWN",
    "bad_request",
    "internal_error",
    "not_implemented",
    "over_budget",
    "shed",
    "shutting_down",
    "too_large",
    "undecodable",
    "upstream_failure",
    "version_not_supported",
    "vllm_refused",
    "vllm_unavailable",
]

# The message of the shutdown 503, as an answer (shutting_down) or a stream's last event.
SHUTTING_DOWN = "kvtax is shutting down; retry the request"
# The header that names why kvtax answered a request itself rather than send it to vLLM: the
# gate's reason (kvtax_gate_rejections_total's), ``shutdown`` or ``vllm_unavailable``; or, on
# vLLM's own 503 behind the gate, ``vllm_refused``. As llm-d's flow control names its drops in
# x-llm-d-request-dropped-reason (docs/gate.md maps the two).
DROPPED_REASON = b"X-Kvtax-Dropped-Reason"
# Seconds a client told that vLLM is unavailable, or that this kvtax is stopping, should wait.
UNAVAILABLE_RETRY_AFTER = 1


def _dropped(reason: str, retry_after: int | None = None) -> list[tuple[bytes, bytes]]:
    headers = [(DROPPED_REASON, reason.encode())]
    if retry_after is not None:
        headers.append((b"Retry-After", str(retry_after).encode()))
    return headers


def _shape(dialect: Dialect | None) -> Callable[[int, str, str], Mapping[str, object]]:
    """The error shape of ``dialect``'s API; OpenAI's for a request of none."""
    return error_body if dialect is None else dialect.error_body


def too_large(limit: int, dialect: Dialect | None = None) -> Answer:
    """The 413 for a request body over ``--proxy.max-body``; the rest of the body is never read,
    so the connection cannot carry another request."""
    return Answer.error(
        413,
        f"request body exceeds the proxy's limit of {limit} bytes (--proxy.max-body)",
        "invalid_request_error",
        close=True,
        shape=_shape(dialect),
    )


def bad_request(status: int, message: str) -> Answer:
    """A request the HTTP parser refused (malformed, or a head over the limit)."""
    return Answer.error(status, message, "invalid_request_error", close=True)


def internal_error() -> Answer:
    """The 500 for a fault of kvtax's own (logged with its traceback); never vLLM's."""
    return Answer.error(500, "kvtax failed to relay the request", "internal_error", close=True)


def not_implemented(message: str) -> Answer:
    """The 501 for a framing kvtax does not implement (a transfer coding other than chunked)."""
    return Answer.error(501, message, "invalid_request_error", close=True)


def version_not_supported() -> Answer:
    """The 505 for a request line of an HTTP version other than 1.0 and 1.1."""
    return Answer.error(
        505, "only HTTP/1.0 and HTTP/1.1 are served here", "invalid_request_error", close=True
    )


def upstream_failure(
    timed_out: bool, timeout: float, broke: str | None = None, dialect: Dialect | None = None
) -> Answer:
    """The 504 when vLLM did not answer in ``timeout`` seconds, else the 502: vLLM is
    unreachable, or (``broke``, what was wrong) its answer broke off or was not HTTP kvtax
    can relay. An operator reading the second must look at vLLM's answer, not its address.

    >>> upstream_failure(False, 600, broke="vLLM's answer is not HTTP: HttpParserError").status
    502
    """
    shape = _shape(dialect)
    if timed_out:
        message = f"vLLM did not answer within {timeout:g}s"
        return Answer.error(504, message, "upstream_timeout", shape=shape)
    if broke is not None:
        message = f"{broke}; kvtax cannot relay that answer"
        return Answer.error(502, message, "upstream_error", shape=shape)
    return Answer.error(502, "vLLM is unreachable", "upstream_unavailable", shape=shape)


def undecodable(encoding: str, dialect: Dialect | None = None) -> Answer:
    """The 502 for a stream vLLM compressed with a coding kvtax cannot read, although kvtax
    asked for identity, when the client would get usage it did not ask for."""
    return Answer.error(
        502,
        f"vLLM answered the stream with Content-Encoding {encoding} though asked for identity; "
        "kvtax cannot read it",
        "upstream_error",
        shape=_shape(dialect),
    )


_SHED_MESSAGES = {
    "queue_full": "the gate's queue is full (--gate.max-queue); retry later",
    "wait_predicted": "the gate's queue would hold the request longer than --gate.max-wait; "
    "retry later",
    "wait_expired": "the request waited in the gate's queue longer than --gate.max-wait; "
    "retry later",
}


def shed(reason: str, retry_after: int, dialect: Dialect | None = None) -> Answer:
    """The gate's 429: the queue was full, the wait would be too long, or it ran out;
    ``Retry-After`` in seconds."""
    return Answer.error(
        429,
        _SHED_MESSAGES[reason],
        "rate_limit_exceeded",
        headers=_dropped(reason, retry_after),
        shape=_shape(dialect),
    )


def vllm_unavailable(dialect: Dialect | None = None) -> Answer:
    """The gate's 503 for a request vLLM could not take: nothing listens (down, restarting, or
    not ready yet). Not the gate's load: another replica may serve it at once."""
    return Answer.error(
        503,
        "vLLM is not serving (down, restarting, or not ready); retry the request",
        "upstream_unavailable",
        headers=_dropped("vllm_unavailable", UNAVAILABLE_RETRY_AFTER),
        shape=_shape(dialect),
    )


def vllm_refused(headers: Headers) -> Headers:
    """What kvtax adds to vLLM's own 503 behind the gate (its queue caps,
    ``--max-num-queued-reqs`` and ``--max-num-queued-tokens``, or a failure it calls
    retryable): the drop reason, and a Retry-After where vLLM gave none. vLLM's body passes
    unchanged."""
    added = [(DROPPED_REASON, b"vllm_refused")]
    if header(headers, b"retry-after") is None:
        added.append((b"Retry-After", str(UNAVAILABLE_RETRY_AFTER).encode()))
    return added


def shutting_down(dialect: Dialect | None = None) -> Answer:
    """The 503 for a request kvtax ends before vLLM answered, because it is shutting down.

    vLLM never answered (or aborted) it, so the client may send it again, to another replica;
    this proxy is going away, so the connection closes with it.
    """
    return Answer.error(
        503,
        SHUTTING_DOWN,
        "server_shutdown",
        close=True,
        headers=_dropped("shutdown", UNAVAILABLE_RETRY_AFTER),
        shape=_shape(dialect),
    )


def over_budget(message: str, dialect: Dialect | None = None) -> Answer:
    """The gate's 400 for a request whose prompt + max_tokens exceeds the token budget."""
    return Answer.error(
        400,
        message,
        "invalid_request_error",
        headers=_dropped("over_budget"),
        shape=_shape(dialect),
    )
