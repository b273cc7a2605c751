"""Static sizing: KV bytes per token, the pool, the tokens it holds and the concurrency at p95.

Arithmetic only. vLLM gives the KV cache what is left of ``gpu_memory x
gpu_memory_utilization`` on each GPU once the weights (split across tensor-parallel ranks) and
the activation peak it profiles at start are taken; that peak is not knowable from a config, so
it is a parameter (``overhead``) with a conservative default in the CLI. Each rank holds its
share of every token's KV (:meth:`KvShape.shards`), so the tokens the pool holds are a rank's
pool over a rank's bytes per token, rounded down to whole blocks.

Example::

    >>> from kvtax.tools.plan.modelcfg import shape_from_flags
    >>> s = shape_from_flags(layers=32, kv_heads=8, head_dim=128, dtype="float16")
    >>> plan = size(s, kv_dtype_bytes=2, pool_bytes=50 * 2**30, block_size=16)
    >>> plan.bytes_per_token, plan.kv_tokens, plan.concurrency(6000)
    (131072, 409600, 68)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvtax.errors import PlanError
from kvtax.figures.derive import recommended_max_num_seqs
from kvtax.tools.plan.modelcfg import KvShape

__all__ = ["GIB", "Flags", "Memory", "Sizing", "pool_bytes", "recommend", "size"]

GIB = 2**30


def pool_bytes(
    *,
    gpu_memory: float,
    utilization: float,
    tensor_parallel: int,
    weights: float,
    overhead: float,
) -> int:
    """KV pool bytes of ONE rank: its memory budget less its weight share and overhead."""
    if gpu_memory <= 0:
        raise PlanError("--gpu-memory-gib", f"must be positive, not {gpu_memory / GIB:g}")
    if not 0 < utilization <= 1:
        raise PlanError("--gpu-memory-utilization", f"must be in (0, 1], not {utilization}")
    if tensor_parallel <= 0:
        raise PlanError(
            "--tensor-parallel-size", f"must be a positive integer, not {tensor_parallel}"
        )
    if weights < 0:
        raise PlanError("--weights-gib", f"must not be negative, not {weights / GIB:g}")
    if overhead < 0:
        raise PlanError("--overhead-gib", f"must not be negative, not {overhead / GIB:g}")
    left = gpu_memory * utilization - weights / tensor_parallel - overhead
    if left <= 0:
        raise PlanError(
            "--gpu-memory-gib",
            f"{gpu_memory / GIB:g} GiB x {utilization} leaves nothing for the KV cache after "
            f"{weights / tensor_parallel / GIB:.1f} GiB of weights per GPU and "
            f"{overhead / GIB:g} GiB of overhead",
        )
    return int(left)


@dataclass(frozen=True, slots=True)
class Memory:
    """Where a rank's KV pool came from: given directly, or the GPU's budget less the rest.

    Byte counts are None when the pool was given (``--kv-pool-gib``). ``weights_source`` says
    where the weights came from (the flag, the checkpoint, or an estimate from the config, in
    which case ``parameters`` is the estimated count and ``weights_dtype`` what it assumed).
    """

    pool_bytes: int
    gpu: str | None = None
    gpu_memory_bytes: float | None = None
    utilization: float | None = None
    tensor_parallel: int = 1
    weights_bytes: float | None = None
    weights_source: str | None = None
    overhead_bytes: float | None = None
    parameters: int | None = None
    weights_dtype: str | None = None


@dataclass(frozen=True, slots=True)
class Sizing:
    """The pool of one deployment and what it holds.

    ``pool_bytes`` and ``bytes_per_token`` are per rank; ``kv_tokens`` is whole blocks.
    """

    shape: KvShape
    kv_dtype_bytes: int
    tensor_parallel: int
    pool_bytes: int
    block_size: int
    bytes_per_token: int  # the whole model's, all ranks
    rank_bytes_per_token: float
    kv_tokens: int

    @property
    def num_blocks(self) -> int:
        return self.kv_tokens // self.block_size

    def sequence_bytes(self, tokens: int) -> float:
        """Bytes one rank holds for a sequence of ``tokens``, in whole blocks, windows applied."""
        rounded = math.ceil(tokens / self.block_size) * self.block_size
        elements = self.shape.sequence_elements(rounded)
        return elements * self.kv_dtype_bytes / self.shape.shards(self.tensor_parallel)

    def concurrency(self, tokens: int) -> int:
        """Sequences of ``tokens`` that fit in the pool at once."""
        if tokens <= 0:
            raise PlanError("--length", f"must be positive, not {tokens}")
        if self.shape.sliding_window is None:
            # Token-granular, as the web calculators and vLLM's own "maximum concurrency" log.
            return self.kv_tokens // tokens
        return int(self.pool_bytes // self.sequence_bytes(tokens))


def size(
    shape: KvShape,
    *,
    kv_dtype_bytes: int,
    pool_bytes: int,
    block_size: int,
    tensor_parallel: int = 1,
) -> Sizing:
    """Size the pool of ``pool_bytes`` per rank for ``shape`` in a KV dtype of that width."""
    if block_size <= 0:
        raise PlanError("--block-size", f"must be a positive integer, not {block_size}")
    if pool_bytes <= 0:
        raise PlanError("--kv-pool-gib", f"must be positive, not {pool_bytes / GIB:g}")
    per_token = shape.elements_per_token() * kv_dtype_bytes
    rank = per_token / shape.shards(tensor_parallel)
    tokens = int(pool_bytes // rank) // block_size * block_size
    return Sizing(
        shape=shape,
        kv_dtype_bytes=kv_dtype_bytes,
        tensor_parallel=tensor_parallel,
        pool_bytes=pool_bytes,
        block_size=block_size,
        bytes_per_token=per_token,
        rank_bytes_per_token=rank,
        kv_tokens=tokens,
    )


@dataclass(frozen=True, slots=True)
class Flags:
    """Recommended ``vllm serve`` flags, each with the reason."""

    max_num_seqs: int
    max_model_len: int
    max_num_queued_reqs: int
    reasons: dict[str, str]


def recommend(
    sizing: Sizing,
    *,
    p95_length: int,
    target_usage: float,
    context_limit: int | None,
) -> Flags:
    """``--max-num-seqs`` from the p95 length, ``--max-model-len`` and a queue bound."""
    if sizing.shape.sliding_window is None:
        seqs = recommended_max_num_seqs(sizing.kv_tokens, target_usage, p95_length)
    else:
        seqs = max(
            1, math.floor(sizing.pool_bytes * target_usage / sizing.sequence_bytes(p95_length))
        )
    # One sequence must fit the pool or vLLM refuses to start; no longer than the model knows.
    model_len = sizing.kv_tokens if context_limit is None else min(context_limit, sizing.kv_tokens)
    return Flags(
        max_num_seqs=seqs,
        max_model_len=model_len,
        max_num_queued_reqs=2 * seqs,
        reasons={
            "max_num_seqs": f"{target_usage:.0%} of the pool over the p95 length "
            f"({p95_length} tokens): more running sequences than fit is what preempts",
            "max_model_len": "the model's context, capped by the pool: a longer sequence "
            "than the pool holds makes vLLM refuse to start",
            "max_num_queued_reqs": "about two batches: a request queued behind more waits "
            "longer than it runs; refusing it at once lets a load balancer try another replica",
        },
    )
