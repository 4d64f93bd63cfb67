"""Each numba.cuda kernel against its NumPy reference in ops.py (or a plain statement of the same rule).

Without a GPU (CI) the kernels run in numba's CUDA simulator, every GPU thread a Python thread: shapes are tiny,
odd-sized so that every edge (partial tiles, idle lanes, block-strided loops over more items than blocks) is hit,
and each kernel runs under two launch geometries. scripts/gpu_check.sh runs the same tests on a real GPU
(NUMBA_ENABLE_CUDASIM=0), there with the hardware geometry.
"""

import sys

import numpy as np
import pytest

from npllm.device import cuda_problem, cuda_simulated, use_cuda_simulator

use_cuda_simulator()  # before numba.cuda is imported (NUMBA_ENABLE_CUDASIM=0 in the environment keeps hardware)
if cuda_problem() is not None:
    pytest.skip(f"CUDA unavailable: {cuda_problem()}", allow_module_level=True)

from numba import cuda  # noqa: E402

from npllm import ops  # noqa: E402
from npllm.cache import RingKVCache  # noqa: E402
from npllm.config import ModelConfig  # noqa: E402
from npllm.kernels import cuda as ck  # noqa: E402
from npllm.kernels import cuda_ffn  # noqa: E402
from npllm import sampling  # noqa: E402
from npllm.sampling import SamplingParams, sample_with  # noqa: E402

SMALL = ck.SIMULATOR
WIDER = ck.Geometry(threads=64, lanes=16, tile=(16, 8, 4, 2, 2), sampler_threads=16, max_blocks=3)
# On a GPU the simulator's tiny geometry gives way to the real one (each geometry compiles every kernel again).
GEOMETRIES = [SMALL, WIDER] if cuda_simulated() else [WIDER, ck.HARDWARE]
EPS = np.float32(1e-5)


@pytest.fixture(autouse=True, scope="module")
def fast_thread_switching():
    """The simulator's threads meet at every syncthreads; Python's default 5 ms switch interval makes each
    meeting slow. A short interval speeds the simulated kernels up several times."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(5e-5)
    yield
    sys.setswitchinterval(before)


def normal(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def meta_rows(tokens, positions, slots, keep=None, ring=None):
    """kernels' [6, T] int32 per-token table (TOKEN, POS, SLOT, KEEP, RING, FIRST)."""
    T = len(tokens)
    keep = np.ones(T) if keep is None else keep
    ring = np.zeros(T) if ring is None else ring
    first = [list(slots).index(s) for s in slots]
    return cuda.to_device(np.stack([tokens, positions, slots, keep, ring, first]).astype(np.int32))


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: f"threads{g.threads}")
def test_embed_and_rms_norm(geometry):
    rng = np.random.default_rng(0)
    table = normal(rng, 11, 37)
    tokens = np.array([3, 0, 10, 3, 7])
    x = cuda.device_array((5, 37), np.float32)
    meta = meta_rows(tokens, tokens * 0, tokens * 0)
    ck.embed_kernel()[2, geometry.threads](cuda.to_device(table), meta, x, np.float32(2.5))  # Gemma's multiplier
    np.testing.assert_array_equal(x.copy_to_host(), ops.embed(table, tokens) * np.float32(2.5))
    ck.embed_kernel()[2, geometry.threads](cuda.to_device(table), meta, x, np.float32(1))
    np.testing.assert_array_equal(x.copy_to_host(), ops.embed(table, tokens))
    g = normal(rng, 37)
    out = cuda.device_array((5, 37), np.float32)
    ck.rms_norm_kernel(geometry.threads)[3, geometry.threads](x, cuda.to_device(g), EPS, out)
    np.testing.assert_allclose(out.copy_to_host(), ops.rms_norm(ops.embed(table, tokens), g, 1e-5),
                               rtol=2e-6, atol=1e-6)
    # an empty gain: no norm at that place (OLMo 2's block inputs), the rows copied
    ck.rms_norm_kernel(geometry.threads)[3, geometry.threads](x, cuda.to_device(np.zeros(0, np.float32)), EPS, out)
    np.testing.assert_array_equal(out.copy_to_host(), ops.embed(table, tokens))


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: f"threads{g.threads}")
def test_post_norm_adds_the_normed_block_output_and_clears_it(geometry):
    """block_norms "sandwich"/"post": x += m rms_norm(y, g) (reference.Transformer: x + r * norm(block(x))), y
    left at zero for the next product to add into."""
    rng = np.random.default_rng(5)
    x, y, g = normal(rng, 5, 37), normal(rng, 5, 37, scale=3.0), normal(rng, 37)
    m = np.float32(0.22)  # Granite's residual multiplier
    dx, dy = cuda.to_device(x), cuda.to_device(y)
    ck.post_norm_kernel(geometry.threads)[2, geometry.threads](dy, cuda.to_device(g), EPS, m, dx)
    np.testing.assert_allclose(dx.copy_to_host(), x + m * ops.rms_norm(y, g, 1e-5), rtol=2e-6, atol=1e-6)
    np.testing.assert_array_equal(dy.copy_to_host(), np.zeros_like(y))


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: f"threads{g.threads}")
@pytest.mark.parametrize("rows, T", [(1, 1), (2, 2), (4, 3), (8, 8)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_matvec_variants(geometry, rows, T, dtype):
    """y = x W^T (plain, RMSNorm-ed input, added to y, and SwiGLU-gated), K spanning several x tiles for 8 rows."""
    rng = np.random.default_rng(rows)
    # 8 rows stage 512 columns of x at a time: 520 needs two tiles, the second of 8 columns. N = 9 output rows for
    # 8 token rows still takes every group of both blocks through a second pass (one row per group per pass), and
    # costs the simulator less than half of 21 (the 8-row cases were its slowest kernel test).
    K, N = (520, 9) if rows == 8 else (45, 21)
    x, g = normal(rng, T, K), normal(rng, K)
    w = normal(rng, N, K, scale=K ** -0.5).astype(dtype)
    w13 = normal(rng, 2, N, K, scale=K ** -0.5).astype(dtype)
    y0 = normal(rng, T, N)
    xn = ops.rms_norm(x, g, 1e-5)
    w32, w13_32 = w.astype(np.float32), w13.astype(np.float32)
    alpha, no_gain = np.float32(0.3), np.zeros(0, np.float32)  # a residual multiplier (Granite); no norm gain
    # (norm, residual, gated, act, gain): act 1 is GeGLU's gelu_tanh; an empty gain skips the norm (OLMo 2)
    cases = {(False, False, False, 0, True): x @ w32.T, (True, False, False, 0, True): xn @ w32.T,
             (True, False, False, 0, False): x @ w32.T,
             (False, True, False, 0, True): y0 + alpha * (x @ w32.T),
             (True, False, True, 0, True): ops.silu(xn @ w13_32[0].T) * (xn @ w13_32[1].T),
             (True, False, True, 1, True): ops.gelu_tanh(xn @ w13_32[0].T) * (xn @ w13_32[1].T)}
    for (norm, residual, gated, act, gain), expected in cases.items():
        y = cuda.to_device(y0)
        kernel = ck.matvec_kernel(rows, geometry.threads, geometry.lanes, norm, residual, gated)
        kernel[2, geometry.threads](cuda.to_device(x), cuda.to_device(g if gain else no_gain), EPS,
                                    cuda.to_device(w13 if gated else w), y, alpha, np.int32(act))
        np.testing.assert_allclose(y.copy_to_host(), expected, rtol=1e-4, atol=2e-5,
                                   err_msg=f"norm={norm} residual={residual} gated={gated} act={act} gain={gain}")


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: f"threads{g.threads}")
@pytest.mark.parametrize("M, N, K", [(1, 1, 1), (9, 13, 37), (20, 5, 16)])
def test_matmul_tiles(geometry, M, N, K):
    rng = np.random.default_rng(M * N * K)
    x, w, y0 = normal(rng, M, K), normal(rng, N, K), normal(rng, M, N)
    alpha = np.float32(0.3)
    for residual, expected in ((False, x @ w.T), (True, y0 + alpha * (x @ w.T))):
        y = cuda.to_device(y0)
        ck.matmul_kernel(geometry.tile, residual)[3, geometry.matmul_threads](cuda.to_device(x), cuda.to_device(w), y,
                                                                              alpha)
        np.testing.assert_allclose(y.copy_to_host(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("qk_norm", ["", "head", "projection"])
def test_bias_rope_matches_ops(interleaved, qk_norm):
    """Bias on every column, the q/k RMSNorms (none, per head: Qwen3, Gemma 3; over the projection: OLMo 2), then
    RoPE on the q and k heads, in both pair layouts, as reference.Transformer.attention_block."""
    rng = np.random.default_rng(1)
    T, Dh, H, K = 4, 6, 2, 1
    heads = H + 2 * K
    qkv, bias = normal(rng, T, heads * Dh), normal(rng, heads * Dh)
    sizes = {"": (0, 0), "head": (Dh, Dh), "projection": (H * Dh, K * Dh)}[qk_norm]
    q_norm, k_norm = normal(rng, sizes[0]), normal(rng, sizes[1])
    positions = np.array([0, 7, 300, 5])
    cos, sin = ops.rope_angles(np.arange(301), ops.rope_inv_freq(Dh, 10000.0), np.float32)
    out = cuda.to_device(qkv)
    ck.bias_rope_kernel(interleaved, 8)[3, 8](out, cuda.to_device(bias), cuda.to_device(q_norm),
                                              cuda.to_device(k_norm), EPS, H, K, Dh, cuda.to_device(cos),
                                              cuda.to_device(sin), meta_rows(positions * 0, positions, positions * 0))
    biased = qkv + bias
    q, k = biased[:, :H * Dh], biased[:, H * Dh:(H + K) * Dh]
    if qk_norm == "projection":
        q, k = ops.rms_norm(q, q_norm, 1e-5), ops.rms_norm(k, k_norm, 1e-5)
    q, k = q.reshape(T, H, Dh), k.reshape(T, K, Dh)
    if qk_norm == "head":
        q, k = ops.rms_norm(q, q_norm, 1e-5), ops.rms_norm(k, k_norm, 1e-5)
    rope = ops.rope_interleaved if interleaved else ops.rope_half
    expected = np.concatenate([rope(np.concatenate([q, k], axis=1), cos[positions], sin[positions]),
                               biased.reshape(T, heads, Dh)[:, H + K:]], axis=1)
    np.testing.assert_allclose(out.copy_to_host().reshape(T, heads, Dh), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("act", [0, 1], ids=ck.ACTIVATIONS)
def test_swiglu(act):
    rng = np.random.default_rng(2)
    gate_up = normal(rng, 3, 2 * 19, scale=3.0)
    h = cuda.device_array((3, 19), np.float32)
    ck.swiglu_kernel()[2, 8](cuda.to_device(gate_up), h, np.int32(act))
    gate = ops.ACTIVATIONS[ck.ACTIVATIONS[act]]
    np.testing.assert_allclose(h.copy_to_host(), gate(gate_up[:, :19]) * gate_up[:, 19:], rtol=1e-5, atol=1e-6)


def reference_attention(config, cache, layer, q, k, v, positions, slots, window, cap=0.0):
    """The reference Transformer's attention: per slot, the ring as read before the call, then the chunk's keys."""
    out = np.empty_like(q)
    for slot in np.unique(slots):
        idx = np.flatnonzero(slots == slot)
        ring_k, ring_v, ring_pos = cache.read(layer, slot)
        keys, values = np.concatenate([ring_k, k[idx]]), np.concatenate([ring_v, v[idx]])
        mask = ops.attention_mask(positions[idx], np.concatenate([ring_pos, positions[idx]]), window)
        out[idx] = ops.attention(q[idx], keys, values, mask, cap=cap)
    return out


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: f"threads{g.threads}")
@pytest.mark.parametrize("H, K, cap", [(4, 4, 0.0), (4, 2, 0.0), (8, 1, 0.0), (4, 2, 0.8)])
def test_attention_and_ring_write(geometry, H, K, cap):
    """Grouped-query attention over a wrapped ring plus this call's tokens from three slots (one bringing more
    positions than the ring holds, one empty before the call, two interleaved), then the ring write and the
    position commit, against RingKVCache and ops.attention (cap: Gemma 2's soft-capping of the scores, small
    enough here to change them)."""
    rng = np.random.default_rng(H * 10 + K)
    Dh, C, L = 6, 5, 2
    config = ModelConfig(dim=H * Dh, hidden_dim=8, n_layers=L, n_heads=H, n_kv_heads=K, vocab_size=8,
                         max_seq_len=64)
    host = RingKVCache(config, C, slots=3)
    history = {0: 9, 1: 3, 2: 0}  # positions already cached per slot: slot 0 has wrapped its ring
    for slot, n in history.items():
        if n:
            for layer in range(L):
                host.write(layer, slot, np.arange(n), normal(rng, n, K, Dh), normal(rng, n, K, Dh))
    slots = np.array([0, 1, 2, 1, 2, 2, 2, 2, 2, 2])  # slot 2 brings 7 positions into a ring of 5; slots
    positions = np.array([9, 3, 0, 4, 1, 2, 3, 4, 5, 6])  # 1 and 2 interleave
    T, W = len(slots), (H + 2 * K) * Dh
    qkv = normal(rng, T, W)
    q, k, v = qkv[:, :H * Dh].reshape(T, H, Dh), qkv[:, H * Dh:(H + K) * Dh].reshape(T, K, Dh), \
        qkv[:, (H + K) * Dh:].reshape(T, K, Dh)
    last = {s: positions[slots == s].max() for s in history}
    keep = np.array([p > last[s] - C for p, s in zip(positions, slots)])
    ring = np.minimum(host.lengths[slots], C)
    meta = meta_rows(positions * 0, positions, slots, keep, ring)
    ring_k, ring_v, ring_pos = (cuda.to_device(a.copy()) for a in (host.k, host.v, host.positions.astype(np.int32)))
    window = 4  # a sliding window shorter than the ring, so the mask's lower bound matters too
    blocks = 3
    scores = cuda.device_array((blocks, C + T), np.float32)
    out = cuda.device_array((T, H * Dh), np.float32)
    layer = 1
    ck.attention_kernel(geometry.threads)[blocks, geometry.threads](
        cuda.to_device(qkv), meta, H, K, Dh, ring_k[layer], ring_v[layer], ring_pos, window,
        np.float32(1 / np.sqrt(Dh)), np.float32(cap), scores, out)
    expected = reference_attention(config, host, layer, q, k, v, positions, slots, window, cap)
    np.testing.assert_allclose(out.copy_to_host(), expected.reshape(T, H * Dh), rtol=1e-5, atol=1e-6)

    ck.kv_write_kernel()[blocks, geometry.threads](cuda.to_device(qkv), meta, H, K, Dh, ring_k[layer],
                                                   ring_v[layer])
    ck.commit_positions_kernel()[2, 4](meta, ring_pos)
    for slot in history:
        idx = np.flatnonzero(slots == slot)
        for l in range(L):
            host.write(l, slot, positions[idx], k[idx], v[idx])
    np.testing.assert_array_equal(ring_pos.copy_to_host(), host.positions)
    filled = host.positions >= 0
    np.testing.assert_array_equal(ring_k.copy_to_host()[layer][filled], host.k[layer][filled])
    np.testing.assert_array_equal(ring_v.copy_to_host()[layer][filled], host.v[layer][filled])


# --- sampling ----------------------------------------------------------------------------------------------------
# References: sampling.py's own filters with its inverse-CDF rule for a given u, and sample_with end to end.

def reference_draw(logits_row, temperature, top_k, top_p, min_p, u):
    """sampling.py's filters (ties at a floor kept whole), then the kept token j, by ascending id, with
    sum_{i<j} p_i <= u * total < sum_{i<=j} p_i."""
    s = (logits_row - logits_row.max()) / np.float32(temperature)
    kept = np.isfinite(sampling.min_p(sampling.top_p(sampling.top_k(s, top_k), top_p), min_p))
    ids = np.flatnonzero(kept)
    cum = np.cumsum(np.exp(s[ids]).astype(np.float64))
    return int(ids[min(int(np.searchsorted(cum, u * cum[-1], side="right")), len(ids) - 1)])


def device_draw(logits, rows, threads):
    """rows: (temperature, top_k, top_p, min_p, u) per row of logits."""
    ids = cuda.device_array(len(logits), np.int32)
    probs = cuda.device_array(logits.shape, np.float32)
    ck.sample_kernel(threads)[2, threads](cuda.to_device(logits), cuda.to_device(np.asarray(rows, np.float32)),
                                          probs, ids)
    return ids.copy_to_host()


def sampler_rows(rng, V):
    logits = normal(rng, 6, V, scale=2.0)
    logits[2, 10:20] = logits[2, 9]  # ties straddling a top-k boundary
    logits[3, :] = np.round(logits[3, :])  # many ties everywhere
    logits[5, 30:] = -np.inf  # masked tokens
    params = [(1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.0, 12, 0.8, 0.0), (1.0, 4, 0.5, 0.0), (0.5, 0, 0.3, 0.02),
              (2.0, 20, 0.9, 0.05)]
    return logits, params


@pytest.mark.parametrize("threads", [8, 32])
def test_sampler_greedy_takes_the_first_maximum(threads):
    logits = np.full((3, 70), -1.0, np.float32)
    logits[0, [5, 40]] = 3.0  # a tie: the lower index wins, as np.argmax
    logits[1, 69] = 0.5
    logits[2, 0] = 2.0
    ids = device_draw(logits, [(0, 0, 1, 0, 0.5)] * 3, threads)
    np.testing.assert_array_equal(ids, np.argmax(logits, axis=1))


def test_sampler_follows_sampling_rules_over_a_grid_of_u():
    """Each row drawn at 6 values of u across [0, 1): the same id as sampling.py's filters and draw rule, so the
    kept set and its order are right, not only one draw."""
    threads = 8
    logits, params = sampler_rows(np.random.default_rng(1), 45)
    grid = np.linspace(0, 1, 6, endpoint=False) + 0.07
    for row, (t, k, p, m) in enumerate(params):
        ids = device_draw(np.repeat(logits[row:row + 1], len(grid), axis=0), [(t, k, p, m, u) for u in grid], threads)
        np.testing.assert_array_equal(ids, [reference_draw(logits[row], t, k, p, m, u) for u in grid],
                                      err_msg=f"row {row}: temperature {t}, top_k {k}, top_p {p}, min_p {m}")


@pytest.mark.parametrize("threads", [8, 32])
def test_sampler_draws_what_sample_with_draws(threads):
    """End to end: with the row's one rng.random() as u, the id sample_with itself picks."""
    logits, params = sampler_rows(np.random.default_rng(threads), 75)
    rows = [(t, k, p, m, np.random.default_rng(seed).random()) for seed, (t, k, p, m) in enumerate(params)]
    expected = [int(sample_with(SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m), logits[b],
                                np.random.default_rng(b))) for b, (t, k, p, m) in enumerate(params)]
    np.testing.assert_array_equal(device_draw(logits, rows, threads), expected)


def test_sampler_tie_rules():
    """Ties at a filter's floor are kept whole; the draw takes the first kept id whose running mass exceeds u times
    the total, so u landing exactly on a step moves on to the next token."""
    logits = np.zeros((4, 20), np.float32)
    logits[1] = [5, 5, 2, 2, 2, 2] + [-1] * 14
    logits[2:] = [3] * 4 + [0] * 16
    rows = [(1, 3, 1, 0, 0.62), (1, 3, 1, 0, 0.99), (1, 0, 0.5, 0, 0.99), (1, 4, 1, 0, 0.5)]
    ids = device_draw(logits, rows, 8)
    # top-k 3 of 20 equal logits keeps all 20 (u 0.62 -> id 12); of (5, 5, 2, 2, 2, 2, ...) both 5s and all four
    # 2s (u 0.99 -> id 5); the four 3s hold over half the mass: top-p 0.5 keeps just them; top-k 4 keeps them and
    # u = 0.5 is exactly their second step: id 2
    np.testing.assert_array_equal(ids, [12, 5, 3, 2])
    np.testing.assert_array_equal(ids, [reference_draw(logits[b], *rows[b]) for b in range(4)])


@pytest.mark.parametrize("normalize, act", [(True, 0), (False, 1)])
def test_routed_ffn_matches_route_and_moe_ffn(normalize, act):
    """The experts' three steps (router + top-k, the chosen experts' gate/up, their down products summed with the
    router's weights into y) against ops.route and ops.moe_ffn: normalised top-k weights (Mixtral, Qwen3-MoE) or
    not, SiLU or GELU gates; two launches of 3 blocks of 8 threads, fewer threads than work items."""
    rng = np.random.default_rng(7 + act)
    T, D, E, k, F = 5, 12, 6, 2, 7
    xn, router = normal(rng, T, D), normal(rng, E, D)
    w1, w2, w3 = normal(rng, E, F, D, scale=0.3), normal(rng, E, D, F, scale=0.3), normal(rng, E, F, D, scale=0.3)
    y0, alpha = normal(rng, T, D), np.float32(0.5)
    probs, chosen = cuda.device_array((T, E), np.float32), cuda.device_array((T, k), np.int32)
    routed, he, y = cuda.device_array((T, k), np.float32), cuda.device_array((T, k, F), np.float32), cuda.to_device(y0)
    args = [cuda.to_device(xn), cuda.to_device(router), np.int32(normalize),
            cuda.to_device(np.ascontiguousarray(np.stack([w1, w3], axis=1))), cuda.to_device(w2), np.int32(act), alpha,
            probs, chosen, routed, he, y]
    for piece in range(3):
        cuda_ffn.routed_ffn_kernel(piece)[3, 8](*args)
    want_chosen, want_weights = ops.route(xn, router, k, normalize)
    np.testing.assert_array_equal(chosen.copy_to_host(), want_chosen)
    np.testing.assert_allclose(routed.copy_to_host(), want_weights, rtol=1e-5)
    gate = ops.ACTIVATIONS[ck.ACTIVATIONS[act]]
    expected = y0 + alpha * ops.moe_ffn(xn, want_chosen, want_weights, w1, w2, w3, gate)
    np.testing.assert_allclose(y.copy_to_host(), expected, rtol=1e-5, atol=1e-5)
