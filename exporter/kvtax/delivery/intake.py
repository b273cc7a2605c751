"""Delivered-token reports from outside the proxy, parsed and validated. Pure, no I/O.

Users who already run a gateway can feed the ledger in two ways. They can push increments as
JSON (:func:`parse_push`), or kvtax can read the gateway's own Prometheus counter
(:func:`gateway_totals`). Examples are LiteLLM's ``litellm_output_tokens_metric_total``
(label ``model``) and Envoy AI Gateway's ``gen_ai_client_token_usage`` histogram (label
``gen_ai_request_model``, selector ``gen_ai_token_type=output``; its ``_sum`` counts tokens).

A push body is one report or a list of them::

    {"model": "tiny-llama", "delivered_tokens": 120, "prompt_tokens": 40,
     "undelivered_tokens": 0, "requests": {"completed": 2}, "slo_met_requests": 2,
     "slo_met_tokens": 120}

Every count is an increment since the previous push; only ``model`` and ``delivered_tokens`` are
required. Each count is at most :data:`MAX_COUNT`. :class:`PushError` messages name the offending
field.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvtax.delivery.ledger import OUTCOMES, DeliveryCounts
from kvtax.errors import RequestError

__all__ = ["MAX_COUNT", "PushError", "gateway_totals", "parse_push"]

_FIELDS = (
    "delivered_tokens",
    "prompt_tokens",
    "undelivered_tokens",
    "slo_met_requests",
    "slo_met_tokens",
)
_MAX_REPORTS = 1000
# A report is an increment since the sender's previous push. One vLLM replica emits at most some
# 10^4-10^5 tokens/s, so 10^9 is hours of a replica's output, more than any sender that pushes
# at least hourly (or catches up after an outage) can owe. The bound keeps a hostile or buggy
# sender from wrecking a counter: a push adds at most 10^12, far from float64's exact range
# (2^53, about 9e15) and nowhere near +Inf, where one 1.7e308 pushed twice used to take it.
MAX_COUNT = 1e9


class PushError(RequestError):
    """A push body is malformed; the message says what and where."""


def _count(report: Mapping[str, Any], key: str, where: str, *, required: bool = False) -> float:
    value = report.get(key)
    if value is None:
        if required:
            raise PushError(f"{where}: {key} is required")
        return 0.0
    shown = json.dumps(value)[:40]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PushError(f"{where}: {key} must be a number, got {shown}")
    # math.isfinite is asked of floats only: it cannot convert an int of 400 digits.
    if isinstance(value, float) and not math.isfinite(value):
        raise PushError(f"{where}: {key} must be a number, got {shown}")
    if value < 0:
        raise PushError(f"{where}: {key} must not be negative, got {shown}")
    if value > MAX_COUNT:
        raise PushError(f"{where}: {key} must be at most {MAX_COUNT:.0e}, got {shown}")
    return float(value)


def _report(item: Any, where: str) -> tuple[str, DeliveryCounts]:
    if not isinstance(item, dict):
        raise PushError(f"{where}: expected a JSON object")
    unknown = set(item) - {"model", "requests", *_FIELDS}
    if unknown:
        raise PushError(f"{where}: unknown field {sorted(unknown)[0]!r}")
    model = item.get("model")
    if not isinstance(model, str) or not model:
        raise PushError(f"{where}: model must be a non-empty string")
    requests = item.get("requests", {})
    if not isinstance(requests, dict):
        raise PushError(f"{where}: requests must be an object of outcome -> count")
    for outcome in requests:
        if outcome not in OUTCOMES:
            raise PushError(
                f"{where}: requests.{outcome} is not an outcome ({', '.join(OUTCOMES)})"
            )
    counts = {key: _count(item, key, where, required=key == "delivered_tokens") for key in _FIELDS}
    return model, DeliveryCounts(
        delivered_tokens=counts["delivered_tokens"],
        prompt_tokens=counts["prompt_tokens"],
        undelivered_tokens=counts["undelivered_tokens"],
        requests={k: _count(requests, k, f"{where}: requests") for k in requests},
        slo_met_requests=counts["slo_met_requests"],
        slo_met_tokens=counts["slo_met_tokens"],
    )


def parse_push(body: bytes) -> list[tuple[str, DeliveryCounts]]:
    """Validate a push body into (model, counts) pairs; all or nothing."""
    try:
        data = json.loads(body)
    except UnicodeDecodeError as exc:
        raise PushError("body is not UTF-8 text") from exc
    except json.JSONDecodeError as exc:
        raise PushError(f"body is not valid JSON: {exc.msg} at line {exc.lineno}") from exc
    except ValueError as exc:  # an integer literal longer than Python converts (4,300 digits)
        raise PushError("body holds a number too long to read") from exc
    except RecursionError as exc:
        raise PushError("body is nested too deeply") from exc
    items = data if isinstance(data, list) else [data]
    if not items:
        raise PushError("body is an empty list")
    if len(items) > _MAX_REPORTS:
        raise PushError(f"at most {_MAX_REPORTS} reports per push")
    return [_report(item, f"report {i}") for i, item in enumerate(items)]


def gateway_totals(
    text: str, metric: str, model_label: str, selector: tuple[tuple[str, str], ...] = ()
) -> dict[str, float]:
    """Per model, the gateway counter's current value (summed over its other labels).

    ``metric`` may be given with or without ``_total``; for a histogram or summary the
    ``_sum`` series is read, since it counts tokens while ``_count`` counts requests.
    """
    base = metric.removesuffix("_total")
    wanted = {f"{base}_total", metric, f"{base}_sum"}
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in (base, metric):
            continue
        for sample in family.samples:
            if sample.name not in wanted:
                continue
            labels = sample.labels
            if any(labels.get(k) != v for k, v in selector):
                continue
            model = labels.get(model_label)
            if model:
                totals[model] = totals.get(model, 0.0) + sample.value
    return totals
