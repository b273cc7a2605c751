"""kvtax: a vLLM sidecar that measures what KV-cache preemption costs, and can stop it."""

from __future__ import annotations

# The one place the version is written. The wheel's metadata reads it (pyproject.toml,
# [tool.setuptools.dynamic]); the Helm chart's version and appVersion, the kustomize image tag
# and the docs' image tags must equal it (tests/unit/test_helm.py, test_dockerfile.py).
__version__ = "0.2.0"

__all__ = ["__version__"]
