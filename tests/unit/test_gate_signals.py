"""One scrape's signals for the gate: vLLM's request latency as the gate's first service time,
and the requests vLLM's own queue caps refused."""

from __future__ import annotations

import re
from pathlib import Path

from kvtax.engine.normalize import normalize
from kvtax.figures.derive import EngineSettings, ModelFigures, derive_all
from kvtax.figures.window import Window
from kvtax.gate.cap import Signals
from kvtax.gate.signals import Totals, signals_of

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm"


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


def test_vllms_queue_cap_refusals_count_from_the_scrape_before() -> None:
    """vLLM's admission rejections (0.32+) since the previous scrape, all models, reset-safe;
    the first scrape's lifetime count is history, not a signal."""

    def page(**refused: float) -> dict[str, ModelFigures]:
        return {
            m: ModelFigures(engine=True, totals={"admission_rejections": n})
            for m, n in refused.items()
        }

    first, totals = _signals(page(a=40.0, b=2.0))
    assert first.refused == 0.0
    later, totals = _signals(page(a=43.0, b=4.0), totals)
    assert later.refused == 5.0
    restarted, _ = _signals(page(a=0.0, b=4.0), totals)
    assert restarted.refused == 0.0


def test_the_refusals_come_from_vllms_own_page() -> None:
    """Read as the scrape reads a real 0.32 capture: both reasons of
    vllm:admission_rejections_total add up in the figures' totals, and the next page's
    increase is the gate's signal."""
    idle = (FIXTURES / "0.32-idle.prom").read_text()

    def page(queued_reqs: float, queued_tokens: float) -> str:
        text = re.sub(r'(reason="max_num_queued_reqs"\} )0\.0', rf"\g<1>{queued_reqs}", idle)
        return re.sub(r'(reason="max_num_queued_tokens"\} )0\.0', rf"\g<1>{queued_tokens}", text)

    window = Window(window_seconds=100)
    window.observe(normalize(page(3.0, 2.0), timestamp=1000.0), {})
    first = derive_all(window, EngineSettings())
    assert first["tiny-llama"].totals["admission_rejections"] == 5.0
    _, totals = _signals(first)
    window.observe(normalize(page(7.0, 2.0), timestamp=1001.0), {})
    signals, _ = _signals(derive_all(window, EngineSettings()), totals)
    assert signals.refused == 4.0
