"""Request fields read the way vLLM reads them: pydantic's lax coercion.

vLLM's OpenAI request models are pydantic models, validated in pydantic's default (lax) mode.
So ``"stream": "true"``, ``"yes"``, ``1`` and ``1.0`` all stream, and ``"max_tokens": "50"``,
``50.0`` and ``" 50 "`` all mean 50. kvtax must read a body as vLLM does, or it counts a stream
as a plain answer, cuts out the usage chunk a client asked for, or refuses what vLLM accepts.
Rather than restate pydantic's conversion table, this asks pydantic itself (the same major
version vLLM pins), through one cached :class:`~pydantic.TypeAdapter` per type.

Each reader returns the value vLLM would use, the ``default`` for an absent field or JSON null
(vLLM's fields are ``Optional`` with a default), and :data:`REFUSED` for a value vLLM's
validation rejects, which means vLLM answers 400 and nothing is generated.

Example::

    >>> lax_bool("yes"), lax_bool(None, default=False), lax_bool("maybe") is REFUSED
    (True, False, True)
    >>> lax_int("50"), lax_int(50.0), lax_int(50.5) is REFUSED
    (50, 50, True)
"""

from __future__ import annotations

from typing import Any, Final, TypeVar

from pydantic import TypeAdapter, ValidationError

__all__ = ["REFUSED", "Refused", "lax_bool", "lax_float", "lax_int"]


class Refused:
    """The type of :data:`REFUSED`: a value vLLM's request validation rejects."""

    _instance: Refused | None = None

    def __new__(cls) -> Refused:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "REFUSED"

    def __bool__(self) -> bool:
        # Never mistaken for a true flag or a non-zero count.
        return False


REFUSED: Final = Refused()

_BOOL: Final = TypeAdapter(bool)
_INT: Final = TypeAdapter(int)
_FLOAT: Final = TypeAdapter(float)

T = TypeVar("T")
D = TypeVar("D")


def _read(adapter: TypeAdapter[T], value: Any, default: D) -> T | D | Refused:
    if value is None:
        return default
    try:
        return adapter.validate_python(value)
    except (ValidationError, TypeError, ValueError):
        return REFUSED


def lax_bool(value: Any, default: D = None) -> bool | D | Refused:  # type: ignore[assignment]
    """``value`` as vLLM's ``bool`` field reads it (``"true"``, ``"yes"``, ``1``, ``1.0`` are
    true; ``"off"``, ``0`` are false; ``2`` and ``"maybe"`` are refused)."""
    return _read(_BOOL, value, default)


def lax_int(value: Any, default: D = None) -> int | D | Refused:  # type: ignore[assignment]
    """``value`` as vLLM's ``int`` field reads it (``"50"``, ``50.0``, ``" 50 "`` and ``True``
    are integers; ``50.5``, ``"1e3"`` and infinity are refused). The result is unbounded, as
    vLLM's is: callers that compute with it bound it first."""
    return _read(_INT, value, default)


def lax_float(value: Any, default: D = None) -> float | D | Refused:  # type: ignore[assignment]
    """``value`` as vLLM's ``float`` field reads it (``"0.5"`` and ``1`` are floats)."""
    return _read(_FLOAT, value, default)
