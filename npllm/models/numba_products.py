"""The matrix products of the Numba model's weights (Packed, models/numba_weights.py), for models/numba.py's
NumbaTransformer and its forward: products_into (one call: several matrices that read the same input, each row range
in its type's kernel: kernels/quant's, or kernels/cpu.py's float32 panels), the embedding rows decoded from their
stored type, and SwiGLU on the products' output."""

from __future__ import annotations

from collections import namedtuple

import numpy as np
from numba import njit, prange

from ..kernels import cpu
from ..kernels import quant as qk
from ..kernels.cpu import PANEL

# A product's input quantized to 8 bits per block of 32 (kernels/quant quantize_activations_q8_into), or in two
# 8-bit parts (two_part_activations_into: q [T, 2K] each token's first part then its second, d, s and s16 those of
# the 15-bit sum v = 128 q + q').
Int8Activations = namedtuple("Int8Activations", [
    "q",  # [T, K] int8       round(x / d)
    "d",  # [T, K/32]         block scales max|x| / 127
    "s",  # [T, K/32]         block sums of q (for offsets: Q4_0's -8, the K-quants' mins)
    "s16",  # [T, K/16] int32  the sums of each half block (where the interleaved kernels' dots start)
])
# The matrices of one products_into call: `count` consecutive rows of `mats` from `first`, over the byte pool.
Matrices = namedtuple("Matrices", ["pool", "mats", "first", "count"])
# The input of one products_into call as its kernels read it: x [>=T, K] float32, T tokens, x's sums of 16 [K/16]
# (one token), and x quantized to 8 bits (xq) and in two 8-bit parts (xv), each Int8Activations (empty if unused).
Operand = namedtuple("Operand", ["x", "T", "sums", "xq", "xv"])


@njit(inline="always")
def _matrix(pool, mats, m):
    """Matrix m's byte rows, a view of the pool.          # -> [N, row bytes] uint8 (interleaved: [ceil(N / 8),
                                                               8 row bytes]; panels: [ceil(N / 16), 16 row bytes])"""
    at, N, row_bytes = mats[m, 0], mats[m, 2], mats[m, 4]
    per = PANEL if qk.held_in_panels(mats[m, 1]) else 8 if qk.held_interleaved(mats[m, 1]) else 1
    G = (N + per - 1) // per
    return pool[at:at + G * per * row_bytes].reshape((G, per * row_bytes))


# Quantizing one token's activations takes ~2.5 us per 768 values on one core; from this many tokens a product's
# quantization is split over the threads (one more parallel region: tens of microseconds where threads sleep)
QUANTIZE_IN_PARALLEL_FROM = 16


@njit(cache=True)
def products_into(pool, mats, first, count, x, T, out, threads):
    """out[:T, col_i : col_i + N_i] = x[:T, :K] @ W_i.T for the `count` matrices first .. first + count - 1, which
    read the same input, side by side (col_i = N_0 + ... + N_{i-1}).   # [>=T, >=K] -> [>=T, >= sum N_i]

    The concatenated groups of 8 or 16 rows (one token: qk.ROWS_AT_ONCE) or panels of 16 rows (several tokens; F32's
    panels always: _unit) are split into one contiguous range per thread, in ONE parallel region (none on one
    thread: a small model's step is mostly such calls); each matrix's part of a range goes to its type's row-range
    worker (kernels/quant).

    Every block type's weights (Q2_K .. Q8_0, as interleaved rows), in calls of any length, meet activations
    quantized to 8 bits per block of 32 (as llama.cpp does): integer dot products, with x quantized once here for
    every matrix and row range (on every thread from QUANTIZE_IN_PARALLEL_FROM tokens; docs/quant.md, "8-bit
    activations", for the rounding bound and the measured KL divergence). Q2_K and Q3_K meet x in two 8-bit parts
    (quant.oracle.quantize_activations_two_part: 15 bits, two dot instructions a word). Other types take x in float32:
    F32 held as panels by cpu.py's register tiles (each output a chain of multiply-adds over k in order: the same
    bits whatever the tokens and threads), F16 and BF16 rows by kernels/quant's.
    """
    total, float_rows = np.int64(0), False  # not a literal 0 (see models/numba.py: layer_product)
    for i in range(count):
        total += -(-mats[first + i, 2] // _unit(mats[first + i, 1], T))
        float_rows = float_rows or mats[first + i, 1] < qk.INTERLEAVED_CODE
    K = mats[first, 3]
    sums = np.zeros(K // 16, np.float32)  # x's sums of 16 for the blocks' offsets (one token only)
    if T == 1 and float_rows:
        for g in range(K // 16):
            s = np.float32(0)
            for j in range(16):
                s += x[0, 16 * g + j]
            sums[g] = s
    any_int8, two_part = False, False
    for i in range(count):
        any_int8 = any_int8 or _int8_type(mats[first + i, 1], T)
        two_part = two_part or _two_part_type(mats[first + i, 1])
    xq = _int8_activations(T if any_int8 else 0, K, 1)
    xv = _int8_activations(T if two_part else 0, K, 2)  # the two parts, for TWO_PART_ACTIVATION_TYPES
    in_parallel = threads > 1 and T >= QUANTIZE_IN_PARALLEL_FROM
    if any_int8 and in_parallel:
        qk.quantize_activations_q8_parallel(x, T, xq.q, xq.d, xq.s, xq.s16, threads)
    elif any_int8:
        qk.quantize_activations_q8_into(x, T, xq.q, xq.d, xq.s, xq.s16)
    if two_part and in_parallel:
        qk.two_part_activations_parallel(x, T, xq.q, xq.d, xv.q, xv.d, xv.s, xv.s16, threads)
    elif two_part:
        qk.two_part_activations_into(x, T, xq.q, xq.d, xv.q, xv.d, xv.s, xv.s16)
    chunks = max(1, min(total, threads))
    group = Matrices(pool, mats, first, count)
    if chunks == 1:
        _product_units(group, Operand(x, T, sums, xq, xv), out, np.int64(0), total)
    else:
        _products_parallel(group, x, T, sums, xq, xv, out, total, chunks)


@njit(inline="always")
def _unit(code, T):
    """Rows of a matrix of this code that a thread's range holds whole: a float32 panel (16), or for the other
    layouts a panel's 16 rows in a call of several tokens, one token's group of interleaved rows (qk.ROWS_AT_ONCE)."""
    return PANEL if T > 1 or qk.held_in_panels(code) else qk.ROWS_AT_ONCE


@njit(inline="always")
def _int8_activations(T, K, parts) -> Int8Activations:
    """Room for T tokens' activations of K values quantized to 8 bits, in one part or two (q [T, 2K] then)."""
    return Int8Activations(np.empty((T, parts * K), np.int8), np.empty((T, K // 32), np.float32),
                           np.empty((T, K // 32), np.float32), np.empty((T, K // 16), np.int32))


@njit(inline="always")
def _int8_type(code, T) -> bool:
    """Whether weights of GGML type `code` meet 8-bit activations (in a call of any T tokens): the interleaved ones,
    every block type's matrices (quant.INT8_ACTIVATION_TYPES states the same for the NumPy oracle)."""
    return qk.held_interleaved(code)


@njit(inline="always")
def _two_part_type(code) -> bool:
    """Whether weights of type `code` take their activations in two 8-bit parts (quant.TWO_PART_ACTIVATION_TYPES:
    Q2_K and Q3_K, interleaved)."""
    return qk.takes_two_parts(code)


@njit(parallel=True, cache=True)
def _products_parallel(group, x, T, sums, xq, xv, out, total, chunks):
    """_product_units of `chunks` ranges of the `total` units, in one parallel region. The input comes as
    Operand's fields: a parallel region's records must be arguments, each a tuple of arrays and numbers."""
    for c in prange(chunks):
        _product_units(group, Operand(x, T, sums, xq, xv), out, c * total // chunks, (c + 1) * total // chunks)


@njit(cache=True)
def _product_units(group, a, out, u0, u1):
    """Units u0 .. u1-1 of the concatenated units (_unit: groups of rows, or panels) of the group's matrices, from
    input a (Operand) into out."""
    mats, T = group.mats, a.T
    base, col = np.int64(0), np.int64(0)
    for i in range(group.count):
        m = group.first + i
        N, unit = mats[m, 2], _unit(mats[m, 1], T)
        units = -(-N // unit)
        lo, hi = max(u0, base), min(u1, base + units)
        if lo < hi:
            w = _matrix(group.pool, mats, m)
            n0, n1 = (lo - base) * unit, min((hi - base) * unit, N)
            if qk.held_in_panels(mats[m, 1]):
                cpu.matmul_panel_rows(w.reshape(w.size).view(np.float32), mats[m, 3], a.x, T, out, col, n0, n1)
            elif _int8_type(mats[m, 1], T):
                q = a.xv if _two_part_type(mats[m, 1]) else a.xq  # one call site: each kernel compiled in once
                qk.matmul_rows_interleaved(mats[m, 1], w, q.q, q.d, q.s, q.s16, T, out, col, n0, n1)
            elif T == 1:
                qk.matvec_rows(mats[m, 1], w, a.x[0], a.sums, out[0], col, n0, n1)
            else:
                qk.matmul_rows(mats[m, 1], w, a.x, T, out, col, n0, n1)
        base += units
        col += N


@njit(inline="always")
def embed_rows(w, tokens, x):
    """x[t] = the embedding row of tokens[t], decoded from its stored type: from the table as stored, or, where the LM
    head is tied to it, gathered back from the head's panels or interleaved rows.               # [T] -> [T, D]"""
    embed = w.mats.shape[0] - 2
    table = w.table if w.table.shape[0] else _matrix(w.pool, w.mats, embed)
    scratch = np.empty(qk.file_row_bytes(w.mats[embed, 1], x.shape[1]), np.uint8)
    for t in range(tokens.shape[0]):
        qk.decode_any_row(w.mats[embed, 1], table, tokens[t], x[t], scratch)


@njit(inline="always")
def swiglu_rows(gate_up, F, out, T, threads, act):
    """silu(gate) * up of T tokens, on the threads from QUANTIZE_IN_PARALLEL_FROM tokens; act cpu.GELU_TANH:
    gelu_tanh(gate) * up (cpu.geglu_hidden_into).                                        # [>=T, 2F] -> [>=T, F]"""
    if act == cpu.GELU_TANH:
        cpu.geglu_hidden_into(gate_up, F, out, F, T)
    elif threads > 1 and T >= QUANTIZE_IN_PARALLEL_FROM:
        _swiglu_halves_parallel(gate_up, F, out, T, threads)
    else:
        _swiglu_halves_into(gate_up, F, out, T)


@njit(parallel=True, cache=True)
def _swiglu_halves_parallel(gate_up, F, out, T, threads):
    """_swiglu_halves_into with the T tokens split into `threads` ranges run in parallel (the same bits: tokens are
    independent). A 128-token prefill at 110M spent ~6 ms in it on one thread."""
    for c in prange(threads):
        t0, t1 = c * T // threads, (c + 1) * T // threads
        _swiglu_halves_into(gate_up[t0:t1], F, out[t0:t1], t1 - t0)


@njit(cache=True)
def _swiglu_halves_into(gate_up, F, out, T):
    """out[t, i] = silu(gate) * up = gate / (1 + e^-gate) * up with gate = gate_up[t, i], up = gate_up[t, F + i].
                                                                                   # [>=T, 2F] -> [>=T, F]"""
    e = np.empty(F, np.float32)
    bits = np.empty(F, np.int32)
    for t in range(T):
        for i in range(F):
            e[i] = -gate_up[t, i]
        cpu._exp_into(e, F, bits)
        for i in range(F):
            out[t, i] = gate_up[t, i] / (np.float32(1.0) + e[i]) * gate_up[t, F + i]
