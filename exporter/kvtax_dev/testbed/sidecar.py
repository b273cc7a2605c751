"""Run a real ``kvtax serve`` as a child process, for end-to-end tests, the demo and benches.

The sidecar runs exactly as in a pod: its own process, its own ports, configured by flags. This
module only starts it (a :class:`~kvtax_dev.process.ChildProcess` running this checkout's
package, through :func:`kvtax_dev.dev_env`), waits for ``/healthz``, reads its ``/metrics`` and
stops it with SIGTERM (the same signal Kubernetes sends), returning the exit status.

Example::

    with KvtaxProcess(vllm_url=engine.url, proxy=True) as kvtax:
        kvtax.wait_for(lambda m: m.get("kvtax_vllm_up") == 1.0)
        print(kvtax.proxy_url)
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType

import requests

from kvtax_dev import dev_env
from kvtax_dev.exposition import read_series, series_key
from kvtax_dev.process import HANG_GUARD_S, ChildProcess, http_ok, poll_until, tail
from kvtax_dev.testbed.engine import free_port

__all__ = ["KvtaxProcess", "parse_metrics", "series_key"]

# Kept under its old name for the tests that import it from here.
parse_metrics = read_series


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
        tls_ca: Path | None = None,
    ) -> None:
        self.port = free_port()
        self.proxy_port = free_port() if proxy else None
        # With a --web.config.file that turns TLS on, pass the CA that signed its certificate.
        self.tls_ca = tls_ca
        scheme = "https" if tls_ca is not None else "http"
        self.metrics_url = f"{scheme}://127.0.0.1:{self.port}/metrics"
        self.base_url = f"{scheme}://127.0.0.1:{self.port}"
        self.proxy_url = f"http://127.0.0.1:{self.proxy_port}" if self.proxy_port else None
        self.args = [
            sys.executable,
            "-m",
            "kvtax.cli.main",
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
        # This checkout's kvtax, not whatever the venv maps: in a worktree they differ.
        self.env = dev_env({**os.environ, **(env or {})})
        self._child: ChildProcess | None = None

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

    def start(self, timeout: float = HANG_GUARD_S) -> None:
        child = ChildProcess(
            "kvtax",
            self.args,
            log_path=self.log_path,
            ready=lambda: http_ok(f"{self.base_url}/healthz", verify=self.tls_ca),
            env=self.env,
        )
        child.start(timeout)
        self._child = child

    @property
    def pid(self) -> int | None:
        return self._child.pid if self._child is not None else None

    def log_tail(self, lines: int = 40) -> str:
        return tail(self.log_path, lines)

    def metrics_text(self) -> str:
        # A guard against hangs, not a latency the tests hold kvtax to: in the gate e2e, beside
        # CI's other lanes, one page took over 5 s to come while the machine's two cores were
        # busy with the overload and the lanes (Prometheus' own scrape timeout is 10 s).
        resp = requests.get(self.metrics_url, timeout=30)
        resp.raise_for_status()
        return resp.content.decode()

    def metrics(self) -> dict[str, float]:
        return read_series(self.metrics_text())

    def wait_for(
        self,
        condition: Callable[[dict[str, float]], bool],
        timeout: float = HANG_GUARD_S,
        what: str = "condition",
    ) -> dict[str, float]:
        """Poll /metrics until ``condition`` holds; raise with the last page if it never does."""
        last: dict[str, float] = {}

        def holds() -> dict[str, float] | None:
            nonlocal last
            try:
                last = self.metrics()
            except requests.RequestException:
                last = {}
            return last if last and condition(last) else None

        page = poll_until(holds, timeout=timeout)
        if page is not None:
            return page
        shown = "\n".join(f"{k} {v}" for k, v in sorted(last.items()) if "kvtax_" in k)
        raise AssertionError(f"kvtax: {what} not met in {timeout}s; last metrics:\n{shown}")

    def stop(self, signum: int = signal.SIGTERM, timeout: float = 60.0) -> int | None:
        """Send ``signum`` and wait; SIGKILL after ``timeout``. Returns the exit status."""
        child, self._child = self._child, None
        return child.stop(signum, grace=timeout) if child is not None else None
