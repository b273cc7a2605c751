"""The Overview's headline of the objective on delivered work: attainment, burn, budget left.

Three stats lead the first row: the share that met the objective over its period, the burn rate
over the pages' long windows, and the error budget left (:mod:`kvtax.mixin.rules.slo`). Their
queries read the objective's per-model records and are made from the RulesConfig the dashboard
is rendered with, so a file with another unit, period or objective moves them with the alerts.
Pure: no I/O.
"""

from __future__ import annotations

from kvtax.mixin.dashboards.model import Panel, Target, Threshold
from kvtax.mixin.dashboards.queries import objective_record
from kvtax.mixin.rules.config import RulesConfig
from kvtax.mixin.rules.slo import budget, budget_record, missed_record

__all__ = ["ATTAINMENT", "BUDGET_LEFT", "BURN_RATE"]

BURN = "suffix:x"


def _attainment(rules: RulesConfig) -> str:
    missed = objective_record(rules, missed_record(rules.slo_unit, rules.slo_period))
    return f"1 - {missed}"


def _burn(page: str) -> Target:
    """The burn over the long window of one page (``fast`` or ``slow``)."""

    def long(rules: RulesConfig) -> str:
        windows: tuple[str, ...] = getattr(rules, f"slo_{page}_windows")
        return windows[0]

    def expr(rules: RulesConfig) -> str:
        missed = objective_record(rules, missed_record(rules.slo_unit, long(rules)))
        return f"{missed} / {budget(rules)}"

    return Target(expr, lambda rules: f"{long(rules)} {{{{model_name}}}}")


ATTAINMENT = Panel(
    "SLO attainment",
    "stat",
    (Target(_attainment, "{{model_name}}"),),
    "percentunit",
    "The share of the model's requests (or delivered tokens, with slo_unit: tokens) over the "
    "objective's period (28 days by default) whose first token came within kvtax serve's "
    "--slo.ttft and with no gap above --slo.itl, across all its pods. Green at or above the "
    "objective (slo_objective, 99 % by default), red below it. A request that failed, was "
    "refused or whose client left counts as missed; the client's own errors (4xx, 413) do not "
    "count. Prometheus must keep the whole period for this to span it.",
    "KvtaxErrorBudgetBurn",
    width=4,
    height=5,
    base_color="red",
    thresholds=(Threshold(0.99, "green", "slo_objective"),),
)

BURN_RATE = Panel(
    "Burn rate",
    "stat",
    (_burn("fast"), _burn("slow")),
    BURN,
    "How fast the error budget is going, over the long windows of the two pages (1h and 6h by "
    "default): the missed share over the budget. 1x spends the budget in exactly the period; "
    "above it (orange) the budget runs out early; from the slow page's factor (red, 6x) a page "
    "is near: it fires when the short window agrees (30m for the 6h burn; the fast page needs "
    "14.4x over 1h and 5m).",
    "KvtaxErrorBudgetBurn",
    width=4,
    height=5,
    thresholds=(
        Threshold(1.0, "orange", "slo_ticket_burn"),
        Threshold(6.0, "red", "slo_slow_burn"),
    ),
)


def _budget_left(rules: RulesConfig) -> str:
    return objective_record(rules, budget_record(rules, rules.slo_unit))


BUDGET_LEFT = Panel(
    "Error budget left",
    "stat",
    (Target(_budget_left, "{{model_name}}"),),
    "percentunit",
    "The share of the period's error budget not yet spent: 100 % untouched, 0 spent, below 0 "
    "overspent (the objective is missed over the period). Orange below a quarter left, red "
    "once spent.",
    "KvtaxErrorBudgetBurn",
    width=4,
    height=5,
    base_color="red",
    thresholds=(Threshold(0.0, "orange"), Threshold(0.25, "green")),
)
