"""A request's size for admission: prompt tokens, worst-case footprint, KV blocks, token budget.

What a request states (its prompt, ``max_tokens``, ``n``) is read by its API's dialect
(:meth:`~kvtax.delivery.dialects.base.Dialect.shape`), as vLLM reads it and bounded. From that
:class:`~kvtax.delivery.dialects.base.Shape`, the prompt is counted without a tokenizer: its
bytes times a tokens-per-byte ratio that starts conservative and is corrected from the prompt
tokens vLLM reports in usage (:class:`TokenEstimator`). The worst case a request can hold in KV
is its prompt plus its ``max_tokens`` (the model's length when it states none) for each sequence
it asks vLLM for: ``n`` of them for each prompt of a ``prompt`` list (:func:`footprint_of`);
counted in whole blocks it is what the budget mode admits against.

Example (an 812-byte prompt asking for 256 tokens):

    >>> from kvtax.delivery.dialects import COMPLETIONS
    >>> payload = {"model": "m", "prompt": "x" * 812, "max_tokens": 256}
    >>> shape = COMPLETIONS.shape(payload, whole=850)
    >>> shape.prompt_bytes, shape.max_tokens
    (812, 256)
    >>> tokens = TokenEstimator().estimate(shape.prompt_bytes)  # before any reply taught it
    >>> blocks_of(footprint_of(tokens, 256, prompts=shape.prompts, n=shape.n), block_size=16)
    34
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "MAX_FOOTPRINT",
    "MAX_TOKENS_PER_BYTE",
    "MIN_TOKENS_PER_BYTE",
    "BudgetVerdict",
    "OverBudget",
    "TokenEstimator",
    "blocks_of",
    "check_budget",
    "footprint_of",
]

OverBudget = Literal["reject", "clamp"]

# The bound of a request's footprint in tokens (2**53: every integer below is a float).
MAX_FOOTPRINT = 2**53


def footprint_of(prompt_tokens: int, completion: int, *, prompts: int = 1, n: int = 1) -> int:
    """The worst-case KV tokens of a request: each of its ``prompts`` (``prompt_tokens`` all
    together) held by each of its ``n`` sequences, each sequence up to ``completion`` tokens
    long. vLLM serves ``n`` as that many requests, each with the whole prompt; prefix caching
    may share the prompt's blocks, which the worst case does not count on. At most
    :data:`MAX_FOOTPRINT`."""
    total = n * (prompt_tokens + prompts * completion)
    return max(1, min(total, MAX_FOOTPRINT))


# The band the learned ratio stays in. No tokenizer spends more than one token on a byte (its
# byte fallback), and real text costs far more than a token per ten bytes (English about one
# per four). One global ratio serves every request: a few odd ones (long runs of whitespace,
# a prompt whose tokens the bytes do not show) must not drag it to where every later prompt is
# under- or over-counted many times.
MIN_TOKENS_PER_BYTE = 0.1
MAX_TOKENS_PER_BYTE = 1.0


@dataclass(frozen=True, slots=True)
class TokenEstimator:
    """Prompt tokens from prompt bytes. The ratio starts at 0.35 tokens a byte (above what
    English text needs, so it over-counts) and moves toward what vLLM reports, within
    [``MIN_TOKENS_PER_BYTE``, ``MAX_TOKENS_PER_BYTE``]."""

    tokens_per_byte: float = 0.35
    weight: float = 0.2

    def estimate(self, prompt_bytes: int) -> int:
        return max(1, math.ceil(prompt_bytes * self.tokens_per_byte))

    def learned(self, prompt_bytes: int, prompt_tokens: int) -> TokenEstimator:
        """Corrected by one request whose prompt vLLM counted."""
        if prompt_bytes < 16 or prompt_tokens <= 0:
            return self  # too short to say anything about the ratio
        # Bounded before the division: the ratio ends in its band whatever a huge count says.
        seen = min(prompt_tokens, MAX_FOOTPRINT) / prompt_bytes
        ratio = (1 - self.weight) * self.tokens_per_byte + self.weight * seen
        bounded = min(MAX_TOKENS_PER_BYTE, max(MIN_TOKENS_PER_BYTE, ratio))
        return TokenEstimator(bounded, self.weight)


def blocks_of(tokens: int, block_size: int) -> int:
    """Whole KV blocks ``tokens`` occupy."""
    return max(1, math.ceil(tokens / block_size))


@dataclass(frozen=True, slots=True)
class BudgetVerdict:
    """``ok``; ``clamp`` to ``max_tokens``; or ``reject`` with a message naming the budget."""

    action: Literal["ok", "clamp", "reject"]
    max_tokens: int | None = None
    message: str = ""


def check_budget(
    prompt_tokens: int,
    max_tokens: int | None,
    budget: int | None,
    over: OverBudget,
    *,
    prompts: int = 1,
    n: int = 1,
) -> BudgetVerdict:
    """Whether the request's footprint (:func:`footprint_of`: prompt + max_tokens for each of
    its ``n`` sequences of each of its ``prompts``) fits the per-request ``budget`` of tokens
    (None: no budget).

    A request without ``max_tokens`` is clamped to what the budget leaves (or rejected, in
    ``reject``). A prompt that leaves no room is always rejected.
    """
    if budget is None:
        return BudgetVerdict("ok")
    # The largest max_tokens whose footprint fits: n * (prompt + prompts * m) <= budget.
    room = (budget - n * prompt_tokens) // (n * prompts)
    copies = "" if n * prompts == 1 else f" for each of {n * prompts} sequences (n x prompts)"
    if room < 1:
        return BudgetVerdict(
            "reject",
            message=f"the prompt (about {prompt_tokens} tokens){copies} leaves no room in the "
            f"per-request budget of {budget} tokens (--gate.token-budget)",
        )
    if max_tokens is not None and max_tokens <= room:
        return BudgetVerdict("ok")
    if over == "clamp":
        return BudgetVerdict("clamp", room)
    stated = "no max_tokens" if max_tokens is None else f"max_tokens={max_tokens}"
    return BudgetVerdict(
        "reject",
        message=f"prompt (about {prompt_tokens} tokens) plus {stated}{copies} exceeds the "
        f"per-request budget of {budget} tokens (--gate.token-budget); ask for at most "
        f"{room}",
    )
