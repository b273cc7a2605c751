"""The gate's decisions, as pure functions: the cap, a request's footprint, the order.

:mod:`~kvtax.gate.cap` steps the concurrency cap from one scrape's signals (static, budget,
auto, adaptive AIMD); :mod:`~kvtax.gate.footprint` sizes a request in tokens and KV blocks
and applies the per-request token budget; :mod:`~kvtax.gate.order` orders the queue and
estimates Retry-After. The asyncio queue that acts on them is :mod:`kvtax.serve.proxy.gatekeeper`.
"""
