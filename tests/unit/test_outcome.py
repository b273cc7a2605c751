"""The one place a request's outcome is decided, and the ledger record it makes. Pure.

Each case builds the facts an exchange ends with, as the relay would leave them, and reads the
outcome under each shutdown phase.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvtax.delivery.asks import UsageWish
from kvtax.delivery.ledger import OUTCOMES
from kvtax.delivery.sse import StreamRewriter
from kvtax.delivery.timing import SloTargets
from kvtax.serve.proxy.acks import AckTracker
from kvtax.serve.proxy.outcome import Facts, Phase, outcome_of, record_of

SERVE = Path(__file__).resolve().parents[2] / "exporter" / "kvtax" / "serve"
PHASES: tuple[Phase, ...] = ("serving", "draining", "cutting")
SLO = SloTargets(2.0, 0.2)


def finished(**facts: object) -> Facts:
    """A 200 whose every byte was written and ended cleanly, with ``facts`` changed."""
    ex = Facts(started=0.0, model="m", status=200, wrote_all=True, eof=True)
    for name, value in facts.items():
        setattr(ex, name, value)
    return ex


def acked(written: int, confirmed: int) -> AckTracker:
    """A tracker whose client acknowledged ``confirmed`` of ``written`` tokens."""
    acks = AckTracker(None)  # no socket: each write counts once it returns
    acks.wrote(10, confirmed)
    acks.written_tokens = written
    return acks


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize(
    ("facts", "outcome"),
    [
        ({"too_large": True, "status": None}, "too_large"),
        ({"status": None, "wrote_all": False, "eof": False}, "upstream_error"),
        # kvtax answered its shutdown 503 itself: queued in the gate, or not answered yet.
        ({"turned_away": True, "status": None, "wrote_all": False, "eof": False}, "shutdown"),
        ({"status": 503}, "upstream_error"),
        ({"status": 400}, "upstream_4xx"),
        ({"status": 404, "client_gone": True, "eof": False}, "upstream_4xx"),
        ({}, "completed"),
        # The client hung up after [DONE] reached its kernel and acknowledged it all.
        ({"client_gone": True, "eof": False}, "completed"),
    ],
)
def test_outcomes_that_the_shutdown_phase_does_not_change(
    facts: dict[str, object], outcome: str, phase: Phase
) -> None:
    assert outcome_of(finished(**facts), phase) == outcome


@pytest.mark.parametrize(
    ("facts", "serving"),
    [
        ({"wrote_all": False, "upstream_broke": True}, "upstream_error"),
        ({"wrote_all": False, "client_gone": True, "eof": False}, "client_disconnected"),
        ({"wrote_all": False, "eof": False}, "client_disconnected"),
        # Left before vLLM answered (queued in the gate, say): not vLLM's error.
        (
            {"status": None, "wrote_all": False, "client_gone": True, "eof": False},
            "client_disconnected",
        ),
    ],
)
def test_a_request_not_completed_when_the_grace_period_is_over_is_a_shutdown(
    facts: dict[str, object], serving: str
) -> None:
    # Past the grace period kvtax closes vLLM's side and cancels handlers itself: what breaks
    # then is its doing, and one state (the proxy's phase) says so, not a flag per request.
    ex = finished(**facts)
    assert outcome_of(ex, "serving") == serving
    assert outcome_of(ex, "draining") == serving
    assert outcome_of(ex, "cutting") == "shutdown"


def test_every_outcome_decided_is_one_the_ledger_knows() -> None:
    cases = [
        finished(too_large=True),
        finished(status=None),
        finished(status=500),
        finished(status=400),
        finished(),
        finished(wrote_all=False, upstream_broke=True),
        finished(wrote_all=False),
        finished(status=None, shed="queue_full"),
    ]
    decided = {outcome_of(ex, phase) for ex in cases for phase in PHASES}
    assert decided == set(OUTCOMES)


def _stream(tokens: int, upstream: int) -> StreamRewriter:
    """A rewriter that handed out ``tokens`` of the ``upstream`` tokens vLLM sent."""
    rw = StreamRewriter(UsageWish())
    line = b'data: {"id":"c","choices":[{"index":0,"text":"t","finish_reason":null}]'
    rw.feed(line + b',"usage":{"prompt_tokens":2,"completion_tokens":%d}}\n\n' % upstream)
    rw.completion_tokens = tokens
    return rw


def test_a_stream_cut_by_shutdown_delivers_what_its_waiting_client_was_written() -> None:
    # Ended with the error event and a clean end of stream while the client was there.
    ex = finished(wrote_all=False, upstream_broke=True, acks=acked(7, 3), counter=_stream(7, 9))
    record = record_of(ex, outcome_of(ex, "cutting"), ended=1.5, slo=SLO)
    assert record.outcome == "shutdown"
    assert (record.delivered_tokens, record.undelivered_tokens) == (7, 2)
    assert record.prompt_tokens == 2
    assert record.duration == 1.5
    assert not record.slo_met


def test_a_client_that_left_has_only_what_it_acknowledged() -> None:
    ex = finished(wrote_all=False, eof=False, client_gone=True, acks=acked(7, 3))
    ex.counter = _stream(7, 9)
    record = record_of(ex, outcome_of(ex, "serving"), ended=1.0, slo=SLO)
    assert record.outcome == "client_disconnected"
    assert (record.delivered_tokens, record.undelivered_tokens) == (3, 6)


@pytest.mark.parametrize("phase", PHASES)
def test_a_non_streamed_answer_cut_short_delivers_nothing(phase: Phase) -> None:
    # Useful only whole: a body that broke off reached the client as nothing.
    ex = finished(wrote_all=False, upstream_broke=True, usage=(11, 3))
    record = record_of(ex, outcome_of(ex, phase), ended=1.0, slo=SLO)
    assert record.outcome in {"upstream_error", "shutdown"}
    assert (record.delivered_tokens, record.undelivered_tokens) == (0, 11)


def test_a_completed_non_streamed_answer_delivers_its_usage() -> None:
    ex = finished(usage=(11, 3), finished_at=0.5)
    record = record_of(ex, outcome_of(ex, "serving"), ended=0.6, slo=SLO)
    assert record.outcome == "completed"
    assert (record.delivered_tokens, record.prompt_tokens) == (11, 3)
    assert record.slo_met
    assert not record.usage_missing


def test_only_outcome_of_names_an_outcome_in_the_proxy() -> None:
    # One home for the decision: no other function of the proxy's modules returns or assigns
    # an outcome's name.
    decided_in: set[str] = set()
    for path in sorted(SERVE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(fn):
                value = getattr(node, "value", None)
                if (
                    isinstance(node, ast.Return | ast.Assign)
                    and isinstance(value, ast.Constant)
                    and value.value in OUTCOMES
                ):
                    decided_in.add(f"{path.stem}.{fn.name}")
    assert decided_in == {"outcome.outcome_of"}
