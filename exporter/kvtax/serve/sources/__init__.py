"""Delivered tokens that arrive from outside the proxy: the push endpoint, a gateway's counter,
and the served-model names read from vLLM's ``/v1/models``."""
