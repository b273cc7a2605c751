"""A real Prometheus and a real Alertmanager on loopback, for end-to-end tests and the demo.

Both run from the Debian packages (``scripts/setup-system.sh`` installs them; override the
binaries with ``KVTAX_PROMETHEUS_BIN`` / ``KVTAX_ALERTMANAGER_BIN``). Each server gets a
fresh temporary directory for its config, storage and log, a free loopback port, and is
stopped with SIGTERM. Query helpers speak the HTTP APIs with urllib. Stdlib only.

Example::

    config = prometheus_config({"kvtax": [kvtax_address]}, alertmanager_url=am.url)
    with PrometheusProcess(config, rule_files=[Path("alerts/kvtax-alerts.yaml")]) as prom:
        prom.wait_for(lambda: prom.query("up == 1"), what="a healthy target")
        print(prom.alerts())
"""

from __future__ import annotations

import abc
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar

from .engine import free_port

__all__ = [
    "AlertmanagerProcess",
    "PrometheusProcess",
    "ServerStartError",
    "prometheus_config",
]

T = TypeVar("T")


class ServerStartError(RuntimeError):
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
) -> str:
    """A prometheus.yml scraping ``jobs`` (job name -> ``host:port`` targets) every ``interval``.

    Rules are evaluated at the same interval; alerts go to ``alertmanager_url`` when given.
    Values are written as JSON, which YAML reads as flow collections.
    """
    lines = [
        "global: " + json.dumps({"scrape_interval": interval, "evaluation_interval": interval}),
        "scrape_configs: "
        + json.dumps(
            [
                {"job_name": job, "static_configs": [{"targets": list(targets)}]}
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
    """Shared lifecycle: temp dir, free port, start and wait for /-/ready, SIGTERM stop."""

    name = "server"

    def __init__(self, log_path: Path | None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.dir = Path(tempfile.mkdtemp(prefix=f"kvtax-{self.name}-"))
        self.log_path = log_path or self.dir / f"{self.name}.log"
        self._proc: subprocess.Popen[bytes] | None = None

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

    def start(self, timeout: float = 60.0) -> None:
        with self.log_path.open("wb") as log:
            self._proc = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, cwd=self.dir
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise ServerStartError(
                    f"{self.name} exited with {self._proc.returncode}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise ServerStartError(f"{self.name} not ready in {timeout}s:\n{self.log_tail()}")

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout``; removes the temp dir. Returns the status."""
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        # The TSDB goes; config and log stay for a post-mortem unless the stop was clean (a log
        # written elsewhere is the caller's to keep).
        shutil.rmtree(self.dir / "data", ignore_errors=True)
        if proc.returncode == 0:
            shutil.rmtree(self.dir, ignore_errors=True)
        return proc.returncode

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def get_json(self, path: str, params: Mapping[str, str] | None = None) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=10) as resp:
            return json.load(resp)

    def post_json(self, path: str, body: Any) -> Any:
        request = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=10) as resp:
            raw = resp.read()
        return json.loads(raw) if raw else None

    def wait_for(
        self, probe: Callable[[], T], timeout: float = 120.0, what: str = "condition"
    ) -> T:
        """Poll ``probe`` until it returns something truthy; raise with the log tail if never."""
        deadline = time.monotonic() + timeout
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            try:
                value = probe()
            except (OSError, urllib.error.URLError, ValueError) as exc:
                last_error = exc
            else:
                if value:
                    return value
            time.sleep(0.5)
        raise AssertionError(
            f"{self.name}: {what} not met in {timeout}s (last error: {last_error}); "
            f"log tail:\n{self.log_tail()}"
        )


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
        body = self.get_json("/api/v1/query", {"query": expr})
        if body.get("status") != "success":
            raise ValueError(f"query {expr!r} failed: {body}")
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def values(self, expr: str) -> dict[str, float]:
        """Instant query as ``{label set rendered as text: value}``, for assertions."""
        return {
            json.dumps(r["metric"], sort_keys=True): float(r["value"][1]) for r in self.query(expr)
        }

    def alerts(self) -> list[dict[str, Any]]:
        """Pending and firing alerts: ``labels``, ``annotations``, ``state``, ``value``."""
        alerts: list[dict[str, Any]] = self.get_json("/api/v1/alerts")["data"]["alerts"]
        return alerts

    def rule_groups(self) -> list[dict[str, Any]]:
        groups: list[dict[str, Any]] = self.get_json("/api/v1/rules")["data"]["groups"]
        return groups

    def targets(self) -> list[dict[str, Any]]:
        """Active scrape targets with ``labels`` and ``health``."""
        active: list[dict[str, Any]] = self.get_json("/api/v1/targets")["data"]["activeTargets"]
        return active


class AlertmanagerProcess(_Server):
    """An Alertmanager with ``config_yaml``, clustering off, on a loopback port."""

    name = "alertmanager"

    def __init__(self, config_yaml: str, *, log_path: Path | None = None) -> None:
        super().__init__(log_path)
        self.binary = _binary("KVTAX_ALERTMANAGER_BIN", "prometheus-alertmanager", "alertmanager")
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
        self.post_json("/api/v2/alerts", list(alerts))

    def alerts(self, **filters: str) -> list[dict[str, Any]]:
        """Alerts with their ``status`` (``state``, ``inhibitedBy``, ``silencedBy``).

        ``filters`` are API flags such as ``inhibited="false"`` or ``active="true"``.
        """
        alerts: list[dict[str, Any]] = self.get_json("/api/v2/alerts", filters or None)
        return alerts

    def groups(self) -> list[dict[str, Any]]:
        """Notification groups: ``labels`` (the group-by values), ``receiver``, ``alerts``."""
        groups: list[dict[str, Any]] = self.get_json("/api/v2/alerts/groups")
        return groups
