"""How long ``kvtax --help`` and a ``kvtax serve`` parse take to start, at two revisions, side by
side in one run.

The restructure by audience made ``kvtax.cli`` import the planner, the load tester and the rule
and dashboard generators only when their subcommand runs. This bench checks out a base revision
into a temporary worktree, then alternates the two checkouts' ``kvtax --help`` (and
``python -X importtime``'s count of modules) round after round, so both see the same machine
noise, and reports medians and the ratio.

    .venv/bin/python -m bench.tools.cli_startup --base 2d985bf --rounds 30 \\
        --out bench/results/cli-startup.md
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import record

ROOT = Path(__file__).resolve().parents[2]

# The same entry point at both revisions: kvtax.cli's main (a module before, a package after).
ENTRY = "import sys; from kvtax.cli import main; sys.exit(main(sys.argv[1:]))"
COUNT = (
    "import sys; from kvtax.cli import main\n"
    "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
    "print(sum(1 for m in sys.modules if m.startswith('kvtax')), len(sys.modules))"
)


def timed(exporter: Path, argv: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", ENTRY, *argv],
        env={"PYTHONPATH": str(exporter), "PATH": "/usr/bin:/bin"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        check=False,
    )
    return time.perf_counter() - started


def modules(exporter: Path, argv: list[str]) -> tuple[int, int]:
    out = subprocess.run(
        [sys.executable, "-c", COUNT, *argv],
        env={"PYTHONPATH": str(exporter), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=False,
    ).stdout.split()
    return int(out[-2]), int(out[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="The revision to compare against.")
    parser.add_argument("--rounds", type=int, default=30, help="Runs of each (default 30).")
    parser.add_argument("--out", type=Path, help="Also write the Markdown table here.")
    args = parser.parse_args()
    cases = {"kvtax --help": ["--help"], "kvtax serve --help": ["serve", "--help"]}
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(base), args.base],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        try:
            sides = {f"base {args.base}": base / "exporter", "this checkout": ROOT / "exporter"}
            times: dict[tuple[str, str], list[float]] = {}
            for n in range(args.rounds):
                print(f"round {n + 1}/{args.rounds}", file=sys.stderr)
                for case, argv in cases.items():
                    for side, exporter in sides.items():
                        times.setdefault((case, side), []).append(timed(exporter, argv))
            counts = {
                (case, side): modules(exporter, argv)
                for case, argv in cases.items()
                for side, exporter in sides.items()
            }
        finally:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, check=False
            )
    names = list(sides)
    lines = [
        f"`python -m bench.tools.cli_startup --base {args.base} --rounds {args.rounds}`: "
        "medians of "
        f"{args.rounds} alternating runs (wall time of a fresh interpreter).",
    ]
    rows = []
    for case in cases:
        before = statistics.median(times[(case, names[0])])
        after = statistics.median(times[(case, names[1])])
        (kb, ab), (ka, aa) = counts[(case, names[0])], counts[(case, names[1])]
        walls = [f"{before * 1000:.0f} ms", f"{after * 1000:.0f} ms", f"{after / before:.2f}"]
        rows.append([f"`{case}`", *walls, f"{kb}, {ka}", f"{ab}, {aa}"])
    header = ["command", *names, "ratio", "kvtax modules loaded (before, after)"]
    lines += ["", record.table([*header, "all modules (before, after)"], rows, "lrrrll")]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:  # every figure is in the table
        record.save(args.out, f"# kvtax's command line: start-up time\n\n{text}", None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
