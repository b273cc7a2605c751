"""The Overview's "Recompute avoided" row: where a resumed request's KV came from.

A preempted request that resumes needs its whole context back. vLLM finds part of it still in
its own KV cache (the prefix cache), a KV connector (CPU offloading, LMCache) may load more back,
and the rest is computed again: the recompute of the tax. The plugin counts all three
(docs/plugin.md), and this row draws them beside the tax: the three streams, the share the
connector saved, and the tax against the tax had the connector's tokens been computed again
(docs/tax.md, "With a KV connector"). The connector's lines exist only where vLLM runs with
one. Pure: no I/O.
"""

from __future__ import annotations

from kvtax.mixin.dashboards.common import (
    MODEL,
    TAX_DEFINITION,
    TAX_THRESHOLDS,
    TOK_S,
    gen_rate,
    sum_rate,
    tax_of,
)
from kvtax.mixin.dashboards.model import Panel, Row, Target
from kvtax.mixin.rules.recording import RECOMPUTE_COUNTERS

__all__ = ["RESUMES_ROW"]

AVOIDED = "kvtax_recompute_avoided_tokens_total"
_MEASURED = RECOMPUTE_COUNTERS["measured"]
_recomputed = sum_rate(_MEASURED)
_from_cache = sum_rate(AVOIDED, where=(("source", "prefix_cache"),))
_loaded = sum_rate(AVOIDED, where=(("source", "kv_connector"),))
# Every token of a resumed request: computed again, or found, or loaded (both sources at once).
_resumed = f"({_recomputed} + {sum_rate(AVOIDED)})"
_computed_prompt = sum_rate("kvtax_engine_prompt_computed_tokens_total")

_streams = Panel(
    "Resumed requests' tokens by source",
    "timeseries",
    (
        Target(_recomputed, "computed again {{model_name}}", color="red", stack=True),
        Target(_from_cache, "in vLLM's prefix cache {{model_name}}", color="green", stack=True),
        Target(_loaded, "loaded by the KV connector {{model_name}}", color="blue", stack=True),
    ),
    TOK_S,
    "Tokens per second of preempted requests that resumed, stacked by where their KV came "
    "from: computed again (red: the recompute of the tax), still in vLLM's own KV cache "
    "(green), or loaded back by a KV connector such as CPU offloading or LMCache (blue; only "
    "where vLLM runs with one). The stack's top is the context the resumes needed. Measured by "
    "kvtax's vLLM plugin. A loaded token cost a transfer, not a prefill: it is not in the tax.",
    "KvtaxPreemptionTaxHigh",
    width=8,
    min=0,
)

_share = Panel(
    "Recompute avoided by offload",
    "timeseries",
    (Target(f"{_loaded} / {_resumed}", "loaded by the KV connector {{model_name}}"),),
    "percentunit",
    "Of the tokens resumed requests needed, the share a KV connector loaded back instead of "
    "vLLM computing them again, over the panel's rate interval. Only where vLLM runs with a "
    "connector. Low while the tax is high: the connector stores too little (LMCache stores "
    "whole chunks; without its save_decode_cache option a request's output is never stored), "
    "or its tier evicts what preempted requests come back for. Empty without a connector, and "
    "while no preempted request resumes.",
    "KvtaxPreemptionTaxHigh",
    width=8,
    min=0,
    max=1,
    no_data="No KV connector in vLLM, or no preempted request resumed",
)

_without_connector = (
    f"({_recomputed} + {_loaded}) / "
    f"({_computed_prompt} + {gen_rate(MODEL)} + {_recomputed} + {_loaded})"
)
_tax_beside = Panel(
    "Tax, and the tax without the connector",
    "timeseries",
    (
        Target(tax_of(_MEASURED), "tax {{model_name}}"),
        Target(_without_connector, "had nothing been loaded {{model_name}}", dashed=True),
    ),
    "percentunit",
    "The measured tax over the panel's rate interval, and (dashed) the tax had the KV "
    "connector's tokens been computed again: the same formula with the loaded tokens added to "
    "the recompute. The gap is what offloading saved, as a share of the engine's token work. "
    "The dashed line exists only where vLLM runs with a connector. " + TAX_DEFINITION,
    "KvtaxPreemptionTaxHigh",
    width=8,
    min=0,
    thresholds=TAX_THRESHOLDS,
    threshold_lines=True,
)

RESUMES_ROW = Row("Recompute avoided", (_streams, _share, _tax_beside))
