"""A model's weights by name: one frozen dataclass per layer, as a C struct would hold them, built once from the
dict of canonical names the format readers return ("layers.3.wq" -> Weights.layers[3].wq).

Shapes, with D = dim, F = hidden_dim, V = vocab_size, H / K = query / key-value heads of Dh = head_dim each;
matrices are stored [out, in], so a projection is x @ W.T.

The compiled backends read the same matrices fused, so that one pass over memory serves several projections:
fused_qkv ([wq; wk; wv], with Hugging Face's RoPE layout permuted into the interleaved one where a backend wants
it) and fused_gate_up (w1 and w3 in alternating blocks of rows).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..config import ModelConfig
from ..tensors import check_weights, permute_qk_half_to_interleaved


@dataclasses.dataclass(frozen=True)
class LayerWeights:
    """One transformer block."""

    attention_norm: np.ndarray | None  # [D]   RMSNorm gain before attention (None: OLMo 2 norms after instead)
    wq: np.ndarray  # [H*Dh, D]                query projection
    wk: np.ndarray  # [K*Dh, D]                key projection
    wv: np.ndarray  # [K*Dh, D]                value projection
    wo: np.ndarray  # [D, H*Dh]                attention output projection
    ffn_norm: np.ndarray | None  # [D]         RMSNorm gain before the feed-forward (None as attention_norm)
    w1: np.ndarray | None  # [F, D]            SwiGLU gate (None in a mixture-of-experts layer)
    w2: np.ndarray | None  # [D, F]            SwiGLU down projection
    w3: np.ndarray | None  # [F, D]            SwiGLU up
    bq: np.ndarray | None = None  # [H*Dh]     projection biases (Qwen2); None where the model has none (Llama)
    bk: np.ndarray | None = None  # [K*Dh]
    bv: np.ndarray | None = None  # [K*Dh]
    # Other families (None where a model has none; config.py says which family uses what):
    q_norm: np.ndarray | None = None  # [Dh] or [H*Dh]   RMSNorm gain of queries, per head or over the projection
    k_norm: np.ndarray | None = None  # [Dh] or [K*Dh]
    post_attention_norm: np.ndarray | None = None  # [D]  RMSNorm of the attention block's output (Gemma, OLMo 2)
    post_ffn_norm: np.ndarray | None = None  # [D]        RMSNorm of the feed-forward's output
    router: np.ndarray | None = None  # [E, D]            mixture of experts: one logit per expert
    w1_exps: np.ndarray | None = None  # [E, Fe, D]       each expert's gate, down and up projections
    w2_exps: np.ndarray | None = None  # [E, D, Fe]
    w3_exps: np.ndarray | None = None  # [E, Fe, D]


@dataclasses.dataclass(frozen=True)
class Weights:
    """The whole model."""

    tok_embeddings: np.ndarray  # [V, D]       token embedding table
    layers: tuple[LayerWeights, ...]  # L blocks
    norm: np.ndarray  # [D]                    final RMSNorm gain
    output: np.ndarray  # [V, D]               LM head (the embedding table itself when tied)

    @classmethod
    def from_checkpoint(cls, config: ModelConfig, tensors: "dict[str, np.ndarray] | Weights",
                        source: str = "checkpoint") -> "Weights":
        """Named weights from a format reader's dict (or another model's Weights), checked against the config first
        (tensors.check_weights)."""
        if isinstance(tensors, Weights):
            tensors = tensors.as_dict()
        tensors = check_weights(config, tensors, source)
        fields = [f.name for f in dataclasses.fields(LayerWeights)]
        layers = tuple(LayerWeights(**{name: tensors.get(f"layers.{l}.{name}") for name in fields})
                       for l in range(config.n_layers))
        output = tensors["tok_embeddings"] if config.tied_embeddings else tensors["output"]
        return cls(tensors["tok_embeddings"], layers, tensors["norm"], output)

    def as_dict(self) -> dict[str, np.ndarray]:
        """The tensors under their canonical names ("layers.3.wq"), as the format readers return them."""
        tensors = {"tok_embeddings": self.tok_embeddings, "norm": self.norm, "output": self.output}
        for l, layer in enumerate(self.layers):
            tensors |= {f"layers.{l}.{f.name}": getattr(layer, f.name) for f in dataclasses.fields(layer)
                        if getattr(layer, f.name) is not None}
        return tensors

    def stacked(self, name: str, dtype=np.float32) -> np.ndarray:
        """One per-layer tensor of every layer, stacked.   # "ffn_norm" -> [L, D]"""
        return np.stack([np.asarray(getattr(layer, name), dtype) for layer in self.layers])


def fused_qkv(config: ModelConfig, layer: LayerWeights, interleave_rope: bool) -> tuple[np.ndarray, np.ndarray]:
    """[wq; wk; wv] and [bq; bk; bv] (zeros without biases), so one product gives q, k and v.
                                                                          # -> [(H + 2K) Dh, D], [(H + 2K) Dh]
    interleave_rope: permute Hugging Face's q and k rows (rope_layout "half") into the interleaved layout, for a
    backend that implements only rope_interleaved. A query or key computed with the reordered rows, rotated by
    rope_interleaved, is the original rotated by rope_half with its entries reordered the same way, so attention
    scores are unchanged.
    """
    H, K, Dh, r = config.n_heads, config.n_kv_heads, config.head_dim, config.rotary_dims
    q, k, bq, bk = layer.wq, layer.wk, layer.bq, layer.bk
    if interleave_rope and config.rope_layout == "half":  # of the first r rows of each head (partial rotary: r < Dh)
        q, k = permute_qk_half_to_interleaved(q, H, Dh, r), permute_qk_half_to_interleaved(k, K, Dh, r)
        if config.attention_bias:
            bq, bk = permute_qk_half_to_interleaved(bq, H, Dh, r), permute_qk_half_to_interleaved(bk, K, Dh, r)
    wqkv = np.concatenate([q, k, layer.wv])
    if not config.attention_bias:  # Llama's projections have none; adding zeros changes nothing
        return wqkv, np.zeros(len(wqkv), np.float32)
    return wqkv, np.concatenate([bq, bk, layer.bv]).astype(np.float32)


def fused_gate_up(layer: LayerWeights, block: int) -> np.ndarray:
    """w1 (gate) and w3 (up) rows in alternating blocks of `block` rows, each zero-padded to a multiple of block:
    w1[0:block], w3[0:block], w1[block:2 block], ...; block = F gives [w1; w3].     # [F, D] x2 -> [2 Fp, D]

    One product then computes both; gate output i lands `block` columns before its up partner.
    """
    F, D = layer.w1.shape
    Fp = -(-F // block) * block
    padded = np.zeros((2, Fp, D), np.result_type(layer.w1, layer.w3))
    padded[0, :F], padded[1, :F] = layer.w1, layer.w3
    return padded.reshape(2, Fp // block, block, D).transpose(1, 0, 2, 3).reshape(2 * Fp, D)
