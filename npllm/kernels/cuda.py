"""numba.cuda kernels: the stages of ops.py on an NVIDIA GPU.

Every stage is a *device function* that walks its work items (token rows, heads, output tiles) in a block-strided
loop: item i is done by block i % nblocks, so any grid size is correct. A kernel for one stage is a thin wrapper
calling it with its own block index. The forward kernels (`decode_step_kernel` with matrix-vector products for up
to 8 tokens, `batch_step_kernel` with tiled products for more: one body, `_forward_kernel`, given the products)
walk one schedule of steps, the layer loop written once: compiled cooperative, they run every step in one launch
with a grid-wide barrier between steps (numba spends about 10 us plus 4 us per array argument on every launch,
which would otherwise dominate decoding); compiled without the barrier, the host launches them a step at a time.

Arrays (row-major, float32 unless said; weights may be stored float16 and are widened as they are read, or as
Q8_0 blocks, see `weight_reader`):
    meta    [6, T] int32   per token: TOKEN id, POS position, SLOT cache slot, KEEP (1: its k/v survive in the
                           ring), RING (how many ring entries, from index 0, its slot may hold before the call),
                           FIRST (index in this call of the first token of its slot)
    x       [T, D]         residual stream
    qkv     [T, W]         W = (H + 2K) Dh: the H query heads, then the K key heads, then the K value heads
    att     [T, H Dh]      attention output (heads side by side, as ops.attention's [T, H, Dv] flattened)
    ring_k, ring_v [L, B, C, K, Dh] and ring_pos [B, C] int32: the ring-buffer cache of npllm/cache.py
    cos, sin [P, Dh/2]     RoPE table for positions 0 .. P-1 (ops.rope_angles, so the very same numbers)

Blocks are 1-D with `threads` threads (a power of two). Reductions go through shared memory and syncthreads:
numba's CUDA simulator, which runs the tests on machines without a GPU, has no warp shuffles, and a single code
path keeps those tests honest about the code that runs on hardware. Every loop that contains a syncthreads has
the same trip count in all threads of a block. Device code spells min and max of scalars as conditional
expressions: the CUDA target built into numba 0.68 cannot compile min(int, int).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda
from numba.core import config as numba_config

from .cuda_ffn import ACTIVATIONS, activation, routed_ffn, silu  # noqa: F401
from .cuda_layout import (HARDWARE, SIMULATOR, STEP_PARTS, Geometry, Q8_0_BLOCK, Q8_0_VALUES,  # noqa: F401
                          StepCache, StepShape, StepWeights, StepWork, compact_kernel, gather_rows_kernel,
                          weight_reader)

MAX_ROWS = 8  # the matrix-vector kernels serve up to this many token rows at once (decode batches)
MAX_HEAD_DIM = 256
NEG_INF = np.float32(-np.inf)
ONE_BITS = 0x3F800000  # the bit pattern of float32 1.0; 0 .. ONE_BITS are the bits of the floats in [0, 1], in order
TOKEN, POS, SLOT, KEEP, RING, FIRST = 0, 1, 2, 3, 4, 5  # rows of `meta`


# ---------------------------------------------------------------------------------------------------------------
# Block-wide reductions (every thread of the block gets the result)
# ---------------------------------------------------------------------------------------------------------------

@cuda.jit(device=True)
def block_sum(value, red):
    """Sum of `value` over the block.  red: shared [threads] of value's type (float32 sums, int32 counts), free on
    entry and on exit."""
    tid = cuda.threadIdx.x
    red[tid] = value
    cuda.syncthreads()
    step = cuda.blockDim.x // 2
    while step > 0:
        if tid < step:
            red[tid] += red[tid + step]
        cuda.syncthreads()
        step //= 2
    total = red[0]
    cuda.syncthreads()
    return total


@cuda.jit(device=True)
def block_best(value, redi, largest):
    """Largest (or, largest=False, smallest) `value` over the block.  redi: shared [threads] of value's type
    (float32 or int32)."""
    tid = cuda.threadIdx.x
    redi[tid] = value
    cuda.syncthreads()
    step = cuda.blockDim.x // 2
    while step > 0:
        if tid < step:
            other = redi[tid + step]
            if (other > redi[tid]) if largest else (other < redi[tid]):
                redi[tid] = other
        cuda.syncthreads()
        step //= 2
    best = redi[0]
    cuda.syncthreads()
    return best


@cuda.jit(device=True)
def block_softmax_merge(m, l, red, red2):
    """Merge each thread's running softmax state (max m, sum l of exp(s - m)) over the block.

    Two states combine as m = max(m1, m2), l = l1 exp(m1 - m) + l2 exp(m2 - m): the order of the keys never
    matters, which is what lets every thread take its own share of them.
    """
    tid = cuda.threadIdx.x
    red[tid] = m
    red2[tid] = l
    cuda.syncthreads()
    step = cuda.blockDim.x // 2
    while step > 0:
        if tid < step:
            m1, m2 = red[tid], red[tid + step]
            top = m1 if m1 > m2 else m2
            if top > NEG_INF:
                red2[tid] = red2[tid] * math.exp(m1 - top) + red2[tid + step] * math.exp(m2 - top)
                red[tid] = top
        cuda.syncthreads()
        step //= 2
    m_all, l_all = red[0], red2[0]
    cuda.syncthreads()
    return m_all, l_all


# ---------------------------------------------------------------------------------------------------------------
# Element-wise and row stages
# ---------------------------------------------------------------------------------------------------------------

@functools.cache
def embed_rows(q8_0: bool = False):
    """x[t] = E[token t] * m (a row gather, widened to float32; E in Q8_0 blocks with q8_0; m the embedding
    multiplier, 1 but for Gemma and Granite).                                        # [V, D], [T] -> [T, D]"""
    weight = weight_reader(q8_0)

    @cuda.jit(device=True)
    def stage(table, meta, x, m, block, nblocks):
        for t in range(block, x.shape[0], nblocks):
            row = meta[TOKEN, t]
            for i in range(cuda.threadIdx.x, x.shape[1], cuda.blockDim.x):
                x[t, i] = weight(table, row, i) * m

    return stage


@cuda.jit(device=True)
def rms_scale(x, t, eps, red):
    """1 / sqrt(mean(x[t]^2) + eps) for row t of x."""
    ss = np.float32(0)
    for i in range(cuda.threadIdx.x, x.shape[1], cuda.blockDim.x):
        v = x[t, i]
        ss += v * v
    return np.float32(1) / math.sqrt(block_sum(ss, red) / np.float32(x.shape[1]) + eps)


@cuda.jit(device=True)
def rms_norm_rows(x, g, eps, out, red, block, nblocks):
    """RMSNorm: out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * g.                          # [T, D], [D] -> [T, D]
    An empty g (a family with no norm there, OLMo 2's inputs: reference.Transformer.norm) copies: out = x."""
    for t in range(block, x.shape[0], nblocks):
        if g.shape[0] == 0:
            for i in range(cuda.threadIdx.x, x.shape[1], cuda.blockDim.x):
                out[t, i] = x[t, i]
            continue
        scale = rms_scale(x, t, eps, red)
        for i in range(cuda.threadIdx.x, x.shape[1], cuda.blockDim.x):
            out[t, i] = x[t, i] * scale * g[i]


@cuda.jit(device=True)
def post_norm_rows(y, g, eps, m, x, red, block, nblocks):
    """A block's output normed into the residual stream (block_norms "sandwich", "post"), y left zero:
        x[t] += m * rms_norm(y[t], g);  y[t] = 0                        # [T, D], [D], [T, D] -> x [T, D]
    m is the residual multiplier (Granite; 1 elsewhere). The products add into y, so it must start at zero."""
    for t in range(block, x.shape[0], nblocks):
        scale = rms_scale(y, t, eps, red)  # its syncthreads: every thread has read y[t] before it is zeroed
        for i in range(cuda.threadIdx.x, x.shape[1], cuda.blockDim.x):
            x[t, i] += m * (y[t, i] * scale * g[i])
            y[t, i] = 0


@cuda.jit(device=True)
def swiglu_rows(gate_up, h, act, block, nblocks):
    """h[t, f] = act(gate[t, f]) * up[t, f], gate and up side by side in gate_up.      # [T, 2F] -> [T, F]"""
    F = h.shape[1]
    for t in range(block, h.shape[0], nblocks):
        for f in range(cuda.threadIdx.x, F, cuda.blockDim.x):
            h[t, f] = activation(gate_up[t, f], act) * gate_up[t, F + f]


@cuda.jit(device=True)
def segment_norms(qkv, t, start, width, g, eps, red):
    """RMSNorm in place of each run of len(g) columns of qkv[t, start:start + width] with gains g: per head
    (g [Dh]: Qwen3, Gemma 3) or over the whole projection (g [heads Dh]: OLMo 2); nothing when g is empty."""
    n = g.shape[0]
    if n > 0:
        for s0 in range(start, start + width, n):
            ss = np.float32(0)
            for i in range(cuda.threadIdx.x, n, cuda.blockDim.x):
                v = qkv[t, s0 + i]
                ss += v * v
            scale = np.float32(1) / math.sqrt(block_sum(ss, red) / np.float32(n) + eps)
            for i in range(cuda.threadIdx.x, n, cuda.blockDim.x):
                qkv[t, s0 + i] = qkv[t, s0 + i] * scale * g[i]


@functools.cache
def bias_rope_rows(interleaved: bool):
    """Add the q/k/v bias, RMS-norm q and k (segment_norms with gains q_norm, k_norm: empty for most families),
    then rotate the q and k heads of each row by its position (RoPE), as reference.Transformer.attention_block.

    Pairs are (2i, 2i+1) with `interleaved` (Meta, llama2.c) and (i, i + Dh/2) otherwise (Hugging Face):
        x'[a] = x[a] cos(pos w_i) - x[b] sin(pos w_i),   x'[b] = x[a] sin(pos w_i) + x[b] cos(pos w_i)
    in place on qkv [T, W] (H query heads, then K key heads); bias [W] (zeros for Llama, whose projections have
    none). red: shared [threads].
    """

    @cuda.jit(device=True)
    def stage(qkv, bias, q_norm, k_norm, eps, n_heads, n_kv, head_dim, cos, sin, meta, red, block, nblocks):
        half, rot_heads = head_dim // 2, n_heads + n_kv
        for t in range(block, qkv.shape[0], nblocks):
            p = meta[POS, t]
            for col in range(cuda.threadIdx.x, qkv.shape[1], cuda.blockDim.x):
                qkv[t, col] += bias[col]
            cuda.syncthreads()
            if q_norm.shape[0] + k_norm.shape[0] > 0:
                segment_norms(qkv, t, 0, n_heads * head_dim, q_norm, eps, red)
                segment_norms(qkv, t, n_heads * head_dim, n_kv * head_dim, k_norm, eps, red)
                cuda.syncthreads()
            for e in range(cuda.threadIdx.x, rot_heads * half, cuda.blockDim.x):
                base = (e // half) * head_dim
                i = e % half
                if interleaved:
                    a, b = base + 2 * i, base + 2 * i + 1
                else:
                    a, b = base + i, base + half + i
                xa, xb = qkv[t, a], qkv[t, b]
                c, s = cos[p, i], sin[p, i]
                qkv[t, a] = xa * c - xb * s
                qkv[t, b] = xa * s + xb * c

    return stage


# ---------------------------------------------------------------------------------------------------------------
# Products with the weights
# ---------------------------------------------------------------------------------------------------------------

@functools.cache
def matvec_rows(rows: int, threads: int, lanes: int, norm: bool, residual: bool, gated: bool, q8_0: bool = False):
    """Matrix-vector products for up to `rows` token rows: y = x W^T, one weight pass serving every row.

    Threads form groups of `lanes` (a warp of 32 on hardware); a group owns R = 8 // rows (4 // rows gated)
    consecutive output rows of W at a time, and its lanes stride along each row, so a warp reads 128 consecutive
    bytes per load (coalesced), four loads in flight per lane. x is staged in shared memory in tiles of
    `matvec_tile(rows)` columns, read by every group of the block. Variants (fixed when the kernel is compiled):
        norm      x is RMSNorm-ed with gain g while it is staged (the norm costs no extra pass over memory; an
                  empty g: no norm, as rms_norm_rows)
        residual  y += alpha x W^T (the residual stream is updated in place; alpha the residual multiplier)
        gated     W is [2, F, D] = (W1, W3) and y = act(x W1^T) * (x W3^T): SwiGLU's (act 0, silu) or GeGLU's
                  (act 1, gelu_tanh) gate and up in one pass
        q8_0      W is Q8_0 blocks [N, K / 32] (gated: [2, F, D / 32]), see weight_reader
                                                          # [T, K], [N, K] (or [2, N, K]) -> [T, N], T <= rows
    Shared arrays (the caller allocates them, so a fused kernel can reuse them): xs [rows, tile], part
    [16, threads], red [threads], scale [rows]. g and eps are read only by the `norm` variant, alpha only by
    `residual`, act only by `gated`.
    """
    M = rows
    R = max(1, MAX_ROWS // (rows * (2 if gated else 1)))  # rows per group: R M (2 R M gated) sums per lane
    groups = threads // lanes
    tile = matvec_tile(rows)
    sums = R * M  # local array sizes must be constants
    weight = weight_reader(q8_0)

    @cuda.jit(device=True)
    def dot_tile(xs, w, n, kn, k0, acc, first):
        """acc[first + m] += W[n, k0:k0+kn] . xs[m, :kn] over this lane's columns (lane, lane + lanes, ...)."""
        k = cuda.threadIdx.x % lanes
        while k + 3 * lanes < kn:
            w0 = weight(w, n, k0 + k)
            w1 = weight(w, n, k0 + k + lanes)
            w2 = weight(w, n, k0 + k + 2 * lanes)
            w3 = weight(w, n, k0 + k + 3 * lanes)
            for m in range(M):
                acc[first + m] += (w0 * xs[m, k] + w1 * xs[m, k + lanes] + w2 * xs[m, k + 2 * lanes]
                                   + w3 * xs[m, k + 3 * lanes])
            k += 4 * lanes
        while k < kn:
            wk = weight(w, n, k0 + k)
            for m in range(M):
                acc[first + m] += wk * xs[m, k]
            k += lanes

    @cuda.jit(device=True)
    def stage_x(x, g, scale, xs, k0, kn):
        """xs[m, :kn] = x[m, k0:k0+kn] (normed when `norm`), zero rows past T."""
        cuda.syncthreads()  # the previous tile is no longer read
        for m in range(M):
            for kk in range(cuda.threadIdx.x, kn, threads):
                v = np.float32(0)
                if m < x.shape[0]:
                    v = x[m, k0 + kk]
                    if norm and g.shape[0] > 0:
                        v = v * scale[m] * g[k0 + kk]
                xs[m, kk] = v
        cuda.syncthreads()

    @cuda.jit(device=True)
    def stage(x, g, eps, w, y, alpha, act, xs, part, red, scale, block, nblocks):
        tid = cuda.threadIdx.x
        group, lane = tid // lanes, tid % lanes
        T, K = x.shape
        N = w.shape[w.ndim - 2]
        if norm and g.shape[0] > 0:
            for m in range(M):
                s = np.float32(0)
                if m < T:
                    s = rms_scale(x, m, eps, red)
                if tid == 0:
                    scale[m] = s
        ntiles = (K + tile - 1) // tile
        if ntiles == 1:
            stage_x(x, g, scale, xs, 0, K)
        acc = cuda.local.array(sums, np.float32)
        acc_up = cuda.local.array(sums, np.float32)
        for base in range(block * groups * R, N, nblocks * groups * R):
            first_row = base + group * R
            for e in range(R * M):
                acc[e] = 0
                acc_up[e] = 0
            for j in range(ntiles):
                k0 = j * tile
                kn = tile if K - k0 > tile else K - k0
                if ntiles > 1:
                    stage_x(x, g, scale, xs, k0, kn)
                for r in range(R):
                    n = first_row + r
                    if n < N:
                        if gated:
                            dot_tile(xs, w[0], n, kn, k0, acc, r * M)
                            dot_tile(xs, w[1], n, kn, k0, acc_up, r * M)
                        else:
                            dot_tile(xs, w, n, kn, k0, acc, r * M)
            for e in range(R * M):
                part[e, tid] = acc[e]
                if gated:
                    part[R * M + e, tid] = acc_up[e]
            cuda.syncthreads()
            for e in range(lane, R * M, lanes):  # lane e adds up the group's partial sums of (row r, token m)
                r, m = e // M, e % M
                n = first_row + r
                if m < T and n < N:
                    total = np.float32(0)
                    for j in range(group * lanes, (group + 1) * lanes):
                        total += part[e, j]
                    if gated:
                        up = np.float32(0)
                        for j in range(group * lanes, (group + 1) * lanes):
                            up += part[R * M + e, j]
                        y[m, n] = activation(total, act) * up
                    elif residual:
                        y[m, n] += alpha * total
                    else:
                        y[m, n] = total
            cuda.syncthreads()

    return stage


def matvec_tile(rows: int) -> int:
    """Columns of x staged per tile: 16 KiB of shared memory whatever the number of rows."""
    return 4096 // rows


@functools.cache
def matmul_tiles(tile: tuple[int, int, int, int, int], residual: bool, q8_0: bool = False):
    """Matrix-matrix product y = x W^T (y += alpha x W^T with `residual`) in shared-memory tiles.
                                                                                     # [M, K], [N, K] -> [M, N]
    (W as Q8_0 blocks [N, K / 32] with q8_0: each weight is widened once, as its tile is loaded.)

    A block computes a BM x BN tile of y: for each slice of BK columns of K it loads x[BM, BK] and W[BN, BK] into
    shared memory (consecutive threads read consecutive k: coalesced), then each thread multiplies its TM x TN
    outputs from registers, rows ty + a BM/TM and columns tx + b BN/TN (strided, so a warp's shared reads fall in
    different banks). Every x element loaded serves BN outputs and every weight element BM outputs.
    Shared arrays: xs [BK, BM], ws [BK, BN].
    """
    BM, BN, BK, TM, TN = tile
    threads = (BM // TM) * (BN // TN)
    cols = BN // TN
    acc_shape = (TM, TN)
    weight = weight_reader(q8_0)

    @cuda.jit(device=True)
    def stage(x, w, y, alpha, xs, ws, block, nblocks):
        tid = cuda.threadIdx.x
        tx, ty = tid % cols, tid // cols
        M, K = x.shape
        N = w.shape[0]
        tiles_n = (N + BN - 1) // BN
        acc = cuda.local.array(acc_shape, np.float32)
        xa = cuda.local.array(TM, np.float32)
        wb = cuda.local.array(TN, np.float32)
        for item in range(block, ((M + BM - 1) // BM) * tiles_n, nblocks):
            m0, n0 = (item // tiles_n) * BM, (item % tiles_n) * BN
            for a in range(TM):
                for b in range(TN):
                    acc[a, b] = 0
            for k0 in range(0, K, BK):
                for e in range(tid, BM * BK, threads):
                    i, kk = e // BK, e % BK
                    xs[kk, i] = x[m0 + i, k0 + kk] if m0 + i < M and k0 + kk < K else np.float32(0)
                for e in range(tid, BN * BK, threads):
                    j, kk = e // BK, e % BK
                    ws[kk, j] = weight(w, n0 + j, k0 + kk) if n0 + j < N and k0 + kk < K else np.float32(0)
                cuda.syncthreads()
                for kk in range(BK):
                    for a in range(TM):
                        xa[a] = xs[kk, ty + a * (BM // TM)]
                    for b in range(TN):
                        wb[b] = ws[kk, tx + b * cols]
                    for a in range(TM):
                        for b in range(TN):
                            acc[a, b] += xa[a] * wb[b]
                cuda.syncthreads()
            for a in range(TM):
                m = m0 + ty + a * (BM // TM)
                for b in range(TN):
                    n = n0 + tx + b * cols
                    if m < M and n < N:
                        if residual:
                            y[m, n] += alpha * acc[a, b]
                        else:
                            y[m, n] = acc[a, b]

    return stage


# ---------------------------------------------------------------------------------------------------------------
# Attention over the ring-buffer cache
# ---------------------------------------------------------------------------------------------------------------

@cuda.jit(device=True)
def attention_rows(qkv, meta, n_heads, n_kv, head_dim, ring_k, ring_v, ring_pos, window, scale, cap, scores, out,
                   qs, vacc, red, red2, block, nblocks):
    """Causal grouped-query attention of every (token t, query head h), one block per pair (ops.attention).

        out[t, h] = sum_s softmax_s(softcap(s q_t,h . k_s,g, cap) + mask) v_s,g,     g = h // (H / K)
                                             # qkv [T, W], ring [B, C, K, Dh] x2, ring_pos [B, C] -> out [T, H Dh]
    The keys of token t are those its slot's ring held before this call (ring indices below meta[RING, t]: a
    slot fills its ring from index 0), then the keys of this call's tokens of the same slot up to t itself
    (already rotated in qkv; later ones are in its future): the concatenation the reference Transformer attends to.
    A key at position k is seen by a query at p when p - window < k <= p (empty ring entries hold -1 and are never
    seen).

    Parallel online softmax: each thread scores its share of the keys (thread j takes keys j, j + threads, ...)
    keeping its own running max and sum of exponentials; the block merges those states (block_softmax_merge),
    then threads split (dimension, key group) to sum the values. scores [blocks, C + T] is scratch, one row per
    block (the grid must not exceed its rows).
    Shared: qs [MAX_HEAD_DIM], vacc [max(threads, MAX_HEAD_DIM)], red, red2 [threads].
    """
    tid, threads = cuda.threadIdx.x, cuda.blockDim.x
    T = qkv.shape[0]
    group = n_heads // n_kv
    groups = threads // head_dim if threads > head_dim else 1  # key groups of the value pass
    for item in range(block, T * n_heads, nblocks):
        t, h = item // n_heads, item % n_heads
        g = h // group
        qpos, slot, ring = meta[POS, t], meta[SLOT, t], meta[RING, t]
        first = meta[FIRST, t]  # keys: ring entries s < ring, then this call's tokens first + (s - ring) <= t
        keys = ring + t + 1 - first
        k_col, v_col = (n_heads + g) * head_dim, (n_heads + n_kv + g) * head_dim
        for d in range(tid, head_dim, threads):
            qs[d] = qkv[t, h * head_dim + d]
        cuda.syncthreads()
        m_run, l_run = NEG_INF, np.float32(0)
        for s in range(tid, keys, threads):
            if s < ring:
                kpos = ring_pos[slot, s]
            else:
                kpos = meta[POS, first + s - ring] if meta[SLOT, first + s - ring] == slot else -1
            score = NEG_INF
            if 0 <= kpos and kpos <= qpos and kpos > qpos - window:
                dot = np.float32(0)
                if s < ring:
                    for d in range(head_dim):
                        dot += qs[d] * ring_k[slot, s, g, d]
                else:
                    for d in range(head_dim):
                        dot += qs[d] * qkv[first + s - ring, k_col + d]
                score = dot * scale
                if cap > 0:  # soft-capping (Gemma 2): cap tanh(score / cap)
                    score = cap * math.tanh(score / cap)
                if score > m_run:
                    l_run *= math.exp(m_run - score)
                    m_run = score
                l_run += math.exp(score - m_run)
            scores[block, s] = score
        m_all, l_all = block_softmax_merge(m_run, l_run, red, red2)  # its syncthreads also publish `scores`
        for e in range(tid, head_dim * groups, threads):
            d, j = e % head_dim, e // head_dim
            acc = np.float32(0)
            for s in range(j, keys, groups):
                sc = scores[block, s]
                if sc > NEG_INF:
                    v = ring_v[slot, s, g, d] if s < ring else qkv[first + s - ring, v_col + d]
                    acc += math.exp(sc - m_all) * v
            vacc[e] = acc
        cuda.syncthreads()
        for d in range(tid, head_dim, threads):
            total = np.float32(0)
            for j in range(groups):
                total += vacc[j * head_dim + d]
            out[t, h * head_dim + d] = total / l_all
        cuda.syncthreads()


@cuda.jit(device=True)
def kv_write_rows(qkv, meta, n_heads, n_kv, head_dim, ring_k, ring_v, block, nblocks):
    """Store each token's rotated key and value at ring index position % C of its slot (tokens with KEEP set:
    when one call brings more than C positions of a slot, only the last C survive, as in RingKVCache.write)."""
    C = ring_k.shape[1]
    for item in range(block, qkv.shape[0] * n_kv, nblocks):
        t, g = item // n_kv, item % n_kv
        if meta[KEEP, t] != 0:
            slot, index = meta[SLOT, t], meta[POS, t] % C
            for d in range(cuda.threadIdx.x, head_dim, cuda.blockDim.x):
                ring_k[slot, index, g, d] = qkv[t, (n_heads + g) * head_dim + d]
                ring_v[slot, index, g, d] = qkv[t, (n_heads + n_kv + g) * head_dim + d]


@cuda.jit(device=True)
def commit_positions(meta, ring_pos, block, nblocks):
    """ring_pos[slot, pos % C] = pos for the surviving tokens: done once, after every layer has attended, since
    the positions table is shared by all layers and attention must see the table as it was before the call."""
    step = nblocks * cuda.blockDim.x
    for t in range(block * cuda.blockDim.x + cuda.threadIdx.x, meta.shape[1], step):
        if meta[KEEP, t] != 0:
            ring_pos[meta[SLOT, t], meta[POS, t] % ring_pos.shape[1]] = meta[POS, t]


# ---------------------------------------------------------------------------------------------------------------
# Sampling on the device: only the chosen ids travel back to the host
# ---------------------------------------------------------------------------------------------------------------

@cuda.jit(device=True)
def mass_from(probs, b, v, red, redi):
    """(count, sum) of the probabilities p[b, i] >= v."""
    count = 0
    mass = np.float32(0)
    for i in range(cuda.threadIdx.x, probs.shape[1], cuda.blockDim.x):
        p = probs[b, i]
        if p >= v:
            count += 1
            mass += p
    return block_sum(count, redi), block_sum(mass, red)


@cuda.jit(device=True)
def largest_value(probs, b, need, by_mass, red, redi, bits):
    """The largest v in [0, 1] with count(p >= v) >= need (or, by_mass, sum(p >= v) >= need): a bisection over
    the bit patterns of float32, which order like the floats they encode. With v one of the p, it is exact.
    bits: a local int32 [1] array, read as float32 through a view."""
    as_float = bits.view(np.float32)
    lo, hi = 0, ONE_BITS + 1  # v = 0 always satisfies the condition, v just above 1 never does
    while hi - lo > 1:
        mid = (lo + hi) // 2
        bits[0] = mid
        count, mass = mass_from(probs, b, as_float[0], red, redi)
        if (mass >= need) if by_mass else (count >= need):
            lo = mid
        else:
            hi = mid
    bits[0] = lo
    return as_float[0]


@cuda.jit(device=True)
def exclusive_scan(values, n):
    """values[j] = values[0] + ... + values[j-1] for j < n, and values[n] = the total (one thread does it: n is the
    number of threads, small next to the work around it)."""
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        run = values[0] - values[0]  # a zero of the array's type
        for j in range(n):
            here = values[j]
            values[j] = run
            run += here
        values[n] = run
    cuda.syncthreads()


@cuda.jit(device=True)
def inverse_cdf(probs, b, floor, u, red, redi):
    """Among the kept tokens p >= floor taken by ascending id, the first whose running mass exceeds u times their
    total (sampling.py's draw). Each thread walks a contiguous chunk of ids; a block scan gives every chunk the
    mass before it. red, redi: shared [threads + 1]."""
    tid, threads = cuda.threadIdx.x, cuda.blockDim.x
    V = probs.shape[1]
    chunk = (V + threads - 1) // threads
    lo = tid * chunk if tid * chunk < V else V
    hi = lo + chunk if lo + chunk < V else V
    mass = np.float32(0)
    for i in range(lo, hi):
        if probs[b, i] >= floor:
            mass += probs[b, i]
    red[tid] = mass
    exclusive_scan(red, threads)
    target = u * red[threads]
    run = red[tid]
    cuda.syncthreads()
    first, last = V, -1
    for i in range(lo, hi):
        p = probs[b, i]
        if p >= floor and p > 0:
            run += p
            last = i
            if run > target and first == V:
                first = i
    first = block_best(first, redi, False)
    last = block_best(last, redi, True)
    return first if first < V else last  # rounding can leave u * total at the very end: the last kept token


@cuda.jit(device=True)
def sample_rows(logits, params, probs, ids, red, redi, block, nblocks):
    """One token id per row, drawn as sampling.sample_with draws it with temperature, top-k, top-p and min-p.
                                                                                       # [B, V], [B, 5] -> [B] int32

    params[b] = (temperature, top_k, top_p, min_p, u), u uniform in [0, 1) drawn on the host (the row's one
    rng.random()). temperature 0: the first index of the largest logit (np.argmax). Otherwise, with
    p_i = exp((l_i - max l) / temperature) (so max p = 1), each filter keeps the tokens at or above a floor, ties
    at the floor kept whole:
        top_k  the k-th largest p
        top_p  the largest v with sum(p_j >= v) >= top_p * (the mass top_k kept)
        min_p  min_p (= min_p * max p)
    and the id is the inverse CDF at u over the kept tokens by ascending id. No sort: a floor is found by
    bisection on the probability value (largest_value). probs [B, V]: scratch. Shared red, redi: [threads + 1].
    """
    tid, threads = cuda.threadIdx.x, cuda.blockDim.x
    V = logits.shape[1]
    bits = cuda.local.array(1, np.int32)
    for b in range(block, logits.shape[0], nblocks):
        temperature, top_k, top_p, min_p, u = params[b, 0], int(params[b, 1]), params[b, 2], params[b, 3], \
            params[b, 4]
        top = NEG_INF
        for i in range(tid, V, threads):
            if logits[b, i] > top:
                top = logits[b, i]
        top = block_best(top, red, True)
        if temperature == 0:
            first = V
            for i in range(tid, V, threads):
                if logits[b, i] == top and i < first:
                    first = i
            first = block_best(first, redi, False)
            if tid == 0:
                ids[b] = first
            continue
        for i in range(tid, V, threads):
            probs[b, i] = math.exp((logits[b, i] - top) / temperature)
        cuda.syncthreads()
        floor = np.float32(0)
        if 0 < top_k < V:
            floor = largest_value(probs, b, top_k, False, red, redi, bits)
        if top_p < 1:
            target = top_p * mass_from(probs, b, floor, red, redi)[1]
            floor = largest_value(probs, b, target, True, red, redi, bits)  # never below the top-k floor
        if min_p > floor:
            floor = min_p
        chosen = inverse_cdf(probs, b, floor, u, red, redi)
        if tid == 0:
            ids[b] = chosen


# ---------------------------------------------------------------------------------------------------------------
# Kernels: one stage a launch (the LM head's products, tests), or the forward pass's schedule of steps
# ---------------------------------------------------------------------------------------------------------------

@functools.cache
def embed_kernel(q8_0: bool = False):
    stage = embed_rows(q8_0)

    @cuda.jit
    def kernel(table, meta, x, m):
        stage(table, meta, x, m, cuda.blockIdx.x, cuda.gridDim.x)

    return kernel


@functools.cache
def rms_norm_kernel(threads: int):
    @cuda.jit
    def kernel(x, g, eps, out):
        red = cuda.shared.array(threads, np.float32)
        rms_norm_rows(x, g, eps, out, red, cuda.blockIdx.x, cuda.gridDim.x)

    return kernel


@functools.cache
def post_norm_kernel(threads: int):
    @cuda.jit
    def kernel(y, g, eps, m, x):
        red = cuda.shared.array(threads, np.float32)
        post_norm_rows(y, g, eps, m, x, red, cuda.blockIdx.x, cuda.gridDim.x)

    return kernel


@functools.cache
def swiglu_kernel():
    @cuda.jit
    def kernel(gate_up, h, act):
        swiglu_rows(gate_up, h, act, cuda.blockIdx.x, cuda.gridDim.x)

    return kernel


@functools.cache
def bias_rope_kernel(interleaved: bool, threads: int):
    stage = bias_rope_rows(interleaved)

    @cuda.jit
    def kernel(qkv, bias, q_norm, k_norm, eps, n_heads, n_kv, head_dim, cos, sin, meta):
        red = cuda.shared.array(threads, np.float32)
        stage(qkv, bias, q_norm, k_norm, eps, n_heads, n_kv, head_dim, cos, sin, meta, red, cuda.blockIdx.x,
              cuda.gridDim.x)

    return kernel


@functools.cache
def attention_kernel(threads: int):
    vacc_size = max(threads, MAX_HEAD_DIM)

    @cuda.jit
    def kernel(qkv, meta, n_heads, n_kv, head_dim, ring_k, ring_v, ring_pos, window, scale, cap, scores, out):
        qs = cuda.shared.array(MAX_HEAD_DIM, np.float32)
        vacc = cuda.shared.array(vacc_size, np.float32)
        red = cuda.shared.array(threads, np.float32)
        red2 = cuda.shared.array(threads, np.float32)
        attention_rows(qkv, meta, n_heads, n_kv, head_dim, ring_k, ring_v, ring_pos, window, scale, cap, scores,
                       out, qs, vacc, red, red2, cuda.blockIdx.x, cuda.gridDim.x)

    return kernel


@functools.cache
def kv_write_kernel():
    @cuda.jit
    def kernel(qkv, meta, n_heads, n_kv, head_dim, ring_k, ring_v):
        kv_write_rows(qkv, meta, n_heads, n_kv, head_dim, ring_k, ring_v, cuda.blockIdx.x, cuda.gridDim.x)

    return kernel


@functools.cache
def commit_positions_kernel():
    @cuda.jit
    def kernel(meta, ring_pos):
        commit_positions(meta, ring_pos, cuda.blockIdx.x, cuda.gridDim.x)

    return kernel


@functools.cache
def matvec_kernel(rows: int, threads: int, lanes: int, norm: bool = False, residual: bool = False,
                  gated: bool = False, q8_0: bool = False):
    stage = matvec_rows(rows, threads, lanes, norm, residual, gated, q8_0)
    xs_shape, part_shape = (rows, matvec_tile(rows)), (2 * MAX_ROWS, threads)  # shared shapes: constants

    @cuda.jit
    def kernel(x, g, eps, w, y, alpha, act):
        xs = cuda.shared.array(xs_shape, np.float32)
        part = cuda.shared.array(part_shape, np.float32)
        red = cuda.shared.array(threads, np.float32)
        scale = cuda.shared.array(rows, np.float32)
        stage(x, g, eps, w, y, alpha, act, xs, part, red, scale, cuda.blockIdx.x, cuda.gridDim.x)

    return kernel


@functools.cache
def matmul_kernel(tile: tuple[int, int, int, int, int], residual: bool = False, q8_0: bool = False):
    stage = matmul_tiles(tile, residual, q8_0)
    BM, BN, BK = tile[:3]
    xs_shape, ws_shape = (BK, BM), (BK, BN)

    @cuda.jit
    def kernel(x, w, y, alpha):
        xs = cuda.shared.array(xs_shape, np.float32)
        ws = cuda.shared.array(ws_shape, np.float32)
        stage(x, w, y, alpha, xs, ws, cuda.blockIdx.x, cuda.gridDim.x)

    return kernel


@functools.cache
def sample_kernel(threads: int):
    size = threads + 1

    @cuda.jit
    def kernel(logits, params, probs, ids):
        red = cuda.shared.array(size, np.float32)
        redi = cuda.shared.array(size, np.int32)
        sample_rows(logits, params, probs, ids, red, redi, cuda.blockIdx.x, cuda.gridDim.x)

    return kernel



def forward_steps(n_layers: int, batch: bool) -> int:
    """Steps of _forward_kernel's schedule: the embedding, each layer's, the final norm."""
    return n_layers * (10 + sum(STEP_PARTS[batch])) + 2


def _forward_kernel(products, batch: bool, interleaved: bool, q8_0: bool, threads: int, shared: tuple,
                    cooperative: bool):
    """The forward pass (all layers, then the final norm) as one schedule of steps, each a stage that needs the
    previous one finished on the whole grid: the one body (and layer loop) of both ways to run it.
        step 0: embed | per layer: [normed: norm + qkv] [bias + q/k norm + rope] [attention] [kv write + residual:
                wo] [post-norm] [gated: norm + gate/up + act] [residual: w2] [experts: norm] [route] [gate/up]
                [down] [post-norm]    (normed, gated: STEP_PARTS[batch] steps) | last: final norm + commit positions
    A layer runs either the dense FFN's steps or the experts' (routed_ffn: where weights.router has rows); the
    other's are idle.
    Where the family norms a block's output (post_norms not empty) the residual products add into work.o and the
    post-norm step adds m norm(o) to x; elsewhere they add m (x W^T) to x and the post-norm steps do nothing (not
    even wait at the grid barrier). m: the residual multiplier.
    kernel(weights, shape, cos, sin, meta, cache, work, hidden, first, count) runs steps first .. first + count - 1
    (records as above; cos, sin [R, P, Dh/2], meta [6, T], hidden [T, D] out; shared: the shapes of xs, tile, scale).
    cooperative: a grid-wide barrier after each step, one launch runs them all (its grid must fit on the device at
    once); else no barrier is compiled in (no cooperative launch, no cudadevrt) and the host launches it once a step.
    products = (normed, gated, residual), the variant's device functions, piece the step within the stage:
        normed(piece, x, g, eps, act, w, y, work, xs, tile, red, scale, block, nblocks)   y = rms_norm(x, g) W^T
        gated(piece, ...the same)                                                 y = act(rms_norm(x, g) W1^T) * ...
        residual(x, w, y, alpha, xs, tile, red, scale, block, nblocks)                   y += alpha x W^T"""
    normed, gated, residual = products
    qkv_parts, per_layer = STEP_PARTS[batch][0], sum(STEP_PARTS[batch]) + 10
    w2_step = qkv_parts + 4 + STEP_PARTS[batch][1]  # then the experts' 4 steps, then the post-norm
    embed, bias_rope = embed_rows(q8_0), bias_rope_rows(interleaved)
    route, experts_gate_up, experts_down = routed_ffn(q8_0)
    (xs_shape, tile_shape, scale_shape), vacc_size = shared, max(threads, MAX_HEAD_DIM)
    # ptxas (sm_90) wants ~135 registers per thread for the decode kernel: one block of 256 threads per SM. Capped
    # at 128 (under 200 bytes spilled) two blocks fit: twice the loads in flight. The simulator has no such option.
    options = {} if numba_config.ENABLE_CUDASIM else {"max_registers": 128}

    @cuda.jit(**options)
    def kernel(weights, shape, cos, sin, meta, cache, work, hidden, first, count):
        xs = cuda.shared.array(xs_shape, np.float32)
        tile = cuda.shared.array(tile_shape, np.float32)
        red = cuda.shared.array(threads, np.float32)
        red2 = cuda.shared.array(threads, np.float32)
        scale_rows = cuda.shared.array(scale_shape, np.float32)
        qs = cuda.shared.array(MAX_HEAD_DIM, np.float32)
        vacc = cuda.shared.array(vacc_size, np.float32)
        block, nblocks = cuda.blockIdx.x, cuda.gridDim.x
        eps, n_heads, n_kv, head_dim = shape.eps, shape.n_heads, shape.n_kv, shape.head_dim
        x, qkv, att, h, scores = work.x, work.qkv, work.att, work.h, work.scores
        gid, everyone = block * cuda.blockDim.x + cuda.threadIdx.x, nblocks * cuda.blockDim.x  # thread-per-item
        posting = weights.post_norms.shape[2] > 0  # the products add into o, the post-norm steps into x
        moe = weights.router.shape[1] > 0
        out = work.o if posting else x
        alpha = np.float32(1) if posting else shape.residual
        attending = nblocks if nblocks < scores.shape[0] else scores.shape[0]  # a row of scores per block
        last = weights.wqkv.shape[0] * per_layer + 1  # the final norm's step
        for step in range(first, first + count):
            layer, s = (step - 1) // per_layer, (step - 1) % per_layer
            idle = False
            if step == 0:
                embed(weights.tok_embeddings, meta, x, shape.embed, block, nblocks)
                if posting:  # o starts at zero: the products add into it
                    for t in range(block, x.shape[0], nblocks):
                        for i in range(cuda.threadIdx.x, x.shape[1], cuda.blockDim.x):
                            out[t, i] = 0
            elif step == last:
                rms_norm_rows(x, weights.final_norm, eps, hidden, red, block, nblocks)
                commit_positions(meta, cache.positions, block, nblocks)
            elif s < qkv_parts:
                normed(s, x, weights.norms[layer, 0], eps, shape.act, weights.wqkv[layer], qkv, work, xs, tile, red,
                       scale_rows, block, nblocks)
            elif s == qkv_parts:
                table = shape.rope[layer]
                bias_rope(qkv, weights.bqkv[layer], weights.q_norm[layer], weights.k_norm[layer], eps, n_heads, n_kv,
                          head_dim, cos[table], sin[table], meta, red, block, nblocks)
            elif s == qkv_parts + 1:
                if block < attending:
                    attention_rows(qkv, meta, n_heads, n_kv, head_dim, cache.k[layer], cache.v[layer],
                                   cache.positions, shape.windows[layer], shape.scale, shape.cap, scores, att, qs,
                                   vacc, red, red2, block, attending)
            elif s == qkv_parts + 2:
                kv_write_rows(qkv, meta, n_heads, n_kv, head_dim, cache.k[layer], cache.v[layer], block, nblocks)
                residual(att, weights.wo[layer], out, alpha, xs, tile, red, scale_rows, block, nblocks)
            elif s == qkv_parts + 3 or s == per_layer - 1:
                idle = not posting
                if posting:
                    post_norm_rows(out, weights.post_norms[layer, 0 if s < per_layer - 1 else 1], eps,
                                   shape.residual, x, red, block, nblocks)
            elif s < w2_step:
                idle = moe
                if not moe:
                    gated(s - qkv_parts - 4, x, weights.norms[layer, 1], eps, shape.act, weights.w13[layer], h, work,
                          xs, tile, red, scale_rows, block, nblocks)
            elif s == w2_step:
                idle = moe
                if not moe:
                    residual(h, weights.w2[layer], out, alpha, xs, tile, red, scale_rows, block, nblocks)
            else:
                idle = not moe
                if moe and s == w2_step + 1:
                    rms_norm_rows(x, weights.norms[layer, 1], eps, work.xn, red, block, nblocks)
                elif moe and s == w2_step + 2:
                    route(work.xn, weights.router[layer], shape.experts_norm, work.probs, work.chosen, work.routed,
                          gid, everyone)
                elif moe and s == w2_step + 3:
                    experts_gate_up(work.xn, weights.w13_exps[layer], work.chosen, shape.act, work.he, gid, everyone)
                elif moe:
                    experts_down(work.he, weights.w2_exps[layer], work.chosen, work.routed, alpha, out, gid, everyone)
            if cooperative and not idle:  # a constant: numba prunes it, so a step-by-step kernel never names the grid
                cuda.cg.this_grid().sync()

    return kernel


@functools.cache
def decode_step_kernel(rows: int, threads: int, lanes: int, interleaved: bool, q8_0: bool = False,
                       cooperative: bool = True):
    """_forward_kernel with matrix-vector products for up to `rows` tokens: the RMSNorms fused into the products
    that read them (normed, gated), the gate's activation into the gate/up product (matvec_rows' variants). w13 [L, 2, F, D]."""
    qkv_proj = matvec_rows(rows, threads, lanes, True, False, False, q8_0)
    gate_up_proj = matvec_rows(rows, threads, lanes, True, False, True, q8_0)
    residual_proj = matvec_rows(rows, threads, lanes, False, True, False, q8_0)

    @cuda.jit(device=True)
    def normed(piece, x, g, eps, act, w, y, work, xs, part, red, scale, block, nblocks):
        qkv_proj(x, g, eps, w, y, np.float32(1), act, xs, part, red, scale, block, nblocks)

    @cuda.jit(device=True)
    def gated(piece, x, g, eps, act, w, y, work, xs, part, red, scale, block, nblocks):
        gate_up_proj(x, g, eps, w, y, np.float32(1), act, xs, part, red, scale, block, nblocks)

    @cuda.jit(device=True)
    def residual(x, w, y, alpha, xs, part, red, scale, block, nblocks):  # no norm: the gain (`scale`) is not read
        residual_proj(x, scale, np.float32(0), w, y, alpha, np.int32(0), xs, part, red, scale, block, nblocks)

    shared = ((rows, matvec_tile(rows)), (2 * MAX_ROWS, threads), rows)
    return _forward_kernel((normed, gated, residual), False, interleaved, q8_0, threads, shared, cooperative)


@functools.cache
def batch_step_kernel(tile: tuple[int, int, int, int, int], interleaved: bool, q8_0: bool = False,
                      cooperative: bool = True):
    """_forward_kernel for any number of tokens (larger decode batches, prefill): tiled matrix-matrix products (a
    weight tile read once serves BM tokens), so the RMSNorms (into work.xn) and SwiGLU (from work.gate_up) are
    steps of their own. Blocks of (BM / TM) (BN / TN) threads. w13 [L, 2F, D] (W1's rows, then W3's)."""
    BM, BN, BK, TM, TN = tile
    product, residual_product = matmul_tiles(tile, False, q8_0), matmul_tiles(tile, True, q8_0)

    @cuda.jit(device=True)
    def normed(piece, x, g, eps, act, w, y, work, xs, ws, red, scale, block, nblocks):
        if piece == 0:
            rms_norm_rows(x, g, eps, work.xn, red, block, nblocks)
        else:
            product(work.xn, w, y, np.float32(1), xs, ws, block, nblocks)

    @cuda.jit(device=True)
    def gated(piece, x, g, eps, act, w, y, work, xs, ws, red, scale, block, nblocks):
        if piece < 2:
            normed(piece, x, g, eps, act, w, work.gate_up, work, xs, ws, red, scale, block, nblocks)
        else:
            swiglu_rows(work.gate_up, y, act, block, nblocks)

    @cuda.jit(device=True)
    def residual(x, w, y, alpha, xs, ws, red, scale, block, nblocks):
        residual_product(x, w, y, alpha, xs, ws, block, nblocks)

    threads, shared = (BM // TM) * (BN // TN), ((BK, BM), (BK, BN), 1)
    return _forward_kernel((normed, gated, residual), True, interleaved, q8_0, threads, shared, cooperative)
