"""The network edge of ``kvtax plan``: a /metrics page, or histogram increases from Prometheus.

Standard library only (``urllib``): ``plan`` is a command people run on a laptop, and it must not
need the sidecar's server stack. Every failure becomes a :class:`PlanError` naming the flag
whose URL failed, in one line: unreachable, an HTTP error, or an answer that is not what was
asked for. Everything after the bytes arrive is pure (:mod:`kvtax.tools.plan.profile`).
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from kvtax.engine.snapshot import Histogram
from kvtax.errors import PlanError

__all__ = ["DEFAULT_TIMEOUT_S", "get_text", "prometheus_histogram"]

DEFAULT_TIMEOUT_S = 10.0
_MAX_BODY = 64 * 2**20


def get_text(url: str, field: str, *, timeout: float = DEFAULT_TIMEOUT_S) -> str:
    """GET ``url`` and return its body; a one-line :class:`PlanError` naming ``field``."""
    if urllib.parse.urlparse(url).scheme not in ("http", "https"):
        raise PlanError(field, f"{url!r} is not an http(s) URL")
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            body: bytes = resp.read(_MAX_BODY + 1)
    except urllib.error.HTTPError as exc:
        raise PlanError(field, f"{url} answered HTTP {exc.code}") from exc
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise PlanError(field, f"cannot reach {url}: {reason}") from exc
    if len(body) > _MAX_BODY:
        raise PlanError(field, f"{url} answered more than {_MAX_BODY // 2**20} MiB")
    return body.decode("utf-8", errors="replace")


def _query(base: str, promql: str, end: str | None, field: str) -> list[dict[str, Any]]:
    params = {"query": promql}
    if end:
        params["time"] = end
    url = base.rstrip("/") + "/api/v1/query?" + urllib.parse.urlencode(params)
    text = get_text(url, field)
    try:
        answer = json.loads(text)
    except ValueError as exc:
        raise PlanError(field, f"{base} is not a Prometheus API (answer is not JSON)") from exc
    if not isinstance(answer, dict) or answer.get("status") != "success":
        error = answer.get("error") if isinstance(answer, dict) else None
        raise PlanError(field, f"query failed: {error or 'unexpected answer'}")
    result: list[dict[str, Any]] = answer.get("data", {}).get("result", [])
    return result


def prometheus_histogram(
    base: str, name: str, *, window: str, end: str | None, selector: str, field: str
) -> Histogram:
    """The increase of histogram ``name`` over ``window`` ending at ``end`` (default now)."""
    inner = f"increase({name}_bucket{{{selector}}}[{window}])"
    rows = _query(base, f"sum by (le) ({inner})", end, field)
    buckets = []
    for row in rows:
        le = row.get("metric", {}).get("le")
        if le is None:
            continue
        buckets.append((math.inf if le == "+Inf" else float(le), float(row["value"][1])))
    if not buckets:
        raise PlanError(field, f"no {name} series in {base} over {window}")
    buckets.sort()
    total = buckets[-1][1]
    sums = _query(base, f"sum(increase({name}_sum{{{selector}}}[{window}]))", end, field)
    return Histogram(tuple(buckets), float(sums[0]["value"][1]) if sums else 0.0, total)
