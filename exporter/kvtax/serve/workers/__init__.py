"""Proxy workers (``--proxy.workers``): several relay processes on one port, one ledger.

:mod:`~kvtax.serve.workers.pool` runs in kvtax's own process and keeps the workers;
:mod:`~kvtax.serve.workers.child` is a worker; :mod:`~kvtax.serve.workers.frames` is what
they say to each other.
"""
