"""``python -m bench.relay``: :mod:`bench.relay.relay`."""

from bench.relay.relay import main

main()
