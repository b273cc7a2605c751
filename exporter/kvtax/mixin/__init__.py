"""The monitoring mixin: Prometheus rules, Alertmanager routing and Grafana dashboards.

Generated from kvtax's own tables of names (:mod:`kvtax.expose.catalog`,
:mod:`kvtax.engine.vocabulary`) by ``kvtax rules`` and ``kvtax dashboards generate``; nothing here
runs in the pod, and ``kvtax serve`` never imports it.
"""
