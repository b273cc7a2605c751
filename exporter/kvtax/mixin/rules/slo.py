"""The objective on delivered work: its SLI as recording rules, and the burn-rate alerts.

kvtax's proxy knows, for every request it relays, whether the client got its first token within
``kvtax serve --slo.ttft`` and every later one within ``--slo.itl`` of the last: it counts those
requests in ``kvtax_slo_met_requests_total`` and their tokens in ``kvtax_slo_met_tokens_total``.
The objective (:class:`~kvtax.mixin.rules.config.RulesConfig`'s ``slo_*`` settings) asks that a
share of requests, or of delivered tokens, meet both over a period (28 days by default). What
missed it spends the error budget, ``1 - objective``.

The SLI is the share that *missed*, per model across its pods (the service's objective, not one
pod's), recorded over each of ``slo_windows`` and over the period, for both units; and the
budget left over the period. The alerts read the unit the config names. Windows longer than the
first are built from the first window's rates with ``sum_over_time``, a ratio of sums: a 3-day
``rate()`` over every pod's raw counters would read millions of samples per evaluation at fleet
size (and trip Prometheus' ``--query.max-samples``), while this reads one recorded series per
model. Each long window therefore looks back by one short window more than its name says.

The alerts are the SRE workbook's multiwindow, multi-burn-rate ones: a burn rate is the missed
share over the budget (1x spends the budget in exactly the period); each alert needs its burn
over a long window *and* a short one, so it starts when enough budget is gone to matter and
stops soon after the burn does. Pure: no I/O.

    >>> from kvtax.mixin.rules.config import DEFAULT
    >>> [r.record for r in recording_rules(DEFAULT)][-1]
    'model_name:kvtax_slo_error_budget_tokens:remaining28d'
    >>> [(a.severity, a.labels["long_window"]) for a in burn_alerts(DEFAULT)]
    [('critical', '1h'), ('critical', '6h'), ('warning', '3d')]
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtax.mixin.rules.config import FLEET, POD, RulesConfig, duration_ms

__all__ = [
    "ALERT",
    "UNITS",
    "BurnAlert",
    "SloRecord",
    "base_counters",
    "budget",
    "budget_record",
    "budget_share",
    "burn_alerts",
    "burn_of",
    "counted_requests",
    "missed_record",
    "recording_rules",
]

ALERT = "KvtaxErrorBudgetBurn"
UNITS = ("requests", "tokens")


@dataclass(frozen=True, slots=True)
class SloRecord:
    """One recording rule of the objective (the same shape as the other records)."""

    record: str
    expr: str
    help: str


@dataclass(frozen=True, slots=True)
class BurnAlert:
    """One burn-rate alert: its severity, windows, factor, for: and the labels it adds."""

    severity: str
    long: str
    short: str
    burn: float
    for_: str
    expr: str

    @property
    def labels(self) -> dict[str, str]:
        return {"long_window": self.long, "short_window": self.short}


def counted_requests(config: RulesConfig) -> str:
    """The selector of the requests the objective counts: every outcome but the excluded."""
    excluded = "|".join(config.slo_excluded_outcomes)
    matcher = f'outcome!~"{excluded}"' if excluded else ""
    return config.selector("kvtax_requests_total", config.kvtax_selector, matcher)


def base_counters(config: RulesConfig, unit: str) -> tuple[tuple[str, str], tuple[str, str]]:
    """(metric, selector) of the unit's good counter and of what it counts, as the per-pod rate
    records name them: met and counted requests, or SLO-met and delivered tokens."""
    k = config.kvtax_selector
    if unit == "requests":
        return (
            ("kvtax_slo_met_requests", config.selector("kvtax_slo_met_requests_total", k)),
            ("kvtax_slo_requests", counted_requests(config)),
        )
    # Delivered tokens count as the stream runs and SLO-met tokens when it ends, so over a
    # window shorter than a stream the two drift apart by the streams open at its edges; they
    # agree over the longer windows that page.
    return (
        ("kvtax_slo_met_tokens", config.selector("kvtax_slo_met_tokens_total", k)),
        ("kvtax_delivered_tokens", config.selector("kvtax_delivered_tokens_total", k)),
    )


# Record names do not change with the cluster label, as the other records' do not.
POD_LEVEL = "_".join(POD)
FLEET_LEVEL = "_".join(FLEET)


def missed_record(unit: str, window: str) -> str:
    """The record of the share of ``unit`` that missed the objective over ``window``."""
    return f"{FLEET_LEVEL}:kvtax_slo_missed_{unit}:ratio_rate{window}"


def budget_record(config: RulesConfig, unit: str) -> str:
    """The record of the error budget left over the period: 1 untouched, 0 spent, below 0
    overspent."""
    return f"{FLEET_LEVEL}:kvtax_slo_error_budget_{unit}:remaining{config.slo_period}"


def budget(config: RulesConfig) -> str:
    """The error budget, 1 - the objective, as PromQL reads it.

    >>> from kvtax.mixin.rules.config import DEFAULT
    >>> budget(DEFAULT)  # not 0.010000000000000009, the float 1 - 0.99 is
    '0.01'
    """
    return f"{1 - config.slo_objective:.12g}"


def burn_of(config: RulesConfig, unit: str, window: str) -> str:
    """PromQL for the burn rate over ``window``: the missed share over the budget."""
    return f"{missed_record(unit, window)} / {budget(config)}"


def recording_rules(
    config: RulesConfig, have: frozenset[str] = frozenset()
) -> tuple[SloRecord, ...]:
    """The objective's records in evaluation order; ``have`` names records already made (the
    per-pod and fleet rates of the rules' own window), which are not made twice."""
    base = config.slo_windows[0]
    pod, model = ", ".join(config.pod_labels), ", ".join(config.fleet_labels)
    rules: list[SloRecord] = []
    made = set(have)

    def add(record: str, expr: str, help_text: str) -> None:
        if record not in made:
            rules.append(SloRecord(record, expr, help_text))
            made.add(record)

    for unit in UNITS:
        for metric, selector in base_counters(config, unit):
            per_pod = f"{POD_LEVEL}:{metric}:rate{base}"
            add(
                per_pod,
                f"sum by ({pod}) (rate({selector}[{base}]))",
                f"The objective's {unit}: {metric} per second, per pod.",
            )
            add(
                f"{FLEET_LEVEL}:{metric}:rate{base}",
                f"sum by ({model}) ({per_pod})",
                f"Fleet-wide sum of {per_pod}.",
            )
    for unit in UNITS:
        (good, _), (counted, _) = base_counters(config, unit)
        good_rate = f"{FLEET_LEVEL}:{good}:rate{base}"
        counted_rate = f"{FLEET_LEVEL}:{counted}:rate{base}"
        for window in (*config.slo_windows, config.slo_period):
            if window == base:
                ratio = f"{good_rate} / {counted_rate}"
            else:
                ratio = (
                    f"sum_over_time({good_rate}[{window}]) / "
                    f"sum_over_time({counted_rate}[{window}])"
                )
            # Never below 0: tokens counted at a stream's end can outrun those counted as it ran.
            add(
                missed_record(unit, window),
                f"clamp_min(1 - {ratio}, 0)",
                f"The share of {unit} that missed the objective over {window}, 0-1.",
            )
        add(
            budget_record(config, unit),
            f"1 - {missed_record(unit, config.slo_period)} / {budget(config)}",
            f"The error budget of the {unit} objective left over {config.slo_period}.",
        )
    return tuple(rules)


def burn_alerts(config: RulesConfig) -> tuple[BurnAlert, ...]:
    """The two pages and the ticket, on the unit the config names."""
    unit = config.slo_unit
    model = ", ".join(config.fleet_labels)
    alerts = []
    for severity, burn, (long, short), for_ in (
        ("critical", config.slo_fast_burn, config.slo_fast_windows, config.slo_fast_for),
        ("critical", config.slo_slow_burn, config.slo_slow_windows, config.slo_slow_for),
        ("warning", config.slo_ticket_burn, config.slo_ticket_windows, config.slo_ticket_for),
    ):
        expr = (
            f"{burn_of(config, unit, long)} > {burn:g}"
            f" and on ({model}) {burn_of(config, unit, short)} > {burn:g}"
        )
        alerts.append(BurnAlert(severity, long, short, burn, for_, expr))
    return tuple(alerts)


def budget_share(config: RulesConfig, burn: float, window: str) -> float:
    """The share of the period's budget a burn of ``burn`` spends over ``window``.

    >>> from kvtax.mixin.rules.config import DEFAULT
    >>> round(budget_share(DEFAULT, 14.4, "1h"), 4)
    0.0214
    """
    return burn * duration_ms(window) / duration_ms(config.slo_period)
