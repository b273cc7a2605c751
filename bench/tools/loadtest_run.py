"""``kvtax loadtest`` against the real vLLM CPU engine, written to bench/results/loadtest.

Starts the testbed engine (16 KV blocks = 2,048 tokens, ``max_num_seqs`` 64, kvtax's plugin
loaded) and runs the sweep the docs show: concurrency 1 to 8, 40-token prompts and 500-token
outputs, 8 s a step. Run from the repository root, under the end-to-end lock (about 3 minutes)::

    flock /tmp/kvtax-e2e.lock .venv/bin/python -m bench.tools.loadtest_run
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from kvtax_dev import dev_env
from kvtax_dev.testbed import VllmEngine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/loadtest"))
    parser.add_argument("--levels", default="1,2,3,4,6,8")
    parser.add_argument("--output-tokens", default="const:500")
    args = parser.parse_args(argv)
    with VllmEngine(log_path=Path("/tmp/kvtax-loadtest-bench-engine.log")) as engine:
        cmd = [
            sys.executable,
            "-m",
            "kvtax.cli.main",
            "loadtest",
            engine.url,
            "--levels",
            args.levels,
            "--step-duration",
            "8",
            "--prompt-tokens",
            "const:40",
            "--output-tokens",
            args.output_tokens,
            "--max-num-seqs",
            str(engine.max_num_seqs),
            "--out",
            str(args.out),
        ]
        print("running:", " ".join(cmd), file=sys.stderr, flush=True)
        return subprocess.run(cmd, env=dev_env(os.environ), check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
