"""A minimal client of Prometheus' HTTP query API, for previews and end-to-end tests.

Only ``/api/v1/query`` and ``/api/v1/query_range``, over the standard library, returning
:class:`Series` values. A query Prometheus rejects raises :class:`QueryError` carrying its
``errorType`` and message, so a bad panel fails with the reason Prometheus gave.

Example::

    prom = PrometheusApi("http://127.0.0.1:9090")
    for s in prom.query("up"):
        print(s.labels, s.points[-1])
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

__all__ = ["PrometheusApi", "QueryError", "Series"]


class QueryError(Exception):
    """Prometheus refused a query, or could not be reached."""


@dataclass(frozen=True, slots=True)
class Series:
    """One result series: its labels and (unix seconds, value) points in time order."""

    labels: dict[str, str]
    points: tuple[tuple[float, float], ...]


class PrometheusApi:
    def __init__(self, url: str, *, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout

    def _get(self, path: str, params: dict[str, str]) -> Any:
        # POST form: long expressions do not hit URL length limits.
        body = urllib.parse.urlencode(params).encode()
        request = urllib.request.Request(f"{self.url}{path}", data=body, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as resp:
                payload = json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            # Prometheus answers 400/422 with a JSON error body: keep its reason.
            try:
                payload = json.loads(exc.read())
            except ValueError:
                raise QueryError(f"HTTP {exc.code} from {self.url}") from exc
        except (OSError, ValueError) as exc:
            raise QueryError(f"cannot query {self.url}: {exc}") from exc
        if payload.get("status") != "success":
            raise QueryError(f"{payload.get('errorType')}: {payload.get('error')}")
        return payload["data"]

    @staticmethod
    def _series(data: Any) -> list[Series]:
        kind, result = data["resultType"], data["result"]
        if kind == "scalar":
            return [Series({}, ((float(result[0]), float(result[1])),))]
        out = []
        for item in result:
            values = item.get("values") or ([item["value"]] if "value" in item else [])
            points = tuple((float(t), float(v)) for t, v in values)
            out.append(Series(dict(item["metric"]), points))
        return out

    def query(self, expr: str, time: float | None = None) -> list[Series]:
        params = {"query": expr}
        if time is not None:
            params["time"] = f"{time:.3f}"
        return self._series(self._get("/api/v1/query", params))

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[Series]:
        params = {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step}"}
        return self._series(self._get("/api/v1/query_range", params))
