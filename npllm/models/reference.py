"""The Llama transformer in NumPy: ops.py's stages wired together over a RingKVCache. The reference the compiled
backends are held to.

One forward call takes any set of tokens, each with its own position and its own cache slot:
    prefill  = T tokens of one sequence (one matrix-matrix pass over the weights),
    decode   = 1 token per sequence, B sequences at once (still one pass over the weights),
    ragged   = several prompts concatenated, each in its slot.
Projections and the FFN run over all tokens together; attention runs per sequence slot against that slot's cache.
"""

from __future__ import annotations

import numpy as np

from .. import ops
from ..cache import RingKVCache
from ..config import ModelConfig
from .base import Model
from .weights import Weights


class Transformer(Model):
    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray]):
        super().__init__(config)
        self.weights = Weights.from_checkpoint(config, weights)
        self.inv_freq = ops.rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)  # [Dh/2]
        self.rope = ops.rope_interleaved if config.rope_layout == "interleaved" else ops.rope_half
        self.dtype = self.weights.output.dtype  # float32 for real checkpoints; float64 weights give a float64 model

    def forward(self, tokens, positions, cache: RingKVCache, slots=None) -> np.ndarray:
        """Final-norm hidden states of the given tokens, updating the cache.     # [T], [T], [T] -> [T, D]

        slots[t] is the cache slot (sequence) of token t (all 0 when omitted). Within a slot, tokens must come in
        increasing position order and follow what the slot's cache already holds.
        """
        tokens, positions, slots = self.call_arrays(tokens, positions, slots)
        self.check_call(tokens, positions, slots, cache)
        cos, sin = ops.rope_angles(positions, self.inv_freq, self.dtype)  # [T, Dh/2] each
        groups = [(int(s), np.flatnonzero(slots == s)) for s in np.unique(slots)]
        x = ops.embed(self.weights.tok_embeddings, tokens)  # [T, D]
        for layer in range(self.config.n_layers):
            x = x + self.attention_block(layer, x, positions, cos, sin, cache, groups)
            x = x + self.ffn_block(layer, x)
        return ops.rms_norm(x, self.weights.norm, self.config.norm_eps)

    def attention_block(self, layer: int, x, positions, cos, sin, cache, groups) -> np.ndarray:
        """RMSNorm -> q, k, v projections -> RoPE -> attention over cache + new keys -> output projection."""
        c, w = self.config, self.weights.layers[layer]
        T = x.shape[0]
        h = ops.rms_norm(x, w.attention_norm, c.norm_eps)  # [T, D]
        q, k, v = h @ w.wq.T, h @ w.wk.T, h @ w.wv.T  # [T, H*Dh], [T, K*Dh], [T, K*Dh]
        if c.attention_bias:
            q, k, v = q + w.bq, k + w.bk, v + w.bv
        q = self.rope(q.reshape(T, c.n_heads, c.head_dim), cos, sin)  # [T, H, Dh]
        k = self.rope(k.reshape(T, c.n_kv_heads, c.head_dim), cos, sin)  # [T, K, Dh]
        v = v.reshape(T, c.n_kv_heads, c.head_dim)  # [T, K, Dh]
        out = np.empty_like(q)  # [T, H, Dh]
        for slot, idx in groups:
            # Keys seen by this chunk: what the ring held before it, then the chunk itself. Reading before writing
            # matters when the chunk is longer than the ring: its writes would evict keys its early queries need.
            # The chunk's own keys are taken as the cache stores them (float16 rounds them), so a prefill sees the
            # same keys as the decode steps that later read them back.
            ring_k, ring_v, ring_pos = cache.read(layer, slot)
            stored = cache.k.dtype
            keys = np.concatenate([ring_k, k[idx].astype(stored)]).astype(self.dtype, copy=False)  # [C + T, K, Dh]
            values = np.concatenate([ring_v, v[idx].astype(stored)]).astype(self.dtype, copy=False)
            mask = ops.attention_mask(positions[idx], np.concatenate([ring_pos, positions[idx]]), self.window(cache))
            out[idx] = ops.attention(q[idx], keys, values, mask)
            cache.write(layer, slot, positions[idx], k[idx], v[idx])
        return out.reshape(T, c.n_heads * c.head_dim) @ w.wo.T  # [T, D]

    def ffn_block(self, layer: int, x) -> np.ndarray:
        """RMSNorm -> SwiGLU feed-forward.  # [T, D] -> [T, D]"""
        w = self.weights.layers[layer]
        h = ops.rms_norm(x, w.ffn_norm, self.config.norm_eps)
        return ops.swiglu(h, w.w1, w.w2, w.w3)

    def head_logits(self, h: np.ndarray) -> np.ndarray:
        """Logits from final hidden states.  # [T, D] -> [T, V]"""
        return ops.lm_head(h, self.weights.output)
