"""kvtax: a vLLM sidecar that measures what KV-cache preemption costs, and can stop it."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvtax")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0.0.0+src"

__all__ = ["__version__"]
