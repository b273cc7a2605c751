"""A real Prometheus and a real Alertmanager on loopback, for end-to-end tests and the demo.

Both run from the Debian packages (``scripts/setup-system.sh`` installs them; override the
binaries with ``KVTAX_PROMETHEUS_BIN`` / ``KVTAX_ALERTMANAGER_BIN``). Each server gets a
fresh temporary directory for its config, storage and log, a free loopback port, and is
stopped with SIGTERM (each is a :class:`~kvtax_dev.process.ChildProcess`). Queries go
through :mod:`kvtax_dev.promapi`, the harness's one client of both HTTP APIs.

Example::

    config = prometheus_config({"kvtax": [kvtax_address]}, alertmanager_url=am.url)
    with PrometheusProcess(config, rule_files=[Path("alerts/kvtax-alerts.yaml")]) as prom:
        prom.wait_for(lambda: prom.query("up == 1"), what="a healthy target")
        print(prom.alerts())
"""

from __future__ import annotations

import abc
import datetime
import json
import os
import re
import shutil
import tempfile
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar

import requests

from kvtax_dev.exposition import read_samples
from kvtax_dev.process import (
    HANG_GUARD_S,
    ChildProcess,
    ChildStartError,
    http_ok,
    poll_until,
    tail,
)
from kvtax_dev.promapi import AlertmanagerApi, PrometheusApi, QueryError
from kvtax_dev.testbed.engine import free_port

__all__ = [
    "AlertmanagerProcess",
    "PrometheusProcess",
    "ServerStartError",
    "epoch_of",
    "prometheus_config",
]

T = TypeVar("T")


class ServerStartError(ChildStartError):
    """The server binary is missing, exited, or did not become ready; carries its log tail."""


def _binary(env: str, *names: str) -> str:
    override = os.environ.get(env)
    if override:
        return override
    for name in names:
        # /usr/bin explicitly: PATH in some test runners is a venv's bin only.
        found = shutil.which(name) or shutil.which(name, path="/usr/bin:/usr/local/bin")
        if found:
            return found
    raise ServerStartError(
        f"none of {', '.join(names)} found (set {env} or run scripts/setup-system.sh)"
    )


def prometheus_config(
    jobs: Mapping[str, Sequence[str]],
    *,
    interval: str = "1s",
    alertmanager_url: str | None = None,
    job_settings: Mapping[str, Mapping[str, Any]] | None = None,
) -> str:
    """A prometheus.yml scraping ``jobs`` (job name -> ``host:port`` targets) every ``interval``.

    Rules are evaluated at the same interval; alerts go to ``alertmanager_url`` when given.
    ``job_settings`` adds scrape-config keys per job name, e.g. ``scheme``, ``tls_config``,
    ``basic_auth`` or ``metrics_path``. Values are written as JSON, which YAML reads as flow
    collections.
    """
    settings = job_settings or {}
    lines = [
        "global: " + json.dumps({"scrape_interval": interval, "evaluation_interval": interval}),
        "scrape_configs: "
        + json.dumps(
            [
                {
                    "job_name": job,
                    "static_configs": [{"targets": list(targets)}],
                    **settings.get(job, {}),
                }
                for job, targets in jobs.items()
            ]
        ),
    ]
    if alertmanager_url:
        address = urllib.parse.urlsplit(alertmanager_url).netloc
        lines.append(
            "alerting: "
            + json.dumps({"alertmanagers": [{"static_configs": [{"targets": [address]}]}]})
        )
    return "\n".join(lines) + "\n"


class _Server(abc.ABC):
    """Shared set-up: a temp dir for config, data and log, a free port, ready on /-/ready."""

    name = "server"

    def __init__(self, log_path: Path | None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.dir = Path(tempfile.mkdtemp(prefix=f"kvtax-{self.name}-"))
        self.log_path = log_path or self.dir / f"{self.name}.log"
        self._child: ChildProcess | None = None

    @abc.abstractmethod
    def command(self) -> list[str]:
        """The server's command line."""

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self, timeout: float = HANG_GUARD_S) -> None:
        child = ChildProcess(
            self.name,
            self.command(),
            log_path=self.log_path,
            ready=lambda: http_ok(f"{self.url}/-/ready"),
            cwd=self.dir,
            error=ServerStartError,
        )
        child.start(timeout)
        self._child = child

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout``; removes the temp dir. Returns the status."""
        child, self._child = self._child, None
        if child is None:
            return None
        code = child.stop(grace=timeout)
        # The TSDB goes; config and log stay for a post-mortem unless the stop was clean (a log
        # written elsewhere is the caller's to keep).
        shutil.rmtree(self.dir / "data", ignore_errors=True)
        if code == 0:
            shutil.rmtree(self.dir, ignore_errors=True)
        return code

    def log_tail(self, lines: int = 40) -> str:
        return tail(self.log_path, lines)

    def wait_for(
        self,
        probe: Callable[[], T],
        timeout: float = HANG_GUARD_S,
        what: str | Callable[[], str] = "condition",
    ) -> T:
        """Poll ``probe`` until it returns something truthy; raise with the log tail if never.

        ``what`` names the condition in that error; a callable is asked only then, so it can
        say what the probe saw last.
        """
        last_error: Exception | None = None
        try:
            value = poll_until(
                probe, timeout=timeout, interval=0.5, retry_on=(QueryError, OSError, ValueError)
            )
        except (QueryError, OSError, ValueError) as exc:
            value, last_error = None, exc
        if value:
            return value
        named = what() if callable(what) else what
        raise AssertionError(
            f"{self.name}: {named} not met in {timeout}s (last error: {last_error}); "
            f"log tail:\n{self.log_tail()}"
        )


_RFC3339 = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)")


class PrometheusProcess(_Server):
    """A Prometheus server with ``config_yaml`` plus ``rule_files`` (absolute paths added).

    ``config_yaml`` must not have a ``rule_files`` key of its own; :func:`prometheus_config`
    builds a suitable one.
    """

    name = "prometheus"

    def __init__(
        self,
        config_yaml: str,
        rule_files: Sequence[Path] = (),
        *,
        log_path: Path | None = None,
    ) -> None:
        super().__init__(log_path)
        self.binary = _binary("KVTAX_PROMETHEUS_BIN", "prometheus")
        self.api = PrometheusApi(self.url, timeout=10.0)
        text = config_yaml.rstrip("\n") + "\n"
        if rule_files:
            text += "rule_files: " + json.dumps([str(Path(p).resolve()) for p in rule_files]) + "\n"
        self.config_path = self.dir / "prometheus.yml"
        self.config_path.write_text(text)

    def command(self) -> list[str]:
        return [
            self.binary,
            f"--config.file={self.config_path}",
            f"--storage.tsdb.path={self.dir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
        ]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query; each result is ``{"metric": {...}, "value": [t, "v"]}``."""
        return self.api.vector(expr)

    def values(self, expr: str) -> dict[str, float]:
        """Instant query as ``{label set rendered as text: value}``, for assertions."""
        return {
            json.dumps(r["metric"], sort_keys=True): float(r["value"][1]) for r in self.query(expr)
        }

    def alerts(self) -> list[dict[str, Any]]:
        """Pending and firing alerts: ``labels``, ``annotations``, ``state``, ``value``."""
        return self.api.alerts()

    def rule_groups(self) -> list[dict[str, Any]]:
        return self.api.rule_groups()

    def evaluated_since(self, since: float) -> bool:
        """Every rule group has been evaluated after ``since`` (a ``time.time()``), by
        Prometheus' own /metrics (which this Prometheus need not scrape)."""
        page = read_samples(requests.get(f"{self.url}/metrics", timeout=10).text)
        stamps = page.get("prometheus_rule_group_last_evaluation_timestamp_seconds", {})
        return bool(stamps) and min(stamps.values()) > since

    def targets(self) -> list[dict[str, Any]]:
        """Active scrape targets with ``labels`` and ``health``."""
        return self.api.targets()

    def scraped_since(self, since: float) -> bool:
        """Every active target has been scraped after ``since`` (a ``time.time()``)."""
        targets = self.targets()
        return bool(targets) and all(epoch_of(t["lastScrape"]) > since for t in targets)


def epoch_of(stamp: str) -> float:
    """Seconds since the epoch of an RFC 3339 time as Prometheus' API writes it (Go's
    nanoseconds, which datetime cannot hold, cut to microseconds)."""
    found = _RFC3339.fullmatch(stamp)
    if found is None:
        raise ValueError(f"not an RFC 3339 time: {stamp!r}")
    whole, fraction, zone = found.groups()
    micro = (fraction or "")[:6].ljust(6, "0")
    offset = "+00:00" if zone == "Z" else zone
    return datetime.datetime.fromisoformat(f"{whole}.{micro}{offset}").timestamp()


class AlertmanagerProcess(_Server):
    """An Alertmanager with ``config_yaml``, clustering off, on a loopback port."""

    name = "alertmanager"

    def __init__(self, config_yaml: str, *, log_path: Path | None = None) -> None:
        super().__init__(log_path)
        self.binary = _binary("KVTAX_ALERTMANAGER_BIN", "prometheus-alertmanager", "alertmanager")
        self.api = AlertmanagerApi(self.url)
        self.config_path = self.dir / "alertmanager.yml"
        self.config_path.write_text(config_yaml)

    def command(self) -> list[str]:
        return [
            self.binary,
            f"--config.file={self.config_path}",
            f"--storage.path={self.dir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            # An empty address turns off the gossip port (9094 by default).
            "--cluster.listen-address=",
        ]

    def post_alerts(self, alerts: Sequence[Mapping[str, Any]]) -> None:
        """Push alerts as Prometheus does (``labels``, ``annotations``, optional times)."""
        self.api.post_alerts(alerts)

    def alerts(self, **filters: str) -> list[dict[str, Any]]:
        """Alerts with their ``status`` (``state``, ``inhibitedBy``, ``silencedBy``).

        ``filters`` are API flags such as ``inhibited="false"`` or ``active="true"``.
        """
        return self.api.alerts(**filters)

    def groups(self) -> list[dict[str, Any]]:
        """Notification groups: ``labels`` (the group-by values), ``receiver``, ``alerts``."""
        return self.api.groups()
