"""Each Numba kernel of npllm/kernels/cpu.py against its NumPy reference in ops.py, over shapes drawn by Hypothesis.

The model calls most kernels on buffers it owns (`*_into`) and inlined into its forward pass; the small compiled
functions below call them as the model does and return new arrays, for comparison.

Tolerances, float32 kernels against float64 references:
- matrix products: |error| <= 2 D u (|x| |W|^T), u = 2^-24, the classic bound for a sum of D products;
- RMSNorm, RoPE, SwiGLU: relative 1e-5 of the output's scale;
- attention: 1e-5 absolute on outputs of size ~1 (the softmax's exp is a degree-6 polynomial, ~1e-7 relative).
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from numba import njit

from npllm import ops
from npllm.kernels import cpu
from npllm.models.weights import LayerWeights, fused_gate_up

seeds = st.integers(0, 2**32 - 1)
U = 2.0**-24  # float32 unit roundoff


@njit
def rms_norm(x, weight, eps):
    """RMSNorm over the last axis, as ops.rms_norm.   # [T, D], [D] -> [T, D]"""
    out = np.empty_like(x)
    cpu.rms_norm_into(x, weight, eps, out, x.shape[0])
    return out


@njit
def rope_interleaved(x, cos, sin):
    """RoPE on adjacent pairs, as ops.rope_interleaved.   # [T, n, Dh], [T, Dh/2] x2 -> [T, n, Dh]"""
    T, n, Dh = x.shape
    out = x.copy().reshape(T, n * Dh)
    cpu.rope_interleaved_into(out, n, Dh, cos, sin, T)
    return out.reshape(T, n, Dh)


@njit
def swiglu(x, w13_panels, w2_panels, threads, act):
    """SwiGLU feed-forward (silu(x W1^T) * (x W3^T)) W2^T, the model's three calls; act cpu.GELU_TANH: GeGLU.
                                                                                                # [T, D] -> [T, D]
    w13_panels = pack_panels(fused_gate_up(layer, 16)); w2_panels = pack_panels(W2).
    """
    T = x.shape[0]
    gate_up = np.empty((T, w13_panels.shape[0] * cpu.PANEL), np.float32)
    cpu.matmul_into(x, w13_panels, gate_up, T, threads)
    hidden = np.empty((T, gate_up.shape[1] // 2), np.float32)
    cpu.swiglu_hidden_into(gate_up, hidden, T, act)
    out = np.empty((T, w2_panels.shape[0] * cpu.PANEL), np.float32)
    cpu.matmul_into(hidden, w2_panels, out, T, threads)
    return out[:, :x.shape[1]].copy()


@njit
def attention(q, k, v, mask):
    """Grouped-query attention through the kernels' online softmax (blocks of KEY_BLOCK keys folded into a running
    max and sum), as ops.attention.      # [T, H, Dh], [S, K, Dh], [S, K, Dv], [T, S] -> [T, H, Dv]"""
    T, H, Dh = q.shape
    S, K, Dv = v.shape
    scale = np.float32(1.0 / np.sqrt(Dh))
    qf, kf, vf = q.copy().reshape(T * H * Dh), k.copy().reshape(S * K * Dh), v.copy().reshape(S * K * Dv)
    out = np.zeros(T * H * Dv, np.float32)
    scores, bases = np.empty(cpu.KEY_BLOCK, np.float32), np.empty(cpu.KEY_BLOCK, np.int64)
    bits = np.empty(cpu.KEY_BLOCK, np.int32)
    for t in range(T):
        for h in range(H):
            m, l = np.float32(-np.inf), np.float32(0.0)
            for j0 in range(0, S, cpu.KEY_BLOCK):
                n = min(cpu.KEY_BLOCK, S - j0)
                for j in range(n):
                    key = (j0 + j) * K + h // (H // K)
                    bases[j] = key * Dv
                    scores[j] = cpu._dot(qf, (t * H + h) * Dh, kf, key * Dh, Dh) * scale + mask[t, j0 + j]
                m, l = cpu._online_softmax_block(scores, bases, n, vf, out, (t * H + h) * Dv, Dv, m, l, bits)
            for d in range(Dv):
                out[(t * H + h) * Dv + d] /= l
    return out.reshape(T, H, Dv)


@njit
def exp(x):
    """exp of a float32 vector through the kernels' polynomial.  # [n] -> [n]"""
    out = x.astype(np.float32)
    cpu._exp_into(out, out.shape[0], np.empty(out.shape[0], np.int32))
    return out


def normal(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def assert_within_dot_bound(got, x, w):
    """got ~ x @ w.T within the rounding bound of D-term float32 dot products."""
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    bound = 2 * x.shape[1] * U * (np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T) + 1e-30
    assert np.all(np.abs(got - exact) <= bound), np.max(np.abs(got - exact) / bound)


@given(seeds, st.integers(1, 20), st.integers(1, 70), st.integers(1, 90))
def test_matmul_within_the_float32_dot_bound(seed, T, D, N):
    rng = np.random.default_rng(seed)
    x, w = normal(rng, T, D), normal(rng, N, D)
    got = cpu.matmul(x, cpu.pack_panels(w), N, 2)
    assert got.shape == (T, N)
    assert_within_dot_bound(got, x, w)


@given(seeds, st.integers(1, 20), st.integers(1, 70), st.integers(1, 90), st.integers(1, 2))
def test_each_matmul_row_is_the_same_bits_whatever_the_token_count(seed, T, D, N, threads):
    """The prefill == decode guarantee at its root: row t of a T-token product equals a 1-token product."""
    rng = np.random.default_rng(seed)
    x, panels = normal(rng, T, D), cpu.pack_panels(normal(rng, N, D))
    together = cpu.matmul(x, panels, N, threads)
    for t in range(T):
        np.testing.assert_array_equal(cpu.matmul(x[t:t + 1].copy(), panels, N, 1)[0], together[t])


def test_pack_panels_layout():
    w = np.arange(20 * 3, dtype=np.float32).reshape(20, 3)
    panels = cpu.pack_panels(w)
    assert panels.shape == (2, 3, 16)
    assert panels[1, 2, 3] == w[19, 2] and np.all(panels[1, :, 4:] == 0)  # zero rows pad 20 up to 32


def ffn_layer(w1, w2, w3) -> LayerWeights:
    """A layer holding only the feed-forward matrices (what fused_gate_up reads)."""
    return LayerWeights(None, None, None, None, None, None, w1, w2, w3)


def test_fused_gate_up_alternates_blocks_of_16():
    a = np.full((20, 2), 1, np.float32)
    b = np.full((20, 2), 2, np.float32)
    rows = fused_gate_up(ffn_layer(a, None, b), cpu.PANEL)[:, 0]
    np.testing.assert_array_equal(rows, [1] * 16 + [2] * 16 + [1] * 4 + [0] * 12 + [2] * 4 + [0] * 12)


@given(seeds, st.integers(1, 9), st.integers(1, 200), st.floats(1e-6, 1e-3))
def test_rms_norm_matches_ops(seed, T, D, eps):
    rng = np.random.default_rng(seed)
    x, g = normal(rng, T, D) * 3, normal(rng, D)
    np.testing.assert_allclose(rms_norm(x, g, eps), ops.rms_norm(x.astype(np.float64), g, eps),
                               rtol=1e-5, atol=1e-5 * np.abs(g).max())


@given(seeds, st.integers(1, 9), st.integers(1, 5), st.integers(1, 40).map(lambda n: 2 * n),
       st.integers(0, 100_000), st.sampled_from([10000.0, 500000.0]))
def test_rope_matches_ops(seed, T, heads, Dh, start, theta):
    rng = np.random.default_rng(seed)
    x = normal(rng, T, heads, Dh)
    positions = start + np.arange(T)
    inv_freq = ops.rope_inv_freq(Dh, theta)
    cos, sin = ops.rope_angles(positions, inv_freq)
    kcos, ksin = np.empty_like(cos), np.empty_like(sin)
    cpu.rope_angles_into(positions, inv_freq, np.ones_like(inv_freq), kcos, ksin, T)
    np.testing.assert_allclose(kcos, cos, atol=1e-7)
    np.testing.assert_allclose(ksin, sin, atol=1e-7)
    np.testing.assert_allclose(rope_interleaved(x, cos, sin), ops.rope_interleaved(x, cos, sin), atol=1e-6)


@given(seeds, st.integers(1, 12), st.integers(1, 40), st.integers(1, 60), st.sampled_from(["silu", "gelu_tanh"]))
def test_swiglu_matches_ops(seed, T, D, F, activation):
    """SwiGLU, and GeGLU (Gemma) through the same panels."""
    rng = np.random.default_rng(seed)
    x, w1, w2, w3 = normal(rng, T, D), normal(rng, F, D), normal(rng, D, F), normal(rng, F, D)
    act = {"silu": cpu.SILU, "gelu_tanh": cpu.GELU_TANH}[activation]
    got = swiglu(x, cpu.pack_panels(fused_gate_up(ffn_layer(w1, w2, w3), cpu.PANEL)), cpu.pack_panels(w2), 2, act)
    want = ops.swiglu(*(a.astype(np.float64) for a in (x, w1, w2, w3)), act=ops.ACTIVATIONS[activation])
    scale = ops.swiglu(np.abs(x).astype(np.float64), np.abs(w1), np.abs(w2), np.abs(w3)).max() + 1
    np.testing.assert_allclose(got, want, atol=1e-5 * scale)


@given(seeds, st.integers(1, 8), st.integers(1, 150), st.sampled_from([1, 2, 4, 8]), st.integers(1, 3),
       st.integers(1, 24), st.one_of(st.none(), st.integers(1, 40)))
def test_attention_matches_ops(seed, T, S_past, group, K, Dh, window):
    """GQA ratios 1/2/4/8, causal masks with and without a window, key counts across several softmax blocks."""
    rng = np.random.default_rng(seed)
    H, S = K * group, S_past + T
    q, k, v = normal(rng, T, H, Dh), normal(rng, S, K, Dh), normal(rng, S, K, Dh)
    mask = ops.attention_mask(np.arange(S_past, S), np.arange(S), window)
    want = ops.attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), mask)
    np.testing.assert_allclose(attention(q, k, v, mask), want, atol=1e-5, rtol=1e-5)


@given(seeds, st.integers(1, 6), st.integers(1, 30), st.integers(1, 200))
@settings(max_examples=50)
def test_lm_head_matches_ops(seed, T, D, V):
    rng = np.random.default_rng(seed)
    x, out = normal(rng, T, D), normal(rng, V, D)
    got = cpu.lm_head(x, cpu.pack_panels(out), V, 2)
    assert got.shape == (T, V)
    assert_within_dot_bound(got, x, out)


def test_attention_softmax_survives_huge_scores():
    """Scores of +-1e4 must not overflow: the online softmax subtracts the running max before exp."""
    q = np.full((1, 1, 4), 100.0, np.float32)
    k = np.array([[[100.0] * 4], [[-100.0] * 4], [[99.0] * 4]], np.float32)
    v = np.arange(12, dtype=np.float32).reshape(3, 1, 4)
    got = attention(q, k, v, np.zeros((1, 3), np.float32))
    np.testing.assert_allclose(got, ops.attention(q.astype(np.float64), k, v, np.zeros((1, 3))), atol=1e-6)
    assert np.all(np.isfinite(got))


@pytest.mark.parametrize("masked", [0, 1, 63, 64, 65, 130])
def test_attention_with_masked_blocks(masked):
    """Whole blocks of masked keys (a window far behind the query) contribute nothing."""
    rng = np.random.default_rng(masked)
    S = masked + 5
    q, k, v = normal(rng, 1, 2, 8), normal(rng, S, 1, 8), normal(rng, S, 1, 8)
    mask = ops.attention_mask(np.array([S - 1]), np.arange(S), 5)
    np.testing.assert_allclose(attention(q, k, v, mask),
                               ops.attention(q.astype(np.float64), k, v, mask), atol=1e-6)


def test_exp_matches_numpy_within_2e_7_relative():
    x = np.concatenate([np.linspace(-86.99, 88, 100_001), [-np.inf, 0.0]]).astype(np.float32)
    got, want = exp(x), np.exp(x.astype(np.float64))
    np.testing.assert_allclose(got[:-2], want[:-2], rtol=2e-7)
    assert got[-2] == 0.0 and got[-1] == 1.0
    assert exp(np.array([-200.0], np.float32))[0] == 0.0  # under float32's normal range: exactly 0


@njit
def dots_one_by_one_and_eight_at_a_time(q, keys, bases, n):
    """cpu._dot per key, and cpu._dot8_into over the same eight keys.          # -> [8], [8]"""
    one, eight = np.empty(8, np.float32), np.empty(8, np.float32)
    for k in range(8):
        one[k] = cpu._dot(q, 0, keys, bases[k], n)
    cpu._dot8_into(q, 0, keys, bases, 0, n, eight)
    return one, eight


@given(seeds, st.integers(1, 80), st.sampled_from([np.float32, np.float16]))
def test_eight_keys_at_a_time_score_the_same_bits_as_one_by_one(seed, n, stored):
    """Attention scores blocks of keys eight at a time and the rest one by one (a query's block depends on its
    position): each score must be the same bits either way, or prefill and decode would differ."""
    rng = np.random.default_rng(seed)
    q = normal(rng, n) * 10
    keys = normal(rng, 12 * n + 5).astype(stored)
    bases = rng.permutation(12)[:8].astype(np.int64) * n + rng.integers(0, 5)
    one, eight = dots_one_by_one_and_eight_at_a_time(q, keys.view(np.uint16) if stored == np.float16 else keys,
                                                     bases, n)
    np.testing.assert_array_equal(one.view(np.int32), eight.view(np.int32))


# ------------------------------------------------------------------------------------------- other families' kernels

@njit
def gelu_tanh(x):
    """cpu.gelu_tanh of each value.   # [n] -> [n]"""
    out = np.empty_like(x)
    for i in range(x.shape[0]):
        out[i] = cpu.gelu_tanh(x[i])
    return out


@njit
def softcap(x, cap):
    """cpu.softcap of each value (cap > 0, float32).   # [n] -> [n]"""
    out = np.empty_like(x)
    for i in range(x.shape[0]):
        out[i] = cpu.softcap(x[i], cap)
    return out


floats32 = hnp.arrays(np.float32, st.integers(1, 200), elements=st.floats(-60, 60, width=32))


@given(floats32)
def test_gelu_tanh_matches_ops(x):
    np.testing.assert_allclose(gelu_tanh(x), ops.gelu_tanh(x.astype(np.float64)), rtol=1e-5, atol=1e-6)


@given(floats32, st.floats(0.5, 60.0))
def test_softcap_matches_ops(x, cap):
    np.testing.assert_allclose(softcap(x, np.float32(cap)), ops.softcap(x.astype(np.float64), np.float32(cap)),
                               rtol=1e-5, atol=1e-6 * cap)


@given(seeds, st.integers(1, 6), st.integers(1, 5), st.integers(1, 20).map(lambda n: 2 * n), st.booleans(),
       st.integers(0, 7), st.floats(1e-6, 1e-2))
def test_rms_norm_of_heads_matches_ops(seed, T, heads, Dh, per_head, col, eps):
    """q/k norms: RMSNorm of each head's Dh values (weight [Dh]) or of the whole projection (weight [heads Dh]),
    in place on the heads' columns, the columns around them untouched."""
    rng = np.random.default_rng(seed)
    x = normal(rng, T, col + heads * Dh + 3) * 3
    g = 1 + normal(rng, Dh if per_head else heads * Dh) / 10
    y = x[:, col:col + heads * Dh].astype(np.float64)
    want = ops.rms_norm(y.reshape(T, heads, Dh) if per_head else y, g, eps).reshape(T, -1)
    got = x.copy()
    cpu.rms_norm_heads_into(got, col, heads, Dh, g, eps, T)
    np.testing.assert_allclose(got[:, col:col + heads * Dh], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[:, :col], x[:, :col])
    np.testing.assert_array_equal(got[:, col + heads * Dh:], x[:, col + heads * Dh:])


@given(seeds, st.integers(1, 9), st.integers(1, 12), st.data(), st.booleans(), st.booleans())
def test_route_matches_ops(seed, T, E, data, normalize, ties):
    """The router's top k, ties to the lower expert id as ops.route's stable sort (logits drawn from a few integers
    make many ties), and its weights."""
    k = data.draw(st.integers(1, E), label="k")
    rng = np.random.default_rng(seed)
    D = 5
    x = rng.integers(-2, 3, (T, D)).astype(np.float32) if ties else normal(rng, T, D)
    router = rng.integers(-1, 2, (E, D)).astype(np.float32) if ties else normal(rng, E, D)
    logits = np.zeros((T, E + 3), np.float32)
    logits[:, :E] = x @ router.T  # exact: small integers, or the same float32 product the reference makes
    chosen, weights = np.full((T, k), -1, np.int64), np.zeros((T, k), np.float32)
    cpu.route_into(logits, T, E, k, normalize, chosen, weights)
    want_chosen, want_weights = ops.route(x, router, k, normalize)
    np.testing.assert_array_equal(chosen, want_chosen)
    np.testing.assert_allclose(weights, want_weights, rtol=1e-6)


@given(seeds, st.integers(1, 20), st.integers(0, 80), st.sampled_from([1, 2, 4]), st.integers(1, 2),
       st.integers(1, 12).map(lambda n: 2 * n), st.one_of(st.none(), st.integers(1, 30)),
       st.sampled_from([None, 0.05, 0.9]), st.sampled_from([0.0, 1.5, 30.0]))
@settings(max_examples=40)
def test_ring_attention_scale_softcap_and_window_match_ops(seed, T, past, group, K, Dh, window, scale, cap):
    """cpu.attention_ring_into with a layer's options (AttentionOptions: window, score scale, soft-cap of the
    scores before the mask) against ops.attention over the same keys."""
    rng = np.random.default_rng(seed)
    H, S = K * group, past + T
    q, k, v = normal(rng, T, H, Dh) * 2, normal(rng, S, K, Dh) * 2, normal(rng, S, K, Dh)
    ring_k, ring_v = np.zeros((1, S, K, Dh), np.float32), np.zeros((1, S, K, Dh), np.float32)
    ring_k[0, :past], ring_v[0, :past] = k[:past], v[:past]
    ring_pos = np.full((1, S), -1, np.int64)
    ring_pos[0, :past] = np.arange(past)
    qkv = np.concatenate([q.reshape(T, -1), k[past:].reshape(T, -1), v[past:].reshape(T, -1)], axis=1)
    positions, seqs = np.arange(past, S), cpu.Sequences(np.arange(T), np.array([0, T]), np.array([0]))
    w = min(window or S, S)
    valid_from = np.empty(1, np.int64)
    cpu.valid_from_into(positions, seqs, ring_pos, w, valid_from)
    out = np.empty((T, H * Dh), np.float32)
    s = 1.0 / np.sqrt(Dh) if scale is None else scale
    cpu.attention_ring_into(qkv, H, K, positions, seqs, valid_from, cpu.LayerRing(ring_k, ring_v, ring_pos),
                            cpu.AttentionOptions(w, s, cap), out)
    mask = ops.attention_mask(positions, np.arange(S), w)
    want = ops.attention(*(a.astype(np.float64) for a in (q, k, v)), mask, np.float32(s), np.float32(cap))
    np.testing.assert_allclose(out, want.reshape(T, -1), atol=2e-5, rtol=1e-5)
