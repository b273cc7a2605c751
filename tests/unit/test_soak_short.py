"""The soak's short form, and its judgement (client records against the ledger) on hand-built data.

The short form runs ``bench.soak`` with 600 requests: a real ``kvtax serve`` and a fake vLLM,
both on loopback. It asserts only what must hold at any size: kvtax's ledger equals what the
clients saw, and kvtax's descriptors (and tasks, if published) come back once it is idle. RSS
growth is judged by the full soak (``python -m bench.soak``); at 600 requests it is noise.
"""

from __future__ import annotations

import pytest
from bench.soak.client import KINDS, SeenStream, Spec, _judge, _whole_record, plan
from bench.soak.compare import (
    Check,
    ClientRecord,
    LedgerView,
    compare,
    compare_one,
    ledger_delta,
    parse_ledger,
)
from bench.soak.soak import run

from kvtax.delivery.ledger import OUTCOMES
from kvtax_dev.fakevllm.events import DONE

OUTS = ("completed", "client_disconnected", "upstream_error")


def _failed(checks: list[Check]) -> list[str]:
    return [c.name for c in checks if not c.ok]


def test_a_ledger_that_counted_what_every_client_received_agrees() -> None:
    records = [
        ClientRecord("done_close", "completed", 200, 40),
        ClientRecord("whole", "completed", 200, 7),
        ClientRecord("drop", "upstream_error", 200, 3),
        ClientRecord("error", "upstream_error", 500, 0),
    ]
    view = LedgerView({"completed": 2, "upstream_error": 2}, delivered=50)
    assert _failed(compare_one(records, view, OUTS)) == []


def test_a_client_that_closed_at_done_counted_as_disconnected_is_a_mismatch() -> None:
    # The race of issue 10: the client read [DONE] and closed; kvtax lost its last tokens.
    records = [ClientRecord("done_close", "completed", 200, 100)] * 24
    view = LedgerView({"completed": 23, "client_disconnected": 1}, delivered=2396)
    failed = _failed(compare_one(records, view, OUTS))
    assert failed == ["completed", "client_disconnected", "delivered tokens (proxy)"]


@pytest.mark.parametrize(("delivered", "ok"), [(10, True), (12, True), (16, True), (9, False)])
def test_a_client_that_hung_up_bounds_its_tokens_by_what_it_read(delivered: int, ok: bool) -> None:
    records = [
        ClientRecord("full", "completed", 200, 10),
        ClientRecord("disconnect", "client_disconnected", 200, 6),
    ]
    view = LedgerView({"completed": 1, "client_disconnected": 1}, delivered=delivered)
    assert (_failed(compare_one(records, view, OUTS)) == []) is ok
    too_many = LedgerView({"completed": 1, "client_disconnected": 1}, delivered=17)
    assert _failed(compare_one(records, too_many, OUTS)) == ["delivered tokens (proxy)"]


def test_outcomes_come_from_the_caller_and_unknown_ones_are_never_dropped() -> None:
    records = [ClientRecord("full", "completed", 200, 5), ClientRecord("x", "hung", 0)]
    # A new outcome kvtax added (0 on both sides) passes; one nobody saw but kvtax counted fails.
    view = LedgerView({"completed": 1, "stream_without_usage": 0, "mystery": 2}, delivered=5)
    checks = compare_one(records, view, ("completed", "stream_without_usage"))
    assert _failed(checks) == ["hung (not a kvtax outcome)", "mystery (unexpected)"]


def test_the_ledger_is_read_per_model_from_the_proxy_source_only() -> None:
    page = (
        "# TYPE kvtax_requests counter\n"
        'kvtax_requests_total{model_name="a",outcome="completed"} 3.0\n'
        'kvtax_requests_total{model_name="other",outcome="completed"} 1.0\n'
        'kvtax_requests_total{model_name="a",outcome="upstream_error"} 2.0\n'
        "# TYPE kvtax_delivered_tokens counter\n"
        'kvtax_delivered_tokens_total{model_name="a",source="proxy"} 30.0\n'
        'kvtax_delivered_tokens_total{model_name="other",source="proxy"} 4.0\n'
        'kvtax_delivered_tokens_total{model_name="a",source="push"} 1000.0\n'
    )
    ledger = parse_ledger(page)
    assert ledger == {
        "a": LedgerView({"completed": 3.0, "upstream_error": 2.0}, 30.0),
        "other": LedgerView({"completed": 1.0}, 4.0),
    }
    delta = ledger_delta(ledger, {"a": LedgerView({"completed": 1.0}, 10.0)})
    assert (delta["a"].requests, delta["a"].delivered, delta["other"].requests) == (4.0, 20.0, 1.0)


def test_a_hung_up_clients_range_cannot_hide_tokens_missing_on_another_model() -> None:
    records = [
        ClientRecord("done_close", "completed", 200, 100, model="m"),
        ClientRecord("disconnect", "client_disconnected", 200, 50, model="m-hangup"),
    ]
    # kvtax lost 4 tokens of the client that read everything and credited the hung-up one 54:
    # one range over both would accept it; per model it does not.
    ledger = {
        "m": LedgerView({"completed": 1}, 96),
        "m-hangup": LedgerView({"client_disconnected": 1}, 54),
    }
    failed = _failed(compare(records, ledger, OUTS))
    assert failed == ["m: delivered tokens (proxy)", "m-hangup: delivered tokens (proxy)"]
    # A request kvtax put under a label no client used is counted against that label.
    stray = {
        **ledger,
        "m": LedgerView({"completed": 1}, 100),
        "other": LedgerView({"completed": 1}),
    }
    assert "other: completed" in _failed(compare(records, stray, OUTS))


def test_a_stream_client_counts_events_split_across_reads() -> None:
    seen = SeenStream("continuous")
    event = b'data: {"choices":[{"index":0,"text":"lorem lorem "}],"usage":{"completion_tokens":2}}'
    seen.feed(event[:30])
    seen.feed(event[30:] + b"\n")
    seen.feed(b"\n" + DONE)
    assert (seen.words, seen.tokens, seen.done, seen.problem) == (2, 2, True, "")
    leaked = SeenStream("none")
    leaked.feed(event + b"\n\n")
    assert leaked.problem == "usage the client did not ask for"


def test_a_body_cut_short_is_a_problem_even_when_the_ledger_agrees_with_it() -> None:
    spec = Spec("whole", "/v1/completions", {"max_tokens": 5, "soak_body_bytes": 1000}, 5)
    record, _ = _whole_record(spec, 200, b'{"id":"cmpl-soak","object":"text_com')
    assert (record.outcome, record.tokens) == ("completed", 0)
    assert record.problem == "200 with 36 bytes, not JSON"
    whole = b'{"usage":{"completion_tokens":5}}'.ljust(1000)
    record, _ = _whole_record(spec, 200, whole)
    assert (record.tokens, _judge(spec, record).problem) == (5, "")


def test_the_mix_is_deterministic_and_has_every_kind() -> None:
    first, again = plan(600, seed=1), plan(600, seed=1)
    assert [s.body for s in first] == [s.body for s in again]
    assert {s.kind for s in first} == set(KINDS)


def test_a_short_soak_ledger_equals_the_clients_and_kvtax_is_idle_again() -> None:
    result = run(600, seed=1)
    assert len(result.records) == 600
    assert {c.name: (c.clients, c.kvtax) for c in result.checks if not c.ok} == {}
    # Every outcome kvtax knows was compared, read from the ledger, not from a list here.
    assert {c.name.split(": ")[1] for c in result.checks} >= set(OUTCOMES)
    baseline, idle = result.baseline, result.marks[-1]
    assert result.idle_seconds is not None, (baseline, idle)
    assert idle.fds <= baseline.fds
    if idle.tasks is not None and baseline.tasks is not None:
        assert idle.tasks <= baseline.tasks
    if idle.streams is not None:
        assert idle.streams == 0


def test_two_proxy_workers_give_one_ledger_equal_to_the_clients() -> None:
    """With ``--proxy.workers=2`` each worker settles what it relayed into the parent's one
    ledger: the same mix is exact, summed over both, and both come back idle."""
    result = run(600, seed=2, workers=2, idle=1.0)
    assert len(result.records) == 600
    assert {c.name: (c.clients, c.kvtax) for c in result.checks if not c.ok} == {}
    baseline, idle = result.baseline, result.marks[-1]
    assert result.idle_seconds is not None, (baseline, idle)
    assert idle.fds <= baseline.fds
    if idle.streams is not None:
        assert idle.streams == 0
