"""The gate's cap from the sidecar's figures, and what /metrics shows of it."""

from __future__ import annotations

from kvtax.expose.exposition import build_families
from kvtax.figures.derive import ModelFigures
from kvtax.gate.cap import CapSettings
from kvtax.serve.config import Config
from kvtax.serve.proxy.gatekeeper import Gate, GateSettings
from kvtax.serve.wiring import build


def _figures(
    preemptions: float, usage: float = 0.5, recomputed: float = 0.0
) -> dict[str, ModelFigures]:
    totals = {"preemptions": preemptions, "recomputed_blocks": recomputed}
    return {
        "m": ModelFigures(
            engine=True,
            totals=totals,
            kv_usage=usage,
            kv_capacity_tokens=2048.0,
            length_p95=180.0,
        )
    }


def test_the_gate_cuts_on_new_preemptions_only() -> None:
    gate = Gate(GateSettings(cap=CapSettings(mode="adaptive", floor=1, ceiling=64, cooldown=1)))
    gate.ticket(30, 150)  # it has seen a request of 180 tokens, as the engine's p95
    gate.in_flight = 10  # as if ten requests ran
    gate.observe(_figures(preemptions=40.0))  # the lifetime total before the gate: no cut
    assert gate.state.cap == 10
    gate.observe(_figures(preemptions=40.0))
    assert gate.state.cap == 10
    gate.observe(_figures(preemptions=41.0))
    assert gate.state.cap == 5
    assert gate.state.source == "cut"


def test_a_model_gone_from_the_page_adds_nothing() -> None:
    gate = Gate(GateSettings(cap=CapSettings(mode="adaptive", floor=1, ceiling=64)))
    gate.observe(_figures(preemptions=5.0))
    gate.observe({"m": ModelFigures(engine=False)})
    gate.observe(_figures(preemptions=5.0))
    assert gate.state.cuts == 0


def test_off_publishes_the_advice_only() -> None:
    stack = build(Config())
    assert stack.proxy.gate is None
    stack.gate.observe(_figures(preemptions=0.0))
    names = {f.name for f in build_families(stack.gate.samples())}
    assert names == {"kvtax_gate_advised_cap"}
    assert stack.gate.state.advice == 10


def test_on_publishes_every_gate_family() -> None:
    stack = build(Config(gate_mode="budget"))
    assert stack.proxy.gate is stack.gate
    stack.gate.observe(_figures(preemptions=0.0))
    names = {f.name for f in build_families(stack.gate.samples())}
    assert {
        "kvtax_gate_cap",
        "kvtax_gate_budget_blocks",
        "kvtax_gate_queue_depth",
        "kvtax_gate_queue_wait_seconds",
        "kvtax_gate_rejections",
        "kvtax_gate_cap_changes",
    } <= names
