"""kvtax's own error answers over HTTP, in OpenAI's shape (:mod:`kvtax.delivery.openai`).

:func:`openai_error` wraps the one error body in an aiohttp response; the push endpoint and the
proxy answer with it. The proxy's own failures are here too: a body over ``--proxy.max-body``
(:func:`too_large`) and a vLLM that could not be reached or did not answer in time
(:func:`upstream_failure`), and the admission gate's answers: a request over the per-request
token budget (:func:`over_budget`) and a request shed from a full or slow queue (:func:`shed`);
and the 503 of a request kvtax ends unanswered because it is shutting down
(:func:`shutting_down`).
Nothing of the request is echoed back: the messages name limits and flags only.

Example::

    return openai_error(401, "missing or wrong bearer token", "authentication_error")
"""

from __future__ import annotations

from aiohttp import web

from kvtax.delivery.openai import error_body

__all__ = [
    "SHUTTING_DOWN",
    "openai_error",
    "over_budget",
    "shed",
    "shutting_down",
    "too_large",
    "upstream_failure",
]

# The message of the shutdown 503, as an answer (shutting_down) or a stream's last event.
SHUTTING_DOWN = "kvtax is shutting down; retry the request"


def openai_error(status: int, message: str, kind: str) -> web.Response:
    """An error in the shape OpenAI clients parse: ``{"error": {message, type, param, code}}``."""
    return web.json_response(error_body(status, message, kind), status=status)


def too_large(limit: int) -> web.Response:
    """The proxy's 413 for a request body over ``--proxy.max-body``."""
    response = openai_error(
        413,
        f"request body exceeds the proxy's limit of {limit} bytes (--proxy.max-body)",
        "invalid_request_error",
    )
    # The rest of the body was never read: the connection cannot carry another request.
    response.force_close()
    return response


def upstream_failure(exc: BaseException, timeout: float) -> web.Response:
    """The proxy's 504 when vLLM did not answer in ``timeout`` seconds, else its 502."""
    if isinstance(exc, TimeoutError):
        return openai_error(504, f"vLLM did not answer within {timeout:g}s", "upstream_timeout")
    return openai_error(502, "vLLM is unreachable", "upstream_unavailable")


_SHED_MESSAGES = {
    "queue_full": "the admission queue is full (--admission.max-queue); retry later",
    "wait_expired": "the request waited in the admission queue longer than --admission.max-wait; "
    "retry later",
}


def shed(reason: str, retry_after: int) -> web.Response:
    """The gate's 429: the queue was full or the wait ran out; ``Retry-After`` in seconds."""
    response = openai_error(429, _SHED_MESSAGES[reason], "rate_limit_exceeded")
    response.headers["Retry-After"] = str(retry_after)
    return response


def shutting_down() -> web.Response:
    """The proxy's 503 for a request it ends before vLLM answered, because it is shutting down.

    vLLM never answered (or aborted) it, so the client may send it again, to another replica.
    """
    response = openai_error(503, SHUTTING_DOWN, "server_shutdown")
    response.force_close()  # this proxy is going away: the next request needs another one
    return response


def over_budget(message: str) -> web.Response:
    """The gate's 400 for a request whose prompt + max_tokens exceeds the token budget."""
    return openai_error(400, message, "invalid_request_error")
