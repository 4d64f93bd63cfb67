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
from ..config import FEATURE_FIELDS, SCALING_FEATURES, ModelConfig
from .base import Model
from .weights import Weights


class Transformer(Model):
    FEATURES = frozenset(FEATURE_FIELDS + SCALING_FEATURES)  # the reference runs every family

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray]):
        super().__init__(config)
        self.weights = Weights.from_checkpoint(config, weights)
        self.rope = ops.rope_interleaved if config.rope_layout == "interleaved" else ops.rope_half
        self.act = ops.ACTIVATIONS[config.ffn_activation]
        self.dtype = self.weights.output.dtype  # float32 for real checkpoints; float64 weights give a float64 model

    def forward(self, tokens, positions, cache: RingKVCache, slots=None) -> np.ndarray:
        """Final-norm hidden states of the given tokens, updating the cache.     # [T], [T], [T] -> [T, D]

        slots[t] is the cache slot (sequence) of token t (all 0 when omitted). Within a slot, tokens must come in
        increasing position order and follow what the slot's cache already holds.
        """
        tokens, positions, slots = self.call_arrays(tokens, positions, slots)
        self.check_call(tokens, positions, slots, cache)
        c = self.config
        # cos, sin [T, r/2] of each kind of layer (full attention, sliding, no RoPE: rope_frequencies' rows)
        angles = [ops.rope_angles(positions, freqs, self.dtype, amplitude)
                  for freqs, amplitude in zip(self.rope_frequencies(), self.rope_amplitudes())]
        rows = self.rope_rows()
        groups = [(int(s), np.flatnonzero(slots == s)) for s in np.unique(slots)]
        r = self.dtype.type(c.residual_multiplier)
        x = ops.embed(self.weights.tok_embeddings, tokens) * self.dtype.type(c.embedding_multiplier)  # [T, D]
        for layer in range(c.n_layers):
            cos, sin = angles[rows[layer]]
            x = x + r * self.attention_block(layer, x, positions, cos, sin, cache, groups)
            x = x + r * self.ffn_block(layer, x)
        return ops.rms_norm(x, self.weights.norm, c.norm_eps)

    def attention_block(self, layer: int, x, positions, cos, sin, cache, groups) -> np.ndarray:
        """RMSNorm -> q, k, v projections -> (q/k norms) -> RoPE -> attention over cache + new keys -> output
        projection (-> RMSNorm, in the families that norm a block's output).                  # [T, D] -> [T, D]"""
        c, w = self.config, self.weights.layers[layer]
        T = x.shape[0]
        h = self.norm(x, w.attention_norm)  # [T, D]
        q, k, v = h @ w.wq.T, h @ w.wk.T, h @ w.wv.T  # [T, H*Dh], [T, K*Dh], [T, K*Dh]
        if c.attention_bias:
            q, k, v = q + w.bq, k + w.bk, v + w.bv
        q = self.rope(self.qk_norm(q, w.q_norm, c.n_heads), cos, sin)  # [T, H, Dh]
        k = self.rope(self.qk_norm(k, w.k_norm, c.n_kv_heads), cos, sin)  # [T, K, Dh]
        v = v.reshape(T, c.n_kv_heads, c.head_dim)  # [T, K, Dh]
        window = self.windows(cache.capacity)[layer]  # this layer's: Gemma alternates sliding and full layers
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
            mask = ops.attention_mask(positions[idx], np.concatenate([ring_pos, positions[idx]]), window)
            out[idx] = ops.attention(q[idx], keys, values, mask, c.score_scale, c.attn_logit_softcap)
            cache.write(layer, slot, positions[idx], k[idx], v[idx])
        return self.norm(out.reshape(T, c.n_heads * c.head_dim) @ w.wo.T, w.post_attention_norm)  # [T, D]

    def ffn_block(self, layer: int, x) -> np.ndarray:
        """RMSNorm -> SwiGLU (GeGLU) feed-forward, dense or routed to experts (-> RMSNorm).  # [T, D] -> [T, D]"""
        c, w = self.config, self.weights.layers[layer]
        h = self.norm(x, w.ffn_norm)
        if w.router is None:
            return self.norm(ops.swiglu(h, w.w1, w.w2, w.w3, self.act), w.post_ffn_norm)
        chosen, weights = ops.route(h, w.router, c.n_experts_used, c.expert_weights_norm)  # [T, k] each
        return self.norm(ops.moe_ffn(h, chosen, weights, w.w1_exps, w.w2_exps, w.w3_exps, self.act), w.post_ffn_norm)

    def norm(self, x, weight) -> np.ndarray:
        """RMSNorm with this gain, or x itself where the family has no norm at this place (weight None)."""
        return x if weight is None else ops.rms_norm(x, weight, self.config.norm_eps)

    def qk_norm(self, y, weight, heads: int) -> np.ndarray:
        """Queries or keys as heads, RMS-normed per head (weight [Dh]) or over the whole projection (weight
        [heads * Dh], OLMo 2) where the family norms them.                     # [T, heads*Dh] -> [T, heads, Dh]"""
        kind = self.config.qk_norm
        if kind == "projection":
            y = self.norm(y, weight)
        y = y.reshape(y.shape[0], heads, self.config.head_dim)
        return self.norm(y, weight) if kind == "head" else y

    def head_logits(self, h: np.ndarray) -> np.ndarray:
        """Logits from final hidden states.  # [T, D] -> [T, V]"""
        return ops.lm_head(h, self.weights.output)
