"""Shared helpers for the unit tests: the vLLM fixtures, an injectable clock, the /metrics
reader, a web port in front of a lone scrape job, the Prometheus command-line tools, and the
``front_door`` fixture (the one fake vLLM's raw rig, :mod:`kvtax_dev.fakevllm.front`).

The fixtures under ``tests/fixtures/vllm`` are real 0.32 captures and hand-written older
versions (see ``OLD-VERSIONS.md`` there). Tests read them through :func:`fixture_text`.
Pages are read with :mod:`kvtax_dev.exposition`, the harness's one reader.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from kvtax.delivery import eventscan, sse
from kvtax.serve.scrape.job import ScrapeJob
from kvtax.serve.web.port import WebPort
from kvtax_dev.exposition import Labels, Samples, read_samples
from kvtax_dev.fakevllm.front import Front, StartFront, start_front, stop_front
from kvtax_dev.fakevllm.raw import Script

__all__ = [
    "FakeClock",
    "Labels",
    "clock",
    "fixture_text",
    "front_door",
    "one",
    "parse_exposition",
    "read_fixture",
    "tool",
    "web_port",
]

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm"

# hypothesis, for the HTTP differential (test_http_differential.py): reproducible (derandomized,
# no example database) and untimed (a front-door example costs a few ms, more when it fails).
# `scripts/test --fast` sets KVTAX_SKIP_E2E=1 and gets the small run; the full suite runs
# 10,000 examples per side; KVTAX_HYPOTHESIS_PROFILE picks one by name. Every other property
# test sets its own max_examples: the full count is sized for the differential alone.
settings.register_profile(
    "kvtax-fast",
    max_examples=200,
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "kvtax-full", parent=settings.get_profile("kvtax-fast"), max_examples=10_000
)
settings.load_profile(
    os.environ.get("KVTAX_HYPOTHESIS_PROFILE")
    or ("kvtax-fast" if os.environ.get("KVTAX_SKIP_E2E") == "1" else "kvtax-full")
)


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


# The harness's reader, under the name the unit tests know (sample name -> {labels: value}).
parse_exposition = read_samples


def tool(name: str) -> str:
    """The path of ``promtool`` or ``amtool``; fails (never skips) when it is not installed.

    ``scripts/setup-prometheus.sh`` installs both, for the unit-only run as for the full one.
    /usr/bin is searched too: PATH in some test runners is a venv's bin only.
    """
    path = shutil.which(name) or shutil.which(name, path="/usr/bin")
    if path is None:
        pytest.fail(f"{name} is not installed: run scripts/setup-prometheus.sh", pytrace=False)
    return path


def one(samples: Samples, name: str, **labels: str) -> float:
    """The value of the one sample with this name and exactly these labels."""
    return samples[name][frozenset(labels.items())]


def web_port(job: ScrapeJob, **kwargs: Any) -> WebPort:
    """The web port in front of a scrape job used alone, connected as ``kvtax serve`` connects
    its own (:func:`kvtax.serve.wiring.build`), with the job's samples for the whole report.
    ``kwargs``: ``security``, ``routes``."""
    return WebPort(
        job.config,
        report=job.samples,
        readiness=job.readiness,
        revision=job.revision,
        **kwargs,
    )


# The front door's rig (a scriptable upstream, a proxy in front), for every unit test. It is
# here rather than in kvtax_dev.fakevllm because that package imports without pytest.
@pytest.fixture
async def front_door() -> AsyncIterator[StartFront]:
    """``await front_door(script, gate=..., **ProxySettings)``: a started :class:`Front`,
    torn down after the test."""
    fronts: list[Front] = []

    async def start(script: Script | None = None, **kwargs: Any) -> Front:
        front = await start_front(script, **kwargs)
        fronts.append(front)
        return front

    yield start
    for front in fronts:
        await stop_front(front)


@pytest.fixture(params=["compiled", "python"])
def each_scan(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The rewriter's one-call scans (:mod:`kvtax.delivery.eventscan`) as C, then as Python:
    a test that uses this runs under both. The C one must be there unless the environment
    says KVTAX_NO_EXTENSIONS: an install that silently lost it fails here."""
    impl: str = request.param
    if impl == "compiled":
        if eventscan.extensions_off():
            pytest.skip("KVTAX_NO_EXTENSIONS is set: the C scan is switched off")
        # Imported here: without the C build, only this variant needs it (and is skipped).
        from kvtax.delivery._eventscan import scan_ids, scan_usage

        monkeypatch.setattr(sse, "scan_ids", scan_ids)
        monkeypatch.setattr(sse, "scan_usage", scan_usage)
    else:
        monkeypatch.setattr(sse, "scan_ids", eventscan.scan_ids_py)
        monkeypatch.setattr(sse, "scan_usage", eventscan.scan_usage_py)
    return impl
