"""Each stage of ops.py against a math law or a straight, loop-by-loop implementation written independently."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from npllm import ops
from npllm.config import RopeScaling

seeds = st.integers(0, 2**32 - 1)


def interleaved_to_half(x):
    """Reorder each head's last axis from pairs (2i, 2i+1) to halves (i, i + Dh/2): HF's q/k row permutation."""
    return np.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


@given(seeds, st.integers(1, 5), st.integers(1, 64))
def test_rms_norm_has_unit_rms_before_the_gain(seed, T, D):
    x = np.random.default_rng(seed).standard_normal((T, D)) * 10
    y = ops.rms_norm(x, np.ones(D), eps=1e-12)
    np.testing.assert_allclose(np.sqrt(np.mean(y**2, axis=-1)), 1.0, rtol=1e-9)
    gain = np.arange(1, D + 1, dtype=np.float64)
    np.testing.assert_allclose(ops.rms_norm(x, gain, 1e-12), y * gain, rtol=1e-12)


def test_rms_norm_matches_a_loop():
    x = np.random.default_rng(0).standard_normal((3, 7)).astype(np.float32)
    g = np.random.default_rng(1).standard_normal(7).astype(np.float32)
    for t in range(3):
        scale = 1 / np.sqrt(sum(float(v) ** 2 for v in x[t]) / 7 + 1e-5)
        np.testing.assert_allclose(ops.rms_norm(x, g, 1e-5)[t], [x[t, i] * scale * g[i] for i in range(7)],
                                   rtol=1e-5)


@given(seeds, st.integers(1, 8).map(lambda n: 2 * n), st.lists(st.integers(0, 5000), min_size=1, max_size=6))
def test_rope_preserves_norms(seed, Dh, positions):
    x = np.random.default_rng(seed).standard_normal((len(positions), 3, Dh))
    cos, sin = ops.rope_angles(np.array(positions), ops.rope_inv_freq(Dh, 10000.0), np.float64)
    for rope in (ops.rope_interleaved, ops.rope_half):
        np.testing.assert_allclose(np.linalg.norm(rope(x, cos, sin), axis=-1), np.linalg.norm(x, axis=-1),
                                   rtol=1e-10)


@given(seeds, st.integers(1, 8).map(lambda n: 2 * n), st.integers(0, 2000), st.integers(0, 2000),
       st.integers(-500, 500))
def test_rope_dot_product_depends_only_on_position_difference(seed, Dh, m, n, shift):
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((1, 1, Dh)), rng.standard_normal((1, 1, Dh))
    inv_freq = ops.rope_inv_freq(Dh, 10000.0)

    def score(pq, pk):
        cq, sq = ops.rope_angles(np.array([pq]), inv_freq, np.float64)
        ck, sk = ops.rope_angles(np.array([pk]), inv_freq, np.float64)
        return float(np.sum(ops.rope_interleaved(q, cq, sq) * ops.rope_interleaved(k, ck, sk)))

    m2, n2 = m + shift, n + shift
    if min(m2, n2) >= 0:
        assert score(m, n) == pytest.approx(score(m2, n2), rel=1e-8, abs=1e-8)


@given(seeds, st.integers(1, 8).map(lambda n: 2 * n), st.lists(st.integers(0, 5000), min_size=1, max_size=6))
def test_both_rope_layouts_agree_after_the_qk_permutation(seed, Dh, positions):
    x = np.random.default_rng(seed).standard_normal((len(positions), 2, Dh))
    cos, sin = ops.rope_angles(np.array(positions), ops.rope_inv_freq(Dh, 500000.0), np.float64)
    np.testing.assert_allclose(ops.rope_half(interleaved_to_half(x), cos, sin),
                               interleaved_to_half(ops.rope_interleaved(x, cos, sin)), rtol=1e-12, atol=1e-12)


def test_rope_interleaved_is_a_rotation_of_each_pair():
    x = np.array([[[1.0, 0.0, 0.0, 1.0]]])
    inv_freq = ops.rope_inv_freq(4, 10000.0)  # [1, 0.01]
    cos, sin = ops.rope_angles(np.array([3]), inv_freq, np.float64)
    out = ops.rope_interleaved(x, cos, sin)[0, 0]
    np.testing.assert_allclose(out, [np.cos(3), np.sin(3), -np.sin(0.03), np.cos(0.03)], rtol=1e-12)


def test_rope_scaling_linear_and_llama3():
    base = ops.rope_inv_freq(64, 500000.0)
    np.testing.assert_allclose(ops.rope_inv_freq(64, 500000.0, RopeScaling("linear", 4.0)), base / 4)
    s = RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)
    scaled = ops.rope_inv_freq(64, 500000.0, s)
    wavelen = 2 * np.pi / base
    assert np.all(scaled[wavelen < 8192 / 4] == base[wavelen < 8192 / 4])  # fast pairs untouched
    np.testing.assert_allclose(scaled[wavelen > 8192], base[wavelen > 8192] / 8)  # slow pairs stretched 8x
    middle = (wavelen >= 8192 / 4) & (wavelen <= 8192)
    assert np.all((scaled[middle] <= base[middle]) & (scaled[middle] >= base[middle] / 8))


def test_attention_mask_table():
    mask = ops.attention_mask(np.arange(4), np.arange(4))
    expected = np.array([[0, -np.inf, -np.inf, -np.inf], [0, 0, -np.inf, -np.inf], [0, 0, 0, -np.inf], [0, 0, 0, 0]])
    np.testing.assert_array_equal(mask, expected)
    windowed = ops.attention_mask(np.array([5]), np.array([-1, 2, 3, 4, 5]), window=2)
    np.testing.assert_array_equal(windowed, [[-np.inf, -np.inf, -np.inf, 0, 0]])


def attention_weights(q, k, positions, window=None):
    """Read the attention matrix out of ops.attention by attending over one-hot values: out[t, h, s] = a_h(t, s)."""
    S, K, _ = k.shape
    v = np.broadcast_to(np.eye(S)[:, None, :], (S, K, S)).copy()
    return ops.attention(q, k, v, ops.attention_mask(positions, positions, window))  # [T, H, S]


@given(seeds, st.integers(1, 12), st.sampled_from([(1, 1), (4, 4), (4, 2), (8, 2), (8, 1)]))
def test_attention_rows_are_causal_and_sum_to_one(seed, T, heads):
    H, K = heads
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((T, H, 8)) * 3, rng.standard_normal((T, K, 8)) * 3
    a = attention_weights(q, k, np.arange(T))
    np.testing.assert_allclose(a.sum(-1), 1.0, rtol=1e-12)
    future = np.triu(np.ones((T, T), bool), k=1)
    assert np.all(a[:, :, :][np.broadcast_to(future[:, None, :], a.shape)] == 0)


@given(seeds, st.integers(1, 10), st.sampled_from([(4, 2), (8, 2), (8, 1), (6, 3)]))
def test_gqa_equals_mha_with_repeated_kv_heads(seed, T, heads):
    H, K = heads
    rng = np.random.default_rng(seed)
    q, k, v = rng.standard_normal((T, H, 4)), rng.standard_normal((T, K, 4)), rng.standard_normal((T, K, 4))
    mask = ops.attention_mask(np.arange(T), np.arange(T))
    mha = ops.attention(q, np.repeat(k, H // K, axis=1), np.repeat(v, H // K, axis=1), mask)
    np.testing.assert_allclose(ops.attention(q, k, v, mask), mha, rtol=1e-12, atol=1e-12)


def test_attention_matches_a_loop():
    rng = np.random.default_rng(3)
    T, H, K, Dh = 5, 4, 2, 6
    q, k, v = rng.standard_normal((T, H, Dh)), rng.standard_normal((T, K, Dh)), rng.standard_normal((T, K, Dh))
    out = ops.attention(q, k, v, ops.attention_mask(np.arange(T), np.arange(T), window=3))
    for t in range(T):
        for h in range(H):
            g = h // (H // K)
            seen = [s for s in range(T) if t - 3 < s <= t]
            scores = [q[t, h] @ k[s, g] / np.sqrt(Dh) for s in seen]
            w = np.exp(np.array(scores) - max(scores))
            w /= w.sum()
            np.testing.assert_allclose(out[t, h], sum(wi * v[s, g] for wi, s in zip(w, seen)), rtol=1e-10)


def test_swiglu_matches_a_loop():
    rng = np.random.default_rng(4)
    x, w1, w2, w3 = (rng.standard_normal(s) for s in [(2, 3), (5, 3), (3, 5), (5, 3)])
    for t in range(2):
        hidden = [(x[t] @ w1[f]) / (1 + np.exp(-(x[t] @ w1[f]))) * (x[t] @ w3[f]) for f in range(5)]
        np.testing.assert_allclose(ops.swiglu(x, w1, w2, w3)[t], w2 @ np.array(hidden), rtol=1e-12)


def test_softmax_seed_table():
    np.testing.assert_allclose(ops.softmax(np.array([11.0, 12.0, 13.0])), [0.0900, 0.2447, 0.6652], atol=5e-5)
    assert np.all(np.isfinite(ops.softmax(np.array([1000.0, 0.0, -1000.0]))))
