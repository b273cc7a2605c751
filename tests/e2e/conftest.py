"""Shared fixtures for end-to-end tests against a real vLLM CPU engine.

Starting vLLM takes 30-60 s, so the whole session shares ONE engine. Tests must therefore
reason about counter *deltas*, never absolute values, and leave the engine idle.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest

from kvtax_dev.testbed import EngineStartError, VllmEngine

_HERE = Path(__file__).resolve().parent


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def pytest_configure(config: pytest.Config) -> None:
    # A run stopped with SIGTERM (a CI timeout, `timeout`, kill) would otherwise skip fixture
    # teardown and leave the session's engine running; as an interrupt, teardown runs.
    signal.signal(signal.SIGTERM, _interrupt)
    # Registered here too so the marker is known even when pytest runs without the
    # project's ini settings (for example from another rootdir).
    config.addinivalue_line("markers", "e2e: needs a real vLLM engine (slow)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Hooks in a conftest see every collected item, so mark only the ones under tests/e2e.
    for item in items:
        if item.path.resolve().is_relative_to(_HERE):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def vllm_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmEngine]:
    """One real vLLM engine (16 KV blocks = 2,048 tokens, 64 seqs) for the whole session.

    Fails, never skips, when the engine cannot start: a missing engine must not turn the
    end-to-end suite silently green.
    """
    engine = VllmEngine(log_path=tmp_path_factory.mktemp("vllm") / "engine.log")
    try:
        engine.start()
    except EngineStartError as exc:
        pytest.fail(f"could not start the vLLM testbed engine: {exc}", pytrace=False)
    try:
        yield engine
    finally:
        engine.stop()
