"""Matrix products on quantized weights, reading the blocks of npllm.quant straight from their bytes.

A weight matrix W [N, K] of a block type is held as its bytes, one row of blocks per output:

    w [N, K / block_size * block_bytes] uint8        (a view of the memory map: no float copy anywhere)

Activations stay float32 (npllm's choice: no 8-bit activation blocks as llama.cpp uses, so the only rounding is the
weights' own and the float32 sums). Each kernel is the NumPy reference `x @ dequantize(w).T` with the sums
regrouped:

    matvec (decode, one token): out[n] = sum_b  d_b * sum_j q_bj x_bj       the block scale leaves the inner sum
                                (K-quants: sum_s (d sc_s) sum_j q x - (dmin mn_s) sum_j x per sub-block s)
    matmul (prefill, T tokens): each block of a row is decoded once into a float32 buffer (32 or 256 values,
                                in L1), then every token's dot product with it is taken.

Rows are split into `threads` contiguous ranges run in parallel (numba.prange), so each weight byte is read once per
product. Sums are reassociated by the compiler (fastmath), so results match the reference to float32 rounding, not
bit for bit; tests hold each kernel to the reference under Hypothesis.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..quant import QK_K, TYPES, QuantizationError

REASSOC = {"reassoc", "contract", "nsz", "nnan", "arcp"}

# 2^(e - 25) for a float16 exponent field e (e = 0: subnormal, 2^-24 per mantissa unit): with the implicit bit,
# |h| = (mantissa + 1024 [e > 0]) * _HALF_SCALE[e], exact in float32.
_HALF_SCALE = np.array([2.0**-24] + [2.0 ** (e - 25) for e in range(1, 31)] + [np.inf], dtype=np.float32)


@njit(inline="always")
def _half(lo, hi):
    """The float16 stored as bytes (lo, hi), as float32 (inf for an all-ones exponent; NaNs read as inf)."""
    h = np.int32(lo) | (np.int32(hi) << 8)
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    value = np.float32(m + (1024 if e > 0 else 0)) * _HALF_SCALE[e]
    return -value if h & 0x8000 else value


@njit(inline="always")
def _int8(byte):
    v = np.int32(byte)
    return v - ((v >> 7) << 8)


# ---------------------------------------------------------------------------------------------- Q8_0

@njit(fastmath=REASSOC, inline="always")
def _dot_q8_0(w, n, b, x):
    """Block b of row n (34 bytes: f16 d, 32 int8) dotted with x[32 b : 32 b + 32]."""
    at, k = 34 * b, 32 * b
    s = np.float32(0)
    for j in range(32):
        s += np.float32(_int8(w[n, at + 2 + j])) * x[k + j]
    return _half(w[n, at], w[n, at + 1]) * s


@njit(inline="always")
def _decode_q8_0(w, n, b, buf):
    at = 34 * b
    d = _half(w[n, at], w[n, at + 1])
    for j in range(32):
        buf[j] = np.float32(_int8(w[n, at + 2 + j])) * d


# ---------------------------------------------------------------------------------------------- Q4_0

@njit(fastmath=REASSOC, inline="always")
def _dot_q4_0(w, n, b, x):
    """Block b of row n (18 bytes: f16 d, 16 bytes; byte j holds values j (low) and j + 16 (high), offset 8)."""
    at, k = 18 * b, 32 * b
    s = np.float32(0)
    for j in range(16):
        byte = np.int32(w[n, at + 2 + j])
        s += np.float32((byte & 15) - 8) * x[k + j] + np.float32((byte >> 4) - 8) * x[k + j + 16]
    return _half(w[n, at], w[n, at + 1]) * s


@njit(inline="always")
def _decode_q4_0(w, n, b, buf):
    at = 18 * b
    d = _half(w[n, at], w[n, at + 1])
    for j in range(16):
        byte = np.int32(w[n, at + 2 + j])
        buf[j] = np.float32((byte & 15) - 8) * d
        buf[j + 16] = np.float32((byte >> 4) - 8) * d


# ---------------------------------------------------------------------------------------------- Q4_K

@njit(inline="always")
def _scale_min_q4_k(w, n, at, s):
    """6-bit scale and min of sub-block s from the 12 scale bytes at w[n, at:] (see quant._scales_6bit)."""
    if s < 4:
        return np.int32(w[n, at + s]) & 63, np.int32(w[n, at + 4 + s]) & 63
    c = np.int32(w[n, at + 4 + s])
    sc = (c & 15) | ((np.int32(w[n, at + s - 4]) >> 6) << 4)
    mn = (c >> 4) | ((np.int32(w[n, at + s]) >> 6) << 4)
    return sc, mn


@njit(fastmath=REASSOC, inline="always")
def _dot_q4_k(w, n, b, x):
    """Super-block b of row n (144 bytes): sum over 8 sub-blocks of (d sc) sum q x - (dmin mn) sum x."""
    at, k = 144 * b, QK_K * b
    d, dmin = _half(w[n, at], w[n, at + 1]), _half(w[n, at + 2], w[n, at + 3])
    total = np.float32(0)
    for r in range(4):  # run r of 32 bytes: sub-block 2r in the low nibbles, 2r + 1 in the high ones
        sc0, mn0 = _scale_min_q4_k(w, n, at + 4, 2 * r)
        sc1, mn1 = _scale_min_q4_k(w, n, at + 4, 2 * r + 1)
        qx0 = qx1 = x0 = x1 = np.float32(0)
        base, k0 = at + 16 + 32 * r, k + 64 * r
        for j in range(32):
            byte = np.int32(w[n, base + j])
            a, c = x[k0 + j], x[k0 + 32 + j]
            qx0 += np.float32(byte & 15) * a
            qx1 += np.float32(byte >> 4) * c
            x0 += a
            x1 += c
        total += d * np.float32(sc0) * qx0 - dmin * np.float32(mn0) * x0
        total += d * np.float32(sc1) * qx1 - dmin * np.float32(mn1) * x1
    return total


@njit(inline="always")
def _decode_q4_k(w, n, b, buf):
    at = 144 * b
    d, dmin = _half(w[n, at], w[n, at + 1]), _half(w[n, at + 2], w[n, at + 3])
    for r in range(4):
        sc0, mn0 = _scale_min_q4_k(w, n, at + 4, 2 * r)
        sc1, mn1 = _scale_min_q4_k(w, n, at + 4, 2 * r + 1)
        s0, m0 = d * np.float32(sc0), dmin * np.float32(mn0)
        s1, m1 = d * np.float32(sc1), dmin * np.float32(mn1)
        base = at + 16 + 32 * r
        for j in range(32):
            byte = np.int32(w[n, base + j])
            buf[64 * r + j] = s0 * np.float32(byte & 15) - m0
            buf[64 * r + 32 + j] = s1 * np.float32(byte >> 4) - m1


# ---------------------------------------------------------------------------------------------- Q6_K

@njit(inline="always")
def _q6_k(w, n, at, h, g, l):
    """6-bit value (0..63) of group g (0..3), lane l (0..31) of half h of the Q6_K block at w[n, at:]."""
    ql = np.int32(w[n, at + 64 * h + 32 * (g & 1) + l])
    low = (ql >> 4) if g >= 2 else (ql & 15)
    high = (np.int32(w[n, at + 128 + 32 * h + l]) >> (2 * g)) & 3
    return low | (high << 4)


@njit(fastmath=REASSOC, inline="always")
def _dot_q6_k(w, n, b, x):
    """Super-block b of row n (210 bytes): sum over 16 sub-blocks of (d sc) sum (q - 32) x."""
    at, k = 210 * b, QK_K * b
    d = _half(w[n, at + 208], w[n, at + 209])
    total = np.float32(0)
    for h in range(2):
        for g in range(4):
            first = k + 128 * h + 32 * g  # 32 values: sub-blocks 8h + 2g and 8h + 2g + 1
            s0 = s1 = np.float32(0)
            for l in range(16):
                s0 += np.float32(_q6_k(w, n, at, h, g, l) - 32) * x[first + l]
                s1 += np.float32(_q6_k(w, n, at, h, g, l + 16) - 32) * x[first + 16 + l]
            sub = 8 * h + 2 * g
            total += d * np.float32(_int8(w[n, at + 192 + sub])) * s0
            total += d * np.float32(_int8(w[n, at + 192 + sub + 1])) * s1
    return total


@njit(inline="always")
def _decode_q6_k(w, n, b, buf):
    at = 210 * b
    d = _half(w[n, at + 208], w[n, at + 209])
    for h in range(2):
        for g in range(4):
            for l in range(32):
                i = 128 * h + 32 * g + l
                scale = d * np.float32(_int8(w[n, at + 192 + i // 16]))
                buf[i] = scale * np.float32(_q6_k(w, n, at, h, g, l) - 32)


# ---------------------------------------------------------------------------------------------- the products

def _kernels(dot, decode, block_size: int):
    """matvec and matmul over the rows of a block type, from its block dot product and its block decoder."""

    @njit(parallel=True, fastmath=REASSOC, cache=True)
    def matvec(w, x, threads):
        N = w.shape[0]
        nb = x.shape[0] // block_size
        out = np.empty(N, np.float32)
        chunks = max(1, min(N, threads))
        for c in prange(chunks):
            for n in range(c * N // chunks, (c + 1) * N // chunks):
                acc = np.float32(0)
                for b in range(nb):
                    acc += dot(w, n, b, x)
                out[n] = acc
        return out

    @njit(parallel=True, fastmath=REASSOC, cache=True)
    def matmul(w, x, threads):
        N = w.shape[0]
        T, K = x.shape
        nb = K // block_size
        out = np.empty((T, N), np.float32)
        chunks = max(1, min(N, threads))
        for c in prange(chunks):
            buf = np.empty(block_size, np.float32)
            acc = np.empty(T, np.float32)
            for n in range(c * N // chunks, (c + 1) * N // chunks):
                acc[:] = 0
                for b in range(nb):
                    decode(w, n, b, buf)
                    k = b * block_size
                    for t in range(T):
                        s = np.float32(0)
                        for j in range(block_size):
                            s += buf[j] * x[t, k + j]
                        acc[t] += s
                for t in range(T):
                    out[t, n] = acc[t]
        return out

    return matvec, matmul


_MATVEC, _MATMUL = {}, {}
for _name, _dot, _decode in [("Q8_0", _dot_q8_0, _decode_q8_0), ("Q4_0", _dot_q4_0, _decode_q4_0),
                             ("Q4_K", _dot_q4_k, _decode_q4_k), ("Q6_K", _dot_q6_k, _decode_q6_k)]:
    _MATVEC[_name], _MATMUL[_name] = _kernels(_dot, _decode, TYPES[_name].block_size)

KERNEL_TYPES = tuple(_MATVEC)


def _check(w: np.ndarray, qtype: str, K: int) -> None:
    if qtype not in _MATVEC:
        raise QuantizationError(f"no kernel for {qtype} weights (npllm has {', '.join(KERNEL_TYPES)})")
    t = TYPES[qtype]
    if w.dtype != np.uint8 or w.ndim != 2 or K % t.block_size or w.shape[1] != K // t.block_size * t.block_bytes:
        raise QuantizationError(f"{qtype} weights of shape {w.shape} do not hold rows of {K} values")


def matvec(w: np.ndarray, qtype: str, x: np.ndarray, threads: int = 1) -> np.ndarray:
    """W x for W given as its rows of `qtype` blocks.  # [N, row bytes] uint8, [K] float32 -> [N] float32"""
    x = np.ascontiguousarray(x, dtype=np.float32)
    _check(w, qtype, x.shape[0])
    return _MATVEC[qtype](w, x, threads)


def matmul(w: np.ndarray, qtype: str, x: np.ndarray, threads: int = 1) -> np.ndarray:
    """x W^T for W given as its rows of `qtype` blocks.  # [N, row bytes] uint8, [T, K] float32 -> [T, N] float32"""
    x = np.ascontiguousarray(x, dtype=np.float32)
    _check(w, qtype, x.shape[1])
    return _MATMUL[qtype](w, x, threads)
