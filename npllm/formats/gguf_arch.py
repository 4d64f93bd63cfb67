"""The model families of GGUF files: each llama.cpp architecture's metadata keys and tensor names mapped onto
ModelConfig's options (npllm/config.py) and the canonical weight names (npllm/formats/__init__.py), as llama.cpp's
loader reads them (src/llama-model.cpp, src/models/<arch>.cpp) and its converter writes them (convert_hf_to_gguf.py).

    llama       Llama, Mistral, SmolLM; Mixtral too (expert_count > 0, router ffn_gate_inp, 3-D ffn_*_exps)
    qwen2       + q/k/v biases
    qwen3       + RMSNorm of each query and key head (attn_q_norm, attn_k_norm [Dh])
    qwen3moe    qwen3 + experts (expert_feed_forward_length wide; without it feed_forward_length / expert_used_count)
    gemma2      GeGLU, norms before and after each block (post_attention_norm, post_ffw_norm), embeddings x sqrt(D),
                soft-capped scores and logits (50 and 30 when the file does not say), a sliding window (4096 when
                not given) on the even layers
    gemma3      gemma2's block without the score soft-cap, + q/k norm; 5 sliding layers of every 6, whose RoPE base
                is rope.freq_base_swa (10000 when not given)
    phi3        fused attn_qkv and ffn_up (gate rows, then up rows), split at load; longrope scaling from the
                rope_factors_long / rope_factors_short tensors
    olmo2       norms after attention and FFN only, q/k norm over the whole projection ([H Dh], [K Dh])
    granite     embedding, residual, attention and logit scales; granitemoe: + experts

What llama.cpp's converter does to the weights, and so how they are read:
- q/k rows: for llama and granite (llama.cpp's "normal" RoPE on pairs (2i, 2i+1)) the converter permutes Hugging
  Face's half-split rows to the interleaved layout; every other family keeps HF's rows and llama.cpp runs them with
  NeoX RoPE: rope_layout "half".
- Gemma's norms compute x * (1 + w); the converter stores w + 1 (q/k norms included): read as they are.
- Experts: one 3-D tensor per projection, ne {D, Fe, E} -> NumPy [E, Fe, D] = w1_exps / w3_exps as they are.

Where llama.cpp itself departs from the model it converts, npllm follows the model: Phi-3's sliding window (which
llama.cpp switches off with a warning) applies here to every layer, as in transformers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..config import RopeScaling
from ..errors import ConfigError, FormatError

GLOBAL_NAMES = {"token_embd.weight": "tok_embeddings", "output_norm.weight": "norm", "output.weight": "output"}
# llama.cpp's tensor name after "blk.{l}." -> canonical name
LAYER_NAMES = {
    "attn_norm.weight": "attention_norm", "attn_q.weight": "wq", "attn_k.weight": "wk", "attn_v.weight": "wv",
    "attn_output.weight": "wo", "attn_q.bias": "bq", "attn_k.bias": "bk", "attn_v.bias": "bv",
    "ffn_norm.weight": "ffn_norm", "ffn_gate.weight": "w1", "ffn_down.weight": "w2", "ffn_up.weight": "w3",
    "attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm",
    "post_attention_norm.weight": "post_attention_norm", "post_ffw_norm.weight": "post_ffn_norm",
    "ffn_gate_inp.weight": "router", "ffn_gate_exps.weight": "w1_exps", "ffn_down_exps.weight": "w2_exps",
    "ffn_up_exps.weight": "w3_exps",
    # Fused by the converter (--fuse-qkv, --fuse-gate-up-exps; any family): split at load. attn_qkv [(H + 2K) Dh, D]
    # into wq, wk, wv (its bias into bq, bk, bv); ffn_gate_up_exps [E, 2 Fe, D] into w1_exps (gate first), w3_exps.
    "attn_qkv.weight": "wqkv", "attn_qkv.bias": "bqkv", "ffn_gate_up_exps.weight": "w13_exps",
}
# Phi-3's ffn_up holds gate and up: [2F, D], gate rows first (ggml's swiglu of one tensor takes its first half).
PHI3_NAMES = LAYER_NAMES | {"ffn_up.weight": "w13"}
ROPE_FREQS = "rope_freqs.weight"  # Llama 3's RoPE divisors [Dh/2]
ROPE_LONG, ROPE_SHORT = "rope_factors_long.weight", "rope_factors_short.weight"  # Phi-3's longrope divisors
CONFIG_TENSORS = (ROPE_FREQS, ROPE_LONG, ROPE_SHORT)  # read into the config, not weights


def meta(g, key: str, kind=int, default=None, required=True):
    """Metadata `key` of a GGUFFile as `kind` (int, float, str, bool), `default` when absent; absent without a
    default is a ConfigError when required, else None."""
    value = g.metadata.get(key, default)
    if value is None:
        if required:
            raise ConfigError(f"{g.path}: metadata {key!r} is missing")
        return None
    ok = isinstance(value, (int, float)) if kind is float else isinstance(value, kind)
    if isinstance(value, bool) and kind is not bool or not ok:
        raise ConfigError(f"{g.path}: metadata {key!r} should be {kind.__name__}, got {value!r:.80}")
    if kind is float and not math.isfinite(value):
        raise ConfigError(f"{g.path}: metadata {key!r} must be a finite number, got {value}")
    return kind(value)


@dataclass(frozen=True)
class Family:
    """One llama.cpp architecture: npllm's name for it, the q/k row layout its files hold, its tensor names, and a
    function (GGUFFile, key prefix "<arch>.", the common config fields) -> the ModelConfig keywords beyond them."""

    arch: str
    rope_layout: str  # "interleaved": rows permuted by the converter (llama.cpp's normal RoPE) | "half": HF's rows
    options: Callable[[object, str, dict], dict] = lambda g, p, base: {}
    names: dict = field(default_factory=lambda: LAYER_NAMES)
    # Sliding windows as llama.cpp's loader sets them; None: the family ignores sliding_window. Else the default
    # period n of the pattern (layer l slides when l % n < n - 1; 0: every layer), the window when the file names
    # none (0: no window), and the sliding layers' RoPE base when rope.freq_base_swa is absent (0: rope_theta).
    swa_period: int | None = None
    swa_window: int = 0
    swa_theta: float = 0.0
    expert_ff_per_used: bool = False  # Fe defaults to feed_forward_length / expert_used_count (Qwen3-MoE)


def _gemma_scale(base: dict, layers_of_27b: int) -> float:
    """llama.cpp's query scale for Gemma: 1/sqrt(Dh) (0 here), except for the 27B models, known by their layer
    count, whose query_pre_attn_scalar is D / H: 1/sqrt(D // H)."""
    return 1.0 / math.sqrt(base["dim"] // base["n_heads"]) if base["n_layers"] == layers_of_27b else 0.0


def _gemma2(g, p: str, base: dict) -> dict:
    return dict(ffn_activation="gelu_tanh", block_norms="sandwich", embedding_multiplier=math.sqrt(base["dim"]),
                attention_scale=_gemma_scale(base, 46),
                attn_logit_softcap=meta(g, p + "attn_logit_softcapping", float, default=50.0),
                final_logit_softcap=meta(g, p + "final_logit_softcapping", float, default=30.0))


def _gemma3(g, p: str, base: dict) -> dict:
    return dict(ffn_activation="gelu_tanh", block_norms="sandwich", embedding_multiplier=math.sqrt(base["dim"]),
                attention_scale=_gemma_scale(base, 62), qk_norm="head",
                final_logit_softcap=meta(g, p + "final_logit_softcapping", float, default=0.0))


def _granite(g, p: str, base: dict) -> dict:
    """Granite's four scales; a scale of 0 (llama.cpp's "not set") is no scaling."""
    logit_scale = meta(g, p + "logit_scale", float)
    if not logit_scale > 0:
        raise ConfigError(f"{g.path}: {p}logit_scale must be > 0, got {logit_scale}")
    if not meta(g, p + "rope.scaling.finetuned", bool, default=True):
        raise ConfigError(f"{g.path}: Granite without RoPE ({p}rope.scaling.finetuned false) is not supported")
    return dict(embedding_multiplier=meta(g, p + "embedding_scale", float, default=0.0) or 1.0,
                residual_multiplier=meta(g, p + "residual_scale", float, default=0.0) or 1.0,
                attention_scale=meta(g, p + "attention.scale", float, default=0.0),
                logit_multiplier=1.0 / logit_scale)


def _qk_norm(g, p: str, base: dict) -> dict:
    return dict(qk_norm="head")


def _olmo2(g, p: str, base: dict) -> dict:
    return dict(block_norms="post", qk_norm="projection")


def _smollm3(g, p: str, base: dict) -> dict:
    """SmolLM3: every 4th layer without RoPE, a rule llama.cpp builds in (its converter writes no no_rope_layers)."""
    return dict(rope_layers=tuple((l + 1) % 4 != 0 for l in range(base["n_layers"])))


FAMILIES = {
    "llama": Family("llama", "interleaved"),
    "qwen2": Family("qwen2", "half"),
    "qwen3": Family("qwen3", "half", _qk_norm),
    "qwen3moe": Family("qwen3_moe", "half", _qk_norm, expert_ff_per_used=True),
    "gemma2": Family("gemma2", "half", _gemma2, swa_period=2, swa_window=4096),
    "gemma3": Family("gemma3", "half", _gemma3, swa_period=6, swa_theta=10000.0),
    "phi3": Family("phi3", "half", names=PHI3_NAMES, swa_period=0),
    "olmo2": Family("olmo2", "half", _olmo2, swa_period=4),
    "granite": Family("granite", "interleaved", _granite),
    "granitemoe": Family("granitemoe", "interleaved", _granite),
    "smollm3": Family("smollm3", "interleaved", _smollm3),
}


def family_of(g) -> Family:
    """The Family of a GGUFFile's general.architecture, or a ConfigError naming those npllm runs."""
    gguf_arch = g.metadata.get("general.architecture")
    if gguf_arch not in FAMILIES:
        raise ConfigError(f"{g.path}: general.architecture {gguf_arch!r:.80} is not one npllm runs "
                          f"({', '.join(FAMILIES)})")
    return FAMILIES[gguf_arch]


def family_options(g, p: str, family: Family, base: dict) -> dict:
    """Every ModelConfig keyword the family sets beyond the common fields in `base`: its own options, its sliding
    window and its experts."""
    options = family.options(g, p, base) | _sliding(g, p, family, base["n_layers"]) | _experts(g, p, family, base)
    # llama.cpp writes Mixtral as a "llama" with experts: named for what it is (its chat layout, `npllm info`)
    mixtral = family.arch == "llama" and options.get("n_experts")
    return options | dict(arch="mixtral" if mixtral else family.arch)


def _sliding(g, p: str, family: Family, n_layers: int) -> dict:
    """sliding_window, sliding_layers and rope_local_theta, as llama.cpp's loader sets them for the family."""
    if family.swa_period is None:
        return {}
    window = meta(g, p + "attention.sliding_window", default=family.swa_window)
    if window == 0:  # Phi-3 files write 0 for "no window"
        return {}
    theta = meta(g, p + "rope.freq_base_swa", float, default=family.swa_theta)
    return dict(sliding_window=window, sliding_layers=_sliding_layers(g, p, family.swa_period, n_layers),
                rope_local_theta=theta)


def _sliding_layers(g, p: str, period: int, n_layers: int) -> tuple[bool, ...]:
    """Which layers slide: attention.sliding_window_pattern, a flag per layer or a period n (layer l slides when
    l % n < n - 1, llama.cpp's rule; 0: every layer, given as ()), else the family's period."""
    key = p + "attention.sliding_window_pattern"
    pattern = g.metadata.get(key, period)
    if isinstance(pattern, np.ndarray) and pattern.dtype.kind in "biu":
        if pattern.shape != (n_layers,) or pattern.max(initial=0) > 1 or pattern.min(initial=0) < 0:
            raise ConfigError(f"{g.path}: {key} must flag each of the {n_layers} layers, got {pattern!r:.80}")
        return tuple(bool(s) for s in pattern)
    if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 0:
        raise ConfigError(f"{g.path}: {key} must be a period >= 0 or a flag per layer, got {pattern!r:.80}")
    return tuple(l % pattern < pattern - 1 for l in range(n_layers)) if pattern else ()


def _experts(g, p: str, family: Family, base: dict) -> dict:
    """n_experts, n_experts_used, expert_hidden_dim, expert_weights_norm of a mixture of experts (nothing for a
    dense model). llama.cpp renormalises the top-k router weights for every family here (Mixtral, Qwen3-MoE,
    Granite-MoE) and its converter stores no flag; a file's expert_weights_norm key is taken where present."""
    n = meta(g, p + "expert_count", default=0)
    if n == 0:
        return {}
    for key in ("expert_shared_count", "expert_shared_feed_forward_length"):
        if meta(g, p + key, default=0):
            raise ConfigError(f"{g.path}: shared experts ({p}{key}) are not supported")
    used = meta(g, p + "expert_used_count")
    if not 0 < used <= n:
        raise ConfigError(f"{g.path}: {p}expert_used_count {used} must be in [1, expert_count {n}]")
    hidden = base["hidden_dim"]
    width = meta(g, p + "expert_feed_forward_length", default=hidden // used if family.expert_ff_per_used else hidden)
    return dict(n_experts=n, n_experts_used=used, expert_hidden_dim=0 if width == hidden else width,
                expert_weights_norm=meta(g, p + "expert_weights_norm", bool, default=True))


def longrope(g, p: str, context: int) -> RopeScaling | None:
    """Phi-3's longrope scaling as llama.cpp reads it, or None when the file has no rope_factors tensors:
    rope_factors_long / rope_factors_short [Dh/2] divide the inverse frequencies (long ones when the model runs
    past rope.scaling.original_context_length, default context_length); cos and sin are multiplied by
    rope.scaling.attn_factor (default 1; the converter writes sqrt(1 + ln s / ln original), s = context / original).
    """
    present = [name for name in (ROPE_LONG, ROPE_SHORT) if name in g.tensors]
    if not present:
        return None
    if len(present) == 1:
        raise FormatError(f"{g.path}: {present[0]} without its partner: longrope needs both factor lists")
    original = meta(g, p + "rope.scaling.original_context_length", default=context)
    if original <= 0:
        raise ConfigError(f"{g.path}: {p}rope.scaling.original_context_length must be positive, got {original}")
    try:
        return RopeScaling("longrope", factor=context / original, original_max_position_embeddings=original,
                           short_factor=tuple(g.tensor(ROPE_SHORT).ravel()),
                           long_factor=tuple(g.tensor(ROPE_LONG).ravel()),
                           attention_factor=meta(g, p + "rope.scaling.attn_factor", float, default=1.0))
    except ConfigError as e:
        raise ConfigError(f"{g.path}: {e}") from None


def has_biases(g) -> bool:
    """Whether the q/k/v projections carry biases (llama.cpp reads them wherever a file has them)."""
    return any(f"blk.0.{name}" in g.tensors for name in ("attn_q.bias", "attn_qkv.bias"))


def canonical_name(gguf_name: str, names: dict = LAYER_NAMES) -> str:
    """llama.cpp's tensor name -> canonical name ('blk.3.attn_q.weight' -> 'layers.3.wq'), by the family's names."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in names:
        return f"layers.{int(parts[1])}.{names[parts[2]]}"
    raise FormatError(f"unexpected tensor {gguf_name!r}: not a tensor of a model npllm knows")


def split_fused(config, weights: dict, source: str) -> dict:
    """The canonical set from what the file names: fused attn_qkv (wqkv, bqkv), Phi-3's ffn_up (w13) and
    ffn_gate_up_exps (w13_exps) split into wq, wk, wv (bq, bk, bv), w1, w3 and w1_exps, w3_exps (a QuantizedMatrix
    splits into views of its rows, kept in its type)."""
    from .hf import split_fused_layer  # the one split of weights, shared with the Hugging Face reader

    out = dict(weights)
    HD, KD = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    for l in range(config.n_layers):
        prefix = f"layers.{l}."
        out |= split_fused_layer(config, out, prefix, source)
        bias = out.pop(prefix + "bqkv", None)
        if bias is not None:
            if bias.shape != (HD + 2 * KD,):
                raise FormatError(f"{source}: {prefix}bqkv has shape {bias.shape}, the config implies "
                                  f"({HD + 2 * KD},)")
            out |= {prefix + "bq": bias[:HD], prefix + "bk": bias[HD:HD + KD], prefix + "bv": bias[HD + KD:]}
    return out


def yarn(g, p: str, context: int) -> RopeScaling:
    """YaRN as llama.cpp's converter writes it: rope.scaling.factor, rope.scaling.original_context_length (default
    context_length), rope.scaling.yarn_beta_fast / yarn_beta_slow (default 32 and 1), and the attention factor:
    rope.scaling.yarn_attn_factor where the converter wrote config.json's attention_factor, else
    0.1 ln(factor) + 1, times rope.scaling.attn_factor (default 1). llama.cpp itself reads the yarn_beta_* and
    yarn_attn_factor keys for a few architectures only (not llama, qwen2, qwen3...); npllm takes the model's values
    wherever the file carries them. yarn_ext_factor other than 1 and yarn_log_multiplier (DeepSeek's mscale_all_dim,
    whose meaning llama.cpp special-cases by architecture) are refused."""
    if meta(g, p + "rope.scaling.yarn_ext_factor", float, default=1.0) != 1.0:
        raise ConfigError(f"{g.path}: {p}rope.scaling.yarn_ext_factor other than 1 is not supported")
    if meta(g, p + "rope.scaling.yarn_log_multiplier", float, default=0.0) != 0.0:
        raise ConfigError(f"{g.path}: {p}rope.scaling.yarn_log_multiplier (mscale_all_dim) is not supported")
    factor = meta(g, p + "rope.scaling.factor", float)
    original = meta(g, p + "rope.scaling.original_context_length", default=context)
    if original <= 0:
        raise ConfigError(f"{g.path}: {p}rope.scaling.original_context_length must be positive, got {original}")
    mscale = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    attention = meta(g, p + "rope.scaling.yarn_attn_factor", float, default=mscale)
    return RopeScaling("yarn", factor=factor, original_max_position_embeddings=original,
                       beta_fast=meta(g, p + "rope.scaling.yarn_beta_fast", float, default=32.0),
                       beta_slow=meta(g, p + "rope.scaling.yarn_beta_slow", float, default=1.0),
                       attention_factor=attention * meta(g, p + "rope.scaling.attn_factor", float, default=1.0))
