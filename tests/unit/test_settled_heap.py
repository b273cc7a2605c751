"""``kvtax serve`` takes what start-up built out of the garbage collector's full collections.

Start-up leaves some 50,000 long-lived objects (modules, classes, pydantic's validators, the
built stack). A full collection walked all of them, 50 to 70 ms of a held event loop, and a
burst of new requests is what set one off, so the pause held up their first bytes.
:func:`kvtax.serve.wiring.run` collects once and freezes the survivors before anything
listens. Checked in a fresh interpreter: freezing is for the whole process, and this test
process has imported everything already.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

EXPORTER = Path(__file__).resolve().parents[2] / "exporter"

# run() as `kvtax serve` calls it, on a web port that is taken: it builds the stack, settles
# the heap, fails to listen and returns 1. Then what a full collection would walk.
SERVE = """
import asyncio, gc, json, sys
from kvtax.cli.main import build_parser, config_from_args
from kvtax.serve.wiring import run
argv = ["serve", "--vllm.url=http://127.0.0.1:9", f"--web.listen-address=127.0.0.1:{sys.argv[1]}"]
config = config_from_args(build_parser(argv).parse_args(argv), {})
status = asyncio.run(run(config))
print(json.dumps({"status": status, "frozen": gc.get_freeze_count(),
                  "walked": len(gc.get_objects())}))
"""


def test_serve_freezes_start_up_s_objects_before_it_listens() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-c", SERVE, str(port)],
            env={"PYTHONPATH": str(EXPORTER), "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["status"] == 1  # it could not listen: the settling came before
    assert seen["frozen"] > 20_000
    # A full collection walks a small part of what it walked before (the failed start's own
    # objects and what the test's lines made).
    assert seen["walked"] < seen["frozen"] / 5
