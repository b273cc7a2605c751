"""The container image's checks that need real tools: hadolint, pip, a fresh venv, a live kvtax.

No Docker engine runs here, so the image is never built. Instead hadolint lints both Dockerfiles,
and scripts/check-dockerfile-install.sh runs the Dockerfile's own install steps in a fresh venv
and starts the installed ``kvtax``; the Deployment's vLLM args go through the real vLLM 0.32
``vllm serve`` parser of the testbed's venv (no engine starts). Slow-ish, hence e2e.
Each check is paired with a fault it must catch, so a silent tool cannot pass for a clean one.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvtax_dev.process import HANG_GUARD_S
from kvtax_dev.testbed.engine import ensure_vllm_venv

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "check-dockerfile-install.sh"
DOCKERFILES = [ROOT / "Dockerfile", ROOT / "deploy" / "vllm-image" / "Dockerfile.plugin"]


def dev_tool(name: str) -> str:
    """A console script of the dev extra: beside this interpreter, else on PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: pip install -e '.[dev]'", pytrace=False)
    return found


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, check=False, capture_output=True, text=True, timeout=HANG_GUARD_S)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_is_clean(dockerfile: Path) -> None:
    result = _run([dev_tool("hadolint"), "--no-color", str(dockerfile)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == ""


def test_hadolint_reports_an_unpinned_base_and_an_unpinned_pip_install(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN pip install --no-cache-dir requests\n")
    result = _run([dev_tool("hadolint"), "--no-color", str(bad)])
    assert result.returncode != 0
    assert "DL3006" in result.stdout
    assert "DL3013" in result.stdout


def _run_check(repo: Path) -> subprocess.CompletedProcess[str]:
    return _run(["bash", str(repo / "scripts" / "check-dockerfile-install.sh")])


def test_dockerfile_install_steps_produce_a_working_kvtax() -> None:
    result = _run_check(ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "check-dockerfile-install: OK" in result.stderr
    # Every stage of the check ran, in order.
    stages = [line for line in result.stderr.splitlines() if line.startswith("== ")]
    assert [s.split(":")[0] for s in stages[:3]] == [
        "== build context",
        "== builder stage",
        "== final stage",
    ]
    assert "== the Dockerfile's HEALTHCHECK passes against a running kvtax serve" in stages
    assert "== the runtime only: no testbed, demo, preview or Prometheus client" in stages


def test_install_check_fails_loudly_when_the_image_would_lack_the_package(tmp_path: Path) -> None:
    # A copy of the repo whose .dockerignore forgets exporter/: the image would have no kvtax.
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy2(SCRIPT, repo / "scripts")
    for name in ("Dockerfile", "pyproject.toml", "README.md"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, repo / name)
    shutil.copytree(
        ROOT / "exporter",
        repo / "exporter",
        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"),
    )
    (repo / ".dockerignore").write_text("*\n!pyproject.toml\n!README.md\n**/__pycache__\n")
    result = _run_check(repo)
    assert result.returncode != 0
    assert "check-dockerfile-install: FAILED" in result.stderr
    assert "check-dockerfile-install: OK" not in result.stderr


# Parses argv as the vLLM image's entrypoint (`vllm serve`) would, with vLLM's own parser, and
# prints the values kvtax's manifests depend on, or the parser's exit code for bad argv.
_PARSE_WITH_VLLM = """
import contextlib, io, json, sys
try:
    from vllm.utils.argparse_utils import FlexibleArgumentParser
except ImportError:
    from vllm.utils import FlexibleArgumentParser
from vllm.entrypoints.cli.serve import ServeSubcommand

def parse(argv):
    root = FlexibleArgumentParser(prog="vllm")
    ServeSubcommand().subparser_init(root.add_subparsers(dest="subparser"))
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            args = root.parse_args(["serve", *argv])
    except SystemExit as exc:
        return {"exit": exc.code}
    return {k: getattr(args, k) for k in ("model_tag", "port", "max_num_seqs", "shutdown_timeout")}

good = json.loads(sys.argv[1])
print(json.dumps({"good": parse(good), "bad": parse([*good, "--shutdown-timeoutt=3"])}))
"""


def test_vllm_container_args_parse_with_vllm_s_own_cli() -> None:
    deployment = yaml.safe_load((ROOT / "deploy/kubernetes/deployment.yaml").read_text())
    containers = {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}
    # The kvtax container comes from the Component the example base lists.
    sidecar = yaml.safe_load((ROOT / "deploy/components/kvtax-sidecar/sidecar.yaml").read_text())
    (containers["kvtax"],) = [
        c for c in sidecar["spec"]["template"]["spec"]["containers"] if c["name"] == "kvtax"
    ]
    args = containers["vllm"]["args"]
    python = ensure_vllm_venv() / "bin" / "python"
    result = _run([str(python), "-c", _PARSE_WITH_VLLM, json.dumps(args)])
    assert result.returncode == 0, result.stderr[-4000:]
    parsed = json.loads(result.stdout.strip().splitlines()[-1])
    assert parsed["bad"] == {"exit": 2}, "vLLM's parser accepted a misspelt flag"
    good = parsed["good"]
    assert good["model_tag"] == args[0]
    assert good["port"] == containers["vllm"]["ports"][0]["containerPort"]
    kvtax_seqs = [a for a in containers["kvtax"]["args"] if a.startswith("--max-num-seqs=")]
    assert kvtax_seqs == [f"--max-num-seqs={good['max_num_seqs']}"]
    assert (
        good["shutdown_timeout"]
        == deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] - 5
    )
