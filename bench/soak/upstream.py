"""The soak's faulty vLLM, as a command: ``python -m bench.soak.upstream --port N --metrics
PAGE [--also-model NAME]...``.

The server itself is :mod:`kvtax_dev.fakevllm.faulty` (its ``--help`` says what it answers and
how each request asks for its faults): it lives with the one fake vLLM so that every stand-in
for vLLM builds its bytes through one builder, and what the soak's client needs of it
(:data:`~kvtax_dev.fakevllm.faulty.WORD`) is that package's public API. This module keeps the
command that :mod:`bench.soak.soak` and the docs start.
"""

from __future__ import annotations

from kvtax_dev.fakevllm.faulty import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
