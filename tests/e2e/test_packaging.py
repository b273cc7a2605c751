"""The container image's checks that need real tools: hadolint, pip, a fresh venv, a live kvtax.

No Docker engine runs here, so the image is never built. Instead hadolint lints both Dockerfiles,
and scripts/check-dockerfile-install.sh runs the Dockerfile's own install steps in a fresh venv
and starts the installed ``kvtax``. Slow-ish (it builds wheels from the package index), hence e2e.
Each check is paired with a fault it must catch, so a silent tool cannot pass for a clean one.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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
    # A generous bound against a hung pip, not a performance assertion.
    return subprocess.run(argv, check=False, capture_output=True, text=True, timeout=900)


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
