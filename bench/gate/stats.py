"""bench/gate/gate.py's numbers: what each request saw, an arm's summary, the targets, the tables.

Pure functions over plain records (no engine, no clock), so unit tests exercise them.

Times in a :class:`Record` are seconds after the arm's start. A request is *refused* when its
last answer was a 429 or a 503, *admitted* otherwise (unless it failed): an admitted request
still unanswered or streaming when the bench stopped waiting is *unfinished*. Its TTFT is then
known only as a lower bound (the time it had waited), and the quantiles say so ("≥").
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bench import record
from kvtax.tools.loadtest.measure import quantile, rank

REFUSED = (429, 503)
STATIC_ARMS = ("vllm-max-num-seqs", "vllm-max-num-queued-reqs")
PEER_ARMS = (*STATIC_ARMS, "gie-saturation")
KVTAX_PREFIX = "kvtax-"


@dataclass
class Refusal:
    """One 429 or 503: its status, the seconds from sending to the answer, its Retry-After."""

    status: int
    seconds: float
    retry_after: str | None = None


@dataclass
class Record:
    """What the client saw of one request (of all its attempts, in the closed loop)."""

    index: int
    long: bool
    prompt_tokens: int
    max_tokens: int
    sent: float
    refusals: list[Refusal] = field(default_factory=list)
    status: int | None = None
    first: float | None = None
    # (time, completion tokens so far), one entry each time the count grew; the first entry is
    # the first token.
    events: list[tuple[float, int]] = field(default_factory=list)
    completed: bool = False
    error: str | None = None

    @property
    def refused(self) -> bool:
        return self.status in REFUSED

    @property
    def admitted(self) -> bool:
        return not self.refused and self.error is None

    @property
    def attempts(self) -> int:
        return len(self.refusals) + (0 if self.refused else 1)

    @property
    def gaps(self) -> list[float]:
        times = [t for t, _ in self.events]
        return [b - a for a, b in itertools.pairwise(times)]

    @property
    def worst_gap(self) -> float:
        return max(self.gaps, default=0.0)

    def row(self) -> dict[str, Any]:
        """The request in a few numbers (times in seconds after the arm's start)."""
        return {
            "index": self.index,
            "long": self.long,
            "prompt_tokens": self.prompt_tokens,
            "max_tokens": self.max_tokens,
            "sent": round(self.sent, 4),
            "status": self.status,
            "refusals": [[f.status, round(f.seconds, 4), f.retry_after] for f in self.refusals],
            "first": None if self.first is None else round(self.first, 4),
            "last": round(self.events[-1][0], 4) if self.events else None,
            "tokens": self.events[-1][1] if self.events else 0,
            "worst_gap": round(self.worst_gap, 4),
            "completed": self.completed,
            "error": self.error,
        }

    def tokens_by(self, until: float) -> int:
        """Completion tokens the client had received by ``until``."""
        got = 0
        for t, n in self.events:
            if t > until:
                break
            got = n
        return got


@dataclass
class Summary:
    """One arm at one load, from the client's side."""

    offered: int
    attempts: int
    admitted: int
    completed: int
    unfinished: int
    errors: int
    refused_429: int
    refused_503: int
    shed_share: float
    refusal_p50: float | None
    refusal_p99: float | None
    retry_after_all: bool | None
    delivered_tps: float
    slo_goodput_tps: float
    slo_met: int
    ttft_p50: float | None
    ttft_p50_at_least: bool
    ttft_p99: float | None
    ttft_p99_at_least: bool
    ttft_p99_long: float | None
    ttft_p99_long_at_least: bool
    worst_gap: float | None
    stalled: int
    tokens: int


def quantile_or_nan(value: float | None) -> float:
    return math.nan if value is None else value


def censored_quantile(values: Sequence[tuple[float, bool]], q: float) -> tuple[float | None, bool]:
    """Nearest-rank quantile of (value, is a lower bound) pairs: the value and whether the
    rank it lands on is a lower bound. A lower bound sorts by its value, which only ever
    under-states the quantile."""
    if not values:
        return None, False
    value, bound = sorted(values)[rank(len(values), q)]
    return value, bound


def meets_slo(record: Record, slo_ttft: float, slo_gap: float) -> bool:
    """Completed, first token within ``slo_ttft`` of sending, no gap between chunks over
    ``slo_gap``."""
    return (
        record.completed
        and record.first is not None
        and record.first - record.sent <= slo_ttft
        and record.worst_gap <= slo_gap
    )


def summarize(
    records: Sequence[Record],
    *,
    window: float,
    cutoff: float,
    slo_ttft: float,
    slo_gap: float,
    stall: float = 1.0,
) -> Summary:
    """The arm's figures. ``window``: the arrival window, over which tokens count toward the
    throughputs; ``cutoff``: when the bench stopped waiting (the TTFT lower bound of a request
    that had no token by then)."""
    admitted = [r for r in records if r.admitted]
    refusals = [f for r in records for f in r.refusals]
    shed = [f for f in refusals if f.status == 429]

    def ttft(r: Record) -> tuple[float, bool]:
        if r.first is not None:
            return r.first - r.sent, False
        return max(0.0, cutoff - r.sent), True

    ttfts = [ttft(r) for r in admitted]
    p50, p50_bound = censored_quantile(ttfts, 0.5)
    p99, p99_bound = censored_quantile(ttfts, 0.99)
    p99_long, p99_long_bound = censored_quantile([ttft(r) for r in admitted if r.long], 0.99)
    good = [r for r in admitted if meets_slo(r, slo_ttft, slo_gap)]
    streamed = [r for r in admitted if r.events]
    attempts = sum(r.attempts for r in records)
    delivered = sum(r.tokens_by(window) for r in records)
    return Summary(
        offered=len(records),
        attempts=attempts,
        admitted=len(admitted),
        completed=sum(1 for r in records if r.completed),
        unfinished=sum(1 for r in admitted if not r.completed),
        errors=sum(1 for r in records if r.error is not None),
        refused_429=len(shed),
        refused_503=sum(1 for f in refusals if f.status == 503),
        shed_share=len(refusals) / attempts if attempts else 0.0,
        refusal_p50=quantile([f.seconds for f in refusals], 0.5),
        refusal_p99=quantile([f.seconds for f in refusals], 0.99),
        retry_after_all=all(f.retry_after for f in shed) if shed else None,
        delivered_tps=delivered / window if window > 0 else 0.0,
        slo_goodput_tps=(sum(r.tokens_by(window) for r in good) / window if window > 0 else 0.0),
        slo_met=len(good),
        ttft_p50=p50,
        ttft_p50_at_least=p50_bound,
        ttft_p99=p99,
        ttft_p99_at_least=p99_bound,
        ttft_p99_long=p99_long,
        ttft_p99_long_at_least=p99_long_bound,
        worst_gap=max((r.worst_gap for r in streamed), default=None),
        stalled=sum(1 for r in streamed if r.worst_gap > stall),
        tokens=sum(r.events[-1][1] for r in streamed),
    )


@dataclass
class ArmResult:
    """One arm at one load level: the client's summary and what the engine and kvtax counted."""

    arm: str
    load: float
    rate: float
    loop: str
    summary: Summary
    preemptions: float
    tax: float | None
    tax_method: str
    prefix_cache_hits: float = 0.0
    rejections: dict[str, float] = field(default_factory=dict)
    note: str = ""
    # One compact row per request (Record.row), for a closer look than the summary.
    requests: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ArmResult:
        return cls(**(data | {"summary": Summary(**data["summary"])}))


# -- the targets ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    target: str
    verdict: str  # met, missed or n/a
    detail: str


def best_kvtax(arms: Sequence[ArmResult]) -> ArmResult | None:
    """The kvtax arm with the most SLO goodput (then the most delivered throughput)."""
    ours = [a for a in arms if a.arm.startswith(KVTAX_PREFIX)]
    return max(
        ours, key=lambda a: (a.summary.slo_goodput_tps, a.summary.delivered_tps), default=None
    )


def _ratio(value: float, reference: float) -> float:
    if reference > 0:
        return value / reference
    return math.inf if value > 0 else 1.0


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "missed")


def _percent(x: float) -> str:
    return "∞" if math.isinf(x) else f"{100 * x:.0f} %"


def against_targets(
    arms: Sequence[ArmResult],
    *,
    tax_limit: float = 0.01,
    refusal_limit: float = 0.05,
    stall_limit: float = 1.0,
) -> tuple[ArmResult | None, list[Check]]:
    """The best kvtax arm at one load against issue 25's targets, from the arms' numbers."""
    best = best_kvtax(arms)
    if best is None:
        return None, []
    by_name = {a.arm: a for a in arms}
    s = best.summary
    checks: list[Check] = []

    if best.tax is None:
        checks.append(Check(f"tax <= {100 * tax_limit:g} %", "n/a", "no tax counters"))
    else:
        checks.append(
            Check(
                f"tax <= {100 * tax_limit:g} %",
                _verdict(best.tax <= tax_limit),
                f"{100 * best.tax:.2f} % ({best.tax_method}), {best.preemptions:.0f} preemptions",
            )
        )

    base = by_name.get("no-gate")
    if base is None:
        checks.append(Check("delivered >= 100 % of no-gate", "n/a", "no no-gate arm"))
    else:
        r = _ratio(s.delivered_tps, base.summary.delivered_tps)
        checks.append(
            Check(
                "delivered >= 100 % of no-gate",
                _verdict(r >= 1.0),
                f"{_percent(r)} ({s.delivered_tps:.0f} vs {base.summary.delivered_tps:.0f} tok/s)",
            )
        )

    statics = [by_name[n] for n in STATIC_ARMS if n in by_name]
    if not statics:
        checks.append(Check("delivered >= 95 % of the best static arm", "n/a", "no vLLM cap arm"))
    else:
        top = max(statics, key=lambda a: a.summary.delivered_tps)
        r = _ratio(s.delivered_tps, top.summary.delivered_tps)
        checks.append(
            Check(
                "delivered >= 95 % of the best static arm",
                _verdict(r >= 0.95),
                f"{_percent(r)} of {top.arm} ({top.summary.delivered_tps:.0f} tok/s)",
            )
        )

    if base is None:
        checks.append(Check("SLO goodput >= 1.5x no-gate", "n/a", "no no-gate arm"))
    else:
        ref = base.summary.slo_goodput_tps
        r = _ratio(s.slo_goodput_tps, ref)
        shown = "∞" if math.isinf(r) else f"{r:.2f}x"
        checks.append(
            Check(
                "SLO goodput >= 1.5x no-gate",
                _verdict(r >= 1.5),
                f"{shown} ({s.slo_goodput_tps:.0f} vs {ref:.0f} tok/s)",
            )
        )

    peers = [by_name[n] for n in PEER_ARMS if n in by_name]
    if not peers:
        checks.append(Check("SLO goodput >= each vLLM cap and GIE", "n/a", "no peer arm"))
    else:
        behind = [p for p in peers if s.slo_goodput_tps < p.summary.slo_goodput_tps]
        detail = ", ".join(f"{p.arm} {p.summary.slo_goodput_tps:.0f}" for p in peers)
        checks.append(
            Check(
                "SLO goodput >= each vLLM cap and GIE",
                _verdict(not behind),
                f"{s.slo_goodput_tps:.0f} tok/s against {detail}",
            )
        )

    if s.refused_429 == 0:
        checks.append(
            Check(f"429 p99 <= {refusal_limit * 1e3:.0f} ms with Retry-After", "n/a", "no 429")
        )
    else:
        p99 = quantile_or_nan(s.refusal_p99)
        ok = p99 <= refusal_limit and bool(s.retry_after_all)
        checks.append(
            Check(
                f"429 p99 <= {refusal_limit * 1e3:.0f} ms with Retry-After",
                _verdict(ok),
                f"p99 {p99 * 1e3:.0f} ms over {s.refused_429} 429s and {s.refused_503} 503s; "
                f"Retry-After on {'every' if s.retry_after_all else 'not every'} 429",
            )
        )

    if s.worst_gap is None:
        checks.append(Check(f"no admitted stall > {stall_limit:g} s", "n/a", "no stream"))
    else:
        checks.append(
            Check(
                f"no admitted stall > {stall_limit:g} s",
                _verdict(s.worst_gap <= stall_limit),
                f"worst gap {s.worst_gap:.2f} s, {s.stalled} requests over {stall_limit:g} s",
            )
        )
    return best, checks


# -- markdown --------------------------------------------------------------------------------


def _s(value: float | None, at_least: bool = False, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    return ("≥" if at_least else "") + f"{value:.{digits}f}"


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 1e3:.0f}"


def _tax(a: ArmResult) -> str:
    return "n/a" if a.tax is None else f"{100 * a.tax:.2f} %"


def _retry(s: Summary) -> str:
    return "n/a" if s.retry_after_all is None else ("yes" if s.retry_after_all else "**no**")


def _reasons(a: ArmResult) -> str:
    shown = [f"{k} {v:.0f}" for k, v in sorted(a.rejections.items()) if v]
    return ", ".join(shown) or "-"


ARM_COLUMNS = (
    "arm",
    "preemptions",
    "tax",
    "delivered tok/s",
    "SLO goodput tok/s",
    "TTFT p50 / p99 s",
    "TTFT p99 long s",
    "worst gap s",
    "gaps > 1 s",
    "admitted / completed / unfinished",
    "shed",
    "429 / 503",
    "to refusal p50 / p99 ms",
    "Retry-After on every 429",
    "kvtax gate rejections",
)


def arm_cells(a: ArmResult) -> list[str]:
    """One arm's row of :func:`arm_table`, a cell for each of ``ARM_COLUMNS``."""
    s = a.summary
    return [
        a.arm,
        f"{a.preemptions:.0f}",
        _tax(a),
        f"{s.delivered_tps:.1f}",
        f"{s.slo_goodput_tps:.1f}",
        f"{_s(s.ttft_p50, s.ttft_p50_at_least)} / {_s(s.ttft_p99, s.ttft_p99_at_least)}",
        _s(s.ttft_p99_long, s.ttft_p99_long_at_least),
        _s(s.worst_gap),
        str(s.stalled),
        f"{s.admitted} / {s.completed} / {s.unfinished}",
        f"{100 * s.shed_share:.0f} %",
        f"{s.refused_429} / {s.refused_503}",
        f"{_ms(s.refusal_p50)} / {_ms(s.refusal_p99)}",
        _retry(s),
        _reasons(a),
    ]


def arm_table(arms: Sequence[ArmResult]) -> str:
    return record.table(ARM_COLUMNS, [arm_cells(a) for a in arms])


def _by_length_cells(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Offered, the share refused, and TTFT p50 / p99 (of those that had a first token) of
    one kind of request, from the JSON's per-request rows."""
    if not rows:
        return ["0", "—", "—"]
    refused = sum(1 for r in rows if r["first"] is None and r["refusals"])
    ttfts = [r["first"] - r["sent"] for r in rows if r["first"] is not None]
    return [
        str(len(rows)),
        f"{100 * refused / len(rows):.0f} %",
        f"{_s(quantile(ttfts, 0.5))} / {_s(quantile(ttfts, 0.99))}",
    ]


def by_length_table(arms: Sequence[ArmResult]) -> str | None:
    """Long and short requests apart, per arm: does an order starve the long ones (refused
    more, or served later)? None when the arms' requests are all of one kind."""
    kinds = {r["long"] for a in arms for r in a.requests}
    if len(kinds) < 2:
        return None
    header = ["arm", "long: offered", "long: refused", "long: TTFT p50 / p99 s"]
    header += ["short: offered", "short: refused", "short: TTFT p50 / p99 s"]
    rows = []
    for a in arms:
        rows.append([a.arm])
        for long in (True, False):
            rows[-1] += _by_length_cells([r for r in a.requests if r["long"] is long])
    return record.table(header, rows)


def targets_table(best: ArmResult | None, checks: Sequence[Check]) -> str:
    if best is None:
        return "No kvtax arm ran at this load."
    rows = [[c.target, f"**{c.verdict}**", c.detail] for c in checks]
    table = record.table(["target", "verdict", "numbers"], rows)
    return f"Best kvtax mode here: **{best.arm}** (most SLO goodput).\n\n{table}"


def loads_of(arms: Sequence[ArmResult]) -> list[float]:
    return sorted({a.load for a in arms})
