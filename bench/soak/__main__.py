"""``python -m bench.soak``: :mod:`bench.soak.soak`."""

from bench.soak.soak import main

main()
