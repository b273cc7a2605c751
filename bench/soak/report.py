"""The soak's results and its Markdown report: marks, verdicts and tables (see bench.soak).

Pure but for :func:`header`, which reads the machine and the git tree the soak ran from.
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from bench import procfs, record
from bench.soak.compare import Check, ClientRecord, LedgerView

__all__ = ["IDLE_LIMIT_S", "MARKS", "Mark", "SoakResult", "header", "report"]

ROOT = Path(__file__).resolve().parents[2]
MARKS = 10  # samples at 10 %, 20 %, ... 100 %
IDLE_LIMIT_S = 30.0  # longest wait for descriptors to come back once idle
# RSS may grow this much over the run's second half: a plateau, not a slow leak (issue 29's
# bound; the first half covers the allocator and the caches filling).
RSS_GROWTH = 0.02
RSS_FROM = MARKS // 2  # the 50 % mark


@dataclass(frozen=True, slots=True)
class Mark:
    """One sample of the kvtax process."""

    label: str
    requests: int
    rss_kib: int
    fds: int
    tasks: float | None
    streams: float | None


@dataclass
class SoakResult:
    """Everything one soak saw. ``marks``: before the load, at each 10 %, then idle."""

    requests: int
    records: list[ClientRecord] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)
    ledger: dict[str, LedgerView] = field(default_factory=dict)  # by model, over the soak
    checks: list[Check] = field(default_factory=list)
    idle_seconds: float | None = None  # time until the idle level was back; None: never
    peak_rss_kib: int = 0
    log_lines: Counter[str] = field(default_factory=Counter)  # what kvtax or the upstream logged

    @property
    def baseline(self) -> Mark:
        return self.marks[0]

    def verdicts(self) -> list[tuple[str, bool, str]]:
        """(verdict, passed, the figures it was judged on)."""
        by_pct = self.marks[1 : 1 + MARKS]
        first, last = by_pct[RSS_FROM - 1].rss_kib, by_pct[-1].rss_kib
        growth = (last - first) / first
        idle = self.marks[-1]
        problems = [r for r in self.records if r.problem]
        back = self.idle_seconds is not None
        return [
            (
                f"RSS grows < {RSS_GROWTH:.0%} from the {RSS_FROM * 100 // MARKS} % to the "
                "100 % mark",
                growth < RSS_GROWTH,
                f"{first / 1024:.1f} -> {last / 1024:.1f} MiB ({growth:+.1%})",
            ),
            (
                "descriptors, tasks and open streams back to their idle level",
                back,
                _idle_figures(self.baseline, idle, self.idle_seconds),
            ),
            (
                "the ledger equals what the clients saw",
                all(c.ok for c in self.checks),
                f"{sum(not c.ok for c in self.checks)} of {len(self.checks)} checks differ",
            ),
            (
                "every client got what the upstream sent",
                not problems,
                f"{len(problems)} of {len(self.records)} clients did not",
            ),
        ]


def _idle_figures(before: Mark, idle: Mark, seconds: float | None) -> str:
    parts = [f"FDs {before.fds} before, {idle.fds} idle"]
    for name, a, b in (
        ("tasks", before.tasks, idle.tasks),
        ("streams", before.streams, idle.streams),
    ):
        parts.append(
            f"{name} {a:g} before, {b:g} idle"
            if a is not None and b is not None
            else f"{name} not published"
        )
    when = (
        f"back after {seconds:.1f} s idle"
        if seconds is not None
        else f"not back within {IDLE_LIMIT_S:g} s"
    )
    return "; ".join(parts) + f"; {when}"


def _cell(value: float | None) -> str:
    return "not published" if value is None else f"{value:g}"


def _marks_table(result: SoakResult) -> list[str]:
    header = ["mark", "requests done", "VmRSS MiB", "open FDs", "event-loop tasks", "streams open"]
    rows = [
        [
            *(m.label, f"{m.requests:,}", f"{m.rss_kib / 1024:.1f}", str(m.fds)),
            *(_cell(m.tasks), _cell(m.streams)),
        ]
        for m in result.marks
    ]
    return [
        record.table(header, rows, "lrrrrr"),
        f"\nPeak RSS (VmHWM): {result.peak_rss_kib / 1024:.1f} MiB.",
    ]


def _clients_table(result: SoakResult) -> list[str]:
    kinds = Counter(r.kind for r in result.records)
    wrong = Counter(r.kind for r in result.records if r.problem)
    tokens = Counter[str]()
    for r in result.records:
        tokens[r.kind] += r.tokens
    header = ["client kind", "requests", "tokens received", "answers not as sent"]
    rows = [
        [kind, f"{n:,}", f"{tokens[kind]:,}", f"{wrong[kind]:,}"]
        for kind, n in sorted(kinds.items())
    ]
    lines = [record.table(header, rows, "lrrr")]
    examples: dict[str, list[str]] = {}
    for r in result.records:
        if r.problem and len(examples.setdefault(r.kind, [])) < 3:
            examples[r.kind].append(f"- {r.kind}: {r.problem}")
    shown = [line for kind in sorted(examples) for line in examples[kind]]
    return lines + (
        ["", "Answers not as sent (the first three of each kind):", *shown] if shown else []
    )


def report(result: SoakResult) -> str:
    """The soak's tables and verdicts, as Markdown."""
    lines = [*_marks_table(result), "", *_clients_table(result)]
    checks = [[c.name, c.clients, c.kvtax, "ok" if c.ok else "DIFFERS"] for c in result.checks]
    lines += ["", record.table(["ledger", "clients saw", "kvtax counted", ""], checks, "lrrl")]
    if result.log_lines:
        lines += ["", "Errors in the logs of kvtax and the fake vLLM (times logged):"]
        lines += [f"    {n:5} x {line}" for line, n in result.log_lines.most_common(10)]
    lines += ["", "Verdicts:"]
    for name, passed, figures in result.verdicts():
        lines.append(f"- **{'PASS' if passed else 'FAIL'}** {name}: {figures}")
    return "\n".join(lines)


def header(argv: list[str]) -> str:
    cpu = procfs.cpu_model() if procfs.cpu_model() != "?" else platform.machine()
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return (
        f"Measured on {when} on {platform.node()}: {os.cpu_count()} cores ({cpu}), "
        f"Python {platform.python_version()}, aiohttp {aiohttp.__version__}, "
        f"load average {os.getloadavg()[0]:.1f} at the start. {_tree()}\n\n"
        f"Command: `.venv/bin/python -m bench.soak {' '.join(argv)}`".rstrip()
        + "\n"
    )


def _git(*args: str) -> str:
    done = subprocess.run(["git", "-C", str(ROOT), *args], check=False, capture_output=True)
    return done.stdout.decode(errors="replace")


def _tree() -> str:
    """The commit measured, and the package files that differed from it (a shared tree)."""
    changed = sorted(
        line[3:] for line in _git("status", "--porcelain", "--", "exporter").splitlines()
    )
    extra = f", with uncommitted changes to {', '.join(changed)}" if changed else ""
    return f"kvtax at commit {_git('rev-parse', '--short', 'HEAD').strip() or 'unknown'}{extra}."
