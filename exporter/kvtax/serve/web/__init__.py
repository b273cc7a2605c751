"""The web port's protection: TLS and basic auth from ``--web.config.file``."""
