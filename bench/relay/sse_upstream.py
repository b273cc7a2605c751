"""The relay bench's synthetic vLLM, as a command: ``python -m bench.relay.sse_upstream --port N``.

The server itself is :mod:`kvtax_dev.fakevllm.fast` (its ``--help`` says what it answers): it
lives with the one fake vLLM so that every stand-in for vLLM builds its bytes through one
builder, and the unit tests that serve its handlers import them from there. This module keeps
the command that :mod:`bench.relay.relay`, :mod:`bench.relay.instructions` and the docs start.
"""

from __future__ import annotations

from kvtax_dev.fakevllm.fast import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
