"""The web port: ``/metrics``, ``/healthz``, ``/readyz`` and the push route (:mod:`.port`), and
its protection, TLS and basic auth from ``--web.config.file`` (:mod:`.webconfig`)."""
