"""What kvtax asks vLLM for so that a stream can be counted, at the least cost to vLLM.

A stream's tokens are counted event by event, so that a client that leaves mid-stream is
credited exactly what it received. Two schemes give a count per event (:data:`Scheme`):

- ``token_ids``: ``stream_options.include_usage`` (the final usage chunk: the exact totals) and
  ``return_token_ids`` (each event carries its delta's ids, so ``len(token_ids)`` is its count).
  vLLM's cost is one short list per event: +1.0 % of its API server's CPU per token against
  +8.5 % for continuous usage (bench/results/engine-relay.md).
- ``usage``: ``include_usage`` and ``continuous_usage_stats``: a cumulative usage object in
  every event. Exact everywhere, and the fallback.

:meth:`Dialect.scheme <kvtax.delivery.dialects.openai.OpenAIDialect.scheme>` decides per
request, from vLLM's version (``GET /version``) and the request's fields, where ids are known to
be missing or wrong:

- a vLLM before 0.10.2 has no ``return_token_ids`` (it would ignore the field);
- chat before 0.12.0 drops ids of tool calls (vLLM issue 27482) and of reasoning models;
- chat with ``include_reasoning: false`` hides them (vLLM does, when a reasoning parser runs);
- ``echo`` makes vLLM put the prompt's ids in the first event, and drop the echoed prompt's
  text, which the client would see changed;
- a client that asked for continuous usage itself already has vLLM paying for it;
- an unknown version, and a vLLM whose streams were seen without ids (the proxy remembers),
  take the fallback too.

:func:`with_usage` reads the client's ``stream_options`` and ``return_token_ids`` as vLLM does
(pydantic's lax bool, :mod:`kvtax.delivery.lax`), once per request, and returns the changes to
make; the rewriter (:mod:`kvtax.delivery.sse`) cuts from the stream what the client did not ask
for. Pure: no I/O.

Example::

    wish, changes = with_usage(payload, "token_ids")
    # changes == {"stream_options": {"include_usage": True}, "return_token_ids": True}
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from kvtax.delivery.lax import REFUSED, lax_bool

__all__ = [
    "SCHEMES",
    "Scheme",
    "UsageWish",
    "asked_everything",
    "release_of",
    "with_usage",
]

# final_usage: an API that streams no count per event (kvtax.delivery.events): its final usage
# is the exact total, and one token per content event counts before it.
Scheme = Literal["token_ids", "usage", "final_usage"]
SCHEMES: tuple[Scheme, ...] = ("token_ids", "usage", "final_usage")
_RELEASE = re.compile(r"(\d+)\.(\d+)(?:\.(\d+))?")


@dataclass(frozen=True, slots=True)
class UsageWish:
    """What the client asked vLLM to report (vLLM's own rule: continuous needs include), and
    whether it asked for the token ids itself."""

    include_usage: bool = False
    continuous: bool = False
    token_ids: bool = False


def asked_everything(wish: UsageWish, scheme: Scheme) -> bool:
    """The client asked for all that kvtax asks vLLM for by ``scheme``: its stream needs no
    cut (and can pass unread when it comes in a coding kvtax cannot inflate). By
    ``final_usage`` kvtax asks for nothing."""
    if scheme == "final_usage":
        return True
    extra = wish.continuous if scheme == "usage" else wish.token_ids
    return wish.include_usage and extra


def release_of(version: str | None) -> tuple[int, int, int] | None:
    """``"0.12.0rc1"`` -> (0, 12, 0); None for a version that does not start with one."""
    match = _RELEASE.match(version or "")
    if match is None:
        return None
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def with_usage(
    payload: dict[str, Any], scheme: Scheme = "usage"
) -> tuple[UsageWish, dict[str, Any]] | None:
    """The client's wish, and the top-level fields to set so that vLLM's stream can be
    counted by ``scheme`` (empty: nothing to add).

    ``stream_options`` is read as vLLM reads it (pydantic's lax bool: ``"true"``, ``1`` and
    ``"yes"`` are true). What the client set that already asks for usage stays as it wrote it;
    only what is missing or false is set. None when vLLM refuses the options as given (not an
    object, or a flag that is not a bool): vLLM answers that request with a 400, and kvtax must
    not turn it into an accepted one by writing valid options over it.
    """
    options = payload.get("stream_options")
    if options is None:
        options = {}
    elif not isinstance(options, dict):
        return None
    include = lax_bool(options.get("include_usage"), False)
    continuous = lax_bool(options.get("continuous_usage_stats"), False)
    ids = lax_bool(payload.get("return_token_ids"), False)
    if REFUSED in (include, continuous, ids):
        return None
    wish = UsageWish(bool(include), bool(include) and bool(continuous), bool(ids))
    changes: dict[str, Any] = {}
    # The flags the scheme needs that the client left out (or false); its own stay as written.
    missing = {"include_usage": True} if not include else {}
    if scheme == "usage" and not continuous:
        missing["continuous_usage_stats"] = True
    if scheme == "token_ids" and not ids:
        changes["return_token_ids"] = True
    if missing:
        changes["stream_options"] = {**options, **missing}
    return wish, changes
