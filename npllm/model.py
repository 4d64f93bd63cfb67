"""The Llama transformer in NumPy: ops.py's stages wired together over a RingKVCache.

One forward call takes any set of tokens, each with its own position and its own cache slot:
    prefill  = T tokens of one sequence (one matrix-matrix pass over the weights),
    decode   = 1 token per sequence, B sequences at once (still one pass over the weights),
    ragged   = several prompts concatenated, each in its slot.
Projections and the FFN run over all tokens together; attention runs per sequence slot against that slot's cache.
"""

from __future__ import annotations

import numpy as np

from . import ops
from .cache import RingKVCache
from .config import ModelConfig
from .errors import FormatError, GenerationError
from .formats import expected_shapes


def check_weights(config: ModelConfig, weights: dict[str, np.ndarray], source: str = "checkpoint") -> None:
    """Every tensor the config implies is present with the right shape (no silent garbage model)."""
    expected = expected_shapes(config)
    for name, shape in expected.items():
        if name not in weights:
            raise FormatError(f"{source}: tensor {name!r} is missing")
        if tuple(weights[name].shape) != shape:
            raise FormatError(f"{source}: tensor {name!r} has shape {tuple(weights[name].shape)}, "
                              f"the config implies {shape}")


def check_forward_inputs(config: ModelConfig, tokens, positions, slots, cache: RingKVCache) -> None:
    """One position and one slot per token, ids inside the vocabulary, slots inside the cache."""
    if tokens.ndim != 1 or tokens.shape != positions.shape or tokens.shape != slots.shape:
        raise GenerationError(f"forward needs 1-D tokens, positions and slots of one length, got shapes "
                              f"{tokens.shape}, {positions.shape}, {slots.shape}")
    if tokens.size and not (0 <= tokens.min() and tokens.max() < config.vocab_size):
        raise GenerationError(f"token ids must lie in [0, {config.vocab_size}), got {tokens.min()}..{tokens.max()}")
    if slots.size and not (0 <= slots.min() and slots.max() < cache.slots):
        raise GenerationError(f"slots must lie in [0, {cache.slots}), got {slots.min()}..{slots.max()}")
    if positions.size and positions.min() < 0:
        raise GenerationError(f"positions must be >= 0, got {positions.min()}")


class Transformer:
    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray]):
        check_weights(config, weights)
        self.config = config
        self.weights = weights
        self.output = weights["tok_embeddings"] if config.tied_embeddings else weights["output"]
        self.inv_freq = ops.rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)  # [Dh/2]
        self.rope = ops.rope_interleaved if config.rope_layout == "interleaved" else ops.rope_half
        self.dtype = self.output.dtype  # float32 for real checkpoints; float64 weights give a float64 model

    def new_cache(self, capacity: int | None = None, slots: int = 1) -> RingKVCache:
        return RingKVCache(self.config, capacity, slots, self.dtype)

    def window(self, cache: RingKVCache) -> int:
        """How many most recent positions a query sees: the model's sliding window, capped by the ring's size."""
        window = self.config.sliding_window or cache.capacity
        return min(window, cache.capacity)

    def forward(self, tokens, positions, cache: RingKVCache, slots=None) -> np.ndarray:
        """Final-norm hidden states of the given tokens, updating the cache.     # [T], [T], [T] -> [T, D]

        slots[t] is the cache slot (sequence) of token t (all 0 when omitted). Within a slot, tokens must come in
        increasing position order and follow what the slot's cache already holds.
        """
        tokens = np.asarray(tokens, dtype=np.int64)
        positions = np.asarray(positions, dtype=np.int64)
        slots = np.zeros_like(tokens) if slots is None else np.asarray(slots, dtype=np.int64)
        check_forward_inputs(self.config, tokens, positions, slots, cache)
        cos, sin = ops.rope_angles(positions, self.inv_freq, self.dtype)  # [T, Dh/2] each
        groups = [(int(s), np.flatnonzero(slots == s)) for s in np.unique(slots)]
        x = ops.embed(self.weights["tok_embeddings"], tokens)  # [T, D]
        for layer in range(self.config.n_layers):
            x = x + self.attention_block(layer, x, positions, cos, sin, cache, groups)
            x = x + self.ffn_block(layer, x)
        return ops.rms_norm(x, self.weights["norm"], self.config.norm_eps)

    def attention_block(self, layer, x, positions, cos, sin, cache, groups) -> np.ndarray:
        """RMSNorm -> q, k, v projections -> RoPE -> attention over cache + new keys -> output projection."""
        c, w = self.config, self.weights
        p = f"layers.{layer}."
        T = x.shape[0]
        h = ops.rms_norm(x, w[p + "attention_norm"], c.norm_eps)  # [T, D]
        q, k, v = h @ w[p + "wq"].T, h @ w[p + "wk"].T, h @ w[p + "wv"].T  # [T, H*Dh], [T, K*Dh], [T, K*Dh]
        if c.attention_bias:
            q, k, v = q + w[p + "bq"], k + w[p + "bk"], v + w[p + "bv"]
        q = self.rope(q.reshape(T, c.n_heads, c.head_dim), cos, sin)  # [T, H, Dh]
        k = self.rope(k.reshape(T, c.n_kv_heads, c.head_dim), cos, sin)  # [T, K, Dh]
        v = v.reshape(T, c.n_kv_heads, c.head_dim)  # [T, K, Dh]
        out = np.empty_like(q)  # [T, H, Dh]
        for slot, idx in groups:
            # Keys seen by this chunk: what the ring held before it, then the chunk itself. Reading before writing
            # matters when the chunk is longer than the ring: its writes would evict keys its early queries need.
            ring_k, ring_v, ring_pos = cache.read(layer, slot)
            keys = np.concatenate([ring_k, k[idx]])  # [C + T_slot, K, Dh]
            values = np.concatenate([ring_v, v[idx]])
            mask = ops.attention_mask(positions[idx], np.concatenate([ring_pos, positions[idx]]), self.window(cache))
            out[idx] = ops.attention(q[idx], keys, values, mask)
            cache.write(layer, slot, positions[idx], k[idx], v[idx])
        return out.reshape(T, c.n_heads * c.head_dim) @ w[p + "wo"].T  # [T, D]

    def ffn_block(self, layer, x) -> np.ndarray:
        """RMSNorm -> SwiGLU feed-forward.  # [T, D] -> [T, D]"""
        p = f"layers.{layer}."
        w = self.weights
        h = ops.rms_norm(x, w[p + "ffn_norm"], self.config.norm_eps)
        return ops.swiglu(h, w[p + "w1"], w[p + "w2"], w[p + "w3"])

    def lm_head(self, h: np.ndarray) -> np.ndarray:
        """Logits from final hidden states.  # [T, D] -> [T, V]"""
        return ops.lm_head(h, self.output)

    def logits(self, tokens, positions=None, cache: RingKVCache | None = None) -> np.ndarray:
        """Logits of every token of one sequence on a fresh cache (or the given one).  # [T] -> [T, V]"""
        tokens = np.asarray(tokens, dtype=np.int64)
        if positions is None:
            positions = np.arange(len(tokens))
        cache = self.new_cache() if cache is None else cache
        return self.lm_head(self.forward(tokens, positions, cache))
