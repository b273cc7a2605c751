"""Shared helpers for the unit tests: reading the vLLM fixtures and an injectable clock.

The fixtures under ``tests/fixtures/vllm`` are real 0.32 captures and hand-written older
versions (see ``OLD-VERSIONS.md`` there). Tests read them through :func:`fixture_text`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

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


Labels = frozenset[tuple[str, str]]


def parse_exposition(text: str) -> dict[str, dict[Labels, float]]:
    """Sample name -> {label set: value}, read back with prometheus-client's parser."""
    samples: dict[str, dict[Labels, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, {})[frozenset(s.labels.items())] = s.value
    return samples


def one(samples: dict[str, dict[Labels, float]], name: str, **labels: str) -> float:
    """The value of the one sample with this name and exactly these labels."""
    return samples[name][frozenset(labels.items())]
