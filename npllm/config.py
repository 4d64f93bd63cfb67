"""ModelConfig: the one frozen description of a Llama-family model, whatever file it came from.

Every reader in `npllm.formats` maps its own metadata (llama2.c header, HF config.json, GGUF key-values) into this
dataclass; the model, the cache and the kernels only ever see a ModelConfig.

Dimension legend used in shape comments throughout npllm:
    V  vocabulary size            D  model width (dim)
    F  FFN hidden width           L  number of layers
    H  query heads                K  key/value heads (GQA: H % K == 0, each KV head serves H // K query heads)
    Dh head dimension             T  tokens in this forward call
    S  cache length (positions)   B  batch (sequences)
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

from .errors import ConfigError

# Plausibility bounds, far above any published model (the deepest have ~130 layers, the longest contexts ~10M
# tokens): a header claiming more is corrupt, and believing it would mean allocating tables of that size.
MAX_LAYERS = 1 << 12
MAX_CONTEXT = 1 << 24


def check_finite_floats(description) -> None:
    """Raise ConfigError if any float field of the dataclass `description`, or any float in a tuple field (longrope's
    factor lists), is NaN or infinite.

    Every format's reader maps its metadata into ModelConfig / RopeScaling, so this one check covers them all: a
    NaN or infinite epsilon, RoPE base or scaling factor loads but turns every activation into NaN or garbage. It
    runs first, so the range checks after it may compare freely (`x <= 0` is False for a NaN x: it would pass).
    """
    for field in dataclasses.fields(description):
        value = getattr(description, field.name)
        items = value if isinstance(value, tuple) else (value,)
        bad = [x for x in items if _is_float(x) and not math.isfinite(x)]
        if bad:
            where = f" (one of its {len(items)})" if isinstance(value, tuple) else ""
            raise ConfigError(f"{field.name} must be a finite number{where}, got {bad[0]} "
                              f"({type(description).__name__})")


def _is_float(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, numbers.Integral)  # NumPy's too


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE frequencies are rescaled for long contexts.

    kind "linear": every inverse frequency is divided by `factor` (position interpolation).
    kind "llama3": Llama 3.1's piecewise rule: long wavelengths (> original_max / low_freq_factor) are divided by
    `factor`, short ones (< original_max / high_freq_factor) kept, and the band between blended smoothly.
    kind "longrope" (Phi-3): inverse frequency i is divided by its own factor, `long_factor[i]` when the model runs
    with a context longer than original_max_position_embeddings, else `short_factor[i]`; queries and keys are both
    scaled by `attention_factor` (so attention scores by its square).
    kind "yarn" (Qwen2.5/3 long context, gpt-oss): frequencies that turn fewer than beta_slow times over the
    original context are divided by `factor`, those that turn more than beta_fast times kept, a linear ramp between
    (ops.yarn_inv_freq); queries and keys scaled by `attention_factor` (0.1 ln(factor) + 1 by default; the format
    reader works it out, from mscale / mscale_all_dim where the config gives them).
    kind "dynamic" (dynamic NTK): the RoPE base grows with the context the model runs with, past
    original_max_position_embeddings (ops.dynamic_ntk_theta); `factor` sets how fast.
    """

    kind: str  # "linear" | "llama3" | "longrope" | "yarn" | "dynamic"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()  # longrope: [Dh/2] divisors of the inverse frequencies
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0  # longrope, yarn: cos and sin times this (the rotated dims of q and k)
    beta_fast: float = 32.0  # yarn: the ramp's ends, in turns over the original context
    beta_slow: float = 1.0
    truncate: bool = True  # yarn: the ramp's ends rounded out to whole dimensions (transformers' default)

    def __post_init__(self):
        if self.kind not in ROPE_SCALINGS:
            raise ConfigError(f"unsupported RoPE scaling type {self.kind!r} "
                              f"(npllm knows {', '.join(repr(k) for k in ROPE_SCALINGS)})")
        object.__setattr__(self, "short_factor", tuple(float(f) for f in self.short_factor))
        object.__setattr__(self, "long_factor", tuple(float(f) for f in self.long_factor))
        check_finite_floats(self)
        if self.kind == "longrope":
            self._check_longrope()
        if self.kind == "yarn":
            self._check_yarn()
        if not self.factor > 0:
            raise ConfigError(f"RoPE scaling factor must be > 0, got {self.factor}")
        if self.kind == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ConfigError(f"llama3 RoPE scaling needs 0 < low_freq_factor < high_freq_factor, got "
                              f"{self.low_freq_factor} and {self.high_freq_factor}")
        original = self.original_max_position_embeddings  # llama3's rule and longrope's choice of list use it
        if self.kind != "linear" and not (isinstance(original, numbers.Integral) and 0 < original <= MAX_CONTEXT):
            raise ConfigError(f"{self.kind} RoPE scaling's original_max_position_embeddings must be a positive "
                              f"integer, got {original!r}")

    def _check_longrope(self) -> None:
        if not self.short_factor or len(self.short_factor) != len(self.long_factor):
            raise ConfigError("longrope scaling needs short_factor and long_factor lists of one length (Dh/2), got "
                              f"{len(self.short_factor)} and {len(self.long_factor)}")
        for name in ("short_factor", "long_factor"):
            bad = [f for f in getattr(self, name) if not f > 0]
            if bad:
                raise ConfigError(f"longrope scaling's {name} must hold numbers > 0 (they divide the RoPE "
                                  f"frequencies), got {bad[0]}")
        if not self.attention_factor > 0:
            raise ConfigError(f"longrope scaling's attention_factor must be > 0, got {self.attention_factor}")

    def _check_yarn(self) -> None:
        if not 0 < self.beta_slow < self.beta_fast:
            raise ConfigError(f"yarn RoPE scaling needs 0 < beta_slow < beta_fast, got {self.beta_slow} and "
                              f"{self.beta_fast}")
        if not self.attention_factor > 0:
            raise ConfigError(f"yarn RoPE scaling's attention_factor must be > 0, got {self.attention_factor}")

    def divisors(self, context: int) -> tuple[float, ...]:
        """longrope: the per-frequency divisors for a model run with `context` positions (long past the original)."""
        return self.long_factor if context > self.original_max_position_embeddings else self.short_factor


ROPE_SCALINGS = ("linear", "llama3", "longrope", "yarn", "dynamic")
FFN_ACTIVATIONS = ("silu", "gelu_tanh")
QK_NORMS = ("", "head", "projection")
BLOCK_NORMS = ("pre", "sandwich", "post")
# ModelConfig's fields for what other families change (their defaults are Llama's); expert_* only matter with experts.
FEATURE_FIELDS = ("ffn_activation", "embedding_multiplier", "residual_multiplier", "attention_scale",
                  "attn_logit_softcap", "final_logit_softcap", "logit_multiplier", "qk_norm", "block_norms",
                  "sliding_layers", "rope_local_theta", "n_experts", "partial_rotary_factor", "rope_layers")
# RoPE scalings named in ModelConfig.features (linear and llama3 are Llama's own, in every backend and GGUF writer).
SCALING_FEATURES = ("longrope", "yarn", "dynamic")


@dataclass(frozen=True)
class ModelConfig:
    dim: int  # D
    hidden_dim: int  # F
    n_layers: int  # L
    n_heads: int  # H
    n_kv_heads: int  # K
    vocab_size: int  # V
    max_seq_len: int  # context length the model was trained for
    head_dim: int = 0  # Dh; 0 means dim // n_heads
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # "interleaved": rotate pairs (x[2i], x[2i+1]) as llama2.c and Meta do;
    # "half": rotate pairs (x[i], x[i + Dh/2]) as Hugging Face checkpoints are laid out.
    rope_layout: str = "interleaved"
    rope_scaling: RopeScaling | None = None
    # The fraction of each head's dims that RoPE rotates (HF partial_rotary_factor; GGUF rope.dimension_count / Dh):
    # the first rotary_dims of each head, paired in rope_layout's way among themselves; the rest pass unrotated.
    partial_rotary_factor: float = 1.0
    tied_embeddings: bool = False  # LM head reuses the token embedding matrix
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    sliding_window: int | None = None  # attend to at most this many most recent positions (Mistral)
    bos_id: int | None = 1  # None: the vocabulary has no BOS
    eos_ids: tuple[int, ...] = (2,)  # empty: no end token, generation stops at its length limit
    # llama2.c's TinyStories convention: a generated BOS ends the story (run.c stops on it).
    stop_at_bos: bool = False
    arch: str = "llama"
    # ids [0, usable_vocab) are the tokenizer's; the embedding rows past it pad the vocabulary to a round size (Qwen2:
    # 151,665 tokens, 151,936 rows) and the model never produces them. None: every one of the vocab_size ids.
    # No checkpoint says it: npllm.load sets it from the tokenizer.
    usable_vocab: int | None = None
    # ---- what other families change (all defaults are Llama's; see docs/architectures.md) ----
    ffn_activation: str = "silu"  # "silu": SwiGLU | "gelu_tanh": GeGLU (Gemma)
    embedding_multiplier: float = 1.0  # x = E[t] * m (Gemma: sqrt(D); Granite)
    residual_multiplier: float = 1.0  # x = x + m * block(x) (Granite)
    attention_scale: float = 0.0  # scores = q.k * s; 0: 1/sqrt(Dh) (Gemma: query_pre_attn_scalar^-1/2; Granite)
    attn_logit_softcap: float = 0.0  # c > 0: scores = c tanh(scores / c) (Gemma 2)
    final_logit_softcap: float = 0.0  # c > 0: logits = c tanh(logits / c) (Gemma 2)
    logit_multiplier: float = 1.0  # logits * m (Granite: 1 / logits_scaling)
    qk_norm: str = ""  # "": none | "head": RMSNorm of each head's q and k (Qwen3, Gemma 3) | "projection": of all of q, of k (OLMo 2)
    block_norms: str = "pre"  # "pre": x += f(norm(x)) | "sandwich": x += norm'(f(norm(x))) (Gemma) | "post": x += norm'(f(x)) (OLMo 2)
    sliding_layers: tuple[bool, ...] = ()  # one flag per layer; empty: every layer slides when sliding_window is set
    rope_local_theta: float = 0.0  # > 0: the RoPE base of sliding layers, unscaled (Gemma 3); 0: rope_theta
    rope_layers: tuple[bool, ...] = ()  # one flag per layer, False: no RoPE there (SmolLM3's NoPE); empty: all rotate
    n_experts: int = 0  # E experts per layer (0: a dense FFN)
    n_experts_used: int = 0  # top k experts per token
    expert_hidden_dim: int = 0  # Fe, each expert's hidden width (0: hidden_dim)
    expert_weights_norm: bool = True  # renormalise the top-k router probabilities to sum 1 (Mixtral; Qwen3-MoE's norm_topk_prob)
    # How the model's files say a text becomes one vector (npllm.embed): "last" token, "mean" of the tokens, "cls"
    # (the first), or "" where they do not say; and whether that vector is scaled to unit length. Not the math of
    # the forward: sentence-transformers' modules.json / 1_Pooling, GGUF's pooling_type.
    pooling: str = ""
    normalize_embeddings: bool = False

    def __post_init__(self):
        check_finite_floats(self)
        if self.head_dim == 0:
            if self.n_heads <= 0 or self.dim % self.n_heads:
                raise ConfigError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if isinstance(self.eos_ids, int):
            object.__setattr__(self, "eos_ids", (self.eos_ids,))
        else:
            object.__setattr__(self, "eos_ids", tuple(int(e) for e in self.eos_ids))
        for name in ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.n_layers > MAX_LAYERS:
            raise ConfigError(f"n_layers {self.n_layers} is implausible (more than {MAX_LAYERS}): a corrupt header?")
        if self.max_seq_len > MAX_CONTEXT:
            raise ConfigError(f"a context of {self.max_seq_len} tokens is implausible (more than {MAX_CONTEXT}): "
                              "a corrupt header?")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim {self.head_dim} must be even for RoPE")
        if self.rope_layout not in ("interleaved", "half"):
            raise ConfigError(f"rope_layout must be 'interleaved' or 'half', got {self.rope_layout!r}")
        if self.usable_vocab is not None and not (isinstance(self.usable_vocab, int)
                                                  and 0 < self.usable_vocab <= self.vocab_size):
            raise ConfigError(f"usable_vocab must be an id count in [1, vocab_size {self.vocab_size}], "
                              f"got {self.usable_vocab!r}")
        if self.sliding_window is not None and not (isinstance(self.sliding_window, numbers.Integral)
                                                    and self.sliding_window > 0):
            raise ConfigError(f"sliding_window must be a positive integer, got {self.sliding_window!r}")
        if not 0 < self.norm_eps < float("inf"):
            raise ConfigError(f"norm_eps must be a finite number > 0, got {self.norm_eps}")
        if not 0 < self.rope_theta < float("inf"):
            raise ConfigError(f"rope_theta must be a finite number > 0, got {self.rope_theta}")
        self._check_rotary()
        self.check_features()

    def _check_rotary(self) -> None:
        """partial_rotary_factor: in (0, 1], rotating an even whole number of each head's dims."""
        factor, Dh = self.partial_rotary_factor, self.head_dim
        if isinstance(factor, bool) or not isinstance(factor, numbers.Real) or not 0 < factor <= 1:
            raise ConfigError(f"partial_rotary_factor must be a number in (0, 1] (the fraction of each head's dims "
                              f"RoPE rotates), got {factor!r}")
        rotated = factor * Dh
        if round(rotated) < 2 or round(rotated) % 2 or abs(rotated - round(rotated)) > 1e-6:
            raise ConfigError(f"partial_rotary_factor {factor} rotates {rotated:g} of each head's {Dh} dims; RoPE "
                              "needs an even whole number of them")

    def check_features(self) -> None:
        """The options beyond Llama's (issue: the other families) are consistent with each other."""
        if self.ffn_activation not in FFN_ACTIVATIONS:
            raise ConfigError(f"ffn_activation must be one of {', '.join(FFN_ACTIVATIONS)}, got {self.ffn_activation!r}")
        if self.qk_norm not in QK_NORMS:
            raise ConfigError(f"qk_norm must be one of {QK_NORMS}, got {self.qk_norm!r}")
        if self.block_norms not in BLOCK_NORMS:
            raise ConfigError(f"block_norms must be one of {', '.join(BLOCK_NORMS)}, got {self.block_norms!r}")
        for name in ("attention_scale", "attn_logit_softcap", "final_logit_softcap", "rope_local_theta"):
            if not getattr(self, name) >= 0:  # not `< 0`: a NaN passes that
                raise ConfigError(f"{name} must be >= 0 (0: not used), got {getattr(self, name)}")
        for name in ("embedding_multiplier", "residual_multiplier", "logit_multiplier"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        object.__setattr__(self, "sliding_layers", tuple(bool(s) for s in self.sliding_layers))
        if self.sliding_layers and len(self.sliding_layers) != self.n_layers:
            raise ConfigError(f"sliding_layers must flag each of the {self.n_layers} layers, got "
                              f"{len(self.sliding_layers)}")
        if any(self.sliding_layers) and self.sliding_window is None:
            raise ConfigError("sliding_layers flags layers as sliding but sliding_window is not set")
        self._check_experts()
        object.__setattr__(self, "rope_layers", tuple(bool(r) for r in self.rope_layers))
        if self.rope_layers and len(self.rope_layers) != self.n_layers:
            raise ConfigError(f"rope_layers must flag each of the {self.n_layers} layers, got {len(self.rope_layers)}")
        scaling = self.rope_scaling
        if scaling is not None and scaling.kind == "dynamic" and self.rotary_dims <= 2:
            raise ConfigError(f"dynamic NTK scaling needs more than 2 rotated dims (its base grows as a power "
                              f"r / (r - 2)), got {self.rotary_dims}")
        if scaling is not None and scaling.kind == "longrope" and len(scaling.short_factor) != self.rotary_dims // 2:
            raise ConfigError(f"longrope factors must number the rotated dims / 2 = {self.rotary_dims // 2}, got "
                              f"{len(scaling.short_factor)}")

    def _check_experts(self) -> None:
        if self.n_experts == 0 and self.n_experts_used == 0:
            return
        if not 0 < self.n_experts_used <= self.n_experts:
            raise ConfigError(f"a mixture of experts needs 0 < n_experts_used <= n_experts, got "
                              f"{self.n_experts_used} of {self.n_experts}")
        if not self.expert_hidden_dim >= 0:
            raise ConfigError(f"expert_hidden_dim must be >= 0 (0: hidden_dim), got {self.expert_hidden_dim}")

    @property
    def rotary_dims(self) -> int:
        """How many of each head's dims RoPE rotates (the first ones): partial_rotary_factor x Dh."""
        return round(self.partial_rotary_factor * self.head_dim)

    def has_rope(self, layer: int) -> bool:
        """Whether layer `layer` rotates its queries and keys (every layer when rope_layers is empty)."""
        return self.rope_layers[layer] if self.rope_layers else True

    def is_sliding(self, layer: int) -> bool:
        """Whether layer `layer` attends through the sliding window (every layer when sliding_layers is empty)."""
        if self.sliding_window is None:
            return False
        return self.sliding_layers[layer] if self.sliding_layers else True

    @property
    def features(self) -> frozenset[str]:
        """The options beyond Llama's that this config uses, by field name (by kind for the RoPE scalings of
        SCALING_FEATURES), so a backend can say plainly which it does not run yet."""
        defaults = {f.name: f.default for f in dataclasses.fields(self) if f.name in FEATURE_FIELDS}
        used = {name for name, default in defaults.items() if getattr(self, name) != default}
        if self.rope_scaling is not None and self.rope_scaling.kind in SCALING_FEATURES:
            used.add(self.rope_scaling.kind)
        return frozenset(used)

    @property
    def score_scale(self) -> float:
        """What q.k is multiplied by before the softmax: attention_scale (1/sqrt(Dh) when 0). (longrope's and
        yarn's attention_factor scales the RoPE tables' cos and sin instead: Model.rope_amplitudes.)"""
        return self.attention_scale or 1.0 / math.sqrt(self.head_dim)

    @property
    def moe_hidden_dim(self) -> int:
        """Fe, the hidden width of each expert."""
        return self.expert_hidden_dim or self.hidden_dim

    @property
    def kv_group(self) -> int:
        """Query heads per KV head (H // K)."""
        return self.n_heads // self.n_kv_heads

    @property
    def n_params(self) -> int:
        """Parameter count as the checkpoint stores it (a tied head is counted once)."""
        D, F, L, V, Dh = self.dim, self.hidden_dim, self.n_layers, self.vocab_size, self.head_dim
        H, K = self.n_heads, self.n_kv_heads
        attn = D * H * Dh * 2 + D * K * Dh * 2
        if self.attention_bias:
            attn += H * Dh + 2 * K * Dh
        attn += {"": 0, "head": 2 * Dh, "projection": (H + K) * Dh}[self.qk_norm]
        norms = (4 if self.block_norms == "sandwich" else 2) * D
        ffn = self.n_experts * (3 * D * self.moe_hidden_dim + D) if self.n_experts else 3 * D * F
        return V * D * (1 if self.tied_embeddings else 2) + L * (attn + norms + ffn) + D

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)
