"""One scrape's signals for the gate: vLLM's request latency as the gate's first service time."""

from __future__ import annotations

from kvtax.figures.derive import ModelFigures
from kvtax.gate.cap import Signals
from kvtax.gate.signals import Totals, signals_of


def _figures(**models: tuple[float, float]) -> dict[str, ModelFigures]:
    return {
        name: ModelFigures(engine=True, totals={"e2e_latency_sum": s, "e2e_latency_count": n})
        for name, (s, n) in models.items()
    }


def _signals(
    figures: dict[str, ModelFigures], before: Totals | None = None
) -> tuple[Signals, Totals]:
    return signals_of(figures, before or {}, queued=0, in_flight=0, footprint_p95=None)


def test_the_first_scrape_gives_vllm_s_lifetime_mean_latency() -> None:
    """At kvtax's first scrape, vLLM's lifetime: all its finished requests, all models."""
    signals, _ = _signals(_figures(a=(30.0, 10.0), b=(10.0, 10.0)))
    assert signals.service_time == 2.0


def test_later_scrapes_give_the_mean_of_the_requests_finished_since() -> None:
    """After it, only what finished between two scrapes: the engine as it is now."""
    _, totals = _signals(_figures(a=(30.0, 10.0)))
    signals, _ = _signals(_figures(a=(30.0 + 5 * 8.0, 15.0)), totals)
    assert signals.service_time == 8.0


def test_no_request_finished_gives_no_service_time() -> None:
    """A fresh vLLM, or a quiet interval: nothing is known, and the gate keeps what it had."""
    first, totals = _signals(_figures(a=(0.0, 0.0)))
    assert first.service_time is None
    quiet, _ = _signals(_figures(a=(0.0, 0.0)), totals)
    assert quiet.service_time is None
