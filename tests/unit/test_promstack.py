"""The Prometheus harness's wait: what its failure says, and the times it reads."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from kvtax_dev.testbed.promstack import PrometheusProcess, epoch_of, prometheus_config


@pytest.fixture
def prom() -> Iterator[PrometheusProcess]:
    # Never started: wait_for's failure path needs only the name and the log's tail.
    server = PrometheusProcess(prometheus_config({"x": ["127.0.0.1:1"]}))
    yield server
    shutil.rmtree(server.dir, ignore_errors=True)


def test_a_failed_wait_names_what_the_probe_saw_last(prom: PrometheusProcess) -> None:
    seen: list[int] = []

    def probe() -> None:  # never satisfied; counts its calls
        seen.append(len(seen))

    with pytest.raises(AssertionError, match=r"^prometheus: verdict \(last: \d+\) not met"):
        prom.wait_for(probe, timeout=0.6, what=lambda: f"verdict (last: {seen[-1]})")


def test_a_plain_name_still_names_the_condition(prom: PrometheusProcess) -> None:
    with pytest.raises(AssertionError, match=r"^prometheus: kvtax stored not met in 0.1s"):
        prom.wait_for(lambda: None, timeout=0.1, what="kvtax stored")


def test_prometheus_times_read_to_the_microsecond_in_any_zone() -> None:
    """Go's nanoseconds are cut to microseconds, an offset is honoured, and a target never
    scraped (Go's zero time) reads as long ago."""
    assert epoch_of("2026-12-07T12:00:00.123456789Z") == pytest.approx(1796644800.123456)
    assert epoch_of("2026-12-07T13:00:00+01:00") == 1796644800.0
    assert epoch_of("0001-01-01T00:00:00Z") < 0
    with pytest.raises(ValueError, match="RFC 3339"):
        epoch_of("yesterday")
