"""The admission gate's decisions, as pure functions: the cap, a request's footprint, the order.

:mod:`~kvtax.admission.cap` steps the concurrency cap from one scrape's signals (static, budget,
auto, adaptive AIMD); :mod:`~kvtax.admission.footprint` sizes a request in tokens and KV blocks
and applies the per-request token budget; :mod:`~kvtax.admission.order` orders the queue and
estimates Retry-After. The asyncio queue that acts on them is :mod:`kvtax.serve.proxy.gate`.
"""
