"""The package is three products by audience: what runs in the pod (``kvtax serve`` and the
pure core), the monitoring mixin (``kvtax.mixin``) and the offline tools (``kvtax.tools``).

``kvtax serve`` and ``kvtax --help`` must load neither of the other two: the pod starts faster,
and a bug or a heavy import in the planner cannot reach the sidecar. Each check runs in a fresh
interpreter, because this test process has long imported everything.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

EXPORTER = Path(__file__).resolve().parents[2] / "exporter"

# Builds the whole serve stack as `kvtax serve` does (parse, configure, wire every part), then
# lists the kvtax modules loaded. Nothing is started: no port is bound.
SERVE = """
import json, sys
from kvtax.cli.main import build_parser, config_from_args
from kvtax.serve.wiring import build
argv = ["serve", "--vllm.url=http://127.0.0.1:9", "--gateway.url=http://127.0.0.1:9/metrics"]
args = build_parser(argv).parse_args(argv)
build(config_from_args(args, {}))
print(json.dumps(sorted(m for m in sys.modules if m.startswith("kvtax"))))
"""

HELP = """
import contextlib, io, json, sys
from kvtax.cli.main import main
with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):
    main(sys.argv[1:])
print(json.dumps(sorted(m for m in sys.modules if m.startswith("kvtax"))))
"""


def _loaded(script: str, *argv: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", script, *argv],
        env={"PYTHONPATH": str(EXPORTER), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    modules: list[str] = json.loads(done.stdout.splitlines()[-1])
    return modules


def _of_other_audiences(modules: list[str]) -> list[str]:
    return [m for m in modules if m.startswith(("kvtax.mixin", "kvtax.tools", "kvtax_dev"))]


def test_the_built_serve_stack_loads_neither_the_mixin_nor_the_tools() -> None:
    loaded = _loaded(SERVE)
    assert "kvtax.serve.wiring" in loaded  # the check saw the whole stack
    assert "kvtax.serve.proxy.relay" in loaded
    assert _of_other_audiences(loaded) == []


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["docs", "--help"]])
def test_help_loads_neither_the_mixin_nor_the_tools(argv: list[str]) -> None:
    assert _of_other_audiences(_loaded(HELP, *argv)) == []


@pytest.mark.parametrize(
    ("argv", "package"),
    [
        (["plan", "--help"], "kvtax.tools.plan"),
        (["rules", "--help"], "kvtax.mixin.rules"),
        (["loadtest", "--help"], "kvtax.tools.loadtest"),
    ],
)
def test_a_tool_s_subcommand_loads_its_own_package(argv: list[str], package: str) -> None:
    # The lazy loading still loads what the subcommand needs (else the test above proves
    # nothing about a parser that lost its subcommands).
    assert any(m.startswith(package) for m in _loaded(HELP, *argv))


def test_every_subcommand_is_listed_without_being_loaded() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from kvtax.cli import main; sys.exit(main(['--help']))",
        ],
        env={"PYTHONPATH": str(EXPORTER), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=False,
    )
    for name in ("serve", "demo", "docs", "rules", "dashboards", "loadtest", "annotate", "plan"):
        assert f"\n    {name}" in done.stdout, (name, done.stdout)


def test_a_tool_left_out_of_the_image_says_how_to_get_it() -> None:
    # The image deletes kvtax/tools; None in sys.modules makes its import fail the same way.
    script = (
        "import sys; sys.modules['kvtax.tools'] = None\n"
        "from kvtax.cli import main; sys.exit(main(['plan', '--help']))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={"PYTHONPATH": str(EXPORTER), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("kvtax plan: the offline tools are not installed"), done.stderr
    assert "pip install kvtax" in done.stderr
    assert len(done.stderr.splitlines()) == 1
