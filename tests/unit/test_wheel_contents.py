"""The wheel, and so the image, holds what runs in the pod and nothing of the dev harness.

The wheel is built for real (``pip wheel --no-deps``) from the files the image's builder stage
sees: the paths ``.dockerignore`` admits, copied into a temp dir. Building from a copy also keeps
the checkout clean, and keeps a stale ``build/lib`` of an earlier layout out of the wheel (pip
builds in the source tree, and setuptools packs whatever ``build/lib`` already holds).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = ROOT / "exporter" / "kvtax"

# A module path with one of these parts is harness: the real-engine testbed, the demo driver,
# the dashboard preview renderer and its Prometheus API client.
HARNESS_PARTS = frozenset({"kvtax_dev", "testbed", "demo", "preview", "promapi"})
# What the pod runs, named so that a packaging change dropping one cannot pass unnoticed.
RUNTIME_MODULES = (
    "kvtax",
    "kvtax.cli.main",
    "kvtax.cli.checkout",
    "kvtax.serve.config",
    "kvtax.serve.scrape.scraper",
    "kvtax.engine.normalize",
    "kvtax.figures.window",
    "kvtax.figures.derive",
    "kvtax.delivery.ledger",
    "kvtax.serve.proxy",
    "kvtax.figures.recompute",
    "kvtax.expose.exposition",
    "kvtax.serve.scrape.job",
    "kvtax.serve.web.port",
    "kvtax.serve.scrape.parseworker",
    "kvtax.plugin",
    "kvtax.mixin.rules.render",
    "kvtax.mixin.dashboards.generate",
)


def harness_modules(modules: Iterable[str]) -> list[str]:
    """The modules among ``modules`` that belong to the development harness."""
    return sorted(m for m in modules if HARNESS_PARTS & set(m.split(".")))


def module_name(path: str) -> str:
    """``kvtax/mixin/rules/__init__.py`` -> ``kvtax.mixin.rules``; ``kvtax/cli/main.py`` ->
    ``kvtax.cli.main``."""
    parts = path.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _build_context(into: Path) -> Path:
    """The paths .dockerignore admits ('!path'), minus its '**/name' exclusions."""
    rules = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()]
    admitted = [r[1:].rstrip("/") for r in rules if r.startswith("!")]
    dropped = [r.removeprefix("**/") for r in rules if r.startswith("**/")]
    for rel in admitted:
        source = ROOT / rel
        if source.is_dir():
            shutil.copytree(source, into / rel, ignore=shutil.ignore_patterns(*dropped))
        elif source.exists():
            shutil.copy2(source, into / rel)
    return into


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    context = _build_context(tmp_path_factory.mktemp("context"))
    # The harness must be in what pip sees, so that keeping it out is pyproject.toml's doing.
    assert (context / "exporter" / "kvtax_dev" / "testbed").is_dir()
    out = tmp_path_factory.mktemp("wheel")
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet"]
    done = subprocess.run(
        [*pip_wheel, "--wheel-dir", str(out), str(context)],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,  # a hung pip, not a performance bound
    )
    assert done.returncode == 0, done.stderr[-4000:]
    (built,) = out.glob("kvtax-*.whl")
    return built


@pytest.fixture(scope="module")
def wheel_modules(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return {module_name(n) for n in archive.namelist() if n.endswith(".py")}


def test_the_wheel_holds_no_testbed_demo_preview_or_prometheus_client(
    wheel_modules: set[str],
) -> None:
    assert harness_modules(wheel_modules) == []
    assert {m.split(".")[0] for m in wheel_modules} == {"kvtax"}


def test_the_wheel_holds_the_runtime(wheel_modules: set[str]) -> None:
    missing = [m for m in RUNTIME_MODULES if m not in wheel_modules]
    assert missing == []


def test_the_wheel_holds_every_module_of_the_runtime_package_and_nothing_else(
    wheel_modules: set[str],
) -> None:
    source = {module_name(p.relative_to(RUNTIME.parent).as_posix()) for p in RUNTIME.rglob("*.py")}
    assert wheel_modules == source


def test_the_wheel_keeps_the_type_marker_and_the_console_script(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        text = archive.read(entry_points).decode()
    assert "kvtax/py.typed" in names
    assert "kvtax = kvtax.cli.main:main" in text
    assert "kvtax = kvtax.plugin:KvtaxStatLogger" in text


def test_the_wheel_carries_the_relay_scan_compiled_with_its_stub(wheel: Path) -> None:
    """The build compiled the C scan (kvtax.delivery._eventscan) into the wheel: on a machine with
    a C compiler, as CI's and the image's builder are, a wheel without it is a broken build that
    would run the slower Python scan and say nothing. Its source stays out; its stub goes in."""
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    assert [n for n in names if n.startswith("kvtax/delivery/_eventscan.") and n.endswith(".so")]
    assert "kvtax/delivery/_eventscan.pyi" in names
    assert not [n for n in names if n.endswith(".c")]


def test_the_harness_check_names_every_kind_of_harness_module() -> None:
    # Each name the old layout shipped must be caught, or the first test proves nothing.
    shipped_before = [
        "kvtax.testbed",
        "kvtax.testbed.engine",
        "kvtax.demo",
        "kvtax.mixin.dashboards.preview",
        "kvtax.mixin.dashboards.promapi",
        "kvtax_dev.preview",
    ]
    assert harness_modules(
        [*shipped_before, "kvtax.serve.proxy", "kvtax.mixin.dashboards.generate"]
    ) == sorted(shipped_before)


def test_the_harness_is_in_the_checkout_beside_the_runtime() -> None:
    # The harness moved, not vanished: the checkout still has every part of it.
    dev = ROOT / "exporter" / "kvtax_dev"
    for rel in ("testbed/engine.py", "demo.py", "preview.py", "promapi.py"):
        assert (dev / rel).is_file(), rel
    assert harness_modules(p.stem for p in RUNTIME.rglob("*.py")) == []
