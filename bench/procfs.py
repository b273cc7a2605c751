"""The benches' one reader of processes (memory, CPU time, children, command lines) and of
the machine's CPU model.

psutil reads what it can (resident memory, CPU ticks, children, command lines); two figures it
does not give are read from /proc here:

- the peak resident set (``VmHWM`` of /proc/PID/status), and its reset (``clear_refs``), which
  a bench needs to see a burst's peak, not the process's lifetime one;
- CPU time to the nanosecond (``/proc/PID/task/*/schedstat``): psutil's user + system time
  counts 10 ms ticks, too coarse for a relay that spends a few hundred milliseconds a turn.

Every reader takes a list of pids and sums over them; a process gone meanwhile counts nothing.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path

import psutil

__all__ = [
    "children",
    "cmdline",
    "cpu_model",
    "cpu_seconds",
    "find",
    "kvtax_pids",
    "name",
    "open_fds",
    "peak_rss_bytes",
    "reset_peak",
    "rss_bytes",
    "run_seconds",
]

_GONE = (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess)
_WORKER = "kvtax.serve.workers.child"  # a proxy worker's module, on its command line


def rss_bytes(pids: Iterable[int]) -> int:
    """The processes' resident set sizes, summed."""
    total = 0
    for pid in pids:
        with contextlib.suppress(*_GONE):
            total += psutil.Process(pid).memory_info().rss
    return total


def peak_rss_bytes(pids: Iterable[int]) -> int:
    """The processes' peak resident set sizes (VmHWM, since start or :func:`reset_peak`),
    summed: an upper bound on their peak together."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) * 1024
    return total


def reset_peak(pid: int) -> None:
    """Start the process's VmHWM over from its resident set now (Linux 4.0+)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU time of the processes, all threads, summed (10 ms ticks)."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(*_GONE):
            times = psutil.Process(pid).cpu_times()
            total += times.user + times.system
    return total


def io_calls(pids: Iterable[int]) -> int:
    """Read and write system calls the processes made (/proc/PID/io's syscr + syscw): libuv's
    read() and write(), not recv() or send(), so only relays alike compare."""
    calls = 0
    for pid in pids:
        with contextlib.suppress(*_GONE):
            io = psutil.Process(pid).io_counters()
            calls += io.read_count + io.write_count
    return calls


def run_seconds(pids: Iterable[int]) -> float:
    """Time the processes' threads ran on a CPU, summed, from schedstat (nanoseconds)."""
    ns = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError, ValueError):
                    ns += int(Path(f"/proc/{pid}/task/{task}/schedstat").read_text().split()[0])
    return ns / 1e9


def children(pid: int, *, recursive: bool = False) -> list[int]:
    """The process's children (all its descendants with ``recursive``); none once it is gone."""
    with contextlib.suppress(*_GONE):
        return [c.pid for c in psutil.Process(pid).children(recursive=recursive)]
    return []


def kvtax_pids(pid: int) -> list[int]:
    """``kvtax serve``'s relaying processes: itself and its proxy workers (``--proxy.workers``),
    not its parse worker."""
    return [pid, *(c for c in children(pid) if _WORKER in cmdline(c))]


def cmdline(pid: int) -> list[str]:
    """The process's arguments; none once it is gone."""
    with contextlib.suppress(*_GONE):
        return [str(arg) for arg in psutil.Process(pid).cmdline()]
    return []


def name(pid: int) -> str:
    """The process's name (its ``comm``), "?" once it is gone."""
    with contextlib.suppress(*_GONE):
        return str(psutil.Process(pid).name())
    return "?"


def open_fds(pid: int) -> int:
    """The process's open file descriptors."""
    return int(psutil.Process(pid).num_fds())


def cpu_model() -> str:
    """The machine's CPU model, as /proc/cpuinfo names it ("?" where it does not)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "?"


def find(*parts: str) -> list[int]:
    """The processes whose arguments hold every one of ``parts``, oldest first."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "create_time"]):
        argv = proc.info["cmdline"] or []
        if all(part in argv for part in parts):
            found.append((proc.info["create_time"], proc.info["pid"]))
    return [pid for _, pid in sorted(found)]
