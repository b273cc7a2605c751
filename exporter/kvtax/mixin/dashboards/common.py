"""What the three dashboards share: label sets, units, thresholds and common selectors.

Thresholds come from the rules' config object, so a dashboard line and the alert it mirrors
cannot disagree; the thrash-state colours come from :class:`kvtax.figures.derive.ThrashState`. Pure:
no I/O.
"""

from __future__ import annotations

from kvtax.figures.derive import ThrashState
from kvtax.mixin.dashboards.model import Threshold, ValueText
from kvtax.mixin.dashboards.queries import by, kvtax, rate
from kvtax.mixin.rules.config import DEFAULT as RULES

__all__ = [
    "KV_THRESHOLDS",
    "MODEL",
    "PER_S",
    "POD",
    "SEQS",
    "TAX_DEFINITION",
    "TAX_THRESHOLDS",
    "THRASH_MAPPINGS",
    "THRASH_THRESHOLDS",
    "TOKENS",
    "TOK_S",
    "capacity_tokens",
    "gen_rate",
    "goodput",
    "kv_usage_ratio",
    "length_p50",
    "length_p95",
    "recommended",
    "running",
    "sum_rate",
    "sum_rate_regex",
    "tax_of",
    "waiting",
]

POD = "namespace, pod, model_name"
MODEL = "model_name"

# Units: Grafana ids where one fits, "suffix:" custom units for kvtax's own quantities.
TOK_S = "suffix:tok/s"
TOKENS = "suffix:tok"
SEQS = "suffix:seqs"
PER_S = "suffix:/s"

THRASH_MAPPINGS = (
    ValueText(ThrashState.OK, "ok", "green"),
    ValueText(ThrashState.AT_RISK, "at risk", "orange"),
    ValueText(ThrashState.THRASHING, "thrashing", "red"),
)
THRASH_THRESHOLDS = (
    Threshold(ThrashState.AT_RISK, "orange"),
    Threshold(ThrashState.THRASHING, "red"),
)
# Every tax panel links the one definition (docs/tax.md) instead of restating it.
TAX_DEFINITION = f"[The tax's definition]({RULES.docs_url('tax.md', 'the-one-definition')})."
# Each names its RulesConfig field, so `kvtax dashboards generate --config` moves the line too.
TAX_THRESHOLDS = (
    Threshold(RULES.tax_warning, "orange", "tax_warning"),
    Threshold(RULES.tax_critical, "red", "tax_critical"),
)
KV_THRESHOLDS = (
    Threshold(RULES.kv_near_full_usage, "orange", "kv_near_full_usage"),
    Threshold(RULES.thrash_usage, "red", "thrash_usage"),
)


def sum_rate(metric: str, labels: str = MODEL, where: tuple[tuple[str, str], ...] = ()) -> str:
    return by(labels, "sum", rate(kvtax(metric, where=where)))


def sum_rate_regex(metric: str, regex: tuple[tuple[str, str], ...], labels: str = MODEL) -> str:
    """``sum_rate`` of the series whose labels match the regular expressions of ``regex``."""
    return by(labels, "sum", rate(kvtax(metric, regex=regex)))


def gen_rate(labels: str = MODEL) -> str:
    return sum_rate("kvtax_engine_generation_tokens_total", labels)


def goodput(labels: str = MODEL) -> str:
    return sum_rate("kvtax_delivered_tokens_total", labels)


def tax_of(recomputed_counter: str, labels: str = MODEL) -> str:
    """R / (Pc + G + R) over the panel's rate interval, R from one recompute counter."""
    r = sum_rate(recomputed_counter, labels)
    pc = sum_rate("kvtax_engine_prompt_computed_tokens_total", labels)
    return f"{r} / ({pc} + {gen_rate(labels)} + {r})"


# Selectors of kvtax's sizing gauges, shared by Capacity and Fleet.
capacity_tokens = kvtax("kvtax_kv_capacity_tokens")
kv_usage_ratio = kvtax("kvtax_kv_cache_usage_ratio")
length_p50 = kvtax("kvtax_request_length_p50_tokens")
length_p95 = kvtax("kvtax_request_length_p95_tokens")
running = kvtax("kvtax_requests_running")
waiting = kvtax("kvtax_requests_waiting")
recommended = kvtax("kvtax_recommended_max_num_seqs")
