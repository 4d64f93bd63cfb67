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
    """Raise ConfigError if any float field of the dataclass `description` is NaN or infinite.

    Every format's reader maps its metadata into ModelConfig / RopeScaling, so this one check covers them all: a
    NaN or infinite epsilon, RoPE base or scaling factor loads but turns every activation into NaN or garbage.
    """
    for field in dataclasses.fields(description):
        value = getattr(description, field.name)
        is_float = isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral)  # NumPy's too
        if is_float and not math.isfinite(value):
            raise ConfigError(f"{field.name} must be a finite number, got {value} ({type(description).__name__})")


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE frequencies are rescaled for long contexts.

    kind "linear": every inverse frequency is divided by `factor` (position interpolation).
    kind "llama3": Llama 3.1's piecewise rule: long wavelengths (> original_max / low_freq_factor) are divided by
    `factor`, short ones (< original_max / high_freq_factor) kept, and the band between blended smoothly.
    """

    kind: str  # "linear" | "llama3"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.kind not in ("linear", "llama3"):
            raise ConfigError(f"unsupported RoPE scaling type {self.kind!r} (npllm knows 'linear' and 'llama3')")
        check_finite_floats(self)
        if not self.factor > 0:
            raise ConfigError(f"RoPE scaling factor must be > 0, got {self.factor}")
        if self.kind == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ConfigError(f"llama3 RoPE scaling needs 0 < low_freq_factor < high_freq_factor, got "
                              f"{self.low_freq_factor} and {self.high_freq_factor}")
        if self.kind == "llama3" and not (isinstance(self.original_max_position_embeddings, int)
                                          and 0 < self.original_max_position_embeddings <= MAX_CONTEXT):
            raise ConfigError(f"llama3 RoPE scaling's original_max_position_embeddings must be a positive integer, "
                              f"got {self.original_max_position_embeddings!r}")


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
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ConfigError(f"sliding_window must be positive, got {self.sliding_window}")
        if not 0 < self.norm_eps < float("inf"):
            raise ConfigError(f"norm_eps must be a finite number > 0, got {self.norm_eps}")
        if not 0 < self.rope_theta < float("inf"):
            raise ConfigError(f"rope_theta must be a finite number > 0, got {self.rope_theta}")

    @property
    def kv_group(self) -> int:
        """Query heads per KV head (H // K)."""
        return self.n_heads // self.n_kv_heads

    @property
    def n_params(self) -> int:
        """Parameter count as the checkpoint stores it (a tied head is counted once)."""
        D, F, L, V, Dh = self.dim, self.hidden_dim, self.n_layers, self.vocab_size, self.head_dim
        attn = D * self.n_heads * Dh * 2 + D * self.n_kv_heads * Dh * 2
        if self.attention_bias:
            attn += self.n_heads * Dh + 2 * self.n_kv_heads * Dh
        per_layer = attn + 3 * D * F + 2 * D
        return V * D * (1 if self.tied_embeddings else 2) + L * per_layer + D

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)
