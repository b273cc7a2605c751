"""kvtax's plugin folder, made from this checkout the way the image makes it.

The kvtax image carries a folder made by ``pip install --no-deps --target`` from the kvtax
wheel; in a pod an init container copies it into an ``emptyDir`` and the vLLM container gets
``PYTHONPATH`` pointing there (docs/plugin.md). :func:`build_plugin_dir` makes the same folder
from the files the image's build context holds, for the end-to-end tests.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from kvtax_dev import repo_root

# What the image's build context holds (.dockerignore): the wheel is built from these alone.
CONTEXT = ("pyproject.toml", "README.md", "LICENSE", "exporter")


def _run(argv: list[str], cwd: Path) -> None:
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{argv} failed:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")


def build_plugin_dir(work: Path) -> Path:
    """The kvtax wheel of this checkout, installed with --no-deps --target into ``work``."""
    root = repo_root()
    context = work / "context"
    context.mkdir()
    for name in CONTEXT:
        source = root / name
        if source.is_dir():
            shutil.copytree(
                source,
                context / name,
                ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "kvtax_dev"),
            )
        elif source.exists():
            shutil.copy2(source, context / name)
    wheels = work / "wheels"
    pip = [sys.executable, "-m", "pip"]
    _run([*pip, "wheel", "--no-deps", "--wheel-dir", str(wheels), "."], cwd=context)
    target = work / "kvtax-plugin"
    install = ["install", "--no-deps", "--no-index", "--find-links", str(wheels)]
    _run([*pip, *install, "--target", str(target), "kvtax"], cwd=work)
    return target


__all__ = ["CONTEXT", "build_plugin_dir"]
