"""Starts and stops a real vLLM CPU engine for tests, the demo and benchmarks.

:class:`VllmEngine` runs ``vllm.entrypoints.openai.api_server`` from a dedicated virtual
environment (installed once per machine by ``scripts/setup-vllm.sh``) on the tiny model
from :mod:`kvtax_dev.testbed.model`, with a KV pool shrunk to a few blocks so that ordinary
load preempts. The engine runs in its own process group so that stopping it also stops
every worker it spawned.

Standard library only: this module is imported by the sidecar's test suite, whose venv
has neither torch nor vLLM.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

from kvtax_dev import dev_env, repo_root

# The vLLM CPU backend's KV block size, in tokens. The pool holds blocks * this.
BLOCK_SIZE_TOKENS = 128
DEFAULT_MODEL_NAME = "tiny-llama"
# A cold first start compiles kernels and can take minutes on 2 cores; warm starts take
# about 30-40 s. The timeout guards against hangs, not against slow machines.
DEFAULT_STARTUP_TIMEOUT_S = 600.0
DEFAULT_STOP_GRACE_S = 20.0
_LOG_TAIL_LINES = 60


class EngineStartError(RuntimeError):
    """The engine could not be installed, prepared or brought to a healthy state."""


def cache_dir() -> Path:
    """Per-machine cache for the engine venv and the tiny model (``KVTAX_CACHE``)."""
    return Path(os.environ.get("KVTAX_CACHE", str(Path.home() / ".cache" / "kvtax")))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _progress(message: str) -> None:
    # Long steps (install, model build, startup) would otherwise look like a hang.
    print(f"kvtax_dev.testbed: {message}", file=sys.stderr, flush=True)


def _tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"(no log at {path}: {exc})"
    return "\n".join(text.splitlines()[-lines:])


def ensure_vllm_venv() -> Path:
    """Return the vLLM venv, installing it via ``scripts/setup-vllm.sh`` if needed.

    ``KVTAX_VLLM_VENV`` names the venv; the setup script honours it too. Without a checkout
    (no setup script), an existing venv at that path or in the cache is used as is.
    """
    script = repo_root() / "scripts" / "setup-vllm.sh"
    if script.is_file():
        stamp_missing = not (_default_venv() / ".kvtax-ready").exists()
        if stamp_missing:
            _progress("installing vLLM CPU engine (several minutes, once per machine)...")
        proc = subprocess.run(
            ["bash", str(script)],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise EngineStartError(
                f"{script} failed with exit code {proc.returncode}:\n{proc.stderr[-4000:]}"
            )
        lines = proc.stdout.strip().splitlines()
        if not lines:
            raise EngineStartError(f"{script} printed no venv path")
        venv = Path(lines[-1])
    else:
        venv = _default_venv()
    if not (venv / "bin" / "python").exists():
        raise EngineStartError(f"no vLLM venv at {venv}; run scripts/setup-vllm.sh")
    return venv


def _default_venv() -> Path:
    return Path(os.environ.get("KVTAX_VLLM_VENV", str(cache_dir() / "vllm-venv")))


def _venv_env(venv: Path) -> dict[str, str]:
    """Environment for running the venv's python: offline, and this checkout importable.

    The model builder is in ``kvtax_dev``, which no install maps (the engine venv's editable
    kvtax included), and kvtax itself may not be installed there yet (an offline machine).
    """
    env = dev_env(os.environ)
    # The model is local and there is no hub; never let transformers try the network.
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


def ensure_tiny_model(venv: Path, directory: Path) -> Path:
    """Build the tiny model into ``directory`` with the venv's python (idempotent)."""
    from . import model  # stdlib-only at import time; heavy work runs in venv

    if (directory / model.MARKER_NAME).exists():
        # Cheap pre-check to skip the subprocess (and its ~10 s torch import) when warm;
        # the builder itself re-checks the recipe version.
        with contextlib.suppress(OSError):
            if model.is_complete(directory):
                return directory
    _progress(f"making tiny model in {directory}...")
    proc = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "kvtax_dev.testbed.model", str(directory)],
        env=_venv_env(venv),
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise EngineStartError(f"building the tiny model failed:\n{proc.stderr[-4000:]}")
    return directory


class VllmEngine:
    """A real vLLM OpenAI server on a tiny model with a deliberately small KV pool.

    Use as a context manager (``with VllmEngine() as eng: ...``) or call :meth:`start`
    and :meth:`stop`. The defaults (16 blocks = 2,048 KV tokens, 64 sequences) make a
    burst of long generations preempt heavily.
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        num_gpu_blocks: int = 16,
        max_num_seqs: int = 64,
        max_model_len: int = 1024,
        extra_args: Sequence[str] = (),
        extra_env: Mapping[str, str] | None = None,
        log_path: Path | None = None,
        model_dir: Path | None = None,
        model_name: str = DEFAULT_MODEL_NAME,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        stop_grace_s: float = DEFAULT_STOP_GRACE_S,
    ) -> None:
        self.port: int = port if port is not None else free_port()
        self.host = "127.0.0.1"
        self.url = f"http://{self.host}:{self.port}"
        self.model_name = model_name
        self.num_gpu_blocks = num_gpu_blocks
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.kv_capacity_tokens = num_gpu_blocks * BLOCK_SIZE_TOKENS
        self.extra_args: tuple[str, ...] = tuple(extra_args)
        self.extra_env: dict[str, str] = dict(extra_env or {})
        self.log_path: Path = (
            log_path
            if log_path is not None
            else Path(tempfile.gettempdir()) / f"kvtax-vllm-{self.port}.log"
        )
        self.model_dir: Path = model_dir if model_dir is not None else cache_dir() / "tiny-llama"
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self.startup_seconds: float | None = None
        self.venv: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    # -- lifecycle ---------------------------------------------------------------------

    def command(self, python: Path) -> list[str]:
        """The server command line (flags checked against vLLM 0.32 CPU)."""
        return [
            str(python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            self.model_name,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--max-model-len",
            str(self.max_model_len),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--num-gpu-blocks-override",
            str(self.num_gpu_blocks),
            "--dtype",
            "bfloat16",
            *self.extra_args,
        ]

    def start(self) -> VllmEngine:
        """Install (once), build the model (once), launch, and wait for ``/health``."""
        if self._proc is not None:
            return self
        venv = ensure_vllm_venv()
        self.venv = venv
        ensure_tiny_model(venv, self.model_dir)
        env = _venv_env(venv)
        # 1 GiB bounds the CPU KV allocation; --num-gpu-blocks-override then picks the
        # actual (much smaller) pool inside it.
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"
        env.update(self.extra_env)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        _progress(f"starting vLLM on {self.url} (log: {self.log_path})...")
        began = time.monotonic()
        with self.log_path.open("wb") as log:
            self._proc = subprocess.Popen(
                self.command(venv / "bin" / "python"),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=str(self.log_path.parent),
                # Own process group: stop() signals the API server and all its workers.
                start_new_session=True,
            )
        # Never leave an orphan engine behind if the caller forgets stop() or crashes.
        atexit.register(self.stop)
        _progress("waiting for engine to become healthy...")
        try:
            self._wait_healthy(began)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - began
        _progress(f"engine healthy after {self.startup_seconds:.1f} s")
        return self

    def _wait_healthy(self, began: float) -> None:
        proc = self._proc
        assert proc is not None
        deadline = began + self.startup_timeout_s
        while True:
            code = proc.poll()
            if code is not None:
                raise EngineStartError(
                    f"vLLM exited with code {code} during startup; log {self.log_path} "
                    f"ends with:\n{_tail(self.log_path)}"
                )
            if self.healthy():
                return
            if time.monotonic() > deadline:
                raise EngineStartError(
                    f"vLLM not healthy after {self.startup_timeout_s:.0f} s; log "
                    f"{self.log_path} ends with:\n{_tail(self.log_path)}"
                )
            time.sleep(0.5)

    def healthy(self) -> bool:
        """True when ``GET /health`` answers 200."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    @property
    def running(self) -> bool:
        """True while the engine process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def stop(self) -> None:
        """Stop the whole process group: SIGTERM, then SIGKILL after a grace. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        atexit.unregister(self.stop)
        pgid = proc.pid  # start_new_session made the server its group's leader
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=self.stop_grace_s)
        # Workers may outlive the leader; kill whatever remains of the group regardless.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        """The last lines of the engine log, for error messages."""
        return _tail(self.log_path, lines)

    # -- convenience ---------------------------------------------------------------------

    def get(self, path: str, timeout: float = 10.0) -> str:
        """GET ``path`` from the engine and return the body as text."""
        with urllib.request.urlopen(f"{self.url}{path}", timeout=timeout) as resp:
            body: bytes = resp.read()
            return body.decode()

    def metrics_text(self) -> str:
        """The engine's current Prometheus exposition (``GET /metrics``)."""
        return self.get("/metrics")

    def __enter__(self) -> VllmEngine:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"VllmEngine({self.url}, blocks={self.num_gpu_blocks}, {state})"


__all__ = [
    "BLOCK_SIZE_TOKENS",
    "DEFAULT_MODEL_NAME",
    "EngineStartError",
    "VllmEngine",
    "cache_dir",
    "ensure_tiny_model",
    "ensure_vllm_venv",
    "free_port",
]
