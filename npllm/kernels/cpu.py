"""The stages of ops.py as Numba CPU kernels: same math, loops instead of array expressions.

The kernels write into buffers the caller owns (`*_into`); models/numba.py strings them into one compiled
forward pass, so that a decode step never returns to Python between layers. matmul and lm_head return new arrays
(the LM head runs after the forward pass). Tests hold each kernel to its NumPy reference in ops.py.

Weight matrices are repacked once into panels (see pack_panels): 16 output rows interleaved along the input axis,
so a kernel streams each weight exactly once, in address order, and keeps a tile of partial sums in registers.

    W [N, D]  --pack_panels-->  panels [P, D, 16]    panels[p, k, j] = W[16 p + j, k]   (P = ceil(N / 16))

Every output of a matrix product is a sum over k = 0 .. D-1 taken strictly in that order with fused multiply-adds,
whatever the number of tokens: prefill and decode give the same bits (see simd.py). Attention for a query at
position p likewise walks its keys in position order with block boundaries fixed by p alone.
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np
from numba import njit, prange

from .simd import (LANES, WIDE, load_kv, prefetch, store_kv, vadd, vfma, vfmav, vload, vload16, vload_kv, vstore,
                   vsum, vsum8, vzero, vzero16)

PANEL = 16  # output rows per panel: two 8-lane vectors
TILE_T = 6  # tokens per prefill tile: 6 x 2 vector accumulators fill 12 of the 16 AVX registers
TILE_T_WIDE = 8  # with AVX-512: 8 x 2 accumulators in 16 of the 32 registers
GROUP = 4  # panels a decode tile covers: 8 independent accumulators hide the latency of a multiply-add
KEY_BLOCK = 64  # keys scored together before one online-softmax update
QUERY_BLOCK = 16  # prefill queries that share each block of keys while it is in cache

# Fast-math flags for sums and maxima whose order the compiler may choose (and so vectorise). The order is still
# fixed once compiled, so prefill and decode, which run the same code, agree. Never 'ninf': attention relies on
# -inf scores and exp(-inf) = 0.
REASSOC = {"reassoc", "contract", "nsz", "nnan"}


# ---------------------------------------------------------------------------------------------- weights in panels

def pack_panels(w: np.ndarray) -> np.ndarray:
    """Repack a weight matrix for the matmul kernels, rows zero-padded to a multiple of 16.  # [N, D] -> [P, D, 16]"""
    N, D = w.shape
    P = -(-N // PANEL)
    padded = np.zeros((P * PANEL, D), np.float32)
    padded[:N] = w
    return np.ascontiguousarray(padded.reshape(P, PANEL, D).transpose(0, 2, 1))


# ----------------------------------------------------------------------------------------------- matrix products

@njit(inline="always")
def tile_6x16(x, t, rows, w, base, D, out, col):
    """out[t : t+rows, col : col+16] = x[t : t+rows, :D] @ panel.T for rows <= 6, the panel's D x 16 floats
    starting at w[base]. Twelve 8-lane accumulators; with fewer than 6 rows the last row is computed again in the
    spare accumulators (same cost, one pass over the panel) and not stored."""
    r1, r2, r3, r4, r5 = min(t + 1, t + rows - 1), min(t + 2, t + rows - 1), min(t + 3, t + rows - 1), \
        min(t + 4, t + rows - 1), min(t + 5, t + rows - 1)
    a00 = vzero(); a01 = vzero(); a10 = vzero(); a11 = vzero(); a20 = vzero(); a21 = vzero()
    a30 = vzero(); a31 = vzero(); a40 = vzero(); a41 = vzero(); a50 = vzero(); a51 = vzero()
    for k in range(D):
        lo = vload(w, base + PANEL * k)  # W rows col .. col+7 at input k
        hi = vload(w, base + PANEL * k + 8)  # W rows col+8 .. col+15
        x0 = x[t, k]; x1 = x[r1, k]; x2 = x[r2, k]; x3 = x[r3, k]; x4 = x[r4, k]; x5 = x[r5, k]
        a00 = vfma(a00, x0, lo); a01 = vfma(a01, x0, hi)
        a10 = vfma(a10, x1, lo); a11 = vfma(a11, x1, hi)
        a20 = vfma(a20, x2, lo); a21 = vfma(a21, x2, hi)
        a30 = vfma(a30, x3, lo); a31 = vfma(a31, x3, hi)
        a40 = vfma(a40, x4, lo); a41 = vfma(a41, x4, hi)
        a50 = vfma(a50, x5, lo); a51 = vfma(a51, x5, hi)
    vstore(out[t], col, a00); vstore(out[t], col + 8, a01)
    if rows > 1:
        vstore(out[r1], col, a10); vstore(out[r1], col + 8, a11)
    if rows > 2:
        vstore(out[r2], col, a20); vstore(out[r2], col + 8, a21)
    if rows > 3:
        vstore(out[r3], col, a30); vstore(out[r3], col + 8, a31)
    if rows > 4:
        vstore(out[r4], col, a40); vstore(out[r4], col + 8, a41)
    if rows > 5:
        vstore(out[r5], col, a50); vstore(out[r5], col + 8, a51)


@njit(inline="always")
def _tile_8x32(x, t, rows, w, base, D, out, col):
    """As tile_6x16 for 8 tokens and two consecutive panels (32 outputs) at once: sixteen 16-lane (AVX-512)
    accumulators. A batch of 8 decode steps is one pass over the weights."""
    r1, r2, r3 = min(t + 1, t + rows - 1), min(t + 2, t + rows - 1), min(t + 3, t + rows - 1)
    r4, r5, r6, r7 = min(t + 4, t + rows - 1), min(t + 5, t + rows - 1), min(t + 6, t + rows - 1), \
        min(t + 7, t + rows - 1)
    second = base + D * PANEL
    a00 = vzero16(); a01 = vzero16(); a10 = vzero16(); a11 = vzero16(); a20 = vzero16(); a21 = vzero16()
    a30 = vzero16(); a31 = vzero16(); a40 = vzero16(); a41 = vzero16(); a50 = vzero16(); a51 = vzero16()
    a60 = vzero16(); a61 = vzero16(); a70 = vzero16(); a71 = vzero16()
    for k in range(D):
        lo = vload16(w, base + PANEL * k)  # W rows col .. col+15 at input k
        hi = vload16(w, second + PANEL * k)  # W rows col+16 .. col+31
        x0 = x[t, k]; x1 = x[r1, k]; x2 = x[r2, k]; x3 = x[r3, k]
        a00 = vfma(a00, x0, lo); a01 = vfma(a01, x0, hi)
        a10 = vfma(a10, x1, lo); a11 = vfma(a11, x1, hi)
        a20 = vfma(a20, x2, lo); a21 = vfma(a21, x2, hi)
        a30 = vfma(a30, x3, lo); a31 = vfma(a31, x3, hi)
        x4 = x[r4, k]; x5 = x[r5, k]; x6 = x[r6, k]; x7 = x[r7, k]
        a40 = vfma(a40, x4, lo); a41 = vfma(a41, x4, hi)
        a50 = vfma(a50, x5, lo); a51 = vfma(a51, x5, hi)
        a60 = vfma(a60, x6, lo); a61 = vfma(a61, x6, hi)
        a70 = vfma(a70, x7, lo); a71 = vfma(a71, x7, hi)
    vstore(out[t], col, a00); vstore(out[t], col + 16, a01)
    if rows > 1:
        vstore(out[r1], col, a10); vstore(out[r1], col + 16, a11)
    if rows > 2:
        vstore(out[r2], col, a20); vstore(out[r2], col + 16, a21)
    if rows > 3:
        vstore(out[r3], col, a30); vstore(out[r3], col + 16, a31)
    if rows > 4:
        vstore(out[r4], col, a40); vstore(out[r4], col + 16, a41)
    if rows > 5:
        vstore(out[r5], col, a50); vstore(out[r5], col + 16, a51)
    if rows > 6:
        vstore(out[r6], col, a60); vstore(out[r6], col + 16, a61)
    if rows > 7:
        vstore(out[r7], col, a70); vstore(out[r7], col + 16, a71)


@njit(inline="always")
def _tile_1x64(x, t, w, base, D, out, col):
    """out[t, col : col+64] = x[t, :D] @ (four consecutive panels).T: one token, eight chains of multiply-adds."""
    stride = D * PANEL  # floats per panel
    a0 = vzero(); a1 = vzero(); a2 = vzero(); a3 = vzero(); a4 = vzero(); a5 = vzero(); a6 = vzero(); a7 = vzero()
    for k in range(D):
        xk = x[t, k]
        i = base + PANEL * k
        a0 = vfma(a0, xk, vload(w, i)); a1 = vfma(a1, xk, vload(w, i + 8))
        i += stride
        a2 = vfma(a2, xk, vload(w, i)); a3 = vfma(a3, xk, vload(w, i + 8))
        i += stride
        a4 = vfma(a4, xk, vload(w, i)); a5 = vfma(a5, xk, vload(w, i + 8))
        i += stride
        a6 = vfma(a6, xk, vload(w, i)); a7 = vfma(a7, xk, vload(w, i + 8))
    row = out[t]
    vstore(row, col, a0); vstore(row, col + 8, a1); vstore(row, col + 16, a2); vstore(row, col + 24, a3)
    vstore(row, col + 32, a4); vstore(row, col + 40, a5); vstore(row, col + 48, a6); vstore(row, col + 56, a7)


@njit(inline="always")
def _matmul_panels(x, T, w, D, p0, p1, out, col):
    """Panels p0 .. p1-1 of x @ W.T into out[:, col + 16 p0 : col + 16 p1], in groups of GROUP panels that stay in
    cache while every token passes.

    A single token (decode) takes four panels at a time. More tokens go 6 at a time through one panel, or, where
    the machine has 16-lane registers, 8 at a time through two.
    """
    for g in range(p0, p1, GROUP):
        n = min(GROUP, p1 - g)
        if T == 1 and n == GROUP:
            _tile_1x64(x, 0, w, g * D * PANEL, D, out, col + g * PANEL)
            continue
        p = g
        if WIDE:
            while p + 2 <= g + n:
                for t in range(0, T, TILE_T_WIDE):
                    _tile_8x32(x, t, min(TILE_T_WIDE, T - t), w, p * D * PANEL, D, out, col + p * PANEL)
                p += 2
        while p < g + n:
            for t in range(0, T, TILE_T):
                tile_6x16(x, t, min(TILE_T, T - t), w, p * D * PANEL, D, out, col + p * PANEL)
            p += 1


@njit(cache=True)
def matmul_panel_rows(w, D, x, T, out, col, n0, n1):
    """out[t, col + n] = W[n] . x[t] for t < T, n0 <= n < n1 (n0 a multiple of 16), W held as panels (pack_panels'
    layout, flat: [P 16 D] float32): the products of the Numba model's float32 matrices (models/numba_products.py),
    one thread's range. A last panel that n1 cuts is computed into an aside and only its rows stored (the columns
    past n1 are another matrix's, perhaps another thread's).             # [>=T, >=D] -> [>=T, >=col + n1]"""
    p0, whole = n0 // PANEL, n1 // PANEL
    _matmul_panels(x, T, w, D, p0, whole, out, col)
    if n1 % PANEL:
        aside = np.empty((T, PANEL), np.float32)
        _matmul_panels(x, T, w, D, whole, whole + 1, aside, -PANEL * whole)
        for t in range(T):
            for j in range(n1 % PANEL):
                out[t, col + PANEL * whole + j] = aside[t, j]


@njit(parallel=True, cache=True)
def matmul_into(x, panels, out, T, threads):
    """out[:T, :16P] = x[:T, :D] @ W.T, W packed as panels.   # [>=T, >=D], [P, D, 16] -> [>=T, >=16P]

    Output panels are split into one contiguous range per thread. Buffers may be wider than the product (the
    extra columns are not read) and longer than T (the extra rows are left alone).
    """
    P, D, _ = panels.shape
    w = panels.reshape(P * D * PANEL)
    chunks = min(P, threads)
    for c in prange(chunks):
        _matmul_panels(x, T, w, D, c * P // chunks, (c + 1) * P // chunks, out, 0)


@njit(cache=True)
def matmul(x, panels, n, threads):
    """x @ W.T for W packed as panels, the first n outputs.   # [T, D], [P, D, 16] -> [T, n]"""
    out = np.empty((x.shape[0], panels.shape[0] * PANEL), np.float32)
    matmul_into(x, panels, out, x.shape[0], threads)
    return out[:, :n].copy()


@njit(cache=True)
def lm_head(x, output_panels, V, threads):
    """Logits x W_out^T.   # [T, D], [P, D, 16] -> [T, V]"""
    return matmul(x, output_panels, V, threads)


# ------------------------------------------------------------------------------------------------------------ exp

# exp(z) = 2^k p(r) with z = k ln2 + r, |r| <= ln2 / 2, p a degree-7 polynomial (relative error ~1e-7): plain
# arithmetic and one integer shift, so the compiler vectorises a loop of them, where libm's expf is a call per value.
_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)  # ln 2 split in two so that k * _LN2_HI is exact
_LN2_LO = np.float32(-2.12194440e-4)
_EXP_MIN = np.float32(-87.0)  # at or below: exp(z) is at the edge of float32's normal range, taken as 0
_EXP_MAX = np.float32(88.0)  # above: clamped (exp(88) = 1.65e38, still finite)


@njit(inline="always")
def _exp_into(x, n, bits):
    """x[j] = exp(x[j]) for j < n; -inf gives exactly 0.   bits: int32 scratch of length >= n."""
    powers = bits.view(np.float32)
    for j in range(n):
        z = min(max(x[j], _EXP_MIN), _EXP_MAX)
        k = np.floor(z * _LOG2E + np.float32(0.5))
        r = (z - k * _LN2_HI) - k * _LN2_LO
        p = np.float32(1.9875691500e-4)
        p = p * r + np.float32(1.3981999507e-3)
        p = p * r + np.float32(8.3334519073e-3)
        p = p * r + np.float32(4.1665795894e-2)
        p = p * r + np.float32(1.6666665459e-1)
        p = p * r + np.float32(5.0000001201e-1)
        p = (p * r) * r + r + np.float32(1.0)
        bits[j] = (np.int32(k) + np.int32(127)) << np.int32(23)  # the float32 bit pattern of 2^k
        x[j] = p if z > _EXP_MIN else np.float32(0.0)
    for j in range(n):
        x[j] *= powers[j]


# ------------------------------------------------------------------------------------------ norms and activations

@njit(fastmath=REASSOC, inline="always")
def _sum_of_squares(x, t, D):
    s = np.float32(0.0)
    for d in range(D):
        s += x[t, d] * x[t, d]
    return s


@njit(cache=True)
def rms_norm_into(x, weight, eps, out, T):
    """out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * g for t < T.   # [>=T, D], [D] -> [>=T, D]"""
    D = weight.shape[0]
    for t in range(T):
        inv = np.float32(1.0) / np.sqrt(_sum_of_squares(x, t, D) / np.float32(D) + np.float32(eps))
        for d in range(D):
            out[t, d] = x[t, d] * inv * weight[d]


@njit(cache=True)
def rms_norm_heads_into(x, col, heads, Dh, weight, eps, T):
    """q or k norms (ModelConfig.qk_norm) in place on columns col .. col + heads*Dh of x's first T rows: RMSNorm of
    each head's Dh values with weight [Dh] ("head": Qwen3, Gemma 3), or of all heads*Dh values at once with weight
    [heads*Dh] ("projection": OLMo 2); each group as ops.rms_norm.                          # [>=T, >=col+heads*Dh]"""
    n = weight.shape[0]
    for t in range(T):
        for g in range(col, col + heads * Dh, n):
            s = np.float32(0.0)
            for i in range(n):
                s += x[t, g + i] * x[t, g + i]
            inv = np.float32(1.0) / np.sqrt(s / np.float32(n) + np.float32(eps))
            for i in range(n):
                x[t, g + i] = x[t, g + i] * inv * weight[i]


SILU, GELU_TANH = 0, 1  # the gate's activation (ModelConfig.ffn_activation "silu", "gelu_tanh"), as kernels take it
_SQRT_2_OVER_PI = np.float32(np.sqrt(2.0 / np.pi))


@njit(inline="always")
def gelu_tanh(x):
    """GELU, tanh approximation, of one float32 value, as ops.gelu_tanh:
    x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    inner = _SQRT_2_OVER_PI * (x + np.float32(0.044715) * x * x * x)
    return np.float32(0.5) * x * (np.float32(1.0) + np.tanh(inner))


@njit(inline="always")
def softcap(x, cap):
    """Soft-capping of one float32 value, as ops.softcap: c tanh(x / c) (cap c > 0, float32)."""
    return cap * np.tanh(x / cap)


@njit(cache=True)
def geglu_hidden_into(gate_up, block, out, F, T):
    """out[t, i] = gelu_tanh(gate) * up for i < F, t < T (GeGLU: Gemma's feed-forward), gate and up in alternating
    blocks of `block` columns as fused_gate_up lays them out: gate i at column 2 block (i // block) + i % block, its
    up `block` columns further (block 16: the panels' layout; block F: gate | up side by side).
                                                                                     # [>=T, 2F'] -> [>=T, >=F]"""
    for t in range(T):
        for i in range(F):
            at = 2 * block * (i // block) + i % block
            out[t, i] = gelu_tanh(gate_up[t, at]) * gate_up[t, at + block]


@njit(cache=True)
def swiglu_hidden_into(gate_up, out, T, act):
    """out[t, 16i + j] = silu(gate) * up = gate / (1 + e^-gate) * up, gate and up read from their interleaved
    panels; act GELU_TANH: gelu_tanh(gate) * up.                                 # [>=T, 2Fp] -> [>=T, Fp]

    gate_up is x @ fused_gate_up(layer, 16).T (models/weights.py): columns 32i .. 32i+15 hold gate outputs
    16i .. 16i+15 and columns 32i+16 .. 32i+31 the matching up outputs.
    """
    Fp = out.shape[1]
    if act == GELU_TANH:
        geglu_hidden_into(gate_up, PANEL, out, Fp, T)
        return
    e = np.empty(Fp, np.float32)
    bits = np.empty(Fp, np.int32)
    for t in range(T):
        for i in range(Fp // PANEL):
            for j in range(PANEL):
                e[PANEL * i + j] = -gate_up[t, 2 * PANEL * i + j]
        _exp_into(e, Fp, bits)
        for i in range(Fp // PANEL):
            for j in range(PANEL):
                gate, up = gate_up[t, 2 * PANEL * i + j], gate_up[t, 2 * PANEL * i + PANEL + j]
                out[t, PANEL * i + j] = gate / (np.float32(1.0) + e[PANEL * i + j]) * up


# --------------------------------------------------------------------------------------------- mixture of experts

@njit(cache=True)
def route_into(logits, T, E, k, normalize, chosen, weights):
    """The router's choice, as ops.route: p = softmax(logits[t, :E]) in float64, chosen[t] = the k largest p (the
    largest first, ties to the lower expert id: a stable sort of -p), weights[t] = their p, divided by their sum
    when normalize.                                         # [>=T, >=E] -> chosen [>=T, >=k] int64, weights float32"""
    p = np.empty(E, np.float64)
    taken = np.empty(E, np.bool_)
    for t in range(T):
        m = -np.inf
        for e in range(E):
            m = max(m, np.float64(logits[t, e]))
        total = 0.0
        for e in range(E):
            p[e] = np.exp(np.float64(logits[t, e]) - m)
            total += p[e]
        taken[:] = False
        kept = 0.0
        for e in range(E):
            p[e] /= total
        for j in range(k):
            best = -1
            for e in range(E):
                if not taken[e] and (best < 0 or p[e] > p[best]):
                    best = e
            taken[best] = True
            chosen[t, j] = best
            kept += p[best]
        for j in range(k):
            weights[t, j] = np.float32(p[chosen[t, j]] / kept if normalize else p[chosen[t, j]])


# --------------------------------------------------------------------------------------------------------- RoPE

@njit(cache=True)
def rope_angles_into(positions, inv_freq, amplitude, cos, sin, T):
    """a_i cos, a_i sin of pos * w_i, computed in float64 as ops.rope_angles does.   # [T], [Dh/2] x2 -> [T, Dh/2] x2"""
    for t in range(T):
        for i in range(inv_freq.shape[0]):
            angle = np.float64(positions[t]) * inv_freq[i]
            cos[t, i] = np.float32(np.cos(angle) * amplitude[i])
            sin[t, i] = np.float32(np.sin(angle) * amplitude[i])


@njit(cache=True)
def rope_interleaved_into(x, heads, Dh, cos, sin, T):
    """Rotate pairs (2i, 2i+1) of the first `heads` heads of each row in place.   # [>=T, >=heads*Dh]"""
    for t in range(T):
        for h in range(heads):
            base = h * Dh
            for i in range(Dh // 2):
                even, odd = x[t, base + 2 * i], x[t, base + 2 * i + 1]
                x[t, base + 2 * i] = even * cos[t, i] - odd * sin[t, i]
                x[t, base + 2 * i + 1] = even * sin[t, i] + odd * cos[t, i]


# ---------------------------------------------------------------------------------------------------- attention

@njit(inline="always")
def _dot(a, ia, b, ib, n):
    """a[ia : ia+n] . b[ib : ib+n] over 1-D arrays (b: float32 or float16 cache bits, simd.vload_kv): eight lanes
    at a time (two chains, even and odd chunks of 8, for twice the throughput), in a fixed order, then the tail."""
    full = n - n % LANES
    even, odd = vzero(), vzero()
    d = 0
    while d + 2 * LANES <= full:
        even = vfmav(even, vload(a, ia + d), vload_kv(b, ib + d))
        odd = vfmav(odd, vload(a, ia + d + LANES), vload_kv(b, ib + d + LANES))
        d += 2 * LANES
    if d < full:
        even = vfmav(even, vload(a, ia + d), vload_kv(b, ib + d))
    s = vsum(vadd(even, odd))
    for d in range(full, n):
        s += a[ia + d] * load_kv(b, ib + d)
    return s


@njit  # its own function, not inlined: inlined it added ~2 s to compiling attention_ring_into (33 vs 31 s)
def _dot8_into(a, ia, b, bases, j, n, out):
    """out[j + k] = a[ia : ia+n] . b[bases[j+k] : bases[j+k]+n] for k < 8: _dot of eight rows of b at once, with the
    same chains and the same tree of sums per row (simd.vsum8), so the same bits. Sixteen independent chains keep
    the multiply-adds busy where one _dot waits on its two."""
    full = n - n % LANES
    e0, e1, e2, e3, e4, e5, e6, e7 = vzero(), vzero(), vzero(), vzero(), vzero(), vzero(), vzero(), vzero()
    o0, o1, o2, o3, o4, o5, o6, o7 = vzero(), vzero(), vzero(), vzero(), vzero(), vzero(), vzero(), vzero()
    b0, b1, b2, b3 = bases[j], bases[j + 1], bases[j + 2], bases[j + 3]
    b4, b5, b6, b7 = bases[j + 4], bases[j + 5], bases[j + 6], bases[j + 7]
    d = 0
    while d + 2 * LANES <= full:
        x, y = vload(a, ia + d), vload(a, ia + d + LANES)
        e0 = vfmav(e0, x, vload_kv(b, b0 + d)); o0 = vfmav(o0, y, vload_kv(b, b0 + d + LANES))
        e1 = vfmav(e1, x, vload_kv(b, b1 + d)); o1 = vfmav(o1, y, vload_kv(b, b1 + d + LANES))
        e2 = vfmav(e2, x, vload_kv(b, b2 + d)); o2 = vfmav(o2, y, vload_kv(b, b2 + d + LANES))
        e3 = vfmav(e3, x, vload_kv(b, b3 + d)); o3 = vfmav(o3, y, vload_kv(b, b3 + d + LANES))
        e4 = vfmav(e4, x, vload_kv(b, b4 + d)); o4 = vfmav(o4, y, vload_kv(b, b4 + d + LANES))
        e5 = vfmav(e5, x, vload_kv(b, b5 + d)); o5 = vfmav(o5, y, vload_kv(b, b5 + d + LANES))
        e6 = vfmav(e6, x, vload_kv(b, b6 + d)); o6 = vfmav(o6, y, vload_kv(b, b6 + d + LANES))
        e7 = vfmav(e7, x, vload_kv(b, b7 + d)); o7 = vfmav(o7, y, vload_kv(b, b7 + d + LANES))
        d += 2 * LANES
    if d < full:
        x = vload(a, ia + d)
        e0 = vfmav(e0, x, vload_kv(b, b0 + d)); e1 = vfmav(e1, x, vload_kv(b, b1 + d))
        e2 = vfmav(e2, x, vload_kv(b, b2 + d)); e3 = vfmav(e3, x, vload_kv(b, b3 + d))
        e4 = vfmav(e4, x, vload_kv(b, b4 + d)); e5 = vfmav(e5, x, vload_kv(b, b5 + d))
        e6 = vfmav(e6, x, vload_kv(b, b6 + d)); e7 = vfmav(e7, x, vload_kv(b, b7 + d))
    vstore(out, j, vsum8(vadd(e0, o0), vadd(e1, o1), vadd(e2, o2), vadd(e3, o3), vadd(e4, o4), vadd(e5, o5),
                         vadd(e6, o6), vadd(e7, o7)))
    for k in range(8):
        s = out[j + k]
        for d in range(full, n):
            s += a[ia + d] * load_kv(b, bases[j + k] + d)
        out[j + k] = s


@njit(inline="always")
def _accumulate_values(weights, bases, n, values, out, col, Dv):
    """out[col : col+Dv] += sum_j weights[j] * values[bases[j] : bases[j]+Dv], keys added in order j = 0 .. n-1.

    values: float32, or float16 cache bits (simd.vload_kv). Output lanes stay in registers while the keys stream
    past: 32 at a time (four independent chains of multiply-adds), then 16, then 8, then one by one. A masked key
    has weight 0 and adds 0.
    """
    d = 0
    while d + 4 * LANES <= Dv:
        a0, a1 = vload(out, col + d), vload(out, col + d + LANES)
        a2, a3 = vload(out, col + d + 2 * LANES), vload(out, col + d + 3 * LANES)
        for j in range(n):
            w, i = weights[j], bases[j] + d
            a0 = vfma(a0, w, vload_kv(values, i))
            a1 = vfma(a1, w, vload_kv(values, i + LANES))
            a2 = vfma(a2, w, vload_kv(values, i + 2 * LANES))
            a3 = vfma(a3, w, vload_kv(values, i + 3 * LANES))
        vstore(out, col + d, a0); vstore(out, col + d + LANES, a1)
        vstore(out, col + d + 2 * LANES, a2); vstore(out, col + d + 3 * LANES, a3)
        d += 4 * LANES
    if d + 2 * LANES <= Dv:
        a0, a1 = vload(out, col + d), vload(out, col + d + LANES)
        for j in range(n):
            w, i = weights[j], bases[j] + d
            a0 = vfma(a0, w, vload_kv(values, i))
            a1 = vfma(a1, w, vload_kv(values, i + LANES))
        vstore(out, col + d, a0); vstore(out, col + d + LANES, a1)
        d += 2 * LANES
    if d + LANES <= Dv:
        a0 = vload(out, col + d)
        for j in range(n):
            a0 = vfma(a0, weights[j], vload_kv(values, bases[j] + d))
        vstore(out, col + d, a0)
        d += LANES
    for d in range(d, Dv):
        acc = out[col + d]
        for j in range(n):
            acc += weights[j] * load_kv(values, bases[j] + d)
        out[col + d] = acc


@njit(fastmath=REASSOC, inline="always")
def _max(x, n):
    m = np.float32(-np.inf)
    for j in range(n):
        m = max(m, x[j])
    return m


@njit(fastmath=REASSOC, inline="always")
def _sum(x, n):
    s = np.float32(0.0)
    for j in range(n):
        s += x[j]
    return s


@njit(inline="always")
def _online_softmax_block(scores, bases, n, values, out, col, Dv, m, l, bits):
    """Fold one block of n scores into the running max m, sum l and unnormalised output out[col : col+Dv].

    With m' = max(m, max_j s_j):   l'   = l e^(m - m') + sum_j e^(s_j - m')
                                   out' = out e^(m - m') + sum_j e^(s_j - m') v_j
    where v_j = values[bases[j] : bases[j]+Dv]. Returns (m', l'). A block of masked keys (all -inf) changes nothing.
    """
    block_max = _max(scores, n)
    if block_max == -np.inf:
        return m, l
    new_m = max(m, block_max)
    alpha = np.exp(m - new_m)  # 0 on the first block, where m = -inf
    if alpha != 1.0:
        l = l * alpha
        for d in range(Dv):
            out[col + d] *= alpha
    for j in range(n):
        scores[j] -= new_m
    _exp_into(scores, n, bits)
    l += _sum(scores, n)
    _accumulate_values(scores, bases, n, values, out, col, Dv)
    return new_m, l


PREFETCH_AHEAD = 8  # key positions between a prefetch and its use: ~2 memory latencies of dot products


@njit(inline="always")
def _prefetch_row(a, at, n):
    """Prefetch a.flat[at : at + n] (a key or value row: one position of one kv head), one request per 64 bytes at
    most. A head's rows lie K x Dh values apart in the ring, a stride the hardware prefetcher does not follow: cold
    decode attention ran at ~2.5 GB/s without this."""
    for i in range(0, n, 16):
        prefetch(a, at + i)


# A forward call's tokens grouped by cache slot: sequence s is order[starts[s] : starts[s + 1]], in slot slots[s].
Sequences = namedtuple("Sequences", ["order", "starts", "slots"])
# One layer of a ring cache: keys and values k, v [B, C, K, Dh] (float32, or float16 bits as uint16; flattened to
# [B C K Dh] inside the kernels) and positions [B, C] (the position each entry held before the call, -1 empty).
LayerRing = namedtuple("LayerRing", ["k", "v", "positions"])
# Attention's shape: K kv heads of G query heads each, head dim Dh, a query at p sees p - window < position <= p,
# scores scaled by `scale` (float32; 1 / sqrt(Dh) in Llama) and soft-capped at `cap` (float32; 0: not).
AttentionShape = namedtuple("AttentionShape", ["K", "G", "Dh", "window", "scale", "cap"])
# A layer's attention options as the model passes them: window, score scale and soft-cap (see AttentionShape).
AttentionOptions = namedtuple("AttentionOptions", ["window", "scale", "cap"])
# One work item's scratch: scores, bases, held, bits [KEY_BLOCK]; stats [QUERY_BLOCK, 2, G] (running max and sum).
Scratch = namedtuple("Scratch", ["scores", "bases", "held", "bits", "stats"])


@njit(inline="always")
def _key_block(ring, shape, b, g, p0, p1, valid_from, bases, held):
    """Where the keys of positions p0 .. p1-1 (kv head g, slot b) lie and whether the ring holds them:
    bases[j] = offset of position p0 + j's key (and value) row, held[j] = whether it counts.

    A key at position >= valid_from is known to be there (written by this call, or checked once per call);
    an older one counts only if ring_pos (the positions held before this call) says so. Each position also asks
    for the key PREFETCH_AHEAD positions on and for its own value row, so cold rows arrive before they are read.
    ring: LayerRing of flat keys and values; shape: AttentionShape.
    """
    keys, values, ring_pos = ring.k, ring.v, ring.positions  # attributes: parfors' array analysis fails on unpacking
    K, Dh = shape.K, shape.Dh
    C = ring_pos.shape[1]
    r = p0 % C  # ring index of position p0 + j, advanced without a division per key
    ahead = (p0 + PREFETCH_AHEAD) % C  # ring index PREFETCH_AHEAD positions further on
    for j in range(p1 - p0):
        bases[j] = ((b * C + r) * K + g) * Dh
        held[j] = p0 + j >= valid_from or ring_pos[b, r] == p0 + j
        _prefetch_row(keys, ((b * C + ahead) * K + g) * Dh, Dh)
        _prefetch_row(values, bases[j], Dh)  # read by _accumulate_values once the block is scored
        ahead = ahead + 1 if ahead + 1 < C else 0
        r = r + 1 if r + 1 < C else 0


@njit(inline="always")
def _score_block(q, q_col, keys, bases, held, n, shape, scores):
    """scores[j] = q[q_col : q_col+Dh] . keys[bases[j] : bases[j]+Dh] * scale for j < n, soft-capped where
    shape.cap > 0 (softcap), -inf where not held[j]. Eight keys at a time (_dot8_into: the same bits as _dot, key by
    key)."""
    Dh, scale, cap = shape.Dh, shape.scale, shape.cap
    j = 0
    while j + 8 <= n:
        _dot8_into(q, q_col, keys, bases, j, Dh, scores)
        j += 8
    for j in range(j, n):
        scores[j] = _dot(q, q_col, keys, bases[j], Dh)
    if cap > 0:
        for j in range(n):
            scores[j] = softcap(scores[j] * scale, cap) if held[j] else -np.inf
        return
    for j in range(n):
        scores[j] = scores[j] * scale if held[j] else -np.inf


@njit(inline="always")
def _attend_queries(qkv, rows, first_pos, g, b, valid_from, ring, shape, scratch, out):
    """Attention of Q = len(rows) consecutive queries of one sequence (positions first_pos .. first_pos+Q-1, token
    rows rows[0 .. Q-1]), each through the G query heads of kv head g, over the ring of slot b (a LayerRing of flat
    keys and values; shape: AttentionShape).

    Query p sees positions lo = max(0, p - window + 1) .. p, visited in blocks aligned to multiples of KEY_BLOCK
    (so the blocks, and every rounding, depend on p alone: one query at a time gives the same bits). The Q queries
    take each block in turn, so its keys and values are read from memory once and from cache Q - 1 times, and
    where its rows lie (_key_block) is worked out once. scratch: a Scratch (stats [Q, 2, G] running max and sum per
    query head).
    """
    G, Dh, window = shape.G, shape.Dh, shape.window
    scores, bases, held, bits, stats = scratch.scores, scratch.bases, scratch.held, scratch.bits, scratch.stats
    Q = rows.shape[0]
    for i in range(Q):
        for hh in range(G):
            stats[i, 0, hh], stats[i, 1, hh] = -np.inf, 0.0
            for d in range(Dh):
                out[rows[i], (g * G + hh) * Dh + d] = 0.0
    lo_first = max(0, first_pos - window + 1)
    for block in range(lo_first - lo_first % KEY_BLOCK, first_pos + Q, KEY_BLOCK):
        p0 = max(block, lo_first)  # the block's first position any query sees; bases[j] is position p0 + j
        _key_block(ring, shape, b, g, p0, min(block + KEY_BLOCK, first_pos + Q), valid_from, bases, held)
        for i in range(Q):
            p = first_pos + i
            j0, j1 = max(block, p - window + 1, 0), min(block + KEY_BLOCK, p + 1)
            if j0 >= j1:
                continue
            q, o = qkv[rows[i]], out[rows[i]]
            key_bases, key_held = bases[j0 - p0:], held[j0 - p0:]
            for hh in range(G):
                col = (g * G + hh) * Dh
                _score_block(q, col, ring.k, key_bases, key_held, j1 - j0, shape, scores)
                stats[i, 0, hh], stats[i, 1, hh] = _online_softmax_block(scores, key_bases, j1 - j0, ring.v, o, col,
                                                                         Dh, stats[i, 0, hh], stats[i, 1, hh], bits)
    for i in range(Q):
        for hh in range(G):
            for d in range(Dh):
                out[rows[i], (g * G + hh) * Dh + d] /= stats[i, 1, hh]


@njit(cache=True)
def valid_from_into(positions, seqs, ring_pos, window, out):
    """out[s] = the oldest position from which sequence s's keys are all present: its first position in this call,
    extended back over the contiguous run of positions the ring holds (at most a window's worth).

    Checking this once per call spares attention a lookup in ring_pos per key.
    """
    C = ring_pos.shape[1]
    for s in range(seqs.slots.shape[0]):
        b = seqs.slots[s]
        first = positions[seqs.order[seqs.starts[s]]]
        q = first
        while q > 0 and q > first - window and ring_pos[b, (q - 1) % C] == q - 1:
            q -= 1
        out[s] = q


@njit(parallel=True, cache=True)
def attention_ring_into(qkv, H, K, positions, seqs, valid_from, ring, options, out):
    """Causal attention of this call's tokens over the ring cache, writing their keys and values into it.

        qkv       [T, (H + 2K) Dh]  rotated queries (heads 0..H-1), rotated keys, values, per token
        seqs      Sequences: token indices grouped by sequence (order [T]), each sequence's tokens in position
                  order; sequence s is order[starts[s] : starts[s + 1]], in cache slot slots[s]
        valid_from [n_seq]  see valid_from_into
        ring      LayerRing: k, v [B, C, K, Dh] one layer of the cache, float32 or float16 bits (uint16: keys and
                  values are rounded to float16 when stored, widened when read); positions [B, C] those the ring
                  held before the call
        options   AttentionOptions: window, scale (float; ModelConfig.score_scale), cap (float; 0: none)
        out       [T, H Dh]

    One work item per (sequence, kv head). It takes the sequence's tokens QUERY_BLOCK at a time: stores their keys
    and values, then answers their queries, each seeing exactly the keys a one-token-at-a-time decode would. When
    storing a block would overwrite a key that one of its own queries still needs (a ring shorter than the prompt),
    the tokens go one at a time. A query at position p sees positions max(0, p - window + 1) .. p.
    """
    B, C, _, Dh = ring.k.shape
    G = H // K
    window = options.window
    shape = AttentionShape(K, G, Dh, window, np.float32(options.scale), np.float32(options.cap))
    keys = ring.k.reshape(B * C * K * Dh)
    values = ring.v.reshape(B * C * K * Dh)
    flat = LayerRing(keys, values, ring.positions)
    order, seq_starts = seqs.order, seqs.starts
    n_items = seqs.slots.shape[0] * K
    scores = np.empty((n_items, KEY_BLOCK), np.float32)  # scratch, one row per work item
    bases = np.empty((n_items, KEY_BLOCK), np.int64)
    held = np.empty((n_items, KEY_BLOCK), np.bool_)
    bits = np.empty((n_items, KEY_BLOCK), np.int32)
    stats = np.empty((n_items, QUERY_BLOCK, 2, G), np.float32)
    for item in prange(n_items):
        s, g = item // K, item % K
        b = seqs.slots[s]
        i = seq_starts[s]
        while i < seq_starts[s + 1]:
            first_pos = positions[order[i]]
            Q = min(QUERY_BLOCK, seq_starts[s + 1] - i)
            if first_pos + Q - 1 - C >= max(0, first_pos - window + 1):  # the block's writes would evict a key
                Q = 1
            rows = order[i:i + Q]
            for t in rows:
                slot_base = ((b * C + positions[t] % C) * K + g) * Dh
                for d in range(Dh):
                    store_kv(keys, slot_base + d, qkv[t, (H + g) * Dh + d])
                    store_kv(values, slot_base + d, qkv[t, (H + K + g) * Dh + d])
            _attend_queries(qkv, rows, first_pos, g, b, valid_from[s], flat, shape,
                            Scratch(scores[item], bases[item], held[item], bits[item], stats[item]), out)
            i += Q


# ------------------------------------------------------------------------------------------------------- sampling
# sampling.sample_with's draw for temperature, top-k, top-p and min-p, one compiled pass per row instead of a dozen
# NumPy calls (which cost as much as a whole forward pass of a small model). Floors are found by quickselect, not a
# sort: O(V) expected. The same arithmetic as sampling.py (float32 logits and exponentials, float64 sums), so the
# same id up to the last bit of an exponential or the order of a float64 sum: a draw differs only when u lands
# within rounding of a step of the running sum.

@njit(inline="always")
def _median_of_three(a, lo, hi):
    x, y, z = a[lo], a[(lo + hi) // 2], a[hi - 1]
    return max(min(x, y), min(max(x, y), z))


@njit(inline="always")
def _partition3(a, lo, hi, pivot):
    """Reorder a[lo:hi] as [> pivot | == pivot | < pivot]; return where the second and third parts start."""
    gt, i, lt = lo, lo, hi  # a[lo:gt] > pivot, a[gt:i] == pivot, a[i:lt] unseen, a[lt:hi] < pivot
    while i < lt:
        v = a[i]
        if v > pivot:
            a[i] = a[gt]
            a[gt] = v
            gt += 1
            i += 1
        elif v < pivot:
            lt -= 1
            a[i] = a[lt]
            a[lt] = v
        else:
            i += 1
    return gt, lt


@njit(cache=True)
def kth_largest(a, n, k):
    """The k-th largest of a[:n], 1 <= k <= n (a tie counts each copy); reorders a[:n]."""
    lo, hi = 0, n  # the answer lies in a[lo:hi], at rank k among them
    while True:
        pivot = _median_of_three(a, lo, hi)
        gt, eq = _partition3(a, lo, hi, pivot)
        if k <= gt - lo:
            hi = gt
        elif k <= eq - lo:
            return pivot
        else:
            k -= eq - lo
            lo = eq


@njit(cache=True)
def nucleus_floor(e, n, target):
    """The largest τ among e[:n] (values >= 0) with Σ_{e_j >= τ} e_j >= target > 0, sums in float64: top-p's floor
    (sampling._top_p_keep walks the descending running sum to the same τ). The smallest value when rounding keeps
    the whole sum below target. Reorders e[:n]."""
    smallest = e[0]
    for i in range(1, n):
        smallest = min(smallest, e[i])
    lo, hi, above = 0, n, 0.0  # a[:lo] > everything in a[lo:hi]; above = their sum, < target
    while hi > lo:
        pivot = _median_of_three(e, lo, hi)
        gt, eq = _partition3(e, lo, hi, pivot)
        greater = 0.0
        for i in range(lo, gt):
            greater += e[i]
        if above + greater >= target:
            hi = gt
            continue
        equal = 0.0
        for i in range(gt, eq):
            equal += e[i]
        if above + greater + equal >= target:
            return pivot
        above += greater + equal
        lo = eq
    return smallest


@njit(inline="always")
def inverse_cdf(e, V, total, u):
    """The first id i < V whose running sum of e (float64, ascending id) exceeds u * total (total = Σ e); the last
    e_i > 0 when rounding leaves u * total at the very end."""
    target, run, last = u * total, 0.0, -1
    for i in range(V):
        if e[i] > 0:
            run += e[i]
            last = i
            if run > target:
                return i
    return last


# top-p's floor in two passes: masses by bucket of the float32 bit pattern (which orders like the value; here the
# exponent and 3 mantissa bits: 8 buckets an octave), then quickselect inside the one bucket where the descending
# mass reaches the target. Values lie in [0, 1], whose patterns end at 0x3F800000.
_BUCKET_SHIFT = 20
_BUCKETS = (0x3F800000 >> _BUCKET_SHIFT) + 1


@njit(cache=True)
def nucleus_floor_bucketed(e, V, target, scratch):
    """nucleus_floor of the positive entries of e[:V] (values in (0, 1]), without reordering e: the largest τ with
    Σ_{e_j >= τ} e_j >= target, or the smallest positive value when rounding keeps the sum below target."""
    bits = e[:V].view(np.int32)
    mass = np.zeros(_BUCKETS, np.float64)
    for i in range(V):
        if e[i] > 0:
            mass[bits[i] >> _BUCKET_SHIFT] += e[i]
    above, b = 0.0, _BUCKETS - 1  # mass of the buckets above b
    while b > 0 and above + mass[b] < target:
        above += mass[b]
        b -= 1
    n = 0
    for i in range(V):
        if e[i] > 0 and bits[i] >> _BUCKET_SHIFT == b:
            scratch[n] = e[i]
            n += 1
    if n == 0:  # rounding: every bucket summed short of the target, keep everything
        return np.float32(0.0)
    return nucleus_floor(scratch, n, target - above)


@njit(inline="always")
def _tempered(x, m, t):
    """(x - m) / t, as sampling._shifted: with m = +inf (the row has +inf logits), 0 for x = +inf, else -inf."""
    if m == np.inf:
        return np.float32(0.0) if x == np.inf else np.float32(-np.inf)
    s = x - m
    return s if t == 1 else s / t


@njit(cache=True)
def sample_row(x, temperature, top_k, top_p, min_p, u, e, scratch):
    """One token id from logits x [V] float32, drawn as sampling.sample_with draws it with uniform u in [0, 1).

    temperature 0: the first index of the largest logit (np.argmax). Otherwise s = (x - max x) / temperature
    (a row with +inf logits: 0 there and -inf elsewhere), and each filter keeps tokens at or above a floor, ties at
    the floor kept whole:
        top_k  s_i >= the k-th largest s
        top_p  e_i >= τ, e = exp(s) of the tokens kept so far, τ the largest e with Σ_{e_j >= τ} e_j >= top_p Σ e
        min_p  s_i >= ln min_p
    then the inverse CDF at u over the kept tokens by ascending id: the first i whose running sum of e passes u Σ e.
    Returns -1 for logits with NaN and -2 when every logit is -inf (the caller reports them).
    e, scratch: float32 buffers of at least V entries.
    """
    V = x.shape[0]
    m = x[0]
    for i in range(V):
        if x[i] != x[i]:
            return -1
        m = max(m, x[i])
    if m == -np.inf:
        return -2
    if temperature == 0.0:
        return np.argmax(x)
    t = np.float32(temperature)
    floor_s = np.float32(-np.inf)
    if 0 < top_k < V:
        for i in range(V):
            scratch[i] = _tempered(x[i], m, t)
        floor_s = kth_largest(scratch, V, top_k)
    total = 0.0
    for i in range(V):  # e = exp(s) of the tokens top_k keeps, 0 elsewhere
        s = _tempered(x[i], m, t)
        e[i] = np.exp(s) if s >= floor_s else np.float32(0.0)
        total += e[i]
    tau = np.float32(0.0)
    if top_p < 1.0:
        tau = nucleus_floor_bucketed(e, V, top_p * total, scratch)
    floor_p = np.float32(np.log(min_p)) if min_p > 0.0 else np.float32(-np.inf)
    if tau > 0 or min_p > 0.0:  # top_p's mass is that of top_k's survivors alone; then min_p
        total = 0.0
        for i in range(V):
            if e[i] < tau or (e[i] > 0 and _tempered(x[i], m, t) < floor_p):
                e[i] = np.float32(0.0)
            total += e[i]
    return inverse_cdf(e, V, total, u)


@njit(cache=True)
def sample_rows(logits, params, ids):
    """sample_row for each row b of logits [B, V] with params[b] = (temperature, top_k, top_p, min_p, u) into ids
    [B]. Returns the first row whose logits have no distribution (ids[b] < 0 says why), or -1."""
    V = logits.shape[1]
    e = np.empty(V, np.float32)
    scratch = np.empty(V, np.float32)
    bad = -1
    for b in range(logits.shape[0]):
        ids[b] = sample_row(logits[b], params[b, 0], np.int64(params[b, 1]), params[b, 2], params[b, 3],
                            params[b, 4], e, scratch)
        if ids[b] < 0 and bad < 0:
            bad = b
    return bad
