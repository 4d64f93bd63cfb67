"""The model over the ring-buffer cache: prefill == step-by-step decode, the ring wraps correctly, slots are
independent, and the cache holds rotated keys."""

import numpy as np
import pytest

from npllm import ops
from npllm.config import ModelConfig
from npllm.errors import FormatError
from npllm.formats.llama2c import read_llama2c
from npllm.formats.random import random_weights
from npllm.models.reference import Transformer

GQA = ModelConfig(dim=32, hidden_dim=48, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=64)


def as_float64(weights):
    return {name: np.asarray(w, np.float64) for name, w in weights.items()}


def step_by_step(model, tokens, capacity=None):
    cache = model.new_cache(capacity)
    return np.stack([model.lm_head(model.forward([t], [p], cache))[0] for p, t in enumerate(tokens)])


def real_model(path, dtype=np.float32, **config_changes):
    config, weights = read_llama2c(path)
    weights = as_float64(weights) if dtype == np.float64 else weights
    return Transformer(config.replace(**config_changes), weights)


def test_prefill_equals_decode_steps_on_stories260k(stories260k):
    """float64 shows the cache arithmetic is exact; float32 differs only by BLAS's gemm-vs-gemv rounding."""
    tokens = np.random.default_rng(0).integers(0, 512, 96)
    exact = real_model(stories260k, np.float64)
    assert np.abs(exact.logits(tokens) - step_by_step(exact, tokens)).max() <= 1e-9
    model = real_model(stories260k)
    assert np.abs(model.logits(tokens) - step_by_step(model, tokens)).max() <= 1e-4
    assert np.abs(model.logits(tokens) - exact.logits(tokens)).max() <= 1e-4


def test_prefill_equals_decode_after_the_ring_wraps(stories260k):
    """A model with a 16-token context, 50 tokens: the ring has wrapped three times."""
    model = real_model(stories260k, np.float64, max_seq_len=16)
    tokens = np.random.default_rng(1).integers(0, 512, 50)
    prefill = model.logits(tokens)
    assert np.abs(prefill - step_by_step(model, tokens)).max() <= 1e-9
    chunked_cache = model.new_cache()
    chunks = [model.lm_head(model.forward(tokens[a:b], np.arange(a, b), chunked_cache))
              for a, b in [(0, 5), (5, 30), (30, 31), (31, 50)]]
    assert np.abs(np.concatenate(chunks) - prefill).max() <= 1e-9


def test_ring_is_a_sliding_window():
    """With capacity C, position p attends to positions p-C+1..p: equal to a model with sliding_window = C."""
    weights = as_float64(random_weights(GQA, seed=2))
    ring = Transformer(GQA, weights)
    windowed = Transformer(GQA.replace(sliding_window=8), weights)
    tokens = np.random.default_rng(3).integers(0, 64, 30)
    small_ring = ring.lm_head(ring.forward(tokens, np.arange(30), ring.new_cache(capacity=8)))
    np.testing.assert_allclose(small_ring, windowed.logits(tokens), rtol=1e-10, atol=1e-10)
    assert np.abs(small_ring - ring.logits(tokens)).max() > 1e-3  # the window really changes the answer


def test_short_prefix_does_not_depend_on_capacity():
    model = Transformer(GQA, as_float64(random_weights(GQA, seed=4)))
    tokens = np.random.default_rng(5).integers(0, 64, 10)
    big = model.logits(tokens)
    exact = model.lm_head(model.forward(tokens, np.arange(10), model.new_cache(capacity=10)))
    np.testing.assert_allclose(exact, big, rtol=1e-12, atol=1e-12)


def test_slots_are_independent_sequences():
    """Two sequences in one forward call (two slots) give each the logits it gets alone."""
    model = Transformer(GQA, as_float64(random_weights(GQA, seed=6)))
    a, b = [5, 9, 2, 7, 1], [3, 3, 8]
    cache = model.new_cache(slots=2)
    both = model.lm_head(model.forward(a + b, list(range(5)) + list(range(3)), cache, slots=[0] * 5 + [1] * 3))
    np.testing.assert_allclose(both[:5], model.logits(a), rtol=1e-12)
    np.testing.assert_allclose(both[5:], model.logits(b), rtol=1e-12)
    step = model.lm_head(model.forward([4, 6], [5, 3], cache, slots=[0, 1]))  # one decode step for both
    np.testing.assert_allclose(step[0], model.logits(a + [4])[-1], rtol=1e-12)
    np.testing.assert_allclose(step[1], model.logits(b + [6])[-1], rtol=1e-12)


def test_cache_holds_rotated_keys():
    w = as_float64(random_weights(GQA, seed=7))
    model = Transformer(GQA, w)
    cache = model.new_cache()
    tokens = [1, 2, 3]
    model.forward(tokens, np.arange(3), cache)
    x = ops.embed(w["tok_embeddings"], np.array(tokens))
    h = ops.rms_norm(x, w["layers.0.attention_norm"], GQA.norm_eps)
    k = (h @ w["layers.0.wk"].T).reshape(3, GQA.n_kv_heads, GQA.head_dim)
    cos, sin = ops.rope_angles(np.arange(3), model.rope_frequencies()[0], np.float64)
    np.testing.assert_allclose(cache.k[0, 0, :3], ops.rope_interleaved(k, cos, sin), rtol=1e-12)
    assert list(cache.positions[0, :4]) == [0, 1, 2, -1]


def test_tied_and_untied_heads():
    untied, tied = GQA.replace(tied_embeddings=False), GQA.replace(tied_embeddings=True)
    weights = as_float64(random_weights(untied, seed=8))
    tokens = [1, 2, 3]
    untied_logits = Transformer(untied, weights).logits(tokens)
    tied_logits = Transformer(tied, {k: v for k, v in weights.items() if k != "output"}).logits(tokens)
    output_is_embedding = dict(weights, output=weights["tok_embeddings"])
    np.testing.assert_allclose(Transformer(untied, output_is_embedding).logits(tokens), tied_logits)
    assert np.abs(untied_logits - tied_logits).max() > 1e-3


def test_missing_or_misshapen_tensor_is_a_clear_error():
    weights = random_weights(GQA)
    with pytest.raises(FormatError, match="layers.1.w2"):
        Transformer(GQA, {k: v for k, v in weights.items() if k != "layers.1.w2"})
    with pytest.raises(FormatError, match="shape"):
        Transformer(GQA, dict(weights, norm=np.ones(5, np.float32)))


def test_bad_forward_inputs_are_clear_errors():
    from npllm.errors import GenerationError

    model = Transformer(GQA, random_weights(GQA))
    cache = model.new_cache(slots=2)
    for tokens, positions, slots, message in [([1, 2], [0], None, "one length"), ([1, 99], [0, 1], None, "token ids"),
                                              ([1], [0], [2], "slots"), ([1], [-1], None, "positions")]:
        with pytest.raises(GenerationError, match=message):
            model.forward(tokens, positions, cache, slots)
