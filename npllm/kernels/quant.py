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
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from ..quant import QK_K, TYPES, QuantizationError
from .simd import _vector, f32x8, vadd, vfma, vfmav, vload, vsum, vzero

REASSOC = {"reassoc", "contract", "nsz", "nnan", "arcp"}

# 2^(e - 25) for a float16 exponent field e (e = 0: subnormal, 2^-24 per mantissa unit): with the implicit bit,
# |h| = (mantissa + 1024 [e > 0]) * _HALF_SCALE[e], exact in float32.
_HALF_SCALE = np.array([2.0**-24] + [2.0 ** (e - 25) for e in range(1, 31)] + [np.inf], dtype=np.float32)


# ---------------------------------------------------------------------------------------------- byte vectors
# Eight weight bytes widened to eight float32 lanes in registers (simd.py's f32x8). Written as LLVM vector
# operations because Numba's indexing of a byte array, one element at a time, keeps the loop from vectorising.


def _byte_lanes(builder, context, array_type, array, index):
    """The 8 bytes at array.flat[index] as an <8 x i8> vector (array: C-contiguous uint8 or int8, any rank)."""
    data = context.make_array(array_type)(context, builder, array).data
    pointer = builder.bitcast(builder.gep(data, [index]), ir.VectorType(ir.IntType(8), 8).as_pointer())
    return builder.load(pointer, align=1)


def _is_byte_c_array(ty) -> bool:
    return isinstance(ty, types.Array) and ty.dtype in (types.uint8, types.int8) and ty.layout == "C"


@intrinsic
def vload_int8(typingctx, array, index):
    """f32x8 of the 8 bytes at array.flat[index] read as int8 (-128..127)."""
    if not (_is_byte_c_array(array) and isinstance(index, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        return builder.sitofp(_byte_lanes(builder, context, signature.args[0], args[0], args[1]), _vector(8))

    return f32x8(array, index), codegen


def _nibbles(high: bool):
    def typer(typingctx, array, index):
        if not (_is_byte_c_array(array) and isinstance(index, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            lanes = _byte_lanes(builder, context, signature.args[0], args[0], args[1])
            i8x8 = ir.VectorType(ir.IntType(8), 8)
            nibble = (builder.lshr(lanes, ir.Constant(i8x8, [4] * 8)) if high
                      else builder.and_(lanes, ir.Constant(i8x8, [15] * 8)))
            return builder.uitofp(nibble, _vector(8))

        return f32x8(array, index), codegen

    return typer


vload_low_nibbles = intrinsic(_nibbles(high=False))  # f32x8 of (byte & 15) for the 8 bytes at array.flat[index]
vload_high_nibbles = intrinsic(_nibbles(high=True))  # f32x8 of (byte >> 4)


@intrinsic
def vload_two_bits(typingctx, array, index, shift):
    """f32x8 of (byte >> shift) & 3 for the 8 bytes at array.flat[index]."""
    if not (_is_byte_c_array(array) and isinstance(index, types.Integer) and isinstance(shift, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        lanes = _byte_lanes(builder, context, signature.args[0], args[0], args[1])
        i8x8 = ir.VectorType(ir.IntType(8), 8)
        amount = builder.trunc(args[2], ir.IntType(8))
        splat = builder.shuffle_vector(builder.insert_element(ir.Constant(i8x8, ir.Undefined), amount,
                                                              ir.Constant(ir.IntType(32), 0)),
                                       ir.Constant(i8x8, ir.Undefined), ir.Constant(ir.VectorType(ir.IntType(32), 8),
                                                                                    [0] * 8))
        bits = builder.and_(builder.lshr(lanes, splat), ir.Constant(i8x8, [3] * 8))
        return builder.uitofp(bits, _vector(8))

    return f32x8(array, index, shift), codegen


@njit(inline="always")
def _half(lo, hi):
    """The float16 stored as bytes (lo, hi), as float32 (inf for an all-ones exponent; NaNs read as inf).

    Branch-free: a sign that flips at random from block to block would otherwise cost a mispredicted jump each.
    """
    h = np.int32(lo) | (np.int32(hi) << 8)
    e = (h >> 10) & 0x1F
    implicit = ((e + 31) >> 5) << 10  # 1024 for a normal number (e > 0), 0 for a subnormal
    sign = np.float32(1 - ((h >> 14) & 2))  # +1 or -1
    return sign * np.float32((h & 0x3FF) + implicit) * _HALF_SCALE[e]


@njit(inline="always")
def _int8(byte):
    v = np.int32(byte)
    return v - ((v >> 7) << 8)


# ---------------------------------------------------------------------------------------------- block kernels
# For each type: _acc_<type>(acc, w, n, b, x) adds block b of row n times x (as eight lanes of partial sums) to the
# f32x8 accumulator `acc`; _decode_<type>(w, n, b, buf, at) writes the block's values to buf[at : at + block_size].
# `w` is [N, row bytes] C-contiguous, so row n's block b starts at flat byte n * w.shape[1] + b * block_bytes.


@njit(fastmath=REASSOC, inline="always")
def _acc_q8_0(acc, w, n, b, x):
    """Q8_0 (34 bytes: f16 d, 32 int8 q): acc += d * q * x[32 b:][:32]."""
    at, k = n * w.shape[1] + 34 * b, 32 * b
    qx = vzero()
    for j in range(0, 32, 8):
        qx = vfmav(qx, vload_int8(w, at + 2 + j), vload(x, k + j))
    return vfma(acc, _half(w[n, 34 * b], w[n, 34 * b + 1]), qx)


@njit(inline="always")
def _decode_q8_0(w, n, b, buf, at):
    base = 34 * b
    d = _half(w[n, base], w[n, base + 1])
    for j in range(32):
        buf[at + j] = np.float32(_int8(w[n, base + 2 + j])) * d


@njit(fastmath=REASSOC, inline="always")
def _acc_q4_0(acc, w, n, b, x):
    """Q4_0 (18 bytes: f16 d, 16 bytes; byte j holds values j (low nibble) and j + 16 (high), offset by 8):
    acc += d * (q x - 8 x)."""
    at, k = n * w.shape[1] + 18 * b + 2, 32 * b
    qx = vzero()
    xs = vzero()
    for j in range(0, 16, 8):
        low, high = vload(x, k + j), vload(x, k + 16 + j)
        qx = vfmav(qx, vload_low_nibbles(w, at + j), low)
        qx = vfmav(qx, vload_high_nibbles(w, at + j), high)
        xs = vadd(xs, vadd(low, high))
    d = _half(w[n, 18 * b], w[n, 18 * b + 1])
    return vfma(vfma(acc, d, qx), np.float32(-8) * d, xs)


@njit(inline="always")
def _decode_q4_0(w, n, b, buf, at):
    base = 18 * b
    d = _half(w[n, base], w[n, base + 1])
    for j in range(16):
        byte = np.int32(w[n, base + 2 + j])
        buf[at + j] = np.float32((byte & 15) - 8) * d
        buf[at + j + 16] = np.float32((byte >> 4) - 8) * d


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
def _acc_q4_k(acc, w, n, b, x):
    """Q4_K (144 bytes): for each sub-block s of 32, acc += (d sc_s) q x - (dmin mn_s) x."""
    base = 144 * b
    flat, k = n * w.shape[1] + base + 16, QK_K * b
    d, dmin = _half(w[n, base], w[n, base + 1]), _half(w[n, base + 2], w[n, base + 3])
    for r in range(4):  # run r of 32 bytes: sub-block 2r in the low nibbles, 2r + 1 in the high ones
        sc0, mn0 = _scale_min_q4_k(w, n, base + 4, 2 * r)
        sc1, mn1 = _scale_min_q4_k(w, n, base + 4, 2 * r + 1)
        qx0, qx1, x0, x1 = vzero(), vzero(), vzero(), vzero()
        for j in range(0, 32, 8):
            a, c = vload(x, k + 64 * r + j), vload(x, k + 64 * r + 32 + j)
            qx0 = vfmav(qx0, vload_low_nibbles(w, flat + 32 * r + j), a)
            qx1 = vfmav(qx1, vload_high_nibbles(w, flat + 32 * r + j), c)
            x0, x1 = vadd(x0, a), vadd(x1, c)
        acc = vfma(acc, d * np.float32(sc0), qx0)
        acc = vfma(acc, -dmin * np.float32(mn0), x0)
        acc = vfma(acc, d * np.float32(sc1), qx1)
        acc = vfma(acc, -dmin * np.float32(mn1), x1)
    return acc


@njit(inline="always")
def _decode_q4_k(w, n, b, buf, at):
    base = 144 * b
    d, dmin = _half(w[n, base], w[n, base + 1]), _half(w[n, base + 2], w[n, base + 3])
    for r in range(4):
        sc0, mn0 = _scale_min_q4_k(w, n, base + 4, 2 * r)
        sc1, mn1 = _scale_min_q4_k(w, n, base + 4, 2 * r + 1)
        s0, m0 = d * np.float32(sc0), dmin * np.float32(mn0)
        s1, m1 = d * np.float32(sc1), dmin * np.float32(mn1)
        for j in range(32):
            byte = np.int32(w[n, base + 16 + 32 * r + j])
            buf[at + 64 * r + j] = s0 * np.float32(byte & 15) - m0
            buf[at + 64 * r + 32 + j] = s1 * np.float32(byte >> 4) - m1


@njit(fastmath=REASSOC, inline="always")
def _acc_q6_k(acc, w, n, b, x):
    """Q6_K (210 bytes): for each sub-block s of 16, acc += (d sc_s) (low + 16 high - 32) x, where value l + 32 g of
    half h has its low 4 bits in ql (nibble g // 2 of byte 32 (g % 2) + l) and its high 2 in bits 2 g of qh[l]."""
    base = 210 * b
    flat, k = n * w.shape[1] + base, QK_K * b
    d = _half(w[n, base + 208], w[n, base + 209])
    for h in range(2):
        for g in range(4):
            ql = flat + 64 * h + 32 * (g & 1)
            qh = flat + 128 + 32 * h
            first = k + 128 * h + 32 * g
            for half in range(2):  # sub-blocks 8h + 2g and 8h + 2g + 1, 16 values each
                lx, hx, xs = vzero(), vzero(), vzero()
                for j in range(16 * half, 16 * half + 16, 8):
                    xv = vload(x, first + j)
                    low = vload_high_nibbles(w, ql + j) if g >= 2 else vload_low_nibbles(w, ql + j)
                    lx = vfmav(lx, low, xv)
                    hx = vfmav(hx, vload_two_bits(w, qh + j, 2 * g), xv)
                    xs = vadd(xs, xv)
                scale = d * np.float32(_int8(w[n, base + 192 + 8 * h + 2 * g + half]))
                acc = vfma(acc, scale, lx)
                acc = vfma(acc, np.float32(16) * scale, hx)
                acc = vfma(acc, np.float32(-32) * scale, xs)
    return acc


@njit(inline="always")
def _q6_k(w, n, at, h, g, l):
    """6-bit value (0..63) of group g (0..3), lane l (0..31) of half h of the Q6_K block at w[n, at:]."""
    ql = np.int32(w[n, at + 64 * h + 32 * (g & 1) + l])
    low = (ql >> 4) if g >= 2 else (ql & 15)
    high = (np.int32(w[n, at + 128 + 32 * h + l]) >> (2 * g)) & 3
    return low | (high << 4)


@njit(inline="always")
def _decode_q6_k(w, n, b, buf, at):
    base = 210 * b
    d = _half(w[n, base + 208], w[n, base + 209])
    for h in range(2):
        for g in range(4):
            for l in range(32):
                i = 128 * h + 32 * g + l
                scale = d * np.float32(_int8(w[n, base + 192 + i // 16]))
                buf[at + i] = scale * np.float32(_q6_k(w, n, base, h, g, l) - 32)


# ---------------------------------------------------------------------------------------------- the products

GROUP_VALUES = 256  # matmul decodes this many values of a row at a time (8 Q8_0 blocks, 1 K-quant block)


def _kernels(acc_block, decode, block_size: int):
    """matvec and matmul over the rows of a block type, from its block accumulator and its block decoder."""
    group = max(1, GROUP_VALUES // block_size)

    @njit(parallel=True, fastmath=REASSOC, cache=True)
    def matvec(w, x, threads):
        N = w.shape[0]
        nb = x.shape[0] // block_size
        out = np.empty(N, np.float32)
        chunks = max(1, min(N, threads))
        for c in prange(chunks):
            for n in range(c * N // chunks, (c + 1) * N // chunks):
                acc = vzero()
                for b in range(nb):
                    acc = acc_block(acc, w, n, b, x)
                out[n] = vsum(acc)
        return out

    @njit(parallel=True, fastmath=REASSOC, cache=True)
    def matmul(w, x, threads):
        N = w.shape[0]
        T, K = x.shape
        nb = K // block_size
        out = np.empty((T, N), np.float32)
        chunks = max(1, min(N, threads))
        flat_x = x.reshape(T * K)
        for c in prange(chunks):
            buf = np.empty(group * block_size, np.float32)
            acc = np.empty(T, np.float32)
            for n in range(c * N // chunks, (c + 1) * N // chunks):
                acc[:] = 0
                for b0 in range(0, nb, group):
                    blocks = min(group, nb - b0)
                    for i in range(blocks):
                        decode(w, n, b0 + i, buf, i * block_size)
                    k, length = b0 * block_size, blocks * block_size
                    for t in range(T):
                        s = vzero()
                        for j in range(0, length, 8):
                            s = vfmav(s, vload(buf, j), vload(flat_x, t * K + k + j))
                        acc[t] += vsum(s)
                for t in range(T):
                    out[t, n] = acc[t]
        return out

    return matvec, matmul


_MATVEC, _MATMUL = {}, {}
for _name, _acc, _decode in [("Q8_0", _acc_q8_0, _decode_q8_0), ("Q4_0", _acc_q4_0, _decode_q4_0),
                             ("Q4_K", _acc_q4_k, _decode_q4_k), ("Q6_K", _acc_q6_k, _decode_q6_k)]:
    _MATVEC[_name], _MATMUL[_name] = _kernels(_acc, _decode, TYPES[_name].block_size)

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
