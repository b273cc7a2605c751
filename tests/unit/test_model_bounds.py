"""Engine-side model names are vLLM's input: bounded in number, forgotten when they leave.

A page can carry any number of ``model_name`` values. The history tracks at most
``max_models``, counts what it leaves out, and forgets a model gone from the page and the ledger
for a window, so rotating names cannot grow kvtax's memory or its output.
"""

from __future__ import annotations

import random

from kvtax.delivery.ledger import LedgerTotals
from kvtax.engine.snapshot import ModelMetrics, VllmSnapshot
from kvtax.figures.window import Window, candidates

WINDOW = 60.0


def page(t: float, *models: str) -> VllmSnapshot:
    metrics = {m: ModelMetrics({"generation_tokens": 10.0 * t, "kv_usage": 0.5}) for m in models}
    return VllmSnapshot(t, metrics)


def test_models_past_the_cap_are_dropped_and_counted() -> None:
    h = Window(WINDOW, max_models=3)
    kept = h.observe(page(0.0, "a", "b", "c", "d", "e"))
    assert h.models() == ["a", "b", "c"]
    assert sorted(kept.models) == ["a", "b", "c"]  # observers see only tracked models
    assert h.dropped_models == 2
    h.observe(page(5.0, "a", "b", "c", "d", "e"))
    assert h.dropped_models == 4  # counted at every scrape that left them out


def test_tracked_models_keep_their_place_when_newcomers_arrive() -> None:
    h = Window(WINDOW, max_models=2)
    h.observe(page(0.0, "z1", "z2"))
    h.observe(page(5.0, "a", "z1", "z2"))  # "a" sorts first but finds no place
    assert h.models() == ["z1", "z2"]
    assert h.dropped_models == 1


def test_a_model_gone_for_a_window_is_forgotten() -> None:
    h = Window(WINDOW, max_models=8)
    h.observe(page(0.0, "old", "stay"))
    h.observe(page(30.0, "stay"))
    assert h.models() == ["old", "stay"]  # gone for less than a window: still published
    h.observe(page(61.0, "stay"))
    assert h.models() == ["stay"]
    assert h.points("old") == ()


def test_a_newcomer_takes_the_place_of_the_model_gone_longest() -> None:
    h = Window(WINDOW, max_models=2)
    h.observe(page(0.0, "gone-first", "gone-later"))
    h.observe(page(5.0, "gone-later"))
    h.observe(page(10.0, "new"))
    assert h.models() == ["gone-later", "new"]
    assert h.dropped_models == 0


def test_ten_thousand_rotating_model_names_stay_bounded() -> None:
    h = Window(WINDOW, max_models=32)
    for scrape in range(200):
        t = 5.0 * scrape
        names = [f"model-{(scrape * 50 + i) % 10_000:05d}" for i in range(50)]
        h.observe(page(t, *names), {})
        assert len(h.models()) <= 32
    assert h.dropped_models == 200 * (50 - 32)
    # Series leave the output: nothing older than a window is still there.
    assert all(m in {f"model-{(199 * 50 + i) % 10_000:05d}" for i in range(50)} for m in h.models())


def test_a_model_the_ledger_still_counts_is_kept_and_loses_its_engine_data_a_window_later() -> None:
    h = Window(WINDOW)
    h.observe(page(0.0, "a"), {"a": LedgerTotals()})
    h.observe(page(30.0), {"a": LedgerTotals(delivered=5.0)})
    # Off the page for less than a window: the last engine values still stand.
    assert h.points("a")[-1].counters["generation_tokens"] == 0.0
    h.observe(page(100.0), {"a": LedgerTotals(delivered=9.0)})
    assert h.models() == ["a"]
    last = h.points("a")[-1]
    assert last.counters == {}
    assert last.ledger.delivered == 9.0


def test_a_ledger_only_model_takes_a_free_place_but_never_a_page_models_place() -> None:
    h = Window(WINDOW, max_models=2)
    h.observe(page(0.0, "p1"), {"alias": LedgerTotals(delivered=1.0), "other": LedgerTotals()})
    assert h.models() == ["alias", "p1"]
    h.observe(page(5.0, "p1", "p2"), {"alias": LedgerTotals(delivered=2.0)})
    assert h.models() == ["p1", "p2"]
    assert h.dropped_models == 0


def test_candidates_choose_what_observe_would_keep() -> None:
    # The parse worker trims the page with candidates(); observe must keep the same models
    # and count the same drops as from the whole page.
    rnd = random.Random(7)
    whole, trimmed = Window(WINDOW, max_models=5), Window(WINDOW, max_models=5)
    for scrape in range(60):
        names = rnd.sample([f"m{i:02d}" for i in range(30)], rnd.randint(0, 12))
        snap = page(5.0 * scrape, *names)
        cut = candidates(snap, trimmed.models(), 5)
        assert len(cut.models) <= 5
        kept_whole = whole.observe(snap)
        kept_trimmed = trimmed.observe(cut)
        assert sorted(kept_trimmed.models) == sorted(kept_whole.models)
        assert trimmed.models() == whole.models()
        assert trimmed.dropped_models == whole.dropped_models
