"""Shared helpers for the unit tests: reading the vLLM fixtures and an injectable clock.

The fixtures under ``tests/fixtures/vllm`` are real 0.32 captures and hand-written older
versions (see ``OLD-VERSIONS.md`` there). Tests read them through :func:`fixture_text`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm"


def read_fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


class FakeClock:
    """A clock the test moves by hand: ``clock.advance(5)``."""

    def __init__(self, start: float = 1_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def fixture_text() -> Callable[[str], str]:
    return read_fixture


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()
