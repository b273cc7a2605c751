"""The harness's one client of the Prometheus and Alertmanager HTTP APIs, on ``requests``.

:class:`PrometheusApi` runs instant and range queries (as :class:`Series`, or as the raw
vector Prometheus returns) and reads alerts, rule groups and targets; :class:`AlertmanagerApi`
pushes and reads alerts. Every failure raises :class:`QueryError` naming the URL and the
reason the server gave (Prometheus' ``errorType: error``, Alertmanager's message), or the
connection error, so a bad panel or a broken test says why. The testbed's server processes
(:mod:`kvtax_dev.testbed.promstack`) and the dashboard preview both use it.

Example::

    prom = PrometheusApi("http://127.0.0.1:9090")
    for s in prom.query("up"):
        print(s.labels, s.points[-1])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import requests

__all__ = ["AlertmanagerApi", "PrometheusApi", "QueryError", "Series", "call"]


class QueryError(Exception):
    """Prometheus or Alertmanager refused a request, or could not be reached."""


@dataclass(frozen=True, slots=True)
class Series:
    """One result series: its labels and (unix seconds, value) points in time order."""

    labels: dict[str, str]
    points: tuple[tuple[float, float], ...]


def _reason(resp: requests.Response, payload: Any) -> str:
    """The server's own words for a failure: Prometheus' envelope, Alertmanager's message."""
    if isinstance(payload, dict):
        if "error" in payload:
            return f"{payload.get('errorType')}: {payload['error']}"
        if "message" in payload:
            return str(payload["message"])
    if isinstance(payload, str):
        return payload
    return resp.text[:500] or "(empty body)"


def call(
    method: str,
    url: str,
    *,
    timeout: float,
    form: Mapping[str, str] | None = None,
    params: Mapping[str, str] | None = None,
    body: Any = None,
) -> Any:
    """One API request; the decoded JSON answer (None for an empty one), or :class:`QueryError`.

    ``form`` is sent as a form body (long PromQL does not hit URL limits), ``body`` as JSON.
    """
    try:
        resp = requests.request(method, url, data=form, params=params, json=body, timeout=timeout)
    except requests.RequestException as exc:
        raise QueryError(f"cannot query {url}: {exc}") from exc
    try:
        payload = resp.json() if resp.content else None
    except ValueError:
        payload = None
        if resp.ok:
            raise QueryError(f"{url} answered {resp.status_code} with no JSON") from None
    failed = isinstance(payload, dict) and payload.get("status") == "error"
    if not resp.ok or failed:
        raise QueryError(f"{url} answered {resp.status_code}: {_reason(resp, payload)}")
    return payload


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


class PrometheusApi:
    """Prometheus' ``/api/v1``: queries, alerts, rule groups and targets."""

    def __init__(self, url: str, *, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout

    def _data(self, path: str, form: Mapping[str, str] | None = None) -> Any:
        method = "POST" if form is not None else "GET"
        answer = call(method, f"{self.url}{path}", timeout=self.timeout, form=form)
        if not isinstance(answer, dict) or answer.get("status") != "success":
            raise QueryError(f"{self.url}{path} answered without success: {answer!r:.300}")
        return answer["data"]

    def query(self, expr: str, time: float | None = None) -> list[Series]:
        """Instant query, as :class:`Series` of one point each."""
        return _series(self._instant(expr, time))

    def vector(self, expr: str) -> list[dict[str, Any]]:
        """Instant query as Prometheus returns it: ``{"metric": {...}, "value": [t, "v"]}``."""
        result: list[dict[str, Any]] = self._instant(expr, None)["result"]
        return result

    def _instant(self, expr: str, time: float | None) -> Any:
        form = {"query": expr}
        if time is not None:
            form["time"] = f"{time:.3f}"
        return self._data("/api/v1/query", form)

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[Series]:
        form = {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step}"}
        return _series(self._data("/api/v1/query_range", form))

    def alerts(self) -> list[dict[str, Any]]:
        """Pending and firing alerts: ``labels``, ``annotations``, ``state``, ``value``."""
        alerts: list[dict[str, Any]] = self._data("/api/v1/alerts")["alerts"]
        return alerts

    def rule_groups(self) -> list[dict[str, Any]]:
        groups: list[dict[str, Any]] = self._data("/api/v1/rules")["groups"]
        return groups

    def targets(self) -> list[dict[str, Any]]:
        """Active scrape targets with ``labels`` and ``health``."""
        active: list[dict[str, Any]] = self._data("/api/v1/targets")["activeTargets"]
        return active


class AlertmanagerApi:
    """Alertmanager's ``/api/v2``: push alerts as Prometheus does, read alerts and groups."""

    def __init__(self, url: str, *, timeout: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout

    def post_alerts(self, alerts: Sequence[Mapping[str, Any]]) -> None:
        """Push alerts (``labels``, ``annotations``, optional ``startsAt``/``endsAt``)."""
        call("POST", f"{self.url}/api/v2/alerts", timeout=self.timeout, body=list(alerts))

    def alerts(self, **filters: str) -> list[dict[str, Any]]:
        """Alerts with their ``status``; ``filters`` are API flags such as ``active="true"``."""
        url = f"{self.url}/api/v2/alerts"
        alerts: list[dict[str, Any]] = call("GET", url, timeout=self.timeout, params=filters)
        return alerts

    def groups(self) -> list[dict[str, Any]]:
        """Notification groups: ``labels`` (the group-by values), ``receiver``, ``alerts``."""
        url = f"{self.url}/api/v2/alerts/groups"
        groups: list[dict[str, Any]] = call("GET", url, timeout=self.timeout)
        return groups
