"""Starts and stops a real vLLM CPU engine for tests, the demo and benchmarks.

:class:`VllmEngine` runs ``vllm.entrypoints.openai.api_server`` from a dedicated virtual
environment (installed once per machine by ``scripts/setup-vllm.sh``) on the tiny model
from :mod:`kvtax_dev.testbed.model`, with a KV pool shrunk to a few blocks so that ordinary
load preempts. The engine runs in its own process group so that stopping it also stops
every worker it spawned.

Light imports only (the standard library and requests): this module is imported by the
sidecar's test suite, whose venv has neither torch nor vLLM. The process itself is a
:class:`~kvtax_dev.process.ChildProcess`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

import requests

from kvtax_dev import dev_env, repo_root
from kvtax_dev.exposition import read_samples, total
from kvtax_dev.machine_lock import LockTimeout, MachineLock
from kvtax_dev.process import HANG_GUARD_S, ChildProcess, ChildStartError, http_ok, tail
from kvtax_dev.testbed.freeze import Freezer

# The vLLM CPU backend's KV block size, in tokens. The pool holds blocks * this.
BLOCK_SIZE_TOKENS = 128
DEFAULT_MODEL_NAME = "tiny-llama"
# A cold first start compiles kernels and can take minutes on 2 cores; warm starts take
# about 30-40 s. The timeout guards against hangs, not against slow machines.
DEFAULT_STARTUP_TIMEOUT_S = 600.0
DEFAULT_STOP_GRACE_S = 20.0
_LOG_TAIL_LINES = 60


class EngineStartError(ChildStartError):
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


def beside_cores() -> str | None:
    """The core for an engine started beside the session's, as ``VllmEngine(cpus=...)`` and
    ``VLLM_CPU_OMP_THREADS_BIND`` read it: "1" on a machine of two cores or more, where vLLM's
    "auto" binds the worker of every engine to core 0 (two engines on it would each compute at
    half speed). None on one core: "auto" is all there is."""
    return "1" if (os.cpu_count() or 1) >= 2 else None


def _cores_of(cpus: str) -> list[int]:
    """VLLM_CPU_OMP_THREADS_BIND's cores: "1", "0-3", "0,2"."""
    cores: list[int] = []
    for part in cpus.split(","):
        low, _, high = part.strip().partition("-")
        cores.extend(range(int(low), int(high or low) + 1))
    return sorted(set(cores))


def _progress(message: str) -> None:
    # Long steps (install, model build, startup) would otherwise look like a hang.
    print(f"kvtax_dev.testbed: {message}", file=sys.stderr, flush=True)


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
    from kvtax_dev.testbed import model  # stdlib-only at import time; heavy work runs in venv

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


ENGINE_STARTS_ENV = "KVTAX_ENGINE_STARTS_LOG"


def _record_start(engine: VllmEngine) -> None:
    """One line per engine start in the file ``$KVTAX_ENGINE_STARTS_LOG`` names, if any:
    scripts/test counts them for the suite's report. Appended, so engines started by child
    processes (the demo's) count too."""
    path = os.environ.get(ENGINE_STARTS_ENV)
    if not path:
        return
    with open(path, "a", encoding="utf-8") as log:
        log.write(
            f"{engine.startup_seconds:.1f}s {engine.model_name} {' '.join(engine.extra_args)}\n"
        )


# vLLM's own bounds (1, 2, 3, 4, 5, 10, 20) with 0.5 before them: counts are whole, so le=0.5
# holds exactly the requests never preempted.
PREEMPTION_BUCKETS = '{"request_num_preemptions": [0.5, 1, 2, 3, 4, 5, 10, 20]}'


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
        cpus: str | None = None,
        alone: bool = False,
        eager: bool = True,
        log_path: Path | None = None,
        model_dir: Path | None = None,
        model_name: str = DEFAULT_MODEL_NAME,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        stop_grace_s: float = DEFAULT_STOP_GRACE_S,
        venv: Path | None = None,
        python_path: Sequence[Path] = (),
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
        # The cores the engine's worker (its OpenMP threads) runs on, as vLLM's
        # VLLM_CPU_OMP_THREADS_BIND reads them ("1", "0-3"). None keeps vLLM's "auto", which on
        # a 2-core machine binds the worker to core 0 and leaves core 1 to the API server and
        # the rest: two engines started with the default both compute on core 0.
        self.cpus = cpus
        # --enforce-eager skips the torch.compile of the model at start (13 s of the 60 s a start
        # takes here: vLLM recompiles at every start, its compile cache failing to load). The
        # testbed measures scheduling, preemption and counters, which compiling does not change;
        # benchmarks of compute speed (bench/engine/prefill_ratio.py) pass eager=False.
        self.eager = eager
        # The machine's one lock (kvtax_dev.machine_lock), held while the engine runs: shared
        # with the other lanes' engines, while a bench waits for them all. ``alone`` takes the
        # engine's cores exclusive, waiting until no other engine bound there runs: a test
        # that watches a calm engine for false alarms must not have another lane's overload on
        # its core.
        cores = _cores_of(cpus) if cpus is not None else []
        self.machine_lock = MachineLock(cores=cores, exclusive=alone, on_wait=_progress)
        self.log_path: Path = (
            log_path
            if log_path is not None
            else Path(tempfile.gettempdir()) / f"kvtax-vllm-{self.port}.log"
        )
        self.model_dir: Path = model_dir if model_dir is not None else cache_dir() / "tiny-llama"
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self.startup_seconds: float | None = None
        # The engine's virtual environment: the one scripts/setup-vllm.sh makes unless given
        # (the LMCache venv of kvtax_dev.testbed.lmcache is the same vLLM with lmcache beside).
        self.venv: Path | None = venv
        # Folders put in front of the engine's PYTHONPATH: where vLLM finds extra entry points
        # (kvtax_dev.testbed.schedprobe's probe_dir).
        self.python_path = tuple(python_path)
        self._child: ChildProcess | None = None

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
            *(["--enforce-eager"] if self.eager else []),
            # A bucket below 1 in vLLM's preemptions-per-request histogram: its default first
            # bucket (le=1) holds never-preempted and once-preempted requests alike, and the
            # Overview's "preempted at least once" line reads this one (docs/dashboards.md).
            "--custom-histogram-buckets",
            PREEMPTION_BUCKETS,
            *self.extra_args,
        ]

    def start(self) -> VllmEngine:
        """Install (once), build the model (once), launch, and wait for ``/health``."""
        if self._child is not None:
            return self
        venv = self.venv if self.venv is not None else ensure_vllm_venv()
        self.venv = venv
        ensure_tiny_model(venv, self.model_dir)
        env = _venv_env(venv)
        # 1 GiB bounds the CPU KV allocation; --num-gpu-blocks-override then picks the
        # actual (much smaller) pool inside it.
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"
        if self.cpus is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpus
        env.update(self.extra_env)
        if self.python_path:
            env["PYTHONPATH"] = os.pathsep.join([*map(str, self.python_path), env["PYTHONPATH"]])
        self._child = ChildProcess(
            "vLLM",
            self.command(venv / "bin" / "python"),
            log_path=self.log_path,
            ready=self.healthy,
            env=env,
            cwd=self.log_path.parent,
            own_group=True,  # stop() signals the API server and all its workers
            startup_timeout=self.startup_timeout_s,
            error=EngineStartError,
        )
        try:
            self.machine_lock.acquire()
        except LockTimeout as exc:
            raise EngineStartError(str(exc)) from None
        _progress(f"starting vLLM on {self.url} (log: {self.log_path})...")
        began = time.monotonic()
        try:
            self._child.start()
        except BaseException:
            self._child = None
            self.machine_lock.release()
            raise
        self.startup_seconds = time.monotonic() - began
        _progress(f"engine healthy after {self.startup_seconds:.1f} s")
        _record_start(self)
        return self

    @property
    def plugins_off(self) -> bool:
        """True when the engine starts with vLLM's plugin allowlist naming no plugin."""
        return self.extra_env.get("VLLM_PLUGINS") == ""

    def turn_plugins_off(self) -> None:
        """From the next start on, load no entry-point plugin (kvtax's stat logger included):
        vLLM reads its allowlist once, at start. ``VLLM_PLUGINS=""`` parses to a list that
        names nothing, so vLLM finds kvtax's entry point and leaves it out."""
        self.extra_env["VLLM_PLUGINS"] = ""

    def healthy(self) -> bool:
        """True when ``GET /health`` answers 200."""
        return http_ok(f"{self.url}/health")

    @property
    def running(self) -> bool:
        """True while the engine process is alive."""
        return self._child is not None and self._child.running

    def stop(self) -> None:
        """Stop the whole process group: SIGTERM, then SIGKILL after a grace. Idempotent."""
        child, self._child = self._child, None
        if child is not None:
            # A worker a freezer left stopped would sit out the SIGTERM until the SIGKILL (the
            # group's id is the leader's pid: own_group).
            if child.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGCONT)
            child.stop(grace=self.stop_grace_s)
            self.machine_lock.release()

    def freezer(self) -> Freezer:
        """A :class:`~kvtax_dev.testbed.freeze.Freezer` of this engine: inside it the engine
        computes only in the slices the caller lets it run. Use as a context manager."""
        pid = self._child.pid if self._child is not None else None
        if pid is None:
            raise RuntimeError("the engine is not running")
        return Freezer(pid)

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        """The last lines of the engine log, for error messages."""
        return tail(self.log_path, lines)

    # -- convenience ---------------------------------------------------------------------

    def get(self, path: str, timeout: float = 30.0) -> str:
        """GET ``path`` from the engine and return the body as text. ``timeout`` guards against
        hangs: vLLM's busy API server took 5.5 s for a ``/metrics`` page in the gate e2e."""
        resp = requests.get(f"{self.url}{path}", timeout=timeout)
        resp.raise_for_status()
        return resp.content.decode()

    def metrics_text(self) -> str:
        """The engine's current Prometheus exposition (``GET /metrics``)."""
        return self.get("/metrics")

    def wait_idle(self, timeout: float = HANG_GUARD_S) -> None:
        """Return once vLLM runs and queues no request (an earlier test's aborted requests can
        take a moment to leave); TimeoutError past ``timeout``, a guard against hangs only."""
        deadline = time.monotonic() + timeout
        while True:
            samples = read_samples(self.metrics_text())
            load = total(samples, "vllm:num_requests_running") + total(
                samples, "vllm:num_requests_waiting"
            )
            if load == 0:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM still has {load:g} request(s) after {timeout:g}s")
            time.sleep(0.2)

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
