"""Reading vLLM: the scrape job (scrape on the schedule, fold, derive, hand the figures on), the
periodic scrape of ``/metrics``, its parsing off the event loop, and the cached ``/health``
answer behind ``/readyz``."""
