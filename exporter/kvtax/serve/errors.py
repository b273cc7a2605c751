"""kvtax's own error answers over HTTP, in OpenAI's shape (:mod:`kvtax.delivery.openai`).

:func:`openai_error` wraps the one error body in an aiohttp response; the push endpoint and the
proxy answer with it. The proxy's own failures are here too: a body over ``--proxy.max-body``
(:func:`too_large`) and a vLLM that could not be reached or did not answer in time
(:func:`upstream_failure`), and the admission gate's answers: a request over the per-request
token budget (:func:`over_budget`) and a request shed from a full or slow queue (:func:`shed`).
Nothing of the request is echoed back: the messages name limits and flags only.

Example::

    return openai_error(401, "missing or wrong bearer token", "authentication_error")
"""

from __future__ import annotations

from aiohttp import web

from kvtax.delivery.openai import error_body

__all__ = ["openai_error", "over_budget", "shed", "too_large", "upstream_failure"]


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


def over_budget(message: str) -> web.Response:
    """The gate's 400 for a request whose prompt + max_tokens exceeds the token budget."""
    return openai_error(400, message, "invalid_request_error")
