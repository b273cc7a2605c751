"""Benchmarks of kvtax, run as modules: ``.venv/bin/python -m bench.scrape.pipeline``."""
