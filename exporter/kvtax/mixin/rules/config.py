"""The one config object the rule generator reads: selectors, windows, thresholds and severities.

Users change this object, never the generated YAML. The defaults follow the monitoring-mixin
conventions (``for: 15m`` unless a comment gives a reason); :func:`short_profile` (and
:data:`TEST_PROFILE`) shrinks every window and ``for:`` so an end-to-end test can watch the
alerts fire in seconds. Pure: no I/O.

Example:

    >>> cfg = replace(DEFAULT, tax_warning=0.1, vllm_selector='job="vllm"')
    >>> cfg.selector("kvtax_vllm_up", cfg.kvtax_selector)
    'kvtax_vllm_up'
    >>> cfg.selector("vllm:num_requests_waiting", cfg.vllm_selector)
    'vllm:num_requests_waiting{job="vllm"}'
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any

__all__ = [
    "CHOICES",
    "DEFAULT",
    "FLEET",
    "MAX_DURATION",
    "MAX_DURATION_MS",
    "OPEN_SHARES",
    "POD",
    "POSITIVE",
    "SHARES",
    "TEST_PROFILE",
    "RulesConfig",
    "duration_ms",
    "format_duration",
    "short_profile",
    "threshold_problem",
]

# Aggregation levels. Per pod keeps namespace and pod, which Prometheus attaches through a
# PodMonitor; in a plain static scrape they are absent and ``by (namespace, pod, model_name)``
# simply degrades to per model, so the same rules work in both places.
POD: tuple[str, ...] = ("namespace", "pod", "model_name")
FLEET: tuple[str, ...] = ("model_name",)


@dataclass(frozen=True, slots=True)
class RulesConfig:
    """Everything the generated rules depend on. Durations are Prometheus durations."""

    # -- selectors: extra label matchers, without braces ------------------------------------
    # kvtax's own series have unique names, so no selector is needed; set e.g. 'job="kvtax"'
    # when several kvtax deployments share one Prometheus and need telling apart.
    kvtax_selector: str = ""
    # The production-stack router re-exports vllm: names without model_name: requiring the
    # label keeps those copies out of every sum.
    vllm_selector: str = 'model_name!=""'
    # Picks kvtax's scrape targets for the sidecar-down alert (``up`` has no other clue). The
    # PodMonitor in deploy/ scrapes vLLM and kvtax under one job, so the default keys on the
    # container label the Prometheus Operator attaches; with static scrape configs use the
    # job instead, e.g. 'job="kvtax"'.
    kvtax_job_selector: str = 'container="kvtax"'
    # The label that names the cluster under Thanos, Mimir or any global view (often
    # "cluster"); empty for a single Prometheus. When set it leads every aggregation's
    # by (...) and on (...), so pods of the same namespace/name in two clusters never merge.
    # Record names stay the same (as the kubernetes mixin does), so queries need not change.
    cluster_label: str = ""
    # kube-prometheus-stack only loads PrometheusRule objects labelled release: <its release>.
    release_label: str = "kube-prometheus-stack"

    # -- windows -------------------------------------------------------------------------------
    # Range of every rate() in recording rules and alerts. 5m holds enough scrapes at 30s.
    rate_window: str = "5m"
    # The queue alert fits a slope over this range: long enough to ignore one burst.
    queue_window: str = "15m"

    # -- runbooks ------------------------------------------------------------------------------
    runbook_url_base: str = "https://github.com/kvtax/kvtax/blob/main/docs/runbooks.md"

    # -- thresholds and for: durations, alert by alert -----------------------------------------
    # Preemption: any preemption in every window for 10m, the alert users already know.
    # Shorter than 15m because a preempting engine is already degrading latency.
    preemption_for: str = "10m"
    kv_near_full_usage: float = 0.85
    kv_near_full_for: str = "15m"
    # The tax is the share of engine token work that was recompute. vLLM's RFC measured
    # 10-23 % under pressure: 5 % is early warning, 20 % pages.
    tax_warning: float = 0.05
    tax_critical: float = 0.20
    tax_for: str = "15m"
    # Delivery yield: delivered / generated. Below 0.9 clients leave before their answer.
    yield_warning: float = 0.9
    yield_critical: float = 0.5
    yield_for: str = "15m"
    # The yield is only meaningful when the proxy sees all traffic.
    join_coverage_min: float = 0.99
    join_coverage_for: str = "30m"
    # Thrashing: cache above this usage while preempting with a queue. 5m: at this point
    # throughput is collapsing, so waiting longer only adds to the damage.
    thrash_usage: float = 0.9
    thrash_for: str = "5m"
    queue_for: str = "15m"
    # Over-admission: configured max_num_seqs / recommended. 1.5 leaves room for estimates.
    over_admission_ratio: float = 1.5
    over_admission_for: str = "30m"
    # TTFT SLO, the same value as kvtax serve --slo.ttft; quantile of the threshold alert.
    slo_ttft_seconds: float = 2.0
    slo_ttft_quantile: float = 0.99
    slo_for: str = "15m"

    # -- the objective on delivered work (docs/rules.md, "An objective on delivered work") ---
    # What pages when clients wait: "burn_rate" pages on the error budget (KvtaxErrorBudgetBurn,
    # two windows at once), "threshold" on a p99 TTFT above slo_ttft_seconds for slo_for
    # (KvtaxTtftSloBreach), for users who have set no objective. The SLI records exist either
    # way, so the dashboards show attainment and budget in both.
    slo_alerting: str = "burn_rate"
    # What the objective counts: "requests" (each request once) or "tokens" (delivered tokens,
    # so a long answer weighs more than a short one).
    slo_unit: str = "requests"
    # The share of requests (or delivered tokens) that must meet kvtax serve's --slo.ttft and
    # --slo.itl (first token in time, and no gap between tokens above the ITL objective) over
    # slo_period. 0.99 leaves a budget of 1 % to spend.
    slo_objective: float = 0.99
    # The gap objective, the same value as kvtax serve --slo.itl; only named in alert texts.
    slo_itl_seconds: float = 0.2
    # The budget's period: four whole weeks weigh every weekday alike (30d is the other
    # usual choice). Prometheus must keep this much history (--storage.tsdb.retention.time,
    # 15d by default) for the budget to span it; with less it spans what is kept.
    slo_period: str = "28d"
    # The windows the SLI is recorded over (the SRE workbook's), shortest first. The alerts'
    # window pairs below must be among them; 2h and 1d are there for dashboards and queries.
    slo_windows: tuple[str, ...] = ("5m", "30m", "1h", "2h", "6h", "1d", "3d")
    # Multiwindow burn-rate alerts: each fires while the budget burns faster than its factor
    # over both its long and its short window (long first). The long window proves the burn
    # is big enough to matter, the short one that it is still going on, so the page stops
    # soon after the burn does. At 14.4x a 30-day budget loses 2 % an hour: that pages; 6x
    # over 6h (5 % of it) pages too; 1x over 3d (10 %) opens a ticket. A blip of a few
    # minutes moves the 1h window too little to page.
    slo_fast_burn: float = 14.4
    slo_fast_windows: tuple[str, ...] = ("1h", "5m")
    slo_slow_burn: float = 6.0
    slo_slow_windows: tuple[str, ...] = ("6h", "30m")
    slo_ticket_burn: float = 1.0
    slo_ticket_windows: tuple[str, ...] = ("3d", "6h")
    # for: of each. Shorter than 15m for the pages because both windows already have to agree:
    # for: only rides over one odd evaluation, and at 14.4x every 15 minutes cost 0.5 % of
    # the budget. The ticket waits longer: it is not urgent, and its 6h window is slow to move.
    slo_fast_for: str = "2m"
    slo_slow_for: str = "15m"
    slo_ticket_for: str = "1h"
    # Request outcomes (kvtax_requests_total) the request objective leaves out: the client's
    # own errors, a bad request (vLLM's 4xx) and a body over kvtax's limit (413). Every other
    # outcome counts, and only a completed request can meet the objective: an error, a
    # shutdown cut, the gate's 429 and a client that left all spend budget. Add
    # "client_disconnected" when clients routinely cancel streams (a chat UI's stop button).
    slo_excluded_outcomes: tuple[str, ...] = ("upstream_4xx", "too_large")
    # Stream stalls per request through the proxy.
    stalls_per_request: float = 0.1
    stalls_for: str = "15m"
    # Requests vLLM rejects at admission per second (vLLM 0.32+ counts them).
    # Any sustained shedding means capacity is short, so the default threshold is 0.
    shed_per_second: float = 0.0
    shed_for: str = "15m"
    # The proxy's gate (docs/gate.md): share of requests it sheds (429) over the rate window.
    gate_shed_ratio: float = 0.05
    gate_shed_for: str = "10m"
    # Scrape health: shorter than 15m because every other alert is blind meanwhile.
    vllm_scrape_for: str = "5m"
    vllm_absent_for: str = "15m"
    sidecar_down_for: str = "5m"
    # Proxy workers (--proxy.workers) started again after one ended on its own: each was a
    # crash or a stuck loop, and its clients' streams broke. Any in the window alerts.
    worker_restart_window: str = "15m"
    worker_restart_for: str = "1m"

    # -- severities ----------------------------------------------------------------------------
    # Alert name -> severity for the single-severity alerts; pairs carry both severities.
    severity_overrides: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def pod_labels(self) -> tuple[str, ...]:
        """The per-pod aggregation labels, the cluster label first when one is set."""
        return self._with_cluster(POD)

    @property
    def fleet_labels(self) -> tuple[str, ...]:
        """The fleet-wide per-model aggregation labels, the cluster label first when set."""
        return self._with_cluster(FLEET)

    @property
    def target_labels(self) -> tuple[str, ...]:
        """Labels that name one scrape target's pod: namespace and pod, plus the cluster."""
        return self._with_cluster(("namespace", "pod"))

    def _with_cluster(self, labels: tuple[str, ...]) -> tuple[str, ...]:
        return (self.cluster_label, *labels) if self.cluster_label else labels

    def selector(self, metric: str, *matchers: str) -> str:
        """``metric{a,b}`` from non-empty matcher strings, or the bare name."""
        inner = ",".join(m for m in matchers if m)
        return f"{metric}{{{inner}}}" if inner else metric

    def name_selector(self, names: tuple[str, ...], *matchers: str) -> str:
        """A selector matching any of ``names`` (a concept's versions), plus ``matchers``."""
        if len(names) == 1:
            return self.selector(names[0], *matchers)
        pattern = "|".join(names)
        inner = ",".join([f'__name__=~"{pattern}"', *(m for m in matchers if m)])
        return f"{{{inner}}}"

    def runbook_url(self, alert: str) -> str:
        """Runbook section of ``alert``: GitHub anchors are the heading in lower case."""
        return f"{self.runbook_url_base}#{alert.lower()}"

    def docs_url(self, page: str, anchor: str) -> str:
        """A section of another page in the runbooks' folder, e.g. the tax's one definition."""
        return f"{self.runbook_url_base.rpartition('/')[0]}/{page}#{anchor}"


# Prometheus's own duration grammar (prometheus/common model.ParseDuration): each unit at most
# once, largest first; "0" alone is allowed.
_DURATION = re.compile(
    r"^(?:([0-9]+)y)?(?:([0-9]+)w)?(?:([0-9]+)d)?(?:([0-9]+)h)?"
    r"(?:([0-9]+)m)?(?:([0-9]+)s)?(?:([0-9]+)ms)?$"
)
_UNITS = ("y", "w", "d", "h", "m", "s", "ms")
_UNIT_MS = (365 * 86_400_000, 7 * 86_400_000, 86_400_000, 3_600_000, 60_000, 1000, 1)
# Prometheus holds a duration as Go's time.Duration, int64 nanoseconds, and refuses a longer
# one ("duration out of range"): the longest it parses is 106751d23h47m16s854ms, about 292
# years (checked with promtool 2.42).
MAX_DURATION_MS = (2**63 - 1) // 1_000_000
MAX_DURATION = "106751d23h47m16s854ms"


def duration_ms(text: str) -> int:
    """Milliseconds of a Prometheus duration; ValueError if Prometheus would refuse it.

    >>> duration_ms("1h30m")
    5400000
    """
    if text == "0":  # the one duration without a unit
        return 0
    match = _DURATION.fullmatch(text)
    if not text or match is None:
        raise ValueError(
            f"expected a Prometheus duration such as 30s, 5m or 1h30m (units y, w, d, h, m, s, "
            f"ms, each once and largest first), not {text!r}"
        )
    groups = match.groups()
    # More than 19 digits is out of range in any unit (and int() refuses thousands of them).
    too_long = any(n is not None and len(n.lstrip("0")) > 19 for n in groups)
    total = 0 if too_long else sum(int(n) * u for n, u in zip(groups, _UNIT_MS, strict=True) if n)
    if too_long or total > MAX_DURATION_MS:
        shown = text if len(text) <= 40 else text[:37] + "..."
        raise ValueError(
            f"{shown} is longer than Prometheus can hold: at most {MAX_DURATION} (about 292 "
            "years; Prometheus keeps durations as int64 nanoseconds)"
        )
    return total


def format_duration(ms: int) -> str:
    """The Prometheus duration of ``ms`` milliseconds, in days and smaller units (no y or w,
    so that 28d stays 28d).

    >>> format_duration(5_400_000), format_duration(2_419_200_000), format_duration(0)
    ('1h30m', '28d', '0')
    """
    if ms <= 0:
        return "0"
    parts = []
    for unit, size in zip(_UNITS[2:], _UNIT_MS[2:], strict=True):
        count, ms = divmod(ms, size)
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts)


DEFAULT = RulesConfig()

# The range of every number above. Shares lie from 0 to 1: a KV usage, a tax, a yield, a
# coverage, a shed ratio, a quantile. The SLO and the over-admission ratio must be above 0 (an
# alert at 0 would fire on every sample); any other threshold must not be negative.
SHARES: frozenset[str] = frozenset(
    {
        "kv_near_full_usage",
        "tax_warning",
        "tax_critical",
        "yield_warning",
        "yield_critical",
        "join_coverage_min",
        "thrash_usage",
        "slo_ttft_quantile",
        "gate_shed_ratio",
    }
)
POSITIVE: frozenset[str] = frozenset(
    {
        "over_admission_ratio",
        "slo_ttft_seconds",
        "slo_itl_seconds",
        "slo_fast_burn",
        "slo_slow_burn",
        "slo_ticket_burn",
    }
)
# A share strictly between 0 and 1: an objective of 1 leaves no budget to burn, and one of 0
# no objective at all.
OPEN_SHARES: frozenset[str] = frozenset({"slo_objective"})
# Settings that take one of a few words, and the words.
CHOICES: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {"slo_alerting": ("burn_rate", "threshold"), "slo_unit": ("requests", "tokens")}
)


def threshold_problem(name: str, value: float) -> str | None:
    """What is wrong with ``value`` for the number setting ``name``; None when it is fine.

    >>> threshold_problem("tax_warning", 1.5)
    'expected a share from 0 to 1, not 1.5'
    >>> threshold_problem("shed_per_second", float("nan")) is None
    False
    """
    if not math.isfinite(value):
        return f"expected a finite number, not {value}"
    if name in SHARES and not 0 <= value <= 1:
        return f"expected a share from 0 to 1, not {value:g}"
    if name in POSITIVE and value <= 0:
        return f"expected a number above 0, not {value:g}"
    if name in OPEN_SHARES and not 0 < value < 1:
        return f"expected a share above 0 and below 1, such as 0.99, not {value:g}"
    if value < 0:
        return f"expected a number of 0 or more, not {value:g}"
    return None


def short_profile(
    base: RulesConfig = DEFAULT, *, window: str = "20s", hold: str = "5s", slo_scale: int = 30
) -> RulesConfig:
    """``base`` with every window set to ``window``, every ``for:`` to ``hold``, and the
    objective's windows and period divided by ``slo_scale``.

    For end-to-end tests that scrape and evaluate every second. The burn-rate alerts keep
    their shape (factors, and which window pairs with which), on a clock ``slo_scale`` times
    as fast: with the default 30, the fast page reads 2m and 10s instead of 1h and 5m.

    >>> profile = short_profile()
    >>> profile.slo_fast_windows, profile.slo_period, profile.slo_fast_for
    (('2m', '10s'), '22h24m', '5s')
    """
    holds: dict[str, Any] = {f.name: hold for f in fields(base) if f.name.endswith("_for")}

    def faster(windows: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(format_duration(duration_ms(w) // slo_scale) for w in windows)

    return replace(
        base,
        rate_window=window,
        queue_window=window,
        slo_period=faster((base.slo_period,))[0],
        slo_windows=faster(base.slo_windows),
        slo_fast_windows=faster(base.slo_fast_windows),
        slo_slow_windows=faster(base.slo_slow_windows),
        slo_ticket_windows=faster(base.slo_ticket_windows),
        **holds,
    )


# The profile the end-to-end test evaluates: 1s scrape and evaluation intervals assumed, and a
# static scrape whose kvtax job is called "kvtax".
TEST_PROFILE = short_profile(replace(DEFAULT, kvtax_job_selector='job="kvtax"'))
