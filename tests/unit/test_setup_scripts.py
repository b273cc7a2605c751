"""scripts/setup-prometheus.sh, run on a sandboxed PATH with a stand-in apt-get.

The unit-only run (``KVTAX_SKIP_E2E=1 scripts/test``) needs promtool and amtool; this checks
that the installer asks apt for exactly the missing packages, skips apt when both tools are on
PATH, and fails loudly when the install did not bring a tool. Nothing is installed for real.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "setup-prometheus.sh"

# Stands in for apt-get: records its arguments and, on install, "installs" what $PROVIDES names.
FAKE_APT = """#!/usr/bin/env bash
echo "$*" >> "$(dirname "$0")/../apt.log"
if [ "$1" = install ]; then
  for tool in $PROVIDES; do
    printf '#!/bin/sh\\n' > "$(dirname "$0")/$tool"
    chmod +x "$(dirname "$0")/$tool"
  done
fi
"""
SUDO = '#!/bin/sh\nexec "$@"\n'


def sandbox(tmp_path: Path, *tools: str) -> Path:
    """A bin directory with bash and the few commands the scripts use, plus ``tools``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("bash", "id", "dirname", "chmod"):
        real = shutil.which(name)
        assert real is not None, name
        (bin_dir / name).symlink_to(real)
    for name, body in (("apt-get", FAKE_APT), ("systemctl", "#!/bin/sh\n"), ("sudo", SUDO)):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    for tool in tools:
        (bin_dir / tool).write_text("#!/bin/sh\n")
        (bin_dir / tool).chmod(0o755)
    return bin_dir


def run(bin_dir: Path, provides: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(bin_dir / "bash"), str(SCRIPT)],
        env={"PATH": str(bin_dir), "PROVIDES": provides},
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )


def apt_calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "apt.log"
    return log.read_text().splitlines() if log.exists() else []


def test_both_tools_missing_installs_both_packages(tmp_path: Path) -> None:
    done = run(sandbox(tmp_path), provides="promtool amtool")
    assert done.returncode == 0, done.stderr
    installs = [c for c in apt_calls(tmp_path) if c.startswith("install")]
    assert installs == ["install -y -qq --no-install-recommends prometheus prometheus-alertmanager"]


@pytest.mark.parametrize(
    ("present", "package"), [("amtool", "prometheus"), ("promtool", "prometheus-alertmanager")]
)
def test_only_the_missing_tools_package_is_installed(
    tmp_path: Path, present: str, package: str
) -> None:
    done = run(sandbox(tmp_path, present), provides="promtool amtool")
    assert done.returncode == 0, done.stderr
    assert [c.split()[-1] for c in apt_calls(tmp_path) if c.startswith("install")] == [package]


def test_tools_on_path_mean_no_apt_at_all(tmp_path: Path) -> None:
    done = run(sandbox(tmp_path, "promtool", "amtool"), provides="")
    assert done.returncode == 0, done.stderr
    assert apt_calls(tmp_path) == []


def test_an_install_that_brings_no_tool_fails(tmp_path: Path) -> None:
    done = run(sandbox(tmp_path), provides="amtool")
    assert done.returncode == 1
    assert "promtool still missing" in done.stderr
