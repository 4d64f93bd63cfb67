"""What each Hugging Face model family adds to the Llama block: its parameter names and its config.json fields,
mapped onto ModelConfig's options (npllm/config.py) and the canonical weight names (npllm/formats/__init__.py).

    llama      the reference block
    mistral    + a sliding window in every layer
    qwen2      + biases on q/k/v
    qwen3      + RMSNorm of each query and key head (q_norm, k_norm)
    qwen3_moe  qwen3 + a mixture of experts in place of the FFN (top-k of a softmax router, optionally renormalised)
    mixtral    mistral + a mixture of experts (top-k renormalised)
    olmo2      norms after attention and FFN instead of before (block_norms "post"), q/k norm over the projection
    granite    + multipliers of the embedding, the residual branches, the attention scores and the logits
    granitemoe granite + a mixture of experts (top-k renormalised), each expert's gate and up fused
    gemma2     GeGLU, (1 + w) norms before and after each block, embeddings x sqrt(D), soft-capped scores and
               logits, sliding window on alternate layers, scores scaled by query_pre_attn_scalar^-1/2
    gemma3     gemma2's block without soft-caps, + q/k norm, 5 sliding layers to 1 global, local RoPE base
    phi3       fused qkv_proj and gate_up_proj (split at load), longrope scaling, partial_rotary_factor
    smollm3    + layers without RoPE (no_rope_layers: NoPE), which alone slide where use_sliding_window says so

A Family record holds the names and a function from config.json to the ModelConfig keywords beyond the common ones;
hf.py does the rest once for all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from ..config import RopeScaling
from ..errors import ConfigError

# HF parameter name (after "model.layers.{l}.") -> canonical name, for the Llama block.
LLAMA_NAMES = {
    "input_layernorm.weight": "attention_norm",
    "self_attn.q_proj.weight": "wq",
    "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv",
    "self_attn.o_proj.weight": "wo",
    "self_attn.q_proj.bias": "bq",
    "self_attn.k_proj.bias": "bk",
    "self_attn.v_proj.bias": "bv",
    "post_attention_layernorm.weight": "ffn_norm",
    "mlp.gate_proj.weight": "w1",
    "mlp.down_proj.weight": "w2",
    "mlp.up_proj.weight": "w3",
}
QK_NORM_NAMES = {"self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm"}
# Gemma's four norms: HF's post_attention_layernorm is the norm *after* attention here, not Llama's pre-FFN norm.
SANDWICH_NAMES = {"input_layernorm.weight": "attention_norm", "post_attention_layernorm.weight": "post_attention_norm",
                  "pre_feedforward_layernorm.weight": "ffn_norm",
                  "post_feedforward_layernorm.weight": "post_ffn_norm"}
POST_NAMES = {"post_attention_layernorm.weight": "post_attention_norm",
              "post_feedforward_layernorm.weight": "post_ffn_norm"}
# Phi-3 fuses projections; hf.py splits these two into wq/wk/wv and w1/w3.
FUSED_NAMES = {"self_attn.qkv_proj.weight": "wqkv", "mlp.gate_up_proj.weight": "w13"}
# Routers, by family spelling; the experts' own names are matched by hf.EXPERT_PARAM.
ROUTER_NAMES = {"mlp.gate.weight": "router", "block_sparse_moe.gate.weight": "router"}
# Granite's mixture stores every expert in one 3-D tensor, gate and up fused (split at load like Phi-3's).
GRANITE_MOE_NAMES = {"block_sparse_moe.router.layer.weight": "router", "block_sparse_moe.input_linear.weight": "w13_exps",
                     "block_sparse_moe.output_linear.weight": "w2_exps"}


GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")  # two spellings of GELU's tanh approximation


@dataclass(frozen=True)
class Family:
    names: dict  # HF layer parameter suffix -> canonical name
    options: Callable[[dict, str, Callable], dict] = lambda cfg, source, field: {}  # config.json -> ModelConfig keywords
    norm_offset: float = 0.0  # added to every RMSNorm gain at load: Gemma computes x * (1 + w)
    tied_default: bool = False  # tie_word_embeddings when config.json does not say
    attention_bias: bool = False
    # how layers slide: "none" (Llama), "config" (sliding_window / layer_types), "qwen", "opt-in" (SmolLM3)
    sliding: str = "config"
    rope_kinds: tuple = ("linear", "llama3", "yarn", "dynamic")  # the RoPE scalings the family's configs may name
    activations: tuple = ("silu",)  # hidden_act values the family's FFN implements


def _qwen3_moe(cfg: dict, source: str, get) -> dict:
    if cfg.get("mlp_only_layers") or get(cfg, "decoder_sparse_step", source, default=1) != 1:
        raise ConfigError(f"{source}: dense layers mixed with expert layers (mlp_only_layers, decoder_sparse_step) "
                          "are not supported")
    experts = "num_experts" if "num_experts" in cfg else "num_local_experts"  # transformers writes either
    return dict(qk_norm="head", n_experts=get(cfg, experts, source),
                n_experts_used=get(cfg, "num_experts_per_tok", source),
                expert_hidden_dim=get(cfg, "moe_intermediate_size", source),
                expert_weights_norm=get(cfg, "norm_topk_prob", source, bool, default=False))


def _mixtral(cfg: dict, source: str, get) -> dict:
    return dict(n_experts=get(cfg, "num_local_experts", source), n_experts_used=get(cfg, "num_experts_per_tok", source))


def _granite(cfg: dict, source: str, get) -> dict:
    scaling = get(cfg, "logits_scaling", source, float, default=1.0)
    if not scaling > 0:
        raise ConfigError(f"{source}: logits_scaling must be > 0, got {scaling}")
    return dict(embedding_multiplier=get(cfg, "embedding_multiplier", source, float, default=1.0),
                residual_multiplier=get(cfg, "residual_multiplier", source, float, default=1.0),
                attention_scale=get(cfg, "attention_multiplier", source, float, default=0.0),
                logit_multiplier=1.0 / scaling)


def _granite_moe(cfg: dict, source: str, get) -> dict:
    """Granite's multipliers, and experts of intermediate_size each: top-k of the router's logits, softmaxed."""
    return _granite(cfg, source, get) | _mixtral(cfg, source, get) | dict(
        expert_hidden_dim=get(cfg, "intermediate_size", source))


def _gemma(cfg: dict, source: str, get) -> dict:
    """What Gemma 2 and 3 share: GeGLU, sandwich norms, sqrt(D) embeddings, query_pre_attn_scalar."""
    scalar = get(cfg, "query_pre_attn_scalar", source, float)
    if not scalar > 0:
        raise ConfigError(f"{source}: query_pre_attn_scalar must be > 0, got {scalar}")
    return dict(ffn_activation="gelu_tanh", block_norms="sandwich",
                embedding_multiplier=math.sqrt(get(cfg, "hidden_size", source)), attention_scale=scalar ** -0.5,
                attn_logit_softcap=get(cfg, "attn_logit_softcapping", source, float, required=False) or 0.0,
                final_logit_softcap=get(cfg, "final_logit_softcapping", source, float, required=False) or 0.0)


def _smollm3(cfg: dict, source: str, get) -> dict:
    return dict(rope_layers=rope_layers(cfg, get(cfg, "num_hidden_layers", source), source, get))


def rope_layers(cfg: dict, n_layers: int, source: str, get) -> tuple[bool, ...]:
    """SmolLM3's per-layer RoPE flags: `no_rope_layers` (1: the layer rotates, 0: NoPE; despite its name), or
    without it every `no_rope_layer_interval`-th layer (default 4) without RoPE, as transformers fills it in."""
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = get(cfg, "no_rope_layer_interval", source, default=4)
        if interval <= 0:
            raise ConfigError(f"{source}: no_rope_layer_interval must be positive, got {interval}")
        return tuple((l + 1) % interval != 0 for l in range(n_layers))
    if not (isinstance(flags, list) and len(flags) == n_layers and all(f in (0, 1) for f in flags)):
        raise ConfigError(f"{source}: 'no_rope_layers' must list a 0 or 1 per layer ({n_layers}), got {flags!r}")
    return tuple(bool(f) for f in flags)


def _gemma3(cfg: dict, source: str, get) -> dict:
    return _gemma(cfg, source, get) | dict(qk_norm="head")


FAMILIES = {
    "llama": Family(LLAMA_NAMES, sliding="none"),
    "mistral": Family(LLAMA_NAMES),
    "qwen2": Family(LLAMA_NAMES, attention_bias=True, sliding="qwen"),
    "qwen3": Family(LLAMA_NAMES | QK_NORM_NAMES, lambda cfg, source, get: dict(qk_norm="head"), sliding="qwen"),
    "qwen3_moe": Family(LLAMA_NAMES | QK_NORM_NAMES | ROUTER_NAMES, _qwen3_moe, sliding="qwen"),
    "mixtral": Family(LLAMA_NAMES | ROUTER_NAMES, _mixtral),
    "olmo2": Family(LLAMA_NAMES | POST_NAMES | QK_NORM_NAMES,
                    lambda cfg, source, get: dict(block_norms="post", qk_norm="projection"), sliding="none"),
    "granite": Family(LLAMA_NAMES, _granite, sliding="none"),
    "granitemoe": Family({k: v for k, v in LLAMA_NAMES.items() if not k.startswith("mlp.")} | GRANITE_MOE_NAMES,
                         _granite_moe, sliding="none"),
    "gemma2": Family(LLAMA_NAMES | SANDWICH_NAMES, _gemma, norm_offset=1.0, tied_default=True, activations=GELU_TANH),
    "gemma3_text": Family(LLAMA_NAMES | SANDWICH_NAMES | QK_NORM_NAMES, _gemma3, norm_offset=1.0, tied_default=True,
                          activations=GELU_TANH),
    "phi3": Family(LLAMA_NAMES | FUSED_NAMES, rope_kinds=("linear", "llama3", "yarn", "dynamic", "longrope")),
    "smollm3": Family(LLAMA_NAMES, _smollm3, tied_default=True, sliding="opt-in"),
}


def longrope(spec: dict, cfg: dict, source: str, get) -> RopeScaling:
    """Phi-3's longrope ("su") scaling. attention_factor, when config.json does not give it, is
    sqrt(1 + ln(s) / ln(original)) for s = max_position_embeddings / original > 1 (1 otherwise), as Phi-3 defines it.
    """
    where = source + " longrope scaling"
    original = spec.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
    original = get({"original_max_position_embeddings": original}, "original_max_position_embeddings", where)
    if original <= 0:
        raise ConfigError(f"{where}: original_max_position_embeddings must be positive, got {original}")
    factor = get(cfg, "max_position_embeddings", source) / original
    attention = get(spec, "attention_factor", where, float, required=False)
    if attention is None and factor > 1 and original < 2:  # ln(1) = 0 divides below
        raise ConfigError(f"{where}: original_max_position_embeddings {original} leaves attention_factor undefined")
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    short, long = spec.get("short_factor"), spec.get("long_factor")
    if not (isinstance(short, list) and isinstance(long, list)):
        raise ConfigError(f"{where}: short_factor and long_factor must be lists of numbers")
    try:
        return RopeScaling("longrope", factor=factor, original_max_position_embeddings=original,
                           short_factor=tuple(map(float, short)), long_factor=tuple(map(float, long)),
                           attention_factor=attention)
    except (TypeError, ValueError, OverflowError) as e:  # OverflowError: an integer past float's range
        raise ConfigError(f"{where}: {e}") from None


def _original_context(spec: dict, cfg: dict, where: str, get) -> int:
    """original_max_position_embeddings: inside the RoPE parameters, else at the top level (Phi-3 keeps it there),
    else max_position_embeddings, as transformers fills it in."""
    original = spec.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
    if original is None:
        original = cfg.get("max_position_embeddings")
    original = get({"original_max_position_embeddings": original}, "original_max_position_embeddings", where)
    if original <= 0:
        raise ConfigError(f"{where}: original_max_position_embeddings must be positive, got {original}")
    return original


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature: 0.1 mscale ln(factor) + 1 (1 for factor <= 1)."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def yarn(spec: dict, cfg: dict, source: str, get) -> RopeScaling:
    """YaRN scaling as transformers reads it: factor (default max_position_embeddings / original), beta_fast and
    beta_slow (32 and 1 when absent or 0), truncate (default true), and the attention factor: attention_factor as
    given, else mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are given (DeepSeek), else
    0.1 ln(factor) + 1."""
    where = source + " yarn scaling"
    original = _original_context(spec, cfg, where, get)
    factor = get(spec, "factor", where, float, required=False)
    if factor is None:
        factor = get(cfg, "max_position_embeddings", source) / original
    attention = get(spec, "attention_factor", where, float, required=False)
    mscale = get(spec, "mscale", where, float, required=False)
    mscale_all_dim = get(spec, "mscale_all_dim", where, float, required=False)
    if attention is None and mscale and mscale_all_dim:
        attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    elif attention is None and (mscale not in (None, 1.0) or mscale_all_dim not in (None, 0.0)):
        # transformers drops one without the other, DeepSeek's own code does not: no one answer to give
        raise ConfigError(f"{where}: mscale {mscale} with mscale_all_dim {mscale_all_dim} (one of them unset or 0) "
                          "is not supported")
    elif attention is None:
        attention = _yarn_mscale(factor)
    truncate = get(spec, "truncate", where, bool, default=True)
    return RopeScaling("yarn", factor=factor, original_max_position_embeddings=original,
                       beta_fast=get(spec, "beta_fast", where, float, required=False) or 32.0,
                       beta_slow=get(spec, "beta_slow", where, float, required=False) or 1.0,
                       truncate=truncate, attention_factor=attention)


def dynamic_ntk(spec: dict, cfg: dict, source: str, get) -> RopeScaling:
    """Dynamic NTK scaling: `factor`, and the context past which the base grows, max_position_embeddings
    (transformers 5 takes that one, not an original_max_position_embeddings, for this kind)."""
    where = source + " dynamic scaling"
    return RopeScaling("dynamic", factor=get(spec, "factor", where, float),
                       original_max_position_embeddings=get(cfg, "max_position_embeddings", source))
