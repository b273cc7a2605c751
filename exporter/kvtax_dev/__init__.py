"""kvtax's development harness: what runs on a developer's machine or in CI, never in the pod.

:mod:`.testbed` starts real processes (a vLLM CPU engine, ``kvtax serve``, Prometheus,
Alertmanager, a webhook) and drives load at them; :mod:`.demo` is ``kvtax demo``;
:mod:`.preview` draws the dashboards from a live Prometheus for ``kvtax dashboards preview``.
Three pieces are written once and shared by all of them: :mod:`.process` (a child process's
start, readiness wait, log and stop), :mod:`.promapi` (the Prometheus and Alertmanager HTTP
APIs, on ``requests``) and :mod:`.exposition` (a ``/metrics`` page into dicts).

The runtime package :mod:`kvtax` never imports this one at import time, and the wheel and the
image do not contain it (``pyproject.toml`` finds ``kvtax*`` only;
``tests/unit/test_wheel_contents.py`` checks).

It lives beside ``kvtax`` in ``exporter/`` and is imported from a checkout only: pytest puts
``exporter/`` on ``sys.path`` (``pythonpath`` in ``pyproject.toml``), ``scripts/demo`` sets
``PYTHONPATH``, and child processes that need it get :func:`dev_env`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["EXPORTER", "dev_env", "repo_root"]

# exporter/kvtax_dev/__init__.py -> exporter/, the folder holding both kvtax and kvtax_dev.
EXPORTER = Path(__file__).resolve().parents[1]


def repo_root() -> Path:
    """The root of the kvtax checkout this package was imported from (parent of ``exporter/``)."""
    return EXPORTER.parent


def dev_env(base: Mapping[str, str]) -> dict[str, str]:
    """``base`` with ``exporter/`` first on ``PYTHONPATH``, for a child Python that imports
    ``kvtax_dev`` (or must run this checkout's ``kvtax``): an editable install maps only the
    packages the wheel contains, and ``sys.path`` edits do not reach a child process."""
    env = dict(base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(EXPORTER), env.get("PYTHONPATH")) if p)
    return env
