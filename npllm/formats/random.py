"""Models with random weights: benchmark shapes and test fixtures without a checkpoint on disk."""

from __future__ import annotations

import numpy as np

from ..config import ModelConfig

# Shapes of public checkpoints, for `npllm bench` and tests (weights random, arithmetic identical).
NAMED_SHAPES = {
    "stories260K": ModelConfig(dim=64, hidden_dim=172, n_layers=5, n_heads=8, n_kv_heads=4, vocab_size=512,
                               max_seq_len=512, tied_embeddings=True),
    "stories15M": ModelConfig(dim=288, hidden_dim=768, n_layers=6, n_heads=6, n_kv_heads=6, vocab_size=32000,
                              max_seq_len=256, tied_embeddings=True),
    "stories42M": ModelConfig(dim=512, hidden_dim=1376, n_layers=8, n_heads=8, n_kv_heads=8, vocab_size=32000,
                              max_seq_len=1024, tied_embeddings=True),
    "stories110M": ModelConfig(dim=768, hidden_dim=2048, n_layers=12, n_heads=12, n_kv_heads=12, vocab_size=32000,
                               max_seq_len=1024, tied_embeddings=True),
    "tinyllama-1.1B": ModelConfig(dim=2048, hidden_dim=5632, n_layers=22, n_heads=32, n_kv_heads=4,
                                  vocab_size=32000, max_seq_len=2048, tied_embeddings=False, rope_layout="half"),
}


def random_weights(config: ModelConfig, seed: int = 0, dtype=np.float32) -> dict[str, np.ndarray]:
    """Weights drawn N(0, 1/fan_in) (norm gains near 1), named as npllm/formats/__init__.py says."""
    rng = np.random.default_rng(seed)
    D, F, Dh, V = config.dim, config.hidden_dim, config.head_dim, config.vocab_size
    HDh, KDh = config.n_heads * Dh, config.n_kv_heads * Dh

    def matrix(rows, cols):
        return (rng.standard_normal((rows, cols), dtype=np.float32) / np.sqrt(cols)).astype(dtype)

    def gain(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(dtype)

    weights = {"tok_embeddings": matrix(V, D), "norm": gain(D)}
    if not config.tied_embeddings:
        weights["output"] = matrix(V, D)
    for l in range(config.n_layers):
        p = f"layers.{l}."
        weights.update({p + "attention_norm": gain(D), p + "ffn_norm": gain(D), p + "wq": matrix(HDh, D),
                        p + "wk": matrix(KDh, D), p + "wv": matrix(KDh, D), p + "wo": matrix(D, HDh),
                        p + "w1": matrix(F, D), p + "w2": matrix(D, F), p + "w3": matrix(F, D)})
        if config.attention_bias:
            for name, n in (("bq", HDh), ("bk", KDh), ("bv", KDh)):
                weights[p + name] = (0.1 * rng.standard_normal(n)).astype(dtype)
    return weights
