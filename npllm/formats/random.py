"""Models with random weights: benchmark shapes and test fixtures without a checkpoint on disk."""

from __future__ import annotations

import numpy as np

from ..config import ModelConfig
from ..tensors import layer_shapes

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
    # A mixture of experts people run on laptops (Granite 3.0 1B-A400M: 32 experts of 512, 8 used per token), and
    # the dense model that computes as much per token (one FFN of 8 x 512): what the routing costs.
    "granite-moe-1B-A400M": ModelConfig(dim=1024, hidden_dim=512, n_layers=24, n_heads=16, n_kv_heads=8,
                                        vocab_size=49155, max_seq_len=4096, tied_embeddings=True, rope_layout="half",
                                        n_experts=32, n_experts_used=8, arch="granitemoe"),
    "granite-dense-A400M": ModelConfig(dim=1024, hidden_dim=4096, n_layers=24, n_heads=16, n_kv_heads=8,
                                       vocab_size=49155, max_seq_len=4096, tied_embeddings=True, rope_layout="half"),
}
# The order each layer's weights are drawn in: Llama's first (so its random models stay what they were), then the
# rest of what the config needs in npllm.tensors.layer_shapes' order.
DRAW_ORDER = ("attention_norm", "ffn_norm", "wq", "wk", "wv", "wo", "w1", "w2", "w3")


def random_weights(config: ModelConfig, seed: int = 0, dtype=np.float32) -> dict[str, np.ndarray]:
    """Weights drawn N(0, 1/fan_in) (norm gains near 1), named as npllm/formats/__init__.py says."""
    rng = np.random.default_rng(seed)
    D, V = config.dim, config.vocab_size

    def matrix(rows, cols):
        return (rng.standard_normal((rows, cols), dtype=np.float32) / np.sqrt(cols)).astype(dtype)

    def gain(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(dtype)

    weights = {"tok_embeddings": matrix(V, D), "norm": gain(D)}
    if not config.tied_embeddings:
        weights["output"] = matrix(V, D)
    shapes = layer_shapes(config)
    order = [n for n in DRAW_ORDER if n in shapes] + [n for n in shapes if n not in DRAW_ORDER]
    for l in range(config.n_layers):
        for name in order:
            weights[f"layers.{l}.{name}"] = _draw(name, shapes[name], gain, matrix, rng, dtype)
    return weights


def _draw(name: str, shape: tuple, gain, matrix, rng, dtype) -> np.ndarray:
    """A norm gain near 1, a small bias, or N(0, 1/fan_in) rows ([E, out, in] experts: one matrix each)."""
    if name.endswith("norm"):
        return gain(shape[0])
    if len(shape) == 1:
        return (0.1 * rng.standard_normal(shape[0])).astype(dtype)
    if len(shape) == 3:
        return np.stack([matrix(*shape[1:]) for _ in range(shape[0])])
    return matrix(*shape)
