"""A real vLLM CPU engine for tests, the demo and benchmarks.

Nothing here is a mock: :class:`VllmEngine` runs vLLM's own OpenAI server in a separate
virtual environment on a tiny random-weight Llama, with a KV pool small enough that
ordinary load makes it preempt. :func:`~kvtax_dev.testbed.load.drive` is the async load
driver that pushes it. The engine's heavy dependencies (torch, transformers, vLLM) live only in
that separate venv; importing this package needs only kvtax's dev extras (requests; aiohttp for
``load``).
"""

from kvtax_dev.testbed.engine import (
    BLOCK_SIZE_TOKENS,
    EngineStartError,
    VllmEngine,
    free_port,
)

__all__ = [
    "BLOCK_SIZE_TOKENS",
    "EngineStartError",
    "VllmEngine",
    "free_port",
]
