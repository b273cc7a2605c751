"""A request's size for admission: prompt tokens, worst-case footprint, KV blocks, token budget.

The prompt is counted without a tokenizer: its bytes times a tokens-per-byte ratio that starts
conservative and is corrected from the prompt tokens vLLM reports in usage
(:class:`TokenEstimator`). The worst case a request can hold in KV is its prompt plus its
``max_tokens`` (the model's length when it states none) for each sequence it asks vLLM for:
``n`` of them for each prompt of a ``prompt`` list (:func:`footprint_of`); counted in whole
blocks it is what the budget mode admits against.

Fields are read as vLLM reads them (pydantic's lax coercion, :mod:`kvtax.delivery.lax`), so
``"max_tokens": "50"`` and ``50.0`` mean 50, and every number a client sends is bounded
(:data:`MAX_COUNT`) before any arithmetic: a ``max_tokens`` of 10**309 is a very large request,
not an OverflowError.

Example (an 812-byte prompt asking for 256 tokens):

    >>> payload = {"model": "m", "prompt": "x" * 812, "max_tokens": 256}
    >>> shape = shape_of(payload, "/v1/completions", whole=850)
    >>> shape.prompt_bytes, shape.max_tokens
    (812, 256)
    >>> tokens = TokenEstimator().estimate(shape.prompt_bytes)  # before any reply taught it
    >>> blocks_of(footprint_of(tokens, 256, prompts=shape.prompts, n=shape.n), block_size=16)
    34
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from kvtax.delivery.lax import REFUSED, lax_int

__all__ = [
    "CHAT_PATH",
    "LIMIT_KEYS",
    "MAX_COUNT",
    "MAX_FOOTPRINT",
    "MAX_TOKENS_PER_BYTE",
    "MIN_TOKENS_PER_BYTE",
    "BudgetVerdict",
    "Shape",
    "TokenEstimator",
    "blocks_of",
    "check_budget",
    "footprint_of",
    "limit_fields",
    "shape_of",
    "with_max_tokens",
]

OverBudget = Literal["reject", "clamp"]

CHAT_PATH = "/v1/chat/completions"
# The keys that limit a completion's length, in the order vLLM's chat endpoint reads them.
LIMIT_KEYS = ("max_completion_tokens", "max_tokens")
# The bound of every count a client states (max_tokens, n): far past any model's length or
# vLLM's VLLM_MAX_N_SEQUENCES, so it changes no real request, and small enough that sums and
# products of such counts stay exact in a float. A larger value is this one.
MAX_COUNT = 2**31 - 1
# The bound of a request's footprint in tokens (2**53: every integer below is a float).
MAX_FOOTPRINT = 2**53


@dataclass(frozen=True, slots=True)
class Shape:
    """What admission reads of a request body: the prompt's size and the completion's limit.

    ``media``: the prompt also has parts that count as no bytes (images, audio); vLLM's count
    of its tokens includes theirs, so it says nothing about the tokens a byte of text costs.
    ``prompts``: the prompts of a ``prompt`` list (each is a request of its own to vLLM);
    ``n``: the sequences vLLM generates for each. ``max_tokens`` and ``n`` are within
    [1, :data:`MAX_COUNT`].
    """

    prompt_bytes: int
    max_tokens: int | None
    media: bool = False
    prompts: int = 1
    n: int = 1

    @property
    def sequences(self) -> int:
        """The sequences vLLM generates for this request, each up to ``max_tokens`` long."""
        return self.prompts * self.n


def shape_of(payload: Any, path: str, *, whole: int) -> Shape:
    """The shape of a parsed body sent to ``path`` (``/v1/completions`` or ``CHAT_PATH``), read
    as vLLM reads it there; ``whole`` is the body's length. A body that is not an object has
    size 0 and no limit (vLLM answers its 400)."""
    if not isinstance(payload, dict):
        return Shape(0, None)
    chat = path == CHAT_PATH
    media = False
    prompts = 1  # a chat's messages are one prompt
    if chat:
        prompt, media = _text_of(payload.get("messages"))
    else:
        prompt = payload.get("prompt", "")
        prompts = _prompts_in(prompt)
    return Shape(
        _size(prompt, whole), _limit_of(payload, chat), media, prompts, _count(payload.get("n"))
    )


def _prompts_in(prompt: Any) -> int:
    """The prompts of a completions ``prompt``: a string or one list of token ids is one; a
    list of strings or of token-id lists is one per item (vLLM serves each as a request of its
    own, under the same ``max_tokens`` and ``n``)."""
    if not isinstance(prompt, list) or not prompt:
        return 1
    if all(isinstance(item, int) and not isinstance(item, bool) for item in prompt):
        return 1
    return min(len(prompt), MAX_COUNT)


def _count(value: Any) -> int:
    """``n`` as vLLM reads it, bounded: absent, null or a value vLLM refuses (it then answers
    400 and generates nothing) count as 1."""
    read = lax_int(value)
    if not isinstance(read, int) or read < 1:  # None, or REFUSED
        return 1
    return min(read, MAX_COUNT)


def _size(prompt: Any, whole: int) -> int:
    """A prompt's bytes: a string's UTF-8 (a lone surrogate, which Python's parser lets through,
    as its 3 bytes), anything else's compact JSON. When orjson cannot write it (nested past
    254 levels, integers past 64 bits), the whole body's length: never less than the prompt,
    and no second encoder to hit its recursion limit."""
    if isinstance(prompt, str):
        return len(prompt.encode("utf-8", "surrogatepass"))
    try:
        return len(orjson.dumps(prompt))
    except orjson.JSONEncodeError:
        return whole


def _limit_of(payload: dict[str, Any], chat: bool) -> int | None:
    """The completion limit vLLM applies. Its CompletionRequest has ``max_tokens`` only (it
    ignores other keys); its ChatCompletionRequest takes ``max_completion_tokens or
    max_tokens`` (vllm/entrypoints/openai/protocol.py, to_sampling_params), so a null or 0
    ``max_completion_tokens`` leaves ``max_tokens`` in force. Each is read as vLLM's ``int``
    field reads it (``"50"`` and ``50.0`` are 50) and bounded by :data:`MAX_COUNT`. None: no
    limit stated, or one vLLM refuses (the worst case is assumed)."""
    keys = LIMIT_KEYS if chat else ("max_tokens",)
    for key in keys:
        read = lax_int(payload.get(key))
        if read is REFUSED:
            return None
        if read:
            return _bounded(read)
    return None


def _bounded(value: Any) -> int | None:
    """A limit as vLLM reads it, within [1, MAX_COUNT]; None when it is no positive count."""
    read = lax_int(value)
    if not isinstance(read, int) or read < 1:  # None, or REFUSED
        return None
    return min(read, MAX_COUNT)


def _text_of(messages: Any) -> tuple[Any, bool]:
    """Chat messages with each list of content parts cut down to the parts' text, and whether
    any part was left out. An image or audio part is mostly base64: counted as bytes of text
    it made one picture weigh like a book, and taught the estimator a ratio 100 times low."""
    if not isinstance(messages, list):
        return messages, False
    kept: list[Any] = []
    media = False
    for message in messages:
        parts = message.get("content") if isinstance(message, dict) else None
        if not isinstance(parts, list):
            kept.append(message)
            continue
        texts = [part["text"] for part in parts if _is_text(part)]
        media = media or len(texts) < len(parts)
        kept.append({**message, "content": texts})
    return kept, media


def _is_text(part: Any) -> bool:
    return isinstance(part, dict) and isinstance(part.get("text"), str)


def limit_fields(payload: dict[str, Any], limit: int) -> dict[str, Any]:
    """The top-level fields that hold the body's completion limit to at most ``limit``: every
    limit key it has, lowered (whichever one vLLM reads at its endpoint is then within the
    limit); for one without any, ``max_tokens``, which every vLLM reads on both endpoints."""
    present = [key for key in LIMIT_KEYS if key in payload] or ["max_tokens"]
    return {key: _lowered(payload.get(key), limit) for key in present}


def with_max_tokens(payload: dict[str, Any], limit: int) -> dict[str, Any]:
    """The body with its completion limit at most ``limit`` (:func:`limit_fields`)."""
    return {**payload, **limit_fields(payload, limit)}


def _lowered(value: Any, limit: int) -> Any:
    """A limit within ``limit``: as the client wrote it (``"50"`` stays ``"50"``) when vLLM
    reads it as a count that is, else ``limit``."""
    read = _bounded(value)
    return value if read is not None and read <= limit else limit


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
