"""A request's size for admission: prompt tokens, worst-case footprint, KV blocks, token budget.

The prompt is counted without a tokenizer: its bytes times a tokens-per-byte ratio that starts
conservative and is corrected from the prompt tokens vLLM reports in usage
(:class:`TokenEstimator`). The worst case a request can hold in KV is its prompt plus its
``max_tokens`` (the model's length when it states none); counted in whole blocks it is what
the budget mode admits against.

Example::

    shape = shape_of(payload, "/v1/completions", whole=len(body))   # Shape(812, 256)
    tokens = TokenEstimator().estimate(shape.prompt_bytes)
    blocks_of(tokens + 256, block_size=16)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import orjson

__all__ = [
    "CHAT_PATH",
    "LIMIT_KEYS",
    "MAX_TOKENS_PER_BYTE",
    "MIN_TOKENS_PER_BYTE",
    "BudgetVerdict",
    "Shape",
    "TokenEstimator",
    "blocks_of",
    "check_budget",
    "shape_of",
    "with_max_tokens",
]

OverBudget = Literal["reject", "clamp"]

CHAT_PATH = "/v1/chat/completions"
# The keys that limit a completion's length, in the order vLLM's chat endpoint reads them.
LIMIT_KEYS = ("max_completion_tokens", "max_tokens")


@dataclass(frozen=True, slots=True)
class Shape:
    """What admission reads of a request body: the prompt's size and the completion's limit.

    ``media``: the prompt also has parts that count as no bytes (images, audio); vLLM's count
    of its tokens includes theirs, so it says nothing about the tokens a byte of text costs.
    """

    prompt_bytes: int
    max_tokens: int | None
    media: bool = False


def shape_of(payload: Any, path: str, *, whole: int) -> Shape:
    """The shape of a parsed body sent to ``path`` (``/v1/completions`` or ``CHAT_PATH``), read
    as vLLM reads it there; ``whole`` is the body's length. A body that is not an object has
    size 0 and no limit (vLLM answers its 400)."""
    if not isinstance(payload, dict):
        return Shape(0, None)
    chat = path == CHAT_PATH
    media = False
    if chat:
        prompt, media = _text_of(payload.get("messages"))
    else:
        prompt = payload.get("prompt", "")
    return Shape(_size(prompt, whole), _limit_of(payload, chat), media)


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
    ``max_completion_tokens`` leaves ``max_tokens`` in force."""
    keys = LIMIT_KEYS if chat else ("max_tokens",)
    limit = next((payload[key] for key in keys if payload.get(key)), None)
    return limit if _is_count(limit) else None


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


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


def with_max_tokens(payload: dict[str, Any], limit: int) -> dict[str, Any]:
    """The body with its completion limit at most ``limit``: every limit key it has is lowered
    (whichever one vLLM reads at its endpoint is then within the limit); one without any gets
    ``max_tokens``, which every vLLM reads on both endpoints."""
    present = [key for key in LIMIT_KEYS if key in payload] or ["max_tokens"]
    lowered = {key: _lowered(payload.get(key), limit) for key in present}
    return {**payload, **lowered}


def _lowered(value: Any, limit: int) -> int:
    return value if _is_count(value) and value <= limit else limit


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
        seen = prompt_tokens / prompt_bytes
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
    prompt_tokens: int, max_tokens: int | None, budget: int | None, over: OverBudget
) -> BudgetVerdict:
    """Whether prompt + max_tokens fits the per-request ``budget`` of tokens (None: no budget).

    A request without ``max_tokens`` is clamped to what the budget leaves (or rejected, in
    ``reject``). A prompt that leaves no room is always rejected.
    """
    if budget is None:
        return BudgetVerdict("ok")
    room = budget - prompt_tokens
    if room < 1:
        return BudgetVerdict(
            "reject",
            message=f"the prompt (about {prompt_tokens} tokens) leaves no room in the "
            f"per-request budget of {budget} tokens (--admission.token-budget)",
        )
    if max_tokens is not None and max_tokens <= room:
        return BudgetVerdict("ok")
    if over == "clamp":
        return BudgetVerdict("clamp", room)
    stated = "no max_tokens" if max_tokens is None else f"max_tokens={max_tokens}"
    return BudgetVerdict(
        "reject",
        message=f"prompt (about {prompt_tokens} tokens) plus {stated} exceeds the per-request "
        f"budget of {budget} tokens (--admission.token-budget); ask for at most {room}",
    )
