"""The gate's KV block size: --gate.block-size when given, else vLLM's own from its page.

The pages are real captures (0.32 on CPU runs blocks of 128 tokens), read as the scrape reads
them: normalized, folded into a window, derived into figures, handed to ``Gate.observe``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvtax.engine.normalize import normalize
from kvtax.figures.derive import EngineSettings, ModelFigures, derive_all, kv_block_size
from kvtax.figures.window import Window
from kvtax.gate.cap import CapSettings
from kvtax.serve.config import load_config
from kvtax.serve.proxy.gatekeeper import Gate, GateSettings
from kvtax.serve.wiring import gate_settings

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm"
POOL = 2048  # kv_cache_size_tokens of the 0.32 captures: 16 blocks of 128


def _figures(page: str) -> dict[str, ModelFigures]:
    window = Window(window_seconds=100)
    window.observe(normalize(page, timestamp=1000.0), {})
    return derive_all(window, EngineSettings())


def _page(block_size: str | None = "128") -> str:
    """The idle 0.32 capture, its block_size label as given (None: no such label)."""
    page = (FIXTURES / "0.32-idle.prom").read_text()
    assert 'block_size="128"' in page
    label = "" if block_size is None else f'block_size="{block_size}",'
    return re.sub(r'(?<=[{,])block_size="128",', label, page)


def _budget_gate(block_size: int | None = None) -> Gate:
    return Gate(GateSettings(cap=CapSettings(mode="budget", block_size=block_size)))


@pytest.mark.parametrize(
    ("label", "size"),
    [("128", 128), ("16", 16), ("None", None), ("0", None), ("16.5", None), ("x", None)],
)
def test_the_block_size_is_the_label_when_it_is_a_whole_positive_number(
    label: str, size: int | None
) -> None:
    assert kv_block_size({"block_size": label}) == size
    assert kv_block_size({}) is None


def test_the_figures_carry_the_block_size_of_the_page() -> None:
    assert _figures(_page())["tiny-llama"].kv_block_size == 128
    assert _figures(_page(None))["tiny-llama"].kv_block_size is None


def test_unset_the_gate_counts_in_the_block_size_vllm_reports() -> None:
    gate = _budget_gate()
    assert gate.block_size == 16  # before any scrape
    assert gate.ticket(10, 64).blocks == 5  # 74 tokens in blocks of 16
    gate.observe(_figures(_page()))
    assert gate.block_size == 128
    assert gate.ticket(10, 64).blocks == 1
    assert gate.state.budget_blocks == 16  # 2048 / 128, not 128 blocks of 16


def test_the_flag_wins_over_the_block_size_vllm_reports() -> None:
    gate = _budget_gate(block_size=32)
    gate.observe(_figures(_page()))
    assert gate.block_size == 32
    assert gate.ticket(10, 64).blocks == 3
    assert gate.state.budget_blocks == 64  # 2048 / 32


@pytest.mark.parametrize("label", [None, "None"])
def test_a_vllm_that_does_not_say_is_counted_in_blocks_of_16(label: str | None) -> None:
    gate = _budget_gate()
    gate.observe(_figures(_page(label)))
    assert gate.block_size == 16
    assert gate.state.budget_blocks == 128  # 2048 / 16


def test_a_scrape_without_the_block_size_keeps_the_last_one_seen() -> None:
    gate = _budget_gate()
    gate.observe(_figures(_page()))
    gate.observe({})  # vLLM down: no figures
    gate.observe(_figures(_page(None)))
    assert gate.block_size == 128
    assert gate.state.budget_blocks == 16


async def test_a_ticket_keeps_the_blocks_it_was_issued_with() -> None:
    gate = _budget_gate()
    early = gate.ticket(10, 64)  # before the first scrape: 5 blocks of 16
    assert await gate.enter(early) is None
    gate.observe(_figures(_page()))
    late = gate.ticket(10, 64)  # 1 block of 128
    assert await gate.enter(late) is None
    assert gate.blocks_in_flight == 6
    gate.leave(early)
    assert gate.blocks_in_flight == 1  # it gave back what it took, no more
    gate.leave(late)
    assert gate.blocks_in_flight == 0


def test_the_option_is_unset_by_default_and_the_flag_reaches_the_gate() -> None:
    unset = load_config({}, env={}, file=None)
    assert unset.gate_block_size is None
    assert gate_settings(unset).cap.block_size is None
    given = load_config({"gate.block_size": "32"}, env={}, file=None)
    assert gate_settings(given).cap.block_size == 32
