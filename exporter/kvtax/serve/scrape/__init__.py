"""Reading vLLM: the periodic scrape of ``/metrics``, its parsing off the event loop, and the
cached ``/health`` answer behind ``/readyz``."""
