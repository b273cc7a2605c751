"""A model's KV-cache shape, read from a Hugging Face ``config.json`` or given as flags.

What one token costs in the KV cache depends on the attention each layer runs:

- full attention (MHA, GQA, MQA): ``2 x kv_heads x head_dim`` elements per layer (K and V);
- MLA (DeepSeek-style compressed KV): one latent of ``kv_lora_rank + qk_rope_head_dim``
  elements per layer, shared by K and V;
- sliding-window layers cost the same per token, but hold at most ``window`` tokens of a
  sequence, so they stop growing once a sequence is longer than the window.

Layers that are not attention (Mamba, linear attention, convolutions) keep a fixed state per
sequence that vLLM sizes differently; :func:`shape_from_config` refuses such hybrids and names
the layer types it found, rather than print a number that leaves them out.

Example::

    >>> s = shape_from_flags(layers=32, kv_heads=8, head_dim=128, dtype="bfloat16")
    >>> s.elements_per_token()
    65536
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtax.errors import PlanError

__all__ = [
    "DTYPE_BYTES",
    "MAX_CONFIG_INT",
    "MAX_TOKENS",
    "KvShape",
    "config_int",
    "context_limit",
    "dtype_bytes",
    "language_config",
    "opt_config_int",
    "shape_from_config",
    "shape_from_flags",
    "show_number",
]

# Bytes per element of every dtype spelling vLLM's --dtype, --kv-cache-dtype and config.json use.
DTYPE_BYTES: Mapping[str, int] = {
    "float32": 4,
    "fp32": 4,
    "float": 4,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "bfloat16": 2,
    "bf16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_ds_mla": 1,
}
_ATTENTION_TYPES = {"full_attention", "attention", "global", "sliding_attention", "local"}
_SLIDING_TYPES = {"sliding_attention", "local"}
# Models whose every layer is a state-space or recurrent block: no per-token KV at all.
_STATE_SPACE_MODELS = {"mamba", "mamba2", "falcon_mamba", "rwkv", "rwkv6", "xlstm"}


def dtype_bytes(name: str, field: str) -> int:
    """Bytes per element of ``name``; a :class:`PlanError` naming ``field`` if unknown."""
    key = name.strip().lower().removeprefix("torch.")
    if key not in DTYPE_BYTES:
        known = ", ".join(sorted(DTYPE_BYTES))
        raise PlanError(field, f"unknown dtype {name!r} (known: {known})")
    return DTYPE_BYTES[key]


@dataclass(frozen=True, slots=True)
class KvShape:
    """Per-token KV elements of a model, layer kind by layer kind.

    ``full_layers`` hold every token of a sequence; ``sliding_layers`` hold at most
    ``sliding_window`` tokens. ``per_layer`` is the elements one token takes in one layer:
    ``2 x kv_heads x head_dim``, or the MLA latent. ``dtype`` is the model's own dtype, the
    KV cache's unless ``--kv-cache-dtype`` says otherwise.
    """

    name: str
    full_layers: int
    sliding_layers: int
    sliding_window: int | None
    per_layer: int
    kv_heads: int
    head_dim: int
    mla: bool
    dtype: str

    def elements_per_token(self) -> int:
        """Elements one token adds across all attention layers (sliding ones included)."""
        return self.per_layer * (self.full_layers + self.sliding_layers)

    def sequence_elements(self, tokens: int) -> int:
        """Elements a sequence of ``tokens`` holds: sliding layers stop at the window."""
        held = tokens if self.sliding_window is None else min(tokens, self.sliding_window)
        return self.per_layer * (self.full_layers * tokens + self.sliding_layers * held)

    def shards(self, tensor_parallel: int) -> int:
        """How many ways the KV of one token splits across ``tensor_parallel`` GPUs.

        KV heads split across ranks; with fewer heads than ranks each head is replicated, so
        the split stops at the head count. The MLA latent is replicated on every rank.
        """
        if self.mla:
            return 1
        return min(tensor_parallel, self.kv_heads)


# The largest value of each config.json (and flag) number kvtax plan believes: far above any
# published model (the largest have under 200 layers, 128 heads, head_dim 256 and a hidden size
# of 32,768), yet small enough that every product sizing takes stays exact and finite. A larger
# number is a corrupt or hostile file, refused naming the key, never an OverflowError.
MAX_CONFIG_INT: Mapping[str, int] = {
    "num_hidden_layers": 100_000,
    "num_attention_heads": 1_000_000,
    "num_key_value_heads": 1_000_000,
    "head_dim": 1_000_000,
    "hidden_size": 100_000_000,
    "kv_lora_rank": 1_000_000,
    "qk_rope_head_dim": 1_000_000,
    "attn_layer_period": 100_000,
    "attn_layer_offset": 100_000,
    # Read only to estimate the weights (.params): sizes, expert counts and layer pattern.
    "vocab_size": 100_000_000,
    "intermediate_size": 100_000_000,
    "moe_intermediate_size": 100_000_000,
    "shared_expert_intermediate_size": 100_000_000,
    "n_routed_experts": 1_000_000,
    "num_local_experts": 1_000_000,
    "num_experts": 1_000_000,
    "n_shared_experts": 1_000_000,
    "first_k_dense_replace": 100_000,
    "moe_layer_freq": 100_000,
    "decoder_sparse_step": 100_000,
    "q_lora_rank": 1_000_000,
    "qk_nope_head_dim": 1_000_000,
    "v_head_dim": 1_000_000,
}
# Token counts (a sliding window, the model's context): vLLM's max_model_len is an int32.
MAX_TOKENS = 2**31 - 1


def show_number(value: object) -> str:
    """``value`` for an error line: a huge integer by its digit count, not 400 digits."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**15:
        digits = len(str(abs(value))) if abs(value).bit_length() < 14_000 else "thousands of"
        return f"an integer of {digits} digits"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _bound(key: str) -> int:
    return MAX_CONFIG_INT.get(key, MAX_TOKENS)


def opt_config_int(
    cfg: Mapping[str, Any], key: str, source: str, prefix: str = "", *, minimum: int = 1
) -> int | None:
    """``cfg[key]`` as an integer from ``minimum`` to its bound; None when absent."""
    value = cfg.get(key)
    if value is None:
        return None
    top = _bound(key)
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= top:
        kind = "a positive integer" if minimum == 1 else f"an integer from {minimum}"
        raise PlanError(
            source, f"{prefix}{key} must be {kind} up to {top:,}, not {show_number(value)}"
        )
    return value


def config_int(cfg: Mapping[str, Any], key: str, source: str, prefix: str = "") -> int:
    """``cfg[key]`` as a positive integer up to its bound; a :class:`PlanError` when absent."""
    value = opt_config_int(cfg, key, source, prefix)
    if value is None:
        raise PlanError(source, f"{prefix}{key} is missing")
    return value


def context_limit(config: Mapping[str, Any], source: str) -> int | None:
    """The model's ``max_position_embeddings`` when it is an integer (None otherwise, as for
    configs that leave it out); a :class:`PlanError` when it is not positive. A huge one is
    harmless: the pool caps ``--max-model-len`` below it."""
    value = config.get("max_position_embeddings")
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    if value <= 0:
        raise PlanError(
            source, f"max_position_embeddings must be a positive integer, not {show_number(value)}"
        )
    return value


def _layer_types(
    cfg: Mapping[str, Any], layers: int, source: str, prefix: str = ""
) -> list[str] | None:
    """Per-layer attention kind, from whichever spelling the config uses; None if uniform."""
    types = cfg.get("layer_types")
    if isinstance(types, list):
        if len(types) != layers:
            raise PlanError(
                source,
                f"{prefix}layer_types has {len(types)} entries for {layers} num_hidden_layers",
            )
        return [str(t) for t in types]
    for key in ("layers_block_type", "hybrid_override_pattern", "block_types"):
        value = cfg.get(key)
        if value:
            if not isinstance(value, list | str):
                raise PlanError(source, f"{prefix}{key} must be a list or a string")
            return [str(t) for t in value]
    if cfg.get("attn_layer_period") is not None:  # Jamba: attention every Nth layer, else Mamba
        period = config_int(cfg, "attn_layer_period", source, prefix)
        offset = opt_config_int(cfg, "attn_layer_offset", source, prefix, minimum=0) or 0
        return ["attention" if i % period == offset else "mamba" for i in range(layers)]
    window = cfg.get("sliding_window")
    if not window or cfg.get("use_sliding_window") is False:
        return None
    pattern = cfg.get("sliding_window_pattern")
    if str(cfg.get("model_type", "")) == "gemma2":  # local and global layers alternate
        pattern = 2
    if isinstance(pattern, int) and pattern > 1:
        # Every pattern-th layer is global, the others slide (Gemma 2 and 3).
        return [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(layers)
        ]
    return ["sliding_attention"] * layers  # one window on every layer (Mistral 7B v0.1)


def language_config(config: Mapping[str, Any]) -> tuple[Mapping[str, Any], str]:
    """The language model's settings and the prefix errors name them by: multimodal wrappers
    keep them under ``text_config``."""
    text = config.get("text_config")
    if isinstance(text, Mapping):
        return text, "text_config."
    return config, ""


def shape_from_config(config: Mapping[str, Any], *, source: str = "config.json") -> KvShape:
    """The KV shape of a ``config.json`` already parsed; errors name ``source`` and the key."""
    model_type = str(config.get("model_type", ""))
    _refuse_state_space(model_type, source)
    cfg, at = language_config(config)
    layers = config_int(cfg, "num_hidden_layers", source, at)
    heads = config_int(cfg, "num_attention_heads", source, at)
    types = _layer_types(cfg, layers, source, at)
    if types is not None:
        _refuse_hybrid(types, layers, source)
    sliding = 0 if types is None else sum(t in _SLIDING_TYPES for t in types)
    window = opt_config_int(cfg, "sliding_window", source, at) if sliding else None
    dtype = str(
        cfg.get("torch_dtype") or cfg.get("dtype") or config.get("torch_dtype") or "bfloat16"
    )
    dtype_bytes(dtype, f"{source}: torch_dtype")
    kv = _heads(cfg, heads, source, at)
    return KvShape(
        name=model_type or ("mla" if kv.mla else "model"),
        full_layers=layers - sliding,
        sliding_layers=sliding,
        sliding_window=window,
        per_layer=kv.per_layer,
        kv_heads=kv.kv_heads,
        head_dim=kv.head_dim,
        mla=kv.mla,
        dtype=dtype,
    )


def _refuse_state_space(model_type: str, source: str) -> None:
    if model_type in _STATE_SPACE_MODELS:
        raise PlanError(
            source,
            f"model_type {model_type!r} has no attention layers (state-space model): "
            "its per-sequence state is not sized by kvtax plan",
        )


def _refuse_hybrid(types: list[str], layers: int, source: str) -> None:
    # A number that leaves out the Mamba or linear-attention state would look right and be wrong.
    other = sorted({t for t in types if t not in _ATTENTION_TYPES})
    if other:
        count = sum(t not in _ATTENTION_TYPES for t in types)
        raise PlanError(
            source,
            f"hybrid model: {count} of {layers} layers are {', '.join(map(repr, other))}, "
            "not attention; kvtax plan does not size their per-sequence state (unsupported)",
        )


@dataclass(frozen=True, slots=True)
class _Heads:
    """What one token costs in one attention layer, and the heads it splits into."""

    per_layer: int
    kv_heads: int
    head_dim: int
    mla: bool


def _heads(cfg: Mapping[str, Any], heads: int, source: str, at: str = "") -> _Heads:
    """MLA's shared latent when the config has ``kv_lora_rank``, else K and V per KV head."""
    if cfg.get("kv_lora_rank"):
        rank = config_int(cfg, "kv_lora_rank", source, at)
        rope = config_int(cfg, "qk_rope_head_dim", source, at)
        return _Heads(per_layer=rank + rope, kv_heads=1, head_dim=rank + rope, mla=True)
    kv_heads = opt_config_int(cfg, "num_key_value_heads", source, at)
    if kv_heads is None:
        # Falcon's multi_query flag means one KV head; otherwise no key means plain MHA.
        kv_heads = 1 if cfg.get("multi_query") else heads
    head_dim = opt_config_int(cfg, "head_dim", source, at)
    if head_dim is None:
        hidden = config_int(cfg, "hidden_size", source, at)
        if hidden < heads:
            raise PlanError(
                source,
                f"{at}hidden_size {hidden} is smaller than {at}num_attention_heads {heads}: "
                "no head_dim to derive (give head_dim)",
            )
        head_dim = hidden // heads
    return _Heads(
        per_layer=2 * kv_heads * head_dim, kv_heads=kv_heads, head_dim=head_dim, mla=False
    )


def shape_from_flags(
    *,
    layers: int,
    kv_heads: int,
    head_dim: int,
    dtype: str,
    sliding_layers: int = 0,
    sliding_window: int | None = None,
) -> KvShape:
    """A GQA/MQA/MHA shape from numbers given by hand (``--layers`` and friends)."""
    for flag, key, value in (
        ("--layers", "num_hidden_layers", layers),
        ("--kv-heads", "num_key_value_heads", kv_heads),
        ("--head-dim", "head_dim", head_dim),
    ):
        if not 0 < value <= _bound(key):
            top = _bound(key)
            raise PlanError(
                flag, f"must be a positive integer up to {top:,}, not {show_number(value)}"
            )
    if sliding_layers < 0 or sliding_layers > layers:
        raise PlanError("--sliding-layers", f"must be between 0 and --layers, not {sliding_layers}")
    if sliding_layers and not sliding_window:
        raise PlanError("--sliding-window", "is required when --sliding-layers is set")
    if sliding_layers and sliding_window is not None and not 0 < sliding_window <= MAX_TOKENS:
        raise PlanError(
            "--sliding-window",
            f"must be a positive integer up to {MAX_TOKENS:,}, not {show_number(sliding_window)}",
        )
    dtype_bytes(dtype, "--dtype")
    return KvShape(
        name="flags",
        full_layers=layers - sliding_layers,
        sliding_layers=sliding_layers,
        sliding_window=sliding_window if sliding_layers else None,
        per_layer=2 * kv_heads * head_dim,
        kv_heads=kv_heads,
        head_dim=head_dim,
        mla=False,
        dtype=dtype,
    )
