"""A model's weights estimated from its ``config.json``: the parameter count times the dtype.

This is what the web KV-cache calculators do when no checkpoint is at hand. Per layer:

- attention: the Q, K, V and O projections (``heads x head_dim`` for Q and O,
  ``kv_heads x head_dim`` for K and V; Qwen 2's biases), or MLA's low-rank projections
  (``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``,
  ``v_head_dim``);
- the MLP: ``3 x hidden x intermediate`` (gate, up, down; 2 for the ungated GPT-2 family), or on
  mixture-of-experts layers one such MLP per routed expert (``n_routed_experts``,
  ``num_local_experts`` or ``num_experts``, of ``moe_intermediate_size``) plus the shared ones
  (``n_shared_experts``, ``shared_expert_intermediate_size``) and the router. DeepSeek's first
  ``first_k_dense_replace`` layers stay dense, as do the layers off ``moe_layer_freq`` or
  Qwen's ``decoder_sparse_step``;
- two norms.

Plus the embedding, and the output head unless ``tie_word_embeddings``. DeepSeek-V3's
multi-token-prediction layer (``num_nextn_predict_layers``) is left out, as the published 671B
leaves it out; a multimodal model's vision encoder is not counted. The bytes are the count
times ``torch_dtype``, with the transformer blocks' linear layers at the checkpoint's
quantization (``quantization_config``: fp8, or ``bits``) when it says one.

Example (Llama 3.1 8B: 8.03B published)::

    >>> cfg = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
    ...        "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
    ...        "torch_dtype": "bfloat16"}
    >>> e = estimate_weights(cfg)
    >>> round(e.parameters / 1e9, 2), e.bytes / 2**30 > 14.9
    (8.03, True)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtax.errors import PlanError
from kvtax.tools.plan.modelcfg import config_int, dtype_bytes, language_config, opt_config_int

__all__ = ["MAX_ESTIMATE_BYTES", "WeightEstimate", "estimate_weights"]

# Above 1 PiB the numbers are not a model (the same bound as a checkpoint's byte counts).
MAX_ESTIMATE_BYTES = 2**50
# Model families whose MLP is up and down only (no gate), and whose configs tie the output head
# to the embedding when they do not say.
_UNGATED = {"gpt2", "gpt_neox", "gptj", "opt", "bloom", "falcon", "phi", "starcoder2", "mpt"}
_TIED_BY_DEFAULT = {"gemma", "gemma2", "gemma3", "gemma3_text", "gpt2", "opt", "bloom"}
_EXPERT_KEYS = ("n_routed_experts", "num_local_experts", "num_experts")
_FP8_METHODS = {"fp8", "fbgemm_fp8"}


@dataclass(frozen=True, slots=True)
class WeightEstimate:
    """The parameter count of a config, and the bytes its weights take."""

    parameters: int
    bytes: int
    dtype: str  # what the bytes assume: "bfloat16", or "fp8 (bfloat16 embeddings)"


def estimate_weights(config: Mapping[str, Any], source: str = "config.json") -> WeightEstimate:
    """The weights of ``config`` estimated; a :class:`PlanError` naming ``source`` and the key
    when a number it needs is missing or out of bounds."""
    cfg, at = language_config(config)
    model_type = str(cfg.get("model_type") or config.get("model_type") or "")
    e = _Reader(cfg, source, at)
    hidden = e.need("hidden_size")
    layers = e.need("num_hidden_layers")
    vocab = e.need("vocab_size")
    attention = _attention(e, cfg, hidden, model_type)
    dense, moe, moe_layers = _mlps(e, cfg, hidden, layers, model_type)
    norms = 2 * hidden
    blocks = layers * (attention + norms) + (layers - moe_layers) * dense + moe_layers * moe
    tied = cfg.get("tie_word_embeddings", config.get("tie_word_embeddings"))
    if tied is None:
        tied = model_type in _TIED_BY_DEFAULT
    embeddings = vocab * hidden * (1 if tied else 2) + hidden  # the final norm too
    dtype = str(
        cfg.get("torch_dtype") or cfg.get("dtype") or config.get("torch_dtype") or "bfloat16"
    )
    width = dtype_bytes(dtype, f"{source}: torch_dtype")
    linear_width, shown = _quantized(config.get("quantization_config"), width, dtype)
    linear = blocks - layers * norms
    total = blocks + embeddings
    size = linear * linear_width + (total - linear) * width
    if size > MAX_ESTIMATE_BYTES:
        raise PlanError(
            source,
            f"the weights estimated from it ({total:.3g} parameters) exceed 1 PiB: "
            "not a model's numbers (give --weights-gib)",
        )
    return WeightEstimate(parameters=total, bytes=int(size), dtype=shown)


class _Reader:
    """Integer keys of the language config, each within its bound (see ``MAX_CONFIG_INT``)."""

    def __init__(self, cfg: Mapping[str, Any], source: str, at: str) -> None:
        self.cfg, self.source, self.at = cfg, source, at

    def get(self, key: str, *, minimum: int = 1) -> int | None:
        return opt_config_int(self.cfg, key, self.source, self.at, minimum=minimum)

    def need(self, key: str) -> int:
        if self.cfg.get(key) is None:
            raise PlanError(
                self.source,
                f"{self.at}{key} is missing: the weights cannot be estimated "
                "(give --weights-gib, or a model directory with its safetensors)",
            )
        return config_int(self.cfg, key, self.source, self.at)


def _attention(e: _Reader, cfg: Mapping[str, Any], hidden: int, model_type: str) -> int:
    """Parameters of one layer's attention: projections (and Qwen 2's biases)."""
    heads = e.need("num_attention_heads")
    if cfg.get("kv_lora_rank"):  # MLA
        kv_rank = e.need("kv_lora_rank")
        rope = e.need("qk_rope_head_dim")
        nope = e.need("qk_nope_head_dim")
        v_dim = e.need("v_head_dim")
        q_rank = e.get("q_lora_rank")
        q_out = heads * (nope + rope)
        query = hidden * q_rank + q_rank + q_rank * q_out if q_rank else hidden * q_out
        kv = hidden * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + v_dim)
        return query + kv + heads * v_dim * hidden
    kv_heads = e.get("num_key_value_heads") or (1 if cfg.get("multi_query") else heads)
    head_dim = e.get("head_dim") or hidden // heads
    q, k = heads * head_dim, kv_heads * head_dim
    biases = q + 2 * k if cfg.get("attention_bias") or model_type.startswith("qwen2") else 0
    return hidden * (q + 2 * k) + q * hidden + biases


def _mlps(
    e: _Reader, cfg: Mapping[str, Any], hidden: int, layers: int, model_type: str
) -> tuple[int, int, int]:
    """One dense MLP's parameters, one MoE layer's, and how many layers are MoE."""
    matrices = 2 if model_type in _UNGATED else 3
    experts = next((n for key in _EXPERT_KEYS if (n := e.get(key, minimum=0))), 0)
    inter = e.get("intermediate_size")
    if inter is None:
        if model_type in _UNGATED:
            inter = 4 * hidden
        elif not experts or cfg.get("first_k_dense_replace"):
            inter = e.need("intermediate_size")
    dense = matrices * hidden * inter if inter else 0
    if not experts:
        return dense, 0, 0
    expert = e.get("moe_intermediate_size") or inter or e.need("moe_intermediate_size")
    shared = (e.get("n_shared_experts", minimum=0) or 0) * expert
    shared_size = e.get("shared_expert_intermediate_size")
    gate = 0
    if shared_size:  # Qwen MoE: one shared expert of its own size, behind a scalar gate
        shared, gate = shared + shared_size, hidden
    moe = matrices * hidden * (experts * expert + shared) + hidden * experts + gate
    return dense, moe, _moe_layer_count(e, cfg, layers)


def _moe_layer_count(e: _Reader, cfg: Mapping[str, Any], layers: int) -> int:
    """Layers with experts: DeepSeek's after ``first_k_dense_replace`` on ``moe_layer_freq``,
    Qwen's every ``decoder_sparse_step`` but ``mlp_only_layers``, else every layer."""
    first = e.get("first_k_dense_replace", minimum=0) or 0
    freq = e.get("moe_layer_freq") or 1
    step = e.get("decoder_sparse_step") or 1
    dense_only = cfg.get("mlp_only_layers")
    skip = {i for i in dense_only if isinstance(i, int)} if isinstance(dense_only, list) else set()
    return sum(
        1
        for i in range(layers)
        if i >= first and i % freq == 0 and (i + 1) % step == 0 and i not in skip
    )


def _quantized(quant: object, width: int, dtype: str) -> tuple[float, str]:
    """Bytes per parameter of the blocks' linear layers under ``quantization_config``, and
    the dtype as the report names it."""
    if not isinstance(quant, Mapping):
        return float(width), dtype
    method = str(quant.get("quant_method", "")).lower()
    bits = quant.get("bits", quant.get("w_bit"))
    if method in _FP8_METHODS:
        return 1.0, f"fp8 ({dtype} embeddings and norms)"
    if method == "mxfp4":
        bits = 4
    if isinstance(bits, int) and not isinstance(bits, bool) and 1 <= bits <= 16:
        return bits / 8, f"{bits}-bit {method or 'quantized'} ({dtype} embeddings and norms)"
    return float(width), f"{dtype} (quantization_config {method or '?'} not modelled)"
