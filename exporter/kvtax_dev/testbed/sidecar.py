"""Run a real ``kvtax serve`` as a child process, for end-to-end tests, the demo and benches.

The sidecar runs exactly as in a pod: its own process, its own ports, configured by flags. This
module only starts it, waits for ``/healthz``, reads its ``/metrics`` and stops it with SIGTERM
(the same signal Kubernetes sends), returning the exit status. Stdlib only.

Example::

    with KvtaxProcess(vllm_url=engine.url, proxy=True) as kvtax:
        kvtax.wait_for(lambda m: m.get("kvtax_vllm_up") == 1.0)
        print(kvtax.proxy_url)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO

from prometheus_client.parser import text_string_to_metric_families

from .engine import free_port

__all__ = ["KvtaxProcess", "parse_metrics", "series_key"]


def series_key(name: str, labels: dict[str, str] | None = None) -> str:
    """``name{a="1",b="2"}`` with labels sorted, the key :func:`parse_metrics` uses."""
    if not labels:
        return name
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


def parse_metrics(text: str) -> dict[str, float]:
    """Every sample of a /metrics page, keyed by :func:`series_key`."""
    return {
        series_key(s.name, s.labels): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


class KvtaxProcess:
    """A ``kvtax serve`` child process on loopback ports."""

    def __init__(
        self,
        vllm_url: str,
        *,
        proxy: bool = False,
        scrape_interval: str = "1s",
        window: str = "30s",
        extra_args: Sequence[str] = (),
        log_path: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.proxy_port = free_port() if proxy else None
        self.metrics_url = f"http://127.0.0.1:{self.port}/metrics"
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.proxy_url = f"http://127.0.0.1:{self.proxy_port}" if self.proxy_port else None
        self.args = [
            sys.executable,
            "-m",
            "kvtax.cli",
            "serve",
            f"--vllm.url={vllm_url}",
            f"--web.listen_address=127.0.0.1:{self.port}",
            f"--scrape.interval={scrape_interval}",
            f"--window={window}",
            # The proxy is on by default (:8001); a test that does not want it must say off.
            f"--proxy.listen_address=127.0.0.1:{self.proxy_port}"
            if proxy
            else "--proxy.listen_address=off",
            *extra_args,
        ]
        self.log_path = log_path or Path(os.environ.get("TMPDIR", "/tmp")) / (
            f"kvtax-{self.port}.log"
        )
        self._env = {**os.environ, **(env or {})}
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def __enter__(self) -> KvtaxProcess:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self, timeout: float = 30.0) -> None:
        self._log = self.log_path.open("wb")
        self._proc = subprocess.Popen(
            self.args, stdout=self._log, stderr=subprocess.STDOUT, env=self._env
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                code = self.stop()
                raise RuntimeError(f"kvtax exited with {code}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base_url + "/healthz", timeout=2):
                    return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"kvtax did not become healthy in {timeout}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def metrics_text(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=5) as resp:
            body: bytes = resp.read()
        return body.decode()

    def metrics(self) -> dict[str, float]:
        return parse_metrics(self.metrics_text())

    def wait_for(
        self,
        condition: Callable[[dict[str, float]], bool],
        timeout: float = 60.0,
        what: str = "condition",
    ) -> dict[str, float]:
        """Poll /metrics until ``condition`` holds; raise with the last page if it never does."""
        deadline = time.monotonic() + timeout
        last: dict[str, float] = {}
        while time.monotonic() < deadline:
            try:
                last = self.metrics()
            except (OSError, urllib.error.URLError):
                last = {}
            if last and condition(last):
                return last
            time.sleep(0.25)
        shown = "\n".join(f"{k} {v}" for k, v in sorted(last.items()) if "kvtax_" in k)
        raise AssertionError(f"kvtax: {what} not met in {timeout}s; last metrics:\n{shown}")

    def stop(self, signum: int = signal.SIGTERM, timeout: float = 60.0) -> int | None:
        """Send ``signum`` and wait; SIGKILL after ``timeout``. Returns the exit status."""
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        try:
            return self._terminate(proc, signum, timeout)
        finally:
            if self._log is not None:
                self._log.close()
                self._log = None

    @staticmethod
    def _terminate(proc: subprocess.Popen[bytes], signum: int, timeout: float) -> int:
        if proc.poll() is None:
            proc.send_signal(signum)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return proc.returncode
