"""kvtax's own error answers on the web port, in OpenAI's shape (:mod:`kvtax.delivery.openai`).

:func:`openai_error` wraps the one error body in an aiohttp response for the push endpoint. The
proxy port answers its own errors in the same shape, as bytes (:mod:`kvtax.serve.proxy.answers`).
Nothing of the request is echoed back: the messages name limits and flags only.

Example::

    return openai_error(401, "missing or wrong bearer token", "authentication_error")
"""

from __future__ import annotations

from aiohttp import web

from kvtax.delivery.openai import error_body

__all__ = ["openai_error"]


def openai_error(status: int, message: str, kind: str) -> web.Response:
    """An error in the shape OpenAI clients parse: ``{"error": {message, type, param, code}}``."""
    return web.json_response(error_body(status, message, kind), status=status)
