"""How many tokens the engine computed and recomputed: the formulas behind the recompute totals.

Pure functions of one scrape's values. :class:`~kvtax.figures.window.Window` keeps the running
totals and calls these at every scrape; nothing else computes a prompt or recompute count. The
three recompute methods and their meaning (docs/tax.md, vllm-facts.md):

- ``measured``: exact. vLLM V0 counted re-prefill in ``prompt_tokens_total``, so the excess over
  the per-request prompt histogram is the recompute; on V1 kvtax's stat-logger plugin counts it.
- ``estimated``: preemptions x L-hat, the mean context at preemption from vLLM's histograms
  (the prompt tokens computed, not those a new request found cached, + half the generation).
- ``stall_estimated``: preemptions x the mean context at the stream stalls the proxy saw.

Beside the recompute, :func:`recompute_avoided` splits what resumes did not compute again by
where it came from: vLLM's own prefix cache, or a KV connector that loaded it back.

Example (4 preemptions at a mean context of 300 tokens; no estimate while it is unknown):

    >>> estimated_recompute(4.0, 300.0), estimated_recompute(4.0, None)
    (1200.0, None)
"""

from __future__ import annotations

from collections.abc import Mapping

from kvtax.delivery.ledger import LedgerTotals
from kvtax.engine.snapshot import Histogram, ModelMetrics

__all__ = [
    "AVOIDED_SOURCES",
    "METHODS",
    "computed_prompt_raw",
    "estimated_recompute",
    "mean_context",
    "recompute_avoided",
    "stall_mean_context",
    "v0_recompute",
]

# Recompute method -> the window total that holds it, in the order of preference of "the tax":
# the first one available is the best (docs/tax.md).
METHODS = (
    ("measured", "recomputed_measured"),
    ("estimated", "recomputed_estimated"),
    ("stall_estimated", "recomputed_stall_estimated"),
)


# Where a resumed request's tokens came from when they were not computed again.
AVOIDED_SOURCES = ("prefix_cache", "kv_connector")


def recompute_avoided(totals: Mapping[str, float]) -> dict[str, float]:
    """Tokens of resumed requests not computed again, by source, from the plugin's totals.

    The plugin's hits hold both sources; the connector's part is its own counter, present only
    where vLLM runs with a KV connector. Without the plugin there is nothing: no zero either.
    """
    hits = totals.get("preempted_hit_tokens")
    if hits is None:
        return {}
    loaded = totals.get("preempted_connector_hit_tokens")
    if loaded is None:
        return {"prefix_cache": hits}
    return {"prefix_cache": hits - loaded, "kv_connector": loaded}


def computed_prompt_raw(m: ModelMetrics, *, v0: bool) -> float | None:
    """Prompt tokens the engine computed, from the best source this version has."""
    if "prompt_tokens_local_compute" in m.values:
        return m.values["prompt_tokens_local_compute"]
    if "prefill_kv_computed" in m.histograms:
        return m.histograms["prefill_kv_computed"].sum
    if v0 and "request_prompt_tokens" in m.histograms:
        # V0's prompt_tokens_total also counts re-prefill; the per-request histogram does not.
        return m.histograms["request_prompt_tokens"].sum
    if "prompt_tokens" in m.values:
        return m.values["prompt_tokens"] - m.values.get("prefix_cache_hits", 0.0)
    return None


def v0_recompute(prompt_increase: float, request_prompt_increase: float) -> float:
    """V0's measured recompute: prompt tokens counted beyond the requests' own prompts."""
    return max(0.0, prompt_increase - request_prompt_increase)


def mean_context(histograms: Mapping[str, Histogram]) -> float | None:
    """L-hat: the mean context at preemption, the prompt tokens a request's first prefill
    computed + half its generation (the mean victim is halfway through).

    The prompt part is ``request_prefill_kv_computed_tokens`` (0.13+) where vLLM has it, else
    the whole prompt (``request_prompt_tokens``). What a new request found in the prefix cache,
    or loaded from a KV connector, is a prefix others hold too (a system prompt), and it is still
    there when a victim of the same prompt resumes: counting it as recomputed made the estimate
    4.2 x the measurement where 24 requests share a 384-token prefix, 1.1 x without it
    (bench/results/estimate.md).
    An upper bound all the same: a victim's own blocks that survive in the prefix cache until it
    resumes (most of them, often) shorten the real re-prefill further.
    """
    computed = histograms.get("prefill_kv_computed")
    prompt = computed if computed is not None else histograms.get("request_prompt_tokens")
    gen = histograms.get("request_generation_tokens")
    p = prompt.mean() if prompt else None
    g = gen.mean() if gen else None
    if p is None or g is None:
        return None
    return p + g / 2


def stall_mean_context(ledger: LedgerTotals) -> float | None:
    """The mean context at the stalls the proxy saw (lifetime), or None before the first."""
    return ledger.stall_context / ledger.stalls if ledger.stalls > 0 else None


def estimated_recompute(preemptions: float, context: float | None) -> float | None:
    """Preemptions x a mean context; None while the context is unknown (keep them pending)."""
    return None if context is None else preemptions * context
