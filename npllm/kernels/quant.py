"""Matrix products on quantized weights, reading the blocks of npllm.quant straight from their bytes.

A weight matrix W [N, K] of a block type is held as its bytes, one row of blocks per output:

    w [N, K / block_size * block_bytes] uint8        (a view of the memory map: no float copy anywhere)

Two ways to meet activations x, both tested against a NumPy statement:

  - x in float32 (every type; the products of this first section): each kernel is the NumPy reference
    `x @ dequantize(w).T` with the sums regrouped:

    matvec (decode, one token): out[n] = sum_b  d_b * sum_j q_bj x_bj       the block scale leaves the inner sum
                                (K-quants: sum_s (d sc_s) sum_j q x - (dmin mn_s) sum_j x per sub-block s, the
                                sums of x taken once per product, not once per row)
    matmul (prefill, T tokens): 16 rows at a time are decoded into one float32 panel (K x 16, the layout of
                                kernels/cpu.py), which cpu.py's register tile then multiplies by every token: the
                                decoding is paid once per row, the arithmetic runs at the float32 kernel's rate.

  - x quantized to 8 bits per block of 32 (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K; section "8-bit
    activations"): integer dot products, as llama.cpp computes; its NumPy statement is
    quant.matmul_t_q8_activations. What npllm's Numba model runs for those types, on rows interleaved by eight;
    Q2_K and Q3_K meet x in two 8-bit parts (15 bits, quant.matmul_t_two_part_activations).

Rows are split into `threads` contiguous ranges run in parallel (numba.prange), so each weight byte is read once per
product. Sums are reassociated by the compiler (fastmath), so results match the reference to float32 rounding, not
bit for bit; tests hold each kernel to the reference under Hypothesis.
"""

from __future__ import annotations

import os

import llvmlite.binding
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..quant import (INTERLEAVED_BLOCK_BYTES, INTERLEAVED_TYPES, QK_K, TWO_PART_ACTIVATION_TYPES, TYPES,
                     QuantizationError)
from .cpu import PANEL, REASSOC, TILE_T, _tile_6x16
from .simd import (_is_f32_c_array, _lane_pointer, _vector, f32x8, f32x16, prefetch, vadd, vfma, vfmav, vload, vsplat,
                   vstore, vsum, vzero, vzero16)

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


@intrinsic
def load_half(typingctx, array, index):
    """The float16 at bytes array.flat[index : index + 2], widened to float32 (one vcvtph2ps where the CPU has F16C)."""
    if not (_is_byte_c_array(array) and isinstance(index, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        pointer = builder.bitcast(builder.gep(data, [args[1]]), ir.HalfType().as_pointer())
        return builder.fpext(builder.load(pointer, align=1), ir.FloatType())

    return types.float32(array, index), codegen


@njit(inline="always")
def _int8(byte):
    v = np.int32(byte)
    return v - ((v >> 7) << 8)


# ---------------------------------------------------------------------------------------------- block kernels
# For each type: _acc_<type>(acc, w, n, b, x, sums) adds block b of row n times x to the f32x8 accumulator `acc`
# and returns it with a scalar part; _decode_<type>(w, n, b, buf, at) writes the block's values to
# buf[at : at + block_size]. `w` is [N, row bytes] C-contiguous, so row n's block b starts at flat byte
# n * w.shape[1] + b * block_bytes. `sums[i]` = x[16 i : 16 i + 16].sum(), computed once per product: the terms of
# a K-quant's min are (min * sum of x), one multiply per sub-block instead of one add per value. A fixed offset
# (Q4_0's -8, Q6_K's -32) is subtracted from the small integers before the product instead: q x - 32 (sum of x)
# would cancel to a loss of every digit where a weight of 0 meets a large activation.


@njit(fastmath=REASSOC, inline="always")
def _acc_q8_0(acc, w, n, b, x, sums):
    """Q8_0 (34 bytes: f16 d, 32 int8 q): acc += d * q * x[32 b:][:32]."""
    at, k = n * w.shape[1] + 34 * b, 32 * b
    qx = vzero()
    for j in range(0, 32, 8):
        qx = vfmav(qx, vload_int8(w, at + 2 + j), vload(x, k + j))
    return vfma(acc, load_half(w, n * w.shape[1] + 34 * b), qx), np.float32(0)


@njit(inline="always")
def _decode_q8_0(w, n, b, buf, at):
    base = 34 * b
    d = load_half(w, n * w.shape[1] + base)
    for j in range(32):
        buf[at + j] = np.float32(_int8(w[n, base + 2 + j])) * d


@njit(fastmath=REASSOC, inline="always")
def _acc_q4_0(acc, w, n, b, x, sums):
    """Q4_0 (18 bytes: f16 d, 16 bytes; byte j holds values j (low nibble) and j + 16 (high), offset by 8):
    d (u - 8) x in the lanes (u - 8 exact before the product, as Q6_K's q - 32), no scalar part."""
    at, k = n * w.shape[1] + 18 * b + 2, 32 * b
    minus_8 = vsplat(np.float32(-8))
    qx = vzero()
    for j in range(0, 16, 8):
        qx = vfmav(qx, vadd(vload_low_nibbles(w, at + j), minus_8), vload(x, k + j))
        qx = vfmav(qx, vadd(vload_high_nibbles(w, at + j), minus_8), vload(x, k + 16 + j))
    d = load_half(w, n * w.shape[1] + 18 * b)
    return vfma(acc, d, qx), np.float32(0)


@njit(inline="always")
def _decode_q4_0(w, n, b, buf, at):
    base = 18 * b
    d = load_half(w, n * w.shape[1] + base)
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
def _acc_q4_k(acc, w, n, b, x, sums):
    """Q4_K (144 bytes): for each sub-block s of 32, (d sc_s) q x in the lanes, -(dmin mn_s) (sum of x) scalar."""
    base = 144 * b
    flat, k = n * w.shape[1] + base + 16, QK_K * b
    d, dmin = load_half(w, n * w.shape[1] + base), load_half(w, n * w.shape[1] + base + 2)
    offset = np.float32(0)
    for r in range(4):  # run r of 32 bytes: sub-block 2r in the low nibbles, 2r + 1 in the high ones
        sc0, mn0 = _scale_min_q4_k(w, n, base + 4, 2 * r)
        sc1, mn1 = _scale_min_q4_k(w, n, base + 4, 2 * r + 1)
        qx0, qx1 = vzero(), vzero()
        for j in range(0, 32, 8):
            qx0 = vfmav(qx0, vload_low_nibbles(w, flat + 32 * r + j), vload(x, k + 64 * r + j))
            qx1 = vfmav(qx1, vload_high_nibbles(w, flat + 32 * r + j), vload(x, k + 64 * r + 32 + j))
        acc = vfma(vfma(acc, d * np.float32(sc0), qx0), d * np.float32(sc1), qx1)
        s = 16 * b + 4 * r  # sums of 16: sub-block 2r is s, s + 1; sub-block 2r + 1 is s + 2, s + 3
        offset -= dmin * (np.float32(mn0) * (sums[s] + sums[s + 1]) + np.float32(mn1) * (sums[s + 2] + sums[s + 3]))
    return acc, offset


@njit(inline="always")
def _decode_q4_k(w, n, b, buf, at):
    base = 144 * b
    d, dmin = load_half(w, n * w.shape[1] + base), load_half(w, n * w.shape[1] + base + 2)
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
def _acc_q6_k_group(acc, offset, w, n, b, x, sums, d, h, g, high_nibbles):
    """Values 32 g .. 32 g + 31 of half h (sub-blocks 8h + 2g, 8h + 2g + 1) of Q6_K block b: low 4 bits from the
    low (g < 2) or high (g >= 2) nibbles of ql[32 (g % 2):], high 2 bits from bits 2g of qh. Called with g and
    high_nibbles as constants, so the compiler sees constant shifts."""
    flat = n * w.shape[1] + 210 * b
    ql = flat + 64 * h + 32 * (g & 1)
    qh = flat + 128 + 32 * h
    first = QK_K * b + 128 * h + 32 * g
    minus_32 = vsplat(np.float32(-32))
    for half in range(2):
        qx = vzero()
        for j in range(16 * half, 16 * half + 16, 8):
            low = vload_high_nibbles(w, ql + j) if high_nibbles else vload_low_nibbles(w, ql + j)
            # q - 32 exactly, before the product: (q x) - 32 (sum x) would cancel to a loss of every digit where
            # the two nearly meet (a weight of 0 beside a large activation)
            q = vfma(vadd(low, minus_32), np.float32(16), vload_two_bits(w, qh + j, 2 * g))
            qx = vfmav(qx, q, vload(x, first + j))
        sub = 8 * h + 2 * g + half
        scale = d * np.float32(_int8(w[n, 210 * b + 192 + sub]))
        acc = vfma(acc, scale, qx)
    return acc, offset


@njit(fastmath=REASSOC, inline="always")
def _acc_q6_k(acc, w, n, b, x, sums):
    """Q6_K (210 bytes): for each sub-block s of 16, (d sc_s) (low + 16 high - 32) x in the lanes, no scalar part
    (see _acc_q6_k_group for where each value's bits are)."""
    d = load_half(w, n * w.shape[1] + 210 * b + 208)
    offset = np.float32(0)
    for h in range(2):
        acc, offset = _acc_q6_k_group(acc, offset, w, n, b, x, sums, d, h, 0, False)
        acc, offset = _acc_q6_k_group(acc, offset, w, n, b, x, sums, d, h, 1, False)
        acc, offset = _acc_q6_k_group(acc, offset, w, n, b, x, sums, d, h, 2, True)
        acc, offset = _acc_q6_k_group(acc, offset, w, n, b, x, sums, d, h, 3, True)
    return acc, offset


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
    d = load_half(w, n * w.shape[1] + base + 208)
    for h in range(2):
        for g in range(4):
            for l in range(32):
                i = 128 * h + 32 * g + l
                scale = d * np.float32(_int8(w[n, base + 192 + i // 16]))
                buf[at + i] = scale * np.float32(_q6_k(w, n, base, h, g, l) - 32)


# ---------------------------------------------------------------------------------------------- the products

def _kernels(acc_block, decode, block_size: int):
    """matvec and matmul over the rows of a block type, from its block accumulator and its block decoder."""

    @njit(parallel=True, fastmath=REASSOC, cache=True)
    def matvec(w, x, threads):
        N = w.shape[0]
        nb = x.shape[0] // block_size
        sums = x.reshape(-1, 16).sum(axis=1).astype(np.float32)  # [K / 16]
        out = np.empty(N, np.float32)
        chunks = max(1, min(N, threads))
        for c in prange(chunks):
            for n in range(c * N // chunks, (c + 1) * N // chunks):
                acc = vzero()
                offset = np.float32(0)
                for b in range(nb):
                    acc, part = acc_block(acc, w, n, b, x, sums)
                    offset += part
                out[n] = vsum(acc) + offset
        return out

    @njit(parallel=True, fastmath=REASSOC, cache=True)
    def matmul(w, x, threads):
        N = w.shape[0]
        T, K = x.shape
        nb = K // block_size
        P = -(-N // PANEL)
        out = np.empty((T, N), np.float32)
        chunks = max(1, min(P, threads))
        for c in prange(chunks):
            panel = np.zeros(K * PANEL, np.float32)  # rows 16p .. 16p+15 decoded, as cpu.pack_panels lays them out
            row = np.empty(K, np.float32)
            tile = np.empty((T, PANEL), np.float32)
            for p in range(c * P // chunks, (c + 1) * P // chunks):
                rows = min(PANEL, N - PANEL * p)
                for j in range(rows):
                    for b in range(nb):
                        decode(w, PANEL * p + j, b, row, b * block_size)
                    for k in range(K):
                        panel[k * PANEL + j] = row[k]
                for j in range(rows, PANEL):  # past the last row: zeros, computed and not stored
                    for k in range(K):
                        panel[k * PANEL + j] = 0
                for t in range(0, T, TILE_T):
                    _tile_6x16(x, t, min(TILE_T, T - t), panel, 0, K, tile, 0)
                for t in range(T):
                    for j in range(rows):
                        out[t, PANEL * p + j] = tile[t, j]
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
    _check_rows(w, qtype, K)


def _check_rows(w: np.ndarray, qtype: str, K: int) -> None:
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


# ================================================================================================================
# 8-bit activations: integer dot products
#
# The activations of a product are quantized to int8 per block of 32 (quant.quantize_activations_q8: d = max|x| / 127,
# q = round(x / d), s = sum q), and each 32-value weight block meets its activation block in an integer dot product:
#
#     Q8_0:  out[t, n] = sum_b (d_w d_x) * sum_j q_w q_x                   q_w int8
#     Q4_0:  out[t, n] = sum_b (d_w d_x) * sum_j (u - 8) q_x                u = nibble 0..15
#     Q4_1:  out[t, n] = sum_b (d_w d_x) * sum_j u q_x + (m d_x) s_x        u = nibble 0..15
#     Q5_0:  out[t, n] = sum_b (d_w d_x) * sum_j (u - 16) q_x               u = nibble + 16 fifth bit, 0..31
#     Q5_1:  out[t, n] = sum_b (d_w d_x) * sum_j u q_x + (m d_x) s_x        u as Q5_0's
#
# The products of 8-bit integers are summed exactly in 32-bit integer lanes; one float multiply-add per block
# applies d_w d_x. Where the machine has AVX2 the dot of 32 bytes is vpmaddubsw (unsigned byte x signed byte, pairs
# summed to int16) then vpmaddwd by ones (pairs summed to int32): no pair sum can saturate int16 here, since
# |q_x| <= 127 and the unsigned factor is at most 128 (|q_w| for Q8_0, |u - 8| <= 8 for Q4_0, |u - 16| <= 16 for
# Q5_0, with q_x's sign moved onto it) or 63 (an unsigned value: a nibble, 5 or 6 bits): 2 * 128 * 127 < 32767.
# Elsewhere the same sums come from plain LLVM integer vectors (slower, same result).
# Results match quant.matmul_t_q8_activations to float32 rounding of the block sums.
#
# For a model:  quantize_activations_q8_into(x, T, q, d, s, s16)    once per input x [T, K] (q [T, K] int8, d, s
#                   [T, K/32] float32, s16 [T, K/16] int32)
#               matmul_rows_int8(code, w, q, d, s, s16, T, out, col, n0, n1)  out[t, col + n], rows n0..n1 (a thread's)
#               matvec_rows_int8(code, w, q, d, s, s16, out, col, n0, n1)     the same for one token into a vector
#               INT8_MATMUL_INTO[qtype](x, w, out, T, threads)            the whole product (cpu.matmul_into's order)
# and from Python: matvec_int8(w, qtype, x, threads), matmul_int8(w, qtype, x, threads).
# ================================================================================================================


_I8, _I16, _I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)


def _target_has_avx2() -> bool:
    """Whether the machine Numba compiles for has AVX2 (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES obeyed, as in simd.py)."""
    if os.environ.get("NUMBA_CPU_NAME") or os.environ.get("NUMBA_CPU_FEATURES"):
        return "+avx2" in os.environ.get("NUMBA_CPU_FEATURES", "")
    return bool(llvmlite.binding.get_host_cpu_features().get("avx2", False))


def _target_has_vnni() -> bool:
    """Whether the machine Numba compiles for has a 256-bit vpdpbusd (AVX-VNNI, or AVX512-VNNI with AVX512-VL)."""
    if os.environ.get("NUMBA_CPU_NAME") or os.environ.get("NUMBA_CPU_FEATURES"):
        features = set(os.environ.get("NUMBA_CPU_FEATURES", "").split(","))
        return "+avxvnni" in features or {"+avx512vnni", "+avx512vl"} <= features
    host = llvmlite.binding.get_host_cpu_features()
    return bool(host.get("avxvnni", False) or (host.get("avx512vnni", False) and host.get("avx512vl", False)))


AVX2 = _target_has_avx2()
VNNI = AVX2 and _target_has_vnni()


def _ivec(t, lanes):
    return ir.VectorType(t, lanes)


def _x86(builder, name, result, arguments):
    """An LLVM intrinsic function (x86's, or a generic one such as llvm.abs) declared in the module being built."""
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(result, arguments), name)


def _dot_avx2(builder, unsigned, signed, vnni: bool):
    """<8 x i32> partial sums of unsigned (<32 x i8>, 0..255) times signed (<32 x i8>): vpmaddubsw, vpmaddwd; or one
    vpdpbusd where the CPU has VNNI (Q8_0 and Q4_0 one-token rows ~5% faster on a Xeon with AVX-VNNI). The same
    sums for every input here: vpmaddubsw saturates a pair's sum to int16, but the unsigned factors are at most 128
    (|w| of a signed weight) or 63, so a pair stays within 2 * 128 * 127."""
    if vnni:  # declared with <8 x i32> operands, the form every LLVM since 10 reads (LLVM 22 upgrades it to bytes)
        i32x8 = _ivec(_I32, 8)
        function = _x86(builder, "llvm.x86.avx512.vpdpbusd.256", i32x8, [i32x8] * 3)
        return builder.call(function, [ir.Constant(i32x8, [0] * 8), builder.bitcast(unsigned, i32x8),
                                       builder.bitcast(signed, i32x8)])
    pairs16 = builder.call(_x86(builder, "llvm.x86.avx2.pmadd.ub.sw", _ivec(_I16, 16), [_ivec(_I8, 32)] * 2),
                           [unsigned, signed])
    return builder.call(_x86(builder, "llvm.x86.avx2.pmadd.wd", _ivec(_I32, 8), [_ivec(_I16, 16)] * 2),
                        [pairs16, ir.Constant(_ivec(_I16, 16), [1] * 16)])


def _dot_generic(builder, a, b, a_signed):
    """The same sums from plain LLVM integer vectors (a signed or unsigned, b signed): lane i sums the products of
    bytes 4i .. 4i + 3, as vpmaddubsw then vpmaddwd group them."""
    count = a.type.count  # 32 bytes, or 64 for a pair of interleaved groups
    wide = _ivec(_I32, count)
    a32 = builder.sext(a, wide) if a_signed else builder.zext(a, wide)
    products = builder.mul(a32, builder.sext(b, wide))
    total = None
    for k in range(4):
        part = builder.shuffle_vector(products, products, ir.Constant(_ivec(_I32, count // 4),
                                                                      list(range(k, count, 4))))
        total = part if total is None else builder.add(total, part)
    return total


def _dot(builder, w, x, w_signed: bool, avx2: bool, vnni: bool):
    """<8 x i32>: lane i = sum of w[4i + k] x[4i + k], k < 4, for <32 x i8> w (signed, |w| <= 128, or unsigned <= 63)
    and x (|x| <= 127)."""
    if not avx2:
        return _dot_generic(builder, w, x, w_signed)
    if not w_signed:
        return _dot_avx2(builder, w, x, vnni)
    # |w| times x with w's sign moved onto it: the unsigned factor is |w| <= 128
    magnitude = builder.call(_x86(builder, "llvm.abs.v32i8", _ivec(_I8, 32), [_ivec(_I8, 32), ir.IntType(1)]),
                             [w, ir.Constant(ir.IntType(1), 0)])
    signed = builder.call(_x86(builder, "llvm.x86.avx2.psign.b", _ivec(_I8, 32), [_ivec(_I8, 32)] * 2), [x, w])
    return _dot_avx2(builder, magnitude, signed, vnni)


def _load_bytes(builder, context, array_type, array, index, count):
    data = context.make_array(array_type)(context, builder, array).data
    pointer = builder.bitcast(builder.gep(data, [index]), _ivec(_I8, count).as_pointer())
    return builder.load(pointer, align=1)


def _field(builder, bytes_, shift, mask):
    """(bytes >> shift) & mask per byte, shift a run-time integer with mask << shift < 256 (every field here: a
    nibble at 0 or 4, two bits at 0..6, one bit at 0..7). The shift is taken on 16-bit lanes (x86 has no byte
    shift; LLVM would build a per-shift byte mask for one): the bits it brings down from a lane's high byte land at
    8 - shift and up, above the mask."""
    count = bytes_.type.count
    words = builder.bitcast(bytes_, _ivec(_I16, count // 2))
    shift16 = builder.trunc(shift, _I16) if shift.type.width > 16 else builder.zext(shift, _I16)
    lane = builder.insert_element(ir.Constant(_ivec(_I16, count // 2), ir.Undefined), shift16, ir.Constant(_I32, 0))
    shifts = builder.shuffle_vector(lane, lane, ir.Constant(_ivec(_I32, count // 2), [0] * (count // 2)))
    shifted = builder.bitcast(builder.lshr(words, shifts), _ivec(_I8, count))
    return builder.and_(shifted, ir.Constant(_ivec(_I8, count), [mask] * count))


# Weight bytes of each layout as the <32 x i8> of 32 values, and whether they are signed. Arguments after (w, ...)
# and before (x, ix) locate them.
def _int8_values(builder, context, sig, args):  # (w, iw): 32 int8
    return _load_bytes(builder, context, sig.args[0], args[0], args[1], 32), True


def _nibbles16(builder, context, sig, w, iw):
    """<32 x i8>: the 16 bytes at w.flat[iw:] as 32 nibbles, values 0..15 the low nibbles, 16..31 the high ones (the
    order of Q4_0, Q4_1, Q5_0 and Q5_1 blocks)."""
    packed = _load_bytes(builder, context, sig.args[0], w, iw, 16)
    fifteen = ir.Constant(_ivec(_I8, 16), [15] * 16)
    low = builder.and_(packed, fifteen)
    high = builder.and_(builder.lshr(packed, ir.Constant(_ivec(_I8, 16), [4] * 16)), fifteen)
    return builder.shuffle_vector(low, high, ir.Constant(_ivec(_I32, 32), list(range(32))))


def _fifth_bits(builder, context, sig, w, ih):
    """<32 x i8>: 16 where bit j of the little-endian u32 at w.flat[ih:] is set, else 0 (the fifth bits of Q5_0 and
    Q5_1: byte j // 8 of the four, bit j % 8)."""
    four = _load_bytes(builder, context, sig.args[0], w, ih, 4)
    spread = builder.shuffle_vector(four, four, ir.Constant(_ivec(_I32, 32), [j // 8 for j in range(32)]))
    bits = builder.and_(spread, ir.Constant(_ivec(_I8, 32), [1 << (j % 8) for j in range(32)]))
    zero = ir.Constant(_ivec(_I8, 32), [0] * 32)
    return builder.select(builder.icmp_unsigned("!=", bits, zero), ir.Constant(_ivec(_I8, 32), [16] * 32), zero)


def _q4_0_values(builder, context, sig, args):
    """(w, iw): Q4_0's 16 bytes of nibbles, as nibble - 8 in -8..7: signed, so the dot meets x through the sign
    trick as Q8_0's does; the offset stays inside the exact integer sum (no separate -8 d sum x term per block and
    token)."""
    nibbles = _nibbles16(builder, context, sig, args[0], args[1])
    return builder.sub(nibbles, ir.Constant(_ivec(_I8, 32), [8] * 32)), True


def _nibbles16_values(builder, context, sig, args):  # (w, iw): Q4_1's nibbles, 0..15, unsigned
    return _nibbles16(builder, context, sig, args[0], args[1]), False


def _five_bits_values(builder, context, sig, args):
    """(w, iqs, iqh): Q5_1's values, nibble + 16 x fifth bit in 0..31, unsigned."""
    return builder.or_(_nibbles16(builder, context, sig, args[0], args[1]),
                       _fifth_bits(builder, context, sig, args[0], args[2])), False


def _q5_0_values(builder, context, sig, args):
    """(w, iqs, iqh): Q5_0's values minus 16, in -16..15: signed, the offset inside the integer sum as for Q4_0
    (on a Xeon the same speed as unsigned values with a scalar offset term at one token, 7-10% faster in tiles)."""
    five, _ = _five_bits_values(builder, context, sig, args)
    return builder.sub(five, ir.Constant(_ivec(_I8, 32), [16] * 32)), True


def _nibbles32_values(builder, context, sig, args):  # (w, iw, shift): (byte >> shift) & 15 of 32 bytes (Q4_K)
    return _field(builder, _load_bytes(builder, context, sig.args[0], args[0], args[1], 32), args[2], 15), False


def _q6_values(builder, context, sig, args):
    """(w, iql, ql_shift, iqh, qh_shift): ((ql >> ql_shift) & 15 | ((qh >> qh_shift) & 3) << 4) - 32 (Q6_K)."""
    low = _field(builder, _load_bytes(builder, context, sig.args[0], args[0], args[1], 32), args[2], 15)
    high = _field(builder, _load_bytes(builder, context, sig.args[0], args[0], args[3], 32), args[4], 3)
    q = builder.or_(low, builder.shl(high, ir.Constant(_ivec(_I8, 32), [4] * 32)))
    return builder.sub(q, ir.Constant(_ivec(_I8, 32), [32] * 32)), True


def _q5_values(builder, context, sig, args):
    """(w, iqs, qs_shift, iqh, qh_shift): (qs >> qs_shift) & 15 | ((qh >> qh_shift) & 1) << 4 in 0..31 (Q5_K)."""
    low = _field(builder, _load_bytes(builder, context, sig.args[0], args[0], args[1], 32), args[2], 15)
    high = _field(builder, _load_bytes(builder, context, sig.args[0], args[0], args[3], 32), args[4], 1)
    return builder.or_(low, builder.shl(high, ir.Constant(_ivec(_I8, 32), [4] * 32))), False


def _idot_codegen(values, avx2, vnni):
    def codegen(context, builder, signature, args):
        ws, signed = values(builder, context, signature, args)
        xs = _load_bytes(builder, context, signature.args[-2], args[-2], args[-1], 32)
        return builder.sitofp(_dot(builder, ws, xs, signed, avx2, vnni), _vector(8))

    return codegen


def _idot_args_ok(w, locators, x, ix) -> bool:
    return (_is_byte_c_array(w) and _is_byte_c_array(x) and isinstance(ix, types.Integer)
            and all(isinstance(i, types.Integer) for i in locators))


def _idots(avx2: bool, vnni: bool = False):
    """Integer dots of 32 values: weights located by (w, ...) as each layout says, int8 activations at
    x.flat[ix : ix + 32]; the result is the f32x8 of the eight int32 partial sums of 4 consecutive products (each at
    most 4 * 128 * 127 in magnitude, so exact in float32)."""

    def one_locator(values):
        def typer(typingctx, w, iw, x, ix):
            if _idot_args_ok(w, (iw,), x, ix):
                return f32x8(w, iw, x, ix), _idot_codegen(values, avx2, vnni)

        return intrinsic(typer)

    def two_locators(values):  # (w, iqs, iqh, x, ix): nibbles and fifth bits
        def typer(typingctx, w, iqs, iqh, x, ix):
            if _idot_args_ok(w, (iqs, iqh), x, ix):
                return f32x8(w, iqs, iqh, x, ix), _idot_codegen(values, avx2, vnni)

        return intrinsic(typer)

    # The K-quant layouts below keep vpmaddubsw + vpmaddwd: with vpdpbusd, LLVM ordered Q5_K's float sums differently
    # in the row worker and in the parallel kernel (1-ulp differences between two paths that must agree).
    def nibbles32(typingctx, w, iw, shift, x, ix):
        if _idot_args_ok(w, (iw, shift), x, ix):
            return f32x8(w, iw, shift, x, ix), _idot_codegen(_nibbles32_values, avx2, False)

    def two_planes(values):  # low bits and high bits in two runs of 32 bytes
        def typer(typingctx, w, ilow, low_shift, ihigh, high_shift, x, ix):
            if _idot_args_ok(w, (ilow, low_shift, ihigh, high_shift), x, ix):
                return f32x8(w, ilow, low_shift, ihigh, high_shift, x, ix), _idot_codegen(values, avx2, False)

        return intrinsic(typer)

    return (one_locator(_int8_values), one_locator(_q4_0_values), intrinsic(nibbles32), two_planes(_q6_values),
            two_planes(_q5_values), one_locator(_nibbles16_values), two_locators(_q5_0_values),
            two_locators(_five_bits_values))


# idot_int8(w, iw, x, ix)                          32 int8 at w.flat[iw:]              . x.flat[ix:][:32]
# idot_q4_0(w, iw, x, ix)                          Q4_0's 16 bytes of nibbles at w.flat[iw:], minus 8
# idot_nibbles32(w, iw, shift, x, ix)              (byte >> shift) & 15 of 32 bytes
# idot_q6(w, iql, ql_shift, iqh, qh_shift, x, ix)  Q6_K's 6-bit values, minus 32
# idot_q5(w, iqs, qs_shift, iqh, qh_shift, x, ix)  Q5_K's 5-bit values (a nibble and one high bit), unsigned
# idot_nibbles16(w, iw, x, ix)                     Q4_1's 16 bytes of nibbles, unsigned
# idot_q5_0(w, iqs, iqh, x, ix)                    Q5_0's nibbles and fifth bits (u32 at iqh), minus 16
# idot_five_bits(w, iqs, iqh, x, ix)               Q5_1's nibbles and fifth bits, unsigned
(idot_int8, idot_q4_0, idot_nibbles32, idot_q6, idot_q5, idot_nibbles16, idot_q5_0,
 idot_five_bits) = _idots(AVX2, VNNI)
GENERIC_IDOTS = _idots(False)  # the plain-LLVM versions, which tests compare with the machine's
AVX2_IDOTS = _idots(True) if AVX2 else None  # vpmaddubsw + vpmaddwd, which a VNNI machine's tests check as well


@intrinsic
def vhalves(typingctx, a, b):
    """f32x8 (a, a, a, a, b, b, b, b): per-lane scales for two 16-value sub-blocks of one integer dot."""
    if not (a == types.float32 and b == types.float32):
        return None

    def codegen(context, builder, signature, args):
        vector = ir.Constant(_vector(8), ir.Undefined)
        for lane in range(8):
            vector = builder.insert_element(vector, args[lane // 4], ir.Constant(_I32, lane))
        return vector

    return f32x8(a, b), codegen


@intrinsic
def quantize_block_q8(typingctx, x, ix, q, iq):
    """(d, s_low, s_high): quant.quantize_activations_q8 of the block of 32 float32 activations at x.flat[ix:], its
    integers stored at q.flat[iq:][:32], with its scale and the sums of its first and last 16 integers. The NumPy
    statement's operations, on vectors: max |x| as the largest of the values' bits without their sign bit (the bits
    of non-negative floats order as their values do; a NaN's lie above every number's), d = max / 127 in float32,
    each quotient in float64, |quotient| + 1/2 floored and capped at 127, the sign put back, 0 where d = 0.
    (Element by element in Numba, with a float64 division each, this took ~3x as long: ~2.5 us per 768 values.)"""
    if not (_is_f32_c_array(x) and isinstance(ix, types.Integer) and isinstance(q, types.Array)
            and q.dtype == types.int8 and q.layout == "C" and isinstance(iq, types.Integer)):
        return None

    def call(builder, name, result, arguments, values):
        return builder.call(_x86(builder, name, result, arguments), values)  # (any LLVM intrinsic, not only x86's)

    def codegen(context, builder, signature, args):
        i32x32, f64x32, f32 = _ivec(_I32, 32), ir.VectorType(ir.DoubleType(), 32), ir.FloatType()
        values = builder.load(_lane_pointer(context, builder, signature.args[0], args[0], args[1], 32), align=4)
        bits = builder.and_(builder.bitcast(values, i32x32), ir.Constant(i32x32, [0x7FFFFFFF] * 32))
        largest = call(builder, "llvm.vector.reduce.umax.v32i32", _I32, [i32x32], [bits])
        d = builder.fdiv(builder.bitcast(largest, f32), ir.Constant(f32, 127.0))
        ratio = builder.fdiv(builder.fpext(values, f64x32), _splat(builder, builder.fpext(d, ir.DoubleType()), 32))
        magnitude = call(builder, "llvm.fabs.v32f64", f64x32, [f64x32], [ratio])
        magnitude = call(builder, "llvm.floor.v32f64", f64x32, [f64x32],
                         [builder.fadd(magnitude, ir.Constant(f64x32, [0.5] * 32))])
        magnitude = call(builder, "llvm.minnum.v32f64", f64x32, [f64x32, f64x32],
                         [magnitude, ir.Constant(f64x32, [127.0] * 32)])
        integers = builder.fptosi(magnitude, i32x32)
        negative = builder.fcmp_ordered("<", ratio, ir.Constant(f64x32, [0.0] * 32))
        integers = builder.select(negative, builder.neg(integers), integers)
        zero_scale = builder.fcmp_ordered("==", d, ir.Constant(f32, 0.0))
        integers = builder.select(zero_scale, ir.Constant(i32x32, [0] * 32), integers)
        q_data = context.make_array(signature.args[2])(context, builder, args[2]).data
        pointer = builder.bitcast(builder.gep(q_data, [args[3]]), _ivec(_I8, 32).as_pointer())
        builder.store(builder.trunc(integers, _ivec(_I8, 32)), pointer, align=1)
        halves = [builder.shuffle_vector(integers, integers, ir.Constant(_ivec(_I32, 16), list(range(h, h + 16))))
                  for h in (0, 16)]
        sums = [call(builder, "llvm.vector.reduce.add.v16i32", _I32, [_ivec(_I32, 16)], [half]) for half in halves]
        return context.make_tuple(builder, signature.return_type, [d, *sums])

    return types.Tuple((types.float32, types.int32, types.int32))(x, ix, q, iq), codegen


@njit(cache=True)
def quantize_activations_q8_into(x, T, q, d, s, s16):
    """quant.quantize_activations_q8 of x[:T], into q [>=T, K] int8, d [>=T, K / 32] float32, s [>=T, K / 32]
    float32 (the integer sums, exact in float32), and s16 [>=T, K / 16] int32, the sums of each half block (what
    the interleaved kernels start their dots from). Same float64 quotient and rounding, so the same integers."""
    K = q.shape[1]
    for t in range(T):
        for b in range(K // 32):
            scale, low, high = quantize_block_q8(x, t * x.shape[1] + 32 * b, q, t * K + 32 * b)
            d[t, b], s16[t, 2 * b], s16[t, 2 * b + 1], s[t, b] = scale, low, high, low + high


@njit(cache=True, error_model="numpy")  # x / 0 is a float, not an exception (an all-zero block's, overwritten)
def two_part_activations_into(x, T, q, d, v, d_v, s_v, s16_v):
    """quant.quantize_activations_two_part of x[:T], given its first part (q, d from quantize_activations_q8_into):
    v [>=T, 2K] int8 each token's q then its second part q' = round((x - d q) / (d / 128)) (float64, halves away
    from zero), d_v = d / 128 the scale of the 15-bit 128 q + q', s_v and s16_v that sum's over 32 and 16 values
    (float32 and int32, exact) for the types' offsets."""
    K = q.shape[1]
    second = np.empty(32, np.float64)
    for t in range(T):
        for b in range(K // 32):
            d_v[t, b] = d[t, b] / np.float32(128)  # exact: a power of two
            step, scale = np.float64(d_v[t, b]), np.float64(d[t, b])
            for j in range(32):  # branch-free: a vector loop
                r = (np.float64(x[t, 32 * b + j]) - scale * np.float64(q[t, 32 * b + j])) / step
                second[j] = np.copysign(np.floor(np.abs(r) + 0.5), r)
            if step == 0:  # an all-zero block: x = 0 everywhere
                second[:] = 0
            for h in range(2):
                total = np.int32(0)
                for j in range(16 * h, 16 * h + 16):
                    k = 32 * b + j
                    v[t, k], v[t, K + k] = q[t, k], np.int8(second[j])
                    total += 128 * np.int32(q[t, k]) + np.int32(second[j])
                s16_v[t, 2 * b + h] = total
            s_v[t, b] = s16_v[t, 2 * b] + s16_v[t, 2 * b + 1]


@njit(parallel=True, cache=True)
def two_part_activations_parallel(x, T, q, d, v, d_v, s_v, s16_v, threads):
    """two_part_activations_into with the T tokens split into `threads` ranges run in parallel."""
    for c in prange(threads):
        t0, t1 = c * T // threads, (c + 1) * T // threads
        two_part_activations_into(x[t0:t1], t1 - t0, q[t0:t1], d[t0:t1], v[t0:t1], d_v[t0:t1], s_v[t0:t1],
                                  s16_v[t0:t1])


@njit(parallel=True, cache=True)
def quantize_activations_q8_parallel(x, T, q, d, s, s16, threads):
    """quantize_activations_q8_into with the T tokens split into `threads` ranges run in parallel (tokens are
    independent: the same integers)."""
    for c in prange(threads):
        t0, t1 = c * T // threads, (c + 1) * T // threads
        quantize_activations_q8_into(x[t0:t1], t1 - t0, q[t0:t1], d[t0:t1], s[t0:t1], s16[t0:t1])


# For each type: _acc_int8_<type>(acc, w, n, b, q, d, s, t) adds weight block b of row n times token t's int8
# activations (q, d, s: quantize_activations_q8_into's arrays; a weight block of 256 meets 8 activation blocks) to the
# f32x8 `acc`, and returns it with a scalar part (an offset's term).

@njit(fastmath=REASSOC, inline="always")
def _acc_int8_q8_0(acc, w, n, b, q, d, s, t):
    """Q8_0: acc += (d_w d_x) (q_w . q_x)."""
    at = n * w.shape[1] + 34 * b
    return vfma(acc, load_half(w, at) * d[t, b], idot_int8(w, at + 2, q, t * q.shape[1] + 32 * b)), np.float32(0)


@njit(fastmath=REASSOC, inline="always")
def _acc_int8_q4_0(acc, w, n, b, q, d, s, t):
    """Q4_0: acc += (d_w d_x) ((u - 8) . q_x), u the nibbles."""
    at = n * w.shape[1] + 18 * b
    return vfma(acc, load_half(w, at) * d[t, b], idot_q4_0(w, at + 2, q, t * q.shape[1] + 32 * b)), np.float32(0)


@njit(fastmath=REASSOC, inline="always")
def _acc_int8_q4_1(acc, w, n, b, q, d, s, t):
    """Q4_1 (W = d_w u + m): acc += (d_w d_x) (u . q_x), and (m d_x) s_x as the scalar part."""
    at = n * w.shape[1] + 20 * b
    return (vfma(acc, load_half(w, at) * d[t, b], idot_nibbles16(w, at + 4, q, t * q.shape[1] + 32 * b)),
            load_half(w, at + 2) * d[t, b] * s[t, b])


@njit(fastmath=REASSOC, inline="always")
def _acc_int8_q5_0(acc, w, n, b, q, d, s, t):
    """Q5_0: acc += (d_w d_x) ((u - 16) . q_x), u the nibble and fifth bit."""
    at = n * w.shape[1] + 22 * b
    lanes = idot_q5_0(w, at + 6, at + 2, q, t * q.shape[1] + 32 * b)
    return vfma(acc, load_half(w, at) * d[t, b], lanes), np.float32(0)


@njit(fastmath=REASSOC, inline="always")
def _acc_int8_q5_1(acc, w, n, b, q, d, s, t):
    """Q5_1 (W = d_w u + m): acc += (d_w d_x) (u . q_x), and (m d_x) s_x as the scalar part."""
    at = n * w.shape[1] + 24 * b
    return (vfma(acc, load_half(w, at) * d[t, b], idot_five_bits(w, at + 8, at + 4, q, t * q.shape[1] + 32 * b)),
            load_half(w, at + 2) * d[t, b] * s[t, b])


@njit(fastmath=REASSOC, inline="always")
def _acc_int8_q4_k(acc, w, n, b, q, d, s, t):
    """Q4_K: each sub-block i of 32 is activation block j = 8 b + i: acc += (d sc_i d_x) (u . q_x), and
    -(dmin mn_i d_x) s_x as the scalar part (run r of 32 bytes: sub-block 2r in the low nibbles, 2r + 1 high)."""
    base = 144 * b
    at = n * w.shape[1] + base
    d_w, dmin = load_half(w, at), load_half(w, at + 2)
    offset = np.float32(0)
    high = vzero()  # the high-nibble sub-blocks' own sum: two chains of multiply-adds, not one of eight
    for r in range(4):
        sc0, mn0 = _scale_min_q4_k(w, n, base + 4, 2 * r)
        sc1, mn1 = _scale_min_q4_k(w, n, base + 4, 2 * r + 1)
        j = 8 * b + 2 * r
        x0, x1 = t * q.shape[1] + 32 * j, t * q.shape[1] + 32 * (j + 1)
        acc = vfma(acc, d_w * np.float32(sc0) * d[t, j], idot_nibbles32(w, at + 16 + 32 * r, 0, q, x0))
        high = vfma(high, d_w * np.float32(sc1) * d[t, j + 1], idot_nibbles32(w, at + 16 + 32 * r, 4, q, x1))
        offset -= dmin * (np.float32(mn0) * d[t, j] * s[t, j] + np.float32(mn1) * d[t, j + 1] * s[t, j + 1])
    return vadd(acc, high), offset


@njit(fastmath=REASSOC, inline="always")
def _acc_int8_q5_k(acc, w, n, b, q, d, s, t):
    """Q5_K: Q4_K's sub-blocks with a fifth bit: value j of sub-block i is the nibble of qs byte 32 (i // 2) + j
    (low for even i, high for odd) plus bit i of qh byte j times 16; acc += (d sc_i d_x) (u . q_x) and
    -(dmin mn_i d_x) s_x as the scalar part (activation block 8 b + i)."""
    base = 176 * b
    at = n * w.shape[1] + base
    d_w, dmin = load_half(w, at), load_half(w, at + 2)
    offset = np.float32(0)
    high = vzero()  # the odd sub-blocks' own sum: two chains of multiply-adds
    for r in range(4):
        sc0, mn0 = _scale_min_q4_k(w, n, base + 4, 2 * r)
        sc1, mn1 = _scale_min_q4_k(w, n, base + 4, 2 * r + 1)
        j = 8 * b + 2 * r
        x0, x1 = t * q.shape[1] + 32 * j, t * q.shape[1] + 32 * (j + 1)
        acc = vfma(acc, d_w * np.float32(sc0) * d[t, j], idot_q5(w, at + 48 + 32 * r, 0, at + 16, 2 * r, q, x0))
        high = vfma(high, d_w * np.float32(sc1) * d[t, j + 1],
                    idot_q5(w, at + 48 + 32 * r, 4, at + 16, 2 * r + 1, q, x1))
        offset -= dmin * (np.float32(mn0) * d[t, j] * s[t, j] + np.float32(mn1) * d[t, j + 1] * s[t, j + 1])
    return vadd(acc, high), offset


@njit(fastmath=REASSOC, inline="always")
def _acc_int8_q6_k(acc, w, n, b, q, d, s, t):
    """Q6_K: the 32 values of group g of half h (activation block j = 8 b + 4 h + g) as signed q - 32 in one
    integer dot; its lanes 0-3 hold sub-block 8h + 2g, lanes 4-7 sub-block 8h + 2g + 1, each scaled by (d sc d_x)."""
    at = n * w.shape[1] + 210 * b
    odd = vzero()  # odd groups' own sum: two chains of multiply-adds, not one of eight
    for h in range(2):
        for g in range(0, 4, 2):
            scales, lanes = _q6_k_group(w, n, b, q, d, t, at, h, g)
            acc = vfmav(acc, scales, lanes)
            scales, lanes = _q6_k_group(w, n, b, q, d, t, at, h, g + 1)
            odd = vfmav(odd, scales, lanes)
    return vadd(acc, odd), np.float32(0)


@njit(fastmath=REASSOC, inline="always")
def _q6_k_group(w, n, b, q, d, t, at, h, g):
    """(scales, lanes) of _acc_int8_q6_k's group g of half h: lanes = the integer dot of its 32 values with
    activation block j = 8 b + 4 h + g; scales = (d sc d_x) of its two sub-blocks, four lanes each."""
    j = 8 * b + 4 * h + g
    sub = 210 * b + 192 + 8 * h + 2 * g
    d_w = load_half(w, at + 208)
    scales = vhalves(d_w * np.float32(_int8(w[n, sub])) * d[t, j], d_w * np.float32(_int8(w[n, sub + 1])) * d[t, j])
    lanes = idot_q6(w, at + 64 * h + 32 * (g & 1), 4 * (g >> 1), at + 128 + 32 * h, 2 * g, q, t * q.shape[1] + 32 * j)
    return scales, lanes


def _int8_kernels(acc_block, block_size: int):
    """The product workers of one weight type on int8 activations, from its block accumulator."""

    @njit(fastmath=REASSOC, inline="always")
    def one_row(w, n, q, d, s, t, out, col):
        """out[t, col + n] for one token."""
        acc, offset = vzero(), np.float32(0)
        for b in range(q.shape[1] // block_size):
            acc, part = acc_block(acc, w, n, b, q, d, s, t)
            offset += part
        out[t, col + n] = vsum(acc) + offset

    @njit(fastmath=REASSOC, inline="always")
    def four_tokens(w, n, q, d, s, t, out, col):
        """out[t + i, col + n], i < 4: each weight block is loaded and unpacked once for the four tokens (the four
        inlined block accumulators read the same weight bytes, which the compiler loads once) and four independent
        sums run side by side."""
        acc0, acc1, acc2, acc3 = vzero(), vzero(), vzero(), vzero()
        offset0, offset1, offset2, offset3 = np.float32(0), np.float32(0), np.float32(0), np.float32(0)
        for b in range(q.shape[1] // block_size):
            acc0, part0 = acc_block(acc0, w, n, b, q, d, s, t)
            acc1, part1 = acc_block(acc1, w, n, b, q, d, s, t + 1)
            acc2, part2 = acc_block(acc2, w, n, b, q, d, s, t + 2)
            acc3, part3 = acc_block(acc3, w, n, b, q, d, s, t + 3)
            offset0 += part0
            offset1 += part1
            offset2 += part2
            offset3 += part3
        out[t, col + n] = vsum(acc0) + offset0
        out[t + 1, col + n] = vsum(acc1) + offset1
        out[t + 2, col + n] = vsum(acc2) + offset2
        out[t + 3, col + n] = vsum(acc3) + offset3

    @njit(fastmath=REASSOC, cache=True)
    def rows_into(w, q, d, s, T, out, col, n0, n1):
        """out[t, col + n] for t < T, n0 <= n < n1 from token t's quantized activations (q, d, s): one thread's
        share, each weight row read from memory once for every token (it stays in the L1 cache while the tokens
        pass, four at a time)."""
        for n in range(n0, n1):
            t = 0
            while t + 4 <= T:
                four_tokens(w, n, q, d, s, t, out, col)
                t += 4
            while t < T:
                one_row(w, n, q, d, s, t, out, col)
                t += 1

    @njit(parallel=True, fastmath=REASSOC, cache=True)
    def matmul_into(x, w, out, T, threads):
        """out[:T, :N] = x[:T] W^T with x quantized to 8-bit blocks.  # [>=T, K], [N, row bytes] -> [>=T, >=N]"""
        N, K = w.shape[0], x.shape[1]
        q = np.empty((T, K), np.int8)
        d = np.empty((T, K // 32), np.float32)
        s = np.empty((T, K // 32), np.float32)
        quantize_activations_q8_into(x, T, q, d, s, np.empty((T, K // 16), np.int32))
        chunks = max(1, min(N, threads))
        for c in prange(chunks):
            rows_into(w, q, d, s, T, out, np.int64(0), c * N // chunks, (c + 1) * N // chunks)

    return rows_into, matmul_into


# ================================================================================================================
# Interleaved rows (quant.interleave_rows): Q8_0 and Q4_0 matrices as the Numba model holds them, eight rows per group.
#
#     w8 [N / 8, 8 x row bytes] uint8; block b of group g: 8 float16 scales, then words of 32 bytes whose lane r
#     (bytes 4r .. 4r + 3) holds four values of row 8g + r
#
# In the one-row kernels above, every 32 values of a row cost an unpacking, a dot, a conversion, a scale and a
# multiply-add, and the eight lanes of the dot hold parts of ONE sum. Here word k's dot with the four activations
# 4k .. 4k + 3 broadcast to every lane advances eight rows at once, lane r for row r: eight such dots sum a block
# for eight rows, and one conversion and one multiply-add by the eight rows' scales finish it. About a third of the
# instructions per block (scripts/bench/bench_tiles.py, docs/quant.md).
#
#     Q8_0:  out[t, 8g + r] = sum_b  d_r d_x (sum_k lane r of (word k . x[4k .. 4k+3]) - 128 s_x)
#     Q4_0:  out[t, 8g + r] = sum_b  d_r d_x (sum_k lane r of (nibbles of word k . x[4k .. 4k+3]) - 8 s_x)
#
# vpdpbusd and vpmaddubsw multiply unsigned bytes by signed ones, so the stored values are unsigned: Q4_0's nibbles
# u, and Q8_0's q + 128 (interleave_rows flips each value's sign bit). Each dot starts from -8 s_x or -128 s_x, s_x
# the activation block's sum of q_x, which turns it into the dot of u - 8 or q in the same exact integer. (Without
# VNNI, Q8_0's bytes go back to q and take the sign trick: vpmaddubsw's pairs of 255 x 127 would saturate.)


def _target_has_vnni512() -> bool:
    """Whether the machine Numba compiles for has a 512-bit vpdpbusd (AVX512-VNNI with AVX512-BW)."""
    if os.environ.get("NUMBA_CPU_NAME") or os.environ.get("NUMBA_CPU_FEATURES"):
        return {"+avx512vnni", "+avx512bw"} <= set(os.environ.get("NUMBA_CPU_FEATURES", "").split(","))
    host = llvmlite.binding.get_host_cpu_features()
    return bool(host.get("avx512vnni", False) and host.get("avx512bw", False))


def _target_has_gfni() -> bool:
    """Whether the machine Numba compiles for has GFNI's affine byte transform (VEX- or EVEX-encoded)."""
    if os.environ.get("NUMBA_CPU_NAME") or os.environ.get("NUMBA_CPU_FEATURES"):
        return "+gfni" in os.environ.get("NUMBA_CPU_FEATURES", "").split(",")
    return bool(llvmlite.binding.get_host_cpu_features().get("gfni", False))


# PAIRED: the kernels walk two groups at a time as one 16-lane register (rows 8g .. 8g + 15), where the machine
# has a 512-bit vpdpbusd. It runs two per cycle here, as the 256-bit one does, so a pair costs the instructions of
# one group: ~1.7x the multiply-adds per second at 128 tokens (docs/quant.md). Elsewhere groups go one at a time.
PAIRED = VNNI and _target_has_vnni512()
GFNI = AVX2 and _target_has_gfni()  # Q5_K's fifth bit and Q6_K's top two in one instruction (_high_bits)
Q8_0_BIAS = 0 if AVX2 and not VNNI else 128  # a group's Q8_0 bytes go back to q on AVX2 without VNNI: no bias
ROWS_AT_ONCE = 16 if PAIRED else 8  # the rows an interleaved kernel walks together: a thread's range is a multiple
CHAINS = 2  # independent integer sums per dot, so that vpdpbusd's 5-cycle latency is not a chain of eight


def _at(builder, base, stride, group: int, delta: int):
    """base + group * stride + delta, as an i64 (the byte index of a field of group `group` of a pair)."""
    i64 = ir.IntType(64)
    base = builder.sext(base, i64) if base.type.width < 64 else base
    if group:
        base = builder.add(base, builder.sext(stride, i64) if stride.type.width < 64 else stride)
    return builder.add(base, ir.Constant(i64, delta))


def _group_bytes(builder, context, array_type, w, iw, stride, groups: int, delta: int, count: int = 32):
    """<groups * count x i8>: the count bytes at w.flat[iw + j stride + delta:] of each group j < groups, side by
    side (one group's word, or a pair's as one 512-bit word)."""
    parts = [_load_bytes(builder, context, array_type, w, _at(builder, iw, stride, j, delta), count)
             for j in range(groups)]
    if groups == 1:
        return parts[0]
    return builder.shuffle_vector(parts[0], parts[1], ir.Constant(_ivec(_I32, 2 * count), list(range(2 * count))))


def _offset(builder, value, add):
    return builder.add(value, ir.Constant(value.type, add))


def _splat(builder, value, lanes: int):
    """<lanes x T> of a value of type T."""
    vector = ir.VectorType(value.type, lanes)
    lane = builder.insert_element(ir.Constant(vector, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(lane, ir.Constant(vector, ir.Undefined), ir.Constant(_ivec(_I32, lanes), [0] * lanes))


def _splat32(builder, value, lanes: int):
    """<lanes x i32> of an i32 value."""
    return _splat(builder, value, lanes)


def _broadcast4(builder, context, array_type, array, index, lanes: int):
    """<4 lanes x i8>: the four bytes at array.flat[index:] repeated in each of the 32-bit lanes."""
    word = builder.bitcast(_load_bytes(builder, context, array_type, array, index, 4), _I32)
    return builder.bitcast(_splat32(builder, word, lanes), _ivec(_I8, 4 * lanes))


def _dot_lanes(builder, acc, w, x, w_signed: bool, avx2: bool, vnni: bool):
    """acc + (lane i: the sum of w[4i + k] x[4i + k], k < 4), for 8 or 16 lanes: one vpdpbusd where the machine
    has it and w is unsigned, vpmaddubsw + vpmaddwd on AVX2, plain LLVM integer vectors otherwise."""
    lanes = acc.type.count
    if not avx2:
        return builder.add(acc, _dot_generic(builder, w, x, w_signed))
    if vnni and not w_signed:
        vector = _ivec(_I32, lanes)
        function = _x86(builder, f"llvm.x86.avx512.vpdpbusd.{32 * lanes}", vector, [vector] * 3)
        return builder.call(function, [acc, builder.bitcast(w, vector), builder.bitcast(x, vector)])
    return builder.add(acc, _dot(builder, w, x, w_signed, avx2, vnni))  # 8 lanes: no 16-lane code without VNNI


def _run_length(most: int) -> int:
    """How many words' vpmaddubsw outputs may be added in int16 before one vpmaddwd widens them: a pair's sum is at
    most 2 * most * 127 (unsigned values <= most, |x| <= 127), and the run's sum must stay within 32767."""
    return max(1, min(8, 32767 // (2 * most * 127)))


def _runs_of_pairs(builder, words, xs, most: int):
    """<8 x i32> partial dots on AVX2 without VNNI, a run of words at a time: vpmaddubsw per word, the int16 pairs
    of a run added (exact: _run_length), one vpmaddwd per run. vpmaddubsw and vpmaddwd both take the multiply
    ports; a widening per word (Q4's nibbles: 8 words, 8 vpmaddwd -> 1) left those ports half the work."""
    pmaddubsw = _x86(builder, "llvm.x86.avx2.pmadd.ub.sw", _ivec(_I16, 16), [_ivec(_I8, 32)] * 2)
    pmaddwd = _x86(builder, "llvm.x86.avx2.pmadd.wd", _ivec(_I32, 8), [_ivec(_I16, 16)] * 2)
    ones, length, dots = ir.Constant(_ivec(_I16, 16), [1] * 16), _run_length(most), []
    for k0 in range(0, len(words), length):
        parts = [builder.call(pmaddubsw, [word, x]) for word, x in zip(words[k0:k0 + length], xs[k0:k0 + length])]
        while len(parts) > 1:  # a balanced tree: 3 adds deep for 8 words, not 7 (a one-token walk waits on it)
            parts = [builder.add(a, b) for a, b in zip(parts[::2], parts[1::2])] + parts[len(parts) // 2 * 2:]
        dots.append(builder.call(pmaddwd, [parts[0], ones]))
    return dots


def _chained_dots(builder, start, words, xs, w_signed: bool, avx2: bool, vnni: bool, most: int = 255):
    """start + the dots of words[k] with xs[k], in CHAINS independent sums added at the end (the same integer).
    most: the largest unsigned value in the words (on AVX2 without VNNI the products are summed in int16 runs)."""
    zero = ir.Constant(start.type, [0] * start.type.count)
    chains = [start] + [zero] * (CHAINS - 1)
    if avx2 and not vnni and not w_signed and start.type.count == 8:
        for k, dot in enumerate(_runs_of_pairs(builder, words, xs, most)):
            chains[k % CHAINS] = builder.add(chains[k % CHAINS], dot)
    else:
        for k, (word, x) in enumerate(zip(words, xs)):
            chains[k % CHAINS] = _dot_lanes(builder, chains[k % CHAINS], word, x, w_signed, avx2, vnni)
    total = chains[0]
    for chain in chains[1:]:
        total = builder.add(total, chain)
    return total


def _interleaved_idot(qtype, groups: int, avx2: bool, vnni: bool):
    """idot(w, iw, stride, x, ix, start) -> f32x8 (f32x16 for a pair): lane r = start + the exact integer dot of
    row r's 32 unsigned values (Q8_0's stored bytes, q + 128; "Q4_0": the nibbles, Q4_0's and Q4_1's; "Q5_0": the
    nibbles and their fifth bits from the word before them, Q5_0's and Q5_1's) in the interleaved block at
    w.flat[iw:] (after its scales; a pair's second group at iw + stride) with the int8 activations
    x.flat[ix : ix + 32]. A start of -bias times the activations' sum makes it the dot of the values minus bias."""
    flip_back = qtype == "Q8_0" and avx2 and not vnni  # vpmaddubsw would saturate on 255 x 127: the sign trick
    most = {"Q8_0": 255, "Q4_0": 15, "Q5_0": 31}[qtype]  # the largest unsigned value of a word
    width = 32 * groups
    gfni = avx2 and GFNI  # avx2 is only set for a pair where the machine has AVX-512 (X16_IDOTS)

    def words(builder, context, array_type, w, iw, stride):
        """Word k of the block (four unsigned values of each row meeting x[4k .. 4k+3]), k < 8."""
        if qtype == "Q8_0":
            return [_group_bytes(builder, context, array_type, w, iw, stride, groups, 32 * k) for k in range(8)]
        at = 32 if qtype == "Q5_0" else 0
        packed = [_group_bytes(builder, context, array_type, w, iw, stride, groups, at + 32 * m) for m in range(4)]
        nibbles = [_field_const(builder, p, 0, 15) for p in packed] + [_field_const(builder, p, 4, 15) for p in packed]
        if qtype == "Q4_0":
            return nibbles
        qh = _group_bytes(builder, context, array_type, w, iw, stride, groups, 0)  # byte i, bit k: value 4k + i's
        return [builder.or_(word, _high_bits(builder, qh, ir.Constant(_I32, k), 1, gfni))
                for k, word in enumerate(nibbles)]

    def typer(typingctx, w, iw, stride, x, ix, start):
        if not (_idot_args_ok(w, (iw, stride), x, ix) and start in (types.int32, types.int64)):
            return None

        def codegen(context, builder, signature, args):
            ws = words(builder, context, signature.args[0], args[0], args[1], args[2])
            if flip_back:  # q itself, signed
                ws = [builder.xor(u, ir.Constant(_ivec(_I8, width), [128] * width)) for u in ws]
            start = builder.trunc(args[5], _I32) if args[5].type.width > 32 else args[5]
            xs = [_broadcast4(builder, context, signature.args[3], args[3], _offset(builder, args[4], 4 * k),
                              8 * groups) for k in range(8)]
            acc = _chained_dots(builder, _splat32(builder, start, 8 * groups), ws, xs, flip_back, avx2, vnni, most)
            return builder.sitofp(acc, _vector(8 * groups))

        return _F32XN[groups](w, iw, stride, x, ix, start), codegen

    return intrinsic(typer)


def _field_const(builder, bytes_, shift: int, mask: int):
    """(bytes >> shift) & mask per byte, shift a constant."""
    count = bytes_.type.count
    if shift:
        bytes_ = builder.lshr(bytes_, ir.Constant(_ivec(_I8, count), [shift] * count))
    return builder.and_(bytes_, ir.Constant(_ivec(_I8, count), [mask] * count))


def _high_bits(builder, qh, shift, count: int, gfni: bool, to: int = 4):
    """((qh >> shift) & (2^count - 1)) << to per byte, shift a run-time integer (Q5_K's fifth bit: count 1; Q6_K's
    top two: count 2; Q3_K's third bit: count 1, to 2): one GFNI affine byte op where the machine has it, else a
    shift, a mask and a shift. GFNI's output bit j of a byte is the parity of (byte 7 - j of the qword matrix) AND
    the input byte, so the matrix that takes input bit shift + c to output bit to + c holds 1 << (shift + c) in
    byte 7 - to - c of each qword."""
    lanes = qh.type.count
    if not gfni:
        return builder.shl(_field(builder, qh, shift, 2 ** count - 1), ir.Constant(_ivec(_I8, lanes), [to] * lanes))
    i64 = ir.IntType(64)
    shift = builder.sext(shift, i64) if shift.type.width < 64 else shift
    row = ir.Constant(i64, 0)
    for c in range(count):
        bit = builder.shl(ir.Constant(i64, 1), builder.add(shift, ir.Constant(i64, c + 8 * (7 - to - c))))
        row = builder.or_(row, bit)
    matrix = builder.bitcast(_splat(builder, row, lanes // 8), _ivec(_I8, lanes))
    function = _x86(builder, f"llvm.x86.vgf2p8affineqb.{8 * lanes}", _ivec(_I8, lanes),
                    [_ivec(_I8, lanes), _ivec(_I8, lanes), _I8])
    return builder.call(function, [qh, matrix, ir.Constant(_I8, 0)])


def _interleaved_nibble_idot(groups: int, avx2: bool, vnni: bool, fifth: bool = False):
    """idot(w, iw, stride, shift, x, ix) -> f32x8 (f32x16 for a pair): lane r = the exact integer dot of
    (byte >> shift) & 15 of row r's bytes in the eight words at w.flat[iw:] (a Q4_K run: shift 0 its even
    sub-block, 4 its odd one) with x.flat[ix : ix + 32]. With `fifth`, idot(w, iw, stride, shift, iqh, qh_shift, x,
    ix): each value also takes ((qh >> qh_shift) & 1) << 4 from the words at w.flat[iqh:] (Q5_K's fifth bits of
    sub-block qh_shift; _high_bits)."""

    gfni = avx2 and GFNI  # avx2 is only set for a pair where the machine has AVX-512 (X16_IDOTS)

    def codegen(context, builder, signature, args):
        w_type, w, iw, stride, shift = signature.args[0], *args[:4]
        ws = [_field(builder, _group_bytes(builder, context, w_type, w, iw, stride, groups, 32 * k), shift, 15)
              for k in range(8)]
        if fifth:
            qhs = [_group_bytes(builder, context, w_type, w, args[4], stride, groups, 32 * k) for k in range(8)]
            ws = [builder.or_(word, _high_bits(builder, qh, args[5], 1, gfni)) for word, qh in zip(ws, qhs)]
        x_type, x, ix = signature.args[-2], args[-2], args[-1]
        xs = [_broadcast4(builder, context, x_type, x, _offset(builder, ix, 4 * k), 8 * groups) for k in range(8)]
        zero = ir.Constant(_ivec(_I32, 8 * groups), [0] * 8 * groups)
        dots = _chained_dots(builder, zero, ws, xs, False, avx2, vnni, 31 if fifth else 15)
        return builder.sitofp(dots, _vector(8 * groups))

    if fifth:
        def typer(typingctx, w, iw, stride, shift, iqh, qh_shift, x, ix):
            if _idot_args_ok(w, (iw, stride, shift, iqh, qh_shift), x, ix):
                return _F32XN[groups](w, iw, stride, shift, iqh, qh_shift, x, ix), codegen
    else:
        def typer(typingctx, w, iw, stride, shift, x, ix):
            if _idot_args_ok(w, (iw, stride, shift), x, ix):
                return _F32XN[groups](w, iw, stride, shift, x, ix), codegen

    return intrinsic(typer)


def _interleaved_split_idot(groups: int, avx2: bool, vnni: bool, part: int, bits: int = 4, high_bits: int = 2,
                            two_part: bool = False):
    """idot(w, iql, ql_shift, iqh, qh_shift, stride, x, ix, start) -> f32x8 (f32x16 for a pair): lane r = start +
    the exact integer dot of row r's 16 values 16 part .. 16 part + 15 of one group of 32, q = (ql >> ql_shift) &
    (2^bits - 1) | ((qh >> qh_shift) & (2^high_bits - 1)) << bits from the ql and qh runs at w.flat[iql:] and
    w.flat[iqh:] (8 words each; no qh where high_bits = 0), with x.flat[ix + 16 part:][:16]. Q6_K: bits 4, high
    bits 2 (and a start of -32 times the activations' sum: the dot of q - 32).
    two_part (Q3_K: 2 and 1, a start of -4 times the sum; Q2_K: 2 and 0): idot(w, iql, ql_shift, iqh, qh_shift,
    stride, x, ix, ix2, start), the activations in two 8-bit parts (quant.quantize_activations_two_part), the dot
    with the 15-bit v = 128 x.flat[ix:] + x.flat[ix2:] taken as 128 times the first part's plus the second's: the
    words are unpacked once for both."""

    def codegen(context, builder, signature, args):
        w_type, w, iql, ql_shift, iqh, qh_shift, stride = signature.args[0], *args[:6]
        ws = []
        for k in range(4 * part, 4 * part + 4):
            low = _field(builder, _group_bytes(builder, context, w_type, w, iql, stride, groups, 32 * k),
                         ql_shift, 2 ** bits - 1)
            if high_bits:
                high = _high_bits(builder, _group_bytes(builder, context, w_type, w, iqh, stride, groups, 32 * k),
                                  qh_shift, high_bits, avx2 and GFNI, to=bits)
                low = builder.or_(low, high)
            ws.append(low)
        x_type, x, starts = signature.args[6], args[6], args[7:-1]

        def dots(ix, start):
            xs = [_broadcast4(builder, context, x_type, x, _offset(builder, ix, 4 * k), 8 * groups)
                  for k in range(4 * part, 4 * part + 4)]
            return _chained_dots(builder, start, ws, xs, False, avx2, vnni, 2 ** (bits + high_bits) - 1)

        start = _splat32(builder, builder.trunc(args[-1], _I32) if args[-1].type.width > 32 else args[-1], 8 * groups)
        if not two_part:
            return builder.sitofp(dots(starts[0], start), _vector(8 * groups))
        zero = ir.Constant(start.type, [0] * 8 * groups)
        first = builder.shl(dots(starts[0], zero), ir.Constant(start.type, [7] * 8 * groups))
        return builder.sitofp(builder.add(first, dots(starts[1], start)), _vector(8 * groups))

    if two_part:
        def typer(typingctx, w, iql, ql_shift, iqh, qh_shift, stride, x, ix, ix2, start):
            if (_idot_args_ok(w, (iql, ql_shift, iqh, qh_shift, stride, ix), x, ix2)
                    and start in (types.int32, types.int64)):
                return _F32XN[groups](w, iql, ql_shift, iqh, qh_shift, stride, x, ix, ix2, start), codegen
    else:
        def typer(typingctx, w, iql, ql_shift, iqh, qh_shift, stride, x, ix, start):
            if _idot_args_ok(w, (iql, ql_shift, iqh, qh_shift, stride), x, ix) and start in (types.int32, types.int64):
                return _F32XN[groups](w, iql, ql_shift, iqh, qh_shift, stride, x, ix, start), codegen

    return intrinsic(typer)


_F32XN = {1: f32x8, 2: f32x16}  # the float vector of one group or a pair


def _scales(kind: str, groups: int):
    """load(w, i, stride) -> f32x8 (f32x16 for a pair) of eight rows' scales at bytes w.flat[i:] (and a pair's
    second group's at i + stride): "halves" eight float16, "bytes" eight unsigned bytes (Q4_K's 6-bit scales and
    mins), "int8s" eight signed ones (Q6_K's and Q3_K's scales), "low_nibbles" / "high_nibbles" the low or high
    nibbles of eight bytes (Q2_K's scales and mins)."""

    def typer(typingctx, array, index, stride):
        if not (_is_byte_c_array(array) and isinstance(index, types.Integer) and isinstance(stride, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            count = 16 if kind == "halves" else 8
            raw = _group_bytes(builder, context, signature.args[0], args[0], args[1], args[2], groups, 0, count)
            if kind == "halves":
                return builder.fpext(builder.bitcast(raw, ir.VectorType(ir.HalfType(), 8 * groups)),
                                     _vector(8 * groups))
            if kind.endswith("nibbles"):
                raw = _field_const(builder, raw, 4 if kind == "high_nibbles" else 0, 15)
            return (builder.sitofp if kind == "int8s" else builder.uitofp)(raw, _vector(8 * groups))

        return _F32XN[groups](array, index, stride), codegen

    return intrinsic(typer)


def _x8_idots(groups: int, avx2: bool, vnni: bool):
    """(idot_q8_0, idot_q4_0, idot_q4_k, idot_q6_k_low, idot_q6_k_high, idot_q5_k, idot_q5_0, idot_q3_k_low,
    idot_q3_k_high, idot_q2_k_low, idot_q2_k_high) for one group or a pair."""
    return (*(_interleaved_idot(t, groups, avx2, vnni) for t in ("Q8_0", "Q4_0")),
            _interleaved_nibble_idot(groups, avx2, vnni), _interleaved_split_idot(groups, avx2, vnni, 0),
            _interleaved_split_idot(groups, avx2, vnni, 1), _interleaved_nibble_idot(groups, avx2, vnni, fifth=True),
            _interleaved_idot("Q5_0", groups, avx2, vnni),
            *(_interleaved_split_idot(groups, avx2, vnni, part, 2, 1, two_part=True) for part in (0, 1)),
            *(_interleaved_split_idot(groups, avx2, vnni, part, 2, 0, two_part=True) for part in (0, 1)))


# X8_IDOTS: the machine's dots of one group (idot_q8_0(w, iw, stride, x, ix, start), idot_q4_0(...), idot_q4_k(w,
# iw, stride, shift, x, ix): a Q4_K run's nibbles, idot_q6_k_low / _high(w, iql, ql_shift, iqh, qh_shift, stride,
# x, ix, start): the first or last 16 of a Q6_K group's 32 values, idot_q5_k(...), idot_q5_0(w, iw, stride, x, ix,
# start): Q5_0's and Q5_1's 5-bit values, idot_q3_k_low / _high and idot_q2_k_low / _high as Q6_K's, on 3 and 2
# bits); X16_IDOTS: of a pair, on a 512-bit vpdpbusd
# where the machine has one (PAIRED), else in plain LLVM. Tests get the same in plain LLVM and on AVX2.
X8_IDOTS = _x8_idots(1, AVX2, VNNI)
X16_IDOTS = _x8_idots(2, PAIRED, PAIRED)
GENERIC_X8_IDOTS, GENERIC_X16_IDOTS = _x8_idots(1, False, False), _x8_idots(2, False, False)
AVX2_X8_IDOTS = _x8_idots(1, True, False) if AVX2 else None
_SCALE_KINDS = ("halves", "bytes", "int8s", "low_nibbles", "high_nibbles")
load_halves8, load_bytes8, load_int8s8, load_low_nibbles8, load_high_nibbles8 = (_scales(k, 1) for k in _SCALE_KINDS)
load_halves16, load_bytes16, load_int8s16, load_low_nibbles16, load_high_nibbles16 = (_scales(k, 2)
                                                                                      for k in _SCALE_KINDS)


def _block_accumulators(groups: int):
    """tile(a0, a1, a2, a3, n, w, g, b, q, d, s, t) of each interleaved type, for group g (or the pair g, g + 1):
    a_k plus block b's products with token t + k's activations, for k < n (n <= 4; a_k for k >= n come back as
    they were). The tokens meet each unpacked word in turn, so it is unpacked once for the tile. q and d come from
    quantize_activations_q8_into, s16 the activations' sums of 16, from which each dot starts at -bias times the
    sum of the activations it covers (the dot of the unsigned stored values u comes out as that of u - bias)."""
    (idot_q8_0, idot_q4_0, idot_q4_k, idot_q6_k_low, idot_q6_k_high, idot_q5_k, idot_q5_0, idot_q3_k_low,
     idot_q3_k_high, idot_q2_k_low, idot_q2_k_high) = X8_IDOTS if groups == 1 else X16_IDOTS
    halves, bytes_, int8s, low_nibbles, high_nibbles = (
        (load_halves8, load_bytes8, load_int8s8, load_low_nibbles8, load_high_nibbles8) if groups == 1 else
        (load_halves16, load_bytes16, load_int8s16, load_low_nibbles16, load_high_nibbles16))
    zero = vzero if groups == 1 else vzero16

    def blockwise(idot, block_bytes: int, bias: int, with_min: bool = False):
        """Blocks of 32 (Q8_0, Q4_0, Q5_0): acc[r] += d_r (d_x (dot of row r's 32 stored values with q_x, from
        -bias s_x)); with_min (Q4_1, Q5_1: W = d u + m, m_r the eight float16 after the d_r) also + m_r (d_x s_x).
        (The tokens' terms are written out, not a function called four times: Numba's reference counting of the
        arrays passed into a function inlined under a branch costs more than a block's products.)"""
        minus_bias = np.int32(-bias)
        values_at = 32 if with_min else 16  # the words (Q5: its fifth bits' word first) after the scales

        @njit(fastmath=REASSOC, inline="always")
        def tile(w, g, q, d, s, s16, t, n):
            stride, K = w.shape[1], q.shape[1]
            a0, a1, a2, a3 = zero(), zero(), zero(), zero()
            for b in range(K // 32):
                at = g * stride + block_bytes * b
                d_w, iw = halves(w, at, stride), at + values_at
                m_w = halves(w, at + 16, stride) if with_min else zero()
                start = minus_bias * (s16[t, 2 * b] + s16[t, 2 * b + 1])
                a0 = vfmav(a0, d_w, vfma(zero(), d[t, b], idot(w, iw, stride, q, t * K + 32 * b, start)))
                if with_min:
                    a0 = vfma(a0, d[t, b] * s[t, b], m_w)
                if n > 1:
                    u = t + 1
                    start = minus_bias * (s16[u, 2 * b] + s16[u, 2 * b + 1])
                    a1 = vfmav(a1, d_w, vfma(zero(), d[u, b], idot(w, iw, stride, q, u * K + 32 * b, start)))
                    if with_min:
                        a1 = vfma(a1, d[u, b] * s[u, b], m_w)
                if n > 2:
                    u = t + 2
                    start = minus_bias * (s16[u, 2 * b] + s16[u, 2 * b + 1])
                    a2 = vfmav(a2, d_w, vfma(zero(), d[u, b], idot(w, iw, stride, q, u * K + 32 * b, start)))
                    if with_min:
                        a2 = vfma(a2, d[u, b] * s[u, b], m_w)
                if n > 3:
                    u = t + 3
                    start = minus_bias * (s16[u, 2 * b] + s16[u, 2 * b + 1])
                    a3 = vfmav(a3, d_w, vfma(zero(), d[u, b], idot(w, iw, stride, q, u * K + 32 * b, start)))
                    if with_min:
                        a3 = vfma(a3, d[u, b] * s[u, b], m_w)
            return a0, a1, a2, a3

        return tile

    def k_quant_32(block_bytes: int, fifth: bool):
        """Q4_K, and Q5_K (its fifth bits from the qh run after the nibbles): each sub-block i of 32 (activation
        block j = 8 b + i) adds (d_r sc_ri) (d_x (u_r . q_x)) and takes (dmin_r mn_ri) (d_x s_x), the mins' term.
        (The mins' terms go straight into the token's sum: summed apart and taken once per block, they held four
        more vector registers, and the tile spilled: ~4% of Q4_K's time, ~6% of Q5_K's.)"""

        @njit(fastmath=REASSOC, inline="always")
        def token(acc, w, iw, shift, iqh, scale, mn, q, d, s, j, i, t):
            """acc[r] + (d_r sc_ri) (d_x (u_r . q_x)) - (dmin_r mn_ri) (d_x s_x), for sub-block j."""
            ix = t * q.shape[1] + 32 * j
            if fifth:
                dots = idot_q5_k(w, iw, w.shape[1], shift, iqh, i, q, ix)
            else:
                dots = idot_q4_k(w, iw, w.shape[1], shift, q, ix)
            return vfma(vfmav(acc, scale, vfma(zero(), d[t, j], dots)), -(d[t, j] * s[t, j]), mn)

        @njit(fastmath=REASSOC, inline="always")
        def scale_min(w, at, d_w, dmin, i):
            """(d_r sc_ri, dmin_r mn_ri) of the group's eight rows (a pair's sixteen)."""
            return (vfmav(zero(), d_w, bytes_(w, at + 32 + 8 * i, w.shape[1])),
                    vfmav(zero(), dmin, bytes_(w, at + 96 + 8 * i, w.shape[1])))

        @njit(fastmath=REASSOC, inline="always")
        def tile(w, g, q, d, s, s16, t, n):
            a0, a1, a2, a3 = zero(), zero(), zero(), zero()
            for b in range(q.shape[1] // QK_K):
                at, stride = g * w.shape[1] + block_bytes * b, w.shape[1]
                d_w, dmin, iqh = halves(w, at, stride), halves(w, at + 16, stride), at + 1184
                for p in range(4):  # run p: sub-block 2p in the low nibbles, 2p + 1 in the high ones
                    # The two written out, not a loop: each nibble shift is then a constant, and a low nibble costs
                    # one mask and a high one one instruction, not a shift and a mask each (measured: 0.8-0.85x the
                    # time). (A helper holding the four tokens' branches would not do: Numba counts references to
                    # the arrays passed into an inlined function with branches, at ~7x the cost of the products.)
                    i, iw = 2 * p, at + 160 + 256 * p
                    scale, mn = scale_min(w, at, d_w, dmin, i)
                    a0 = token(a0, w, iw, 0, iqh, scale, mn, q, d, s, 8 * b + i, i, t)
                    if n > 1:
                        a1 = token(a1, w, iw, 0, iqh, scale, mn, q, d, s, 8 * b + i, i, t + 1)
                    if n > 2:
                        a2 = token(a2, w, iw, 0, iqh, scale, mn, q, d, s, 8 * b + i, i, t + 2)
                    if n > 3:
                        a3 = token(a3, w, iw, 0, iqh, scale, mn, q, d, s, 8 * b + i, i, t + 3)
                    scale, mn = scale_min(w, at, d_w, dmin, i + 1)
                    a0 = token(a0, w, iw, 4, iqh, scale, mn, q, d, s, 8 * b + i + 1, i + 1, t)
                    if n > 1:
                        a1 = token(a1, w, iw, 4, iqh, scale, mn, q, d, s, 8 * b + i + 1, i + 1, t + 1)
                    if n > 2:
                        a2 = token(a2, w, iw, 4, iqh, scale, mn, q, d, s, 8 * b + i + 1, i + 1, t + 2)
                    if n > 3:
                        a3 = token(a3, w, iw, 4, iqh, scale, mn, q, d, s, 8 * b + i + 1, i + 1, t + 3)
            return a0, a1, a2, a3

        return tile

    @njit(fastmath=REASSOC, inline="always")
    def q6_k_token(acc, w, ql, ql_shift, qh, qh_shift, scale_low, scale_high, q, d, s16, j, t):
        """acc[r] += (d_r sc_ri) (d_x ((q - 32)_r . q_x)) for the two sub-blocks of 16 of group j of 32."""
        ix = t * q.shape[1] + 32 * j
        low = idot_q6_k_low(w, ql, ql_shift, qh, qh_shift, w.shape[1], q, ix, np.int32(-32) * s16[t, 2 * j])
        high = idot_q6_k_high(w, ql, ql_shift, qh, qh_shift, w.shape[1], q, ix, np.int32(-32) * s16[t, 2 * j + 1])
        return vfmav(vfmav(acc, scale_low, vfma(zero(), d[t, j], low)), scale_high, vfma(zero(), d[t, j], high))

    @njit(fastmath=REASSOC, inline="always")
    def q6_k_scales(w, at, d_w, i):
        """(d_r sc_ri, d_r sc_r(i+1)): the scales of a group's two sub-blocks of 16, eight rows (a pair's sixteen)."""
        return (vfmav(zero(), d_w, int8s(w, at + 16 + 8 * i, w.shape[1])),
                vfmav(zero(), d_w, int8s(w, at + 24 + 8 * i, w.shape[1])))

    @njit(fastmath=REASSOC, inline="always")
    def q6_k_one(w, g, q, d, s16, t):
        """q6_k (below) for one token: its four groups of a half written out, so that both shifts are constants
        (registers enough here for what four tokens' tiles ran out of; a decode step's products are all
        one-token, and a Q4_K_M file's LM head is Q6_K)."""
        acc = zero()
        for b in range(q.shape[1] // QK_K):
            at = g * w.shape[1] + 1680 * b
            d_w = halves(w, at, w.shape[1])
            for h in range(2):
                ql, qh, i, j = at + 144 + 512 * h, at + 1168 + 256 * h, 8 * h, 8 * b + 4 * h
                low, high = q6_k_scales(w, at, d_w, i)  # groups 0, 2, 1, 3: q6_k's order, so the same bits
                acc = q6_k_token(acc, w, ql, 0, qh, 0, low, high, q, d, s16, j, t)
                low, high = q6_k_scales(w, at, d_w, i + 4)
                acc = q6_k_token(acc, w, ql, 4, qh, 4, low, high, q, d, s16, j + 2, t)
                low, high = q6_k_scales(w, at, d_w, i + 2)
                acc = q6_k_token(acc, w, ql + 256, 0, qh, 2, low, high, q, d, s16, j + 1, t)
                low, high = q6_k_scales(w, at, d_w, i + 6)
                acc = q6_k_token(acc, w, ql + 256, 4, qh, 6, low, high, q, d, s16, j + 3, t)
        return acc

    @njit(fastmath=REASSOC, inline="always")
    def q6_k(w, g, q, d, s, s16, t, n):
        """Q6_K: group gg of half h (activation block j = 8 b + 4 h + gg) holds sub-blocks i = 8 h + 2 gg and
        i + 1 of 16."""
        if n == 1:
            return q6_k_one(w, g, q, d, s16, t), zero(), zero(), zero()
        a0, a1, a2, a3 = zero(), zero(), zero(), zero()
        for b in range(q.shape[1] // QK_K):
            at = g * w.shape[1] + 1680 * b
            d_w = halves(w, at, w.shape[1])
            for h in range(2):
                for k in range(2):
                    # Groups gg = k and k + 2 share ql run 2h + k, the first its low nibbles, the second its high
                    # ones: written out, so that the nibble shifts are constants (as in k_quant_32; all four
                    # groups written out ran out of registers). The high bits: bits 2gg of qh run h.
                    ql, qh, i, j = at + 144 + 256 * (2 * h + k), at + 1168 + 256 * h, 8 * h + 2 * k, 8 * b + 4 * h + k
                    low, high = q6_k_scales(w, at, d_w, i)
                    a0 = q6_k_token(a0, w, ql, 0, qh, 2 * k, low, high, q, d, s16, j, t)
                    if n > 1:
                        a1 = q6_k_token(a1, w, ql, 0, qh, 2 * k, low, high, q, d, s16, j, t + 1)
                    if n > 2:
                        a2 = q6_k_token(a2, w, ql, 0, qh, 2 * k, low, high, q, d, s16, j, t + 2)
                    if n > 3:
                        a3 = q6_k_token(a3, w, ql, 0, qh, 2 * k, low, high, q, d, s16, j, t + 3)
                    low, high = q6_k_scales(w, at, d_w, i + 4)
                    a0 = q6_k_token(a0, w, ql, 4, qh, 2 * k + 4, low, high, q, d, s16, j + 2, t)
                    if n > 1:
                        a1 = q6_k_token(a1, w, ql, 4, qh, 2 * k + 4, low, high, q, d, s16, j + 2, t + 1)
                    if n > 2:
                        a2 = q6_k_token(a2, w, ql, 4, qh, 2 * k + 4, low, high, q, d, s16, j + 2, t + 2)
                    if n > 3:
                        a3 = q6_k_token(a3, w, ql, 4, qh, 2 * k + 4, low, high, q, d, s16, j + 2, t + 3)
        return a0, a1, a2, a3

    # Q3_K and Q2_K meet activations in two 8-bit parts (quant.quantize_activations_two_part): q [T, 2K] holds
    # each token's first part then its second, d the scale of their 15-bit sum v = 128 q + q' (the first part's
    # over 128), s16 the sums of v (two_part_activations_into).

    @njit(fastmath=REASSOC, inline="always")
    def q3_k_token(acc, w, iqs, qs_shift, ihm, hm_shift, scale_low, scale_high, q, d, s16, j, t):
        """acc[r] += (d_r sc_ri) (d_x ((q - 4)_r . v_x)) for the two sub-blocks of 16 of activation block j."""
        ix = t * q.shape[1] + 32 * j
        ix2, stride = ix + q.shape[1] // 2, w.shape[1]
        low = idot_q3_k_low(w, iqs, qs_shift, ihm, hm_shift, stride, q, ix, ix2, np.int32(-4) * s16[t, 2 * j])
        high = idot_q3_k_high(w, iqs, qs_shift, ihm, hm_shift, stride, q, ix, ix2, np.int32(-4) * s16[t, 2 * j + 1])
        return vfmav(vfmav(acc, scale_low, vfma(zero(), d[t, j], low)), scale_high, vfma(zero(), d[t, j], high))

    @njit(fastmath=REASSOC, inline="always")
    def q3_k(w, g, q, d, s, s16, t, n):
        """Q3_K: group i of 32 (activation block j = 8 b + i) holds sub-blocks 2 i and 2 i + 1 of 16, their low
        bits at shift 2 (i % 4) of qs run i // 4, their third bits bit i of the hmask run."""
        a0, a1, a2, a3 = zero(), zero(), zero(), zero()
        for b in range(q.shape[1] // (2 * QK_K)):
            at, stride = g * w.shape[1] + 912 * b, w.shape[1]
            d_w, ihm = halves(w, at, stride), at + 144
            for i in range(8):
                iqs, shift, j = at + 400 + 256 * (i // 4), 2 * (i % 4), 8 * b + i
                low = vfmav(zero(), d_w, int8s(w, at + 16 + 16 * i, stride))
                high = vfmav(zero(), d_w, int8s(w, at + 24 + 16 * i, stride))
                a0 = q3_k_token(a0, w, iqs, shift, ihm, i, low, high, q, d, s16, j, t)
                if n > 1:
                    a1 = q3_k_token(a1, w, iqs, shift, ihm, i, low, high, q, d, s16, j, t + 1)
                if n > 2:
                    a2 = q3_k_token(a2, w, iqs, shift, ihm, i, low, high, q, d, s16, j, t + 2)
                if n > 3:
                    a3 = q3_k_token(a3, w, iqs, shift, ihm, i, low, high, q, d, s16, j, t + 3)
        return a0, a1, a2, a3

    @njit(fastmath=REASSOC, inline="always")
    def q2_k_token(acc, w, iqs, qs_shift, scale_low, scale_high, min_low, min_high, q, d, s16, j, t):
        """acc[r] += (d_r sc_ri) (d_x (q_r . v_x)) - (dmin_r mn_ri) (d_x s_x) for the two sub-blocks of 16 of
        activation block j (s_x the sum of the 16 activations a sub-block meets)."""
        ix = t * q.shape[1] + 32 * j
        ix2 = ix + q.shape[1] // 2
        low = idot_q2_k_low(w, iqs, qs_shift, iqs, 0, w.shape[1], q, ix, ix2, np.int32(0))
        high = idot_q2_k_high(w, iqs, qs_shift, iqs, 0, w.shape[1], q, ix, ix2, np.int32(0))
        acc = vfmav(vfmav(acc, scale_low, vfma(zero(), d[t, j], low)), scale_high, vfma(zero(), d[t, j], high))
        acc = vfma(acc, -(d[t, j] * np.float32(s16[t, 2 * j])), min_low)
        return vfma(acc, -(d[t, j] * np.float32(s16[t, 2 * j + 1])), min_high)

    @njit(fastmath=REASSOC, inline="always")
    def q2_k(w, g, q, d, s, s16, t, n):
        """Q2_K: group i of 32 (activation block j = 8 b + i) holds sub-blocks 2 i and 2 i + 1 of 16 at shift
        2 (i % 4) of qs run i // 4; each sub-block's byte holds its scale (low nibble) and min (high nibble)."""
        a0, a1, a2, a3 = zero(), zero(), zero(), zero()
        for b in range(q.shape[1] // (2 * QK_K)):
            at, stride = g * w.shape[1] + 672 * b, w.shape[1]
            d_w, dmin = halves(w, at, stride), halves(w, at + 16, stride)
            for i in range(8):
                iqs, shift, j, sc = at + 160 + 256 * (i // 4), 2 * (i % 4), 8 * b + i, at + 32 + 16 * i
                low, high = vfmav(zero(), d_w, low_nibbles(w, sc, stride)), vfmav(zero(), d_w, low_nibbles(w, sc + 8,
                                                                                                           stride))
                min_low = vfmav(zero(), dmin, high_nibbles(w, sc, stride))
                min_high = vfmav(zero(), dmin, high_nibbles(w, sc + 8, stride))
                a0 = q2_k_token(a0, w, iqs, shift, low, high, min_low, min_high, q, d, s16, j, t)
                if n > 1:
                    a1 = q2_k_token(a1, w, iqs, shift, low, high, min_low, min_high, q, d, s16, j, t + 1)
                if n > 2:
                    a2 = q2_k_token(a2, w, iqs, shift, low, high, min_low, min_high, q, d, s16, j, t + 2)
                if n > 3:
                    a3 = q2_k_token(a3, w, iqs, shift, low, high, min_low, min_high, q, d, s16, j, t + 3)
        return a0, a1, a2, a3

    return {"Q8_0": blockwise(idot_q8_0, 272, 128 if groups == 2 else Q8_0_BIAS),
            "Q4_0": blockwise(idot_q4_0, 144, 8),
            "Q4_K": k_quant_32(1184, False), "Q6_K": q6_k, "Q5_K": k_quant_32(1440, True),
            "Q4_1": blockwise(idot_q4_0, 160, 0, with_min=True), "Q5_0": blockwise(idot_q5_0, 176, 16),
            "Q5_1": blockwise(idot_q5_0, 192, 0, with_min=True), "Q2_K": q2_k, "Q3_K": q3_k}


def _group_walker(tile):
    """walk(w, q, d, s, s16, T, out, col, g): out[t, col + 8g + r] for t < T and r < 8 (16 for a pair), four tokens at a
    time."""

    @njit(fastmath=REASSOC, inline="always")
    def walk(w, q, d, s, s16, T, out, col, g):
        stride, at = out.shape[1], col + 8 * g
        for t in range(0, T, 4):
            n = min(4, T - t)
            a0, a1, a2, a3 = tile(w, g, q, d, s, s16, t, n)
            vstore(out, t * stride + at, a0)
            if n > 1:
                vstore(out, (t + 1) * stride + at, a1)
            if n > 2:
                vstore(out, (t + 2) * stride + at, a2)
            if n > 3:
                vstore(out, (t + 3) * stride + at, a3)

    return walk


# STREAM_PREFETCH: the types whose decode walk (one token) asks for the bytes of the groups two ahead (the next
# pair, or the group after next) before it multiplies the current ones; it depends on the walk. A Q6_K group's
# blocks are read in four runs (ql, qh, ql, and the next half's), which the hardware prefetcher follows worse than
# one run. Paired walk (AVX-512 VNNI), streamed from memory (a Q4_0 or Q4_K_M file's LM head, too big for the
# cache): a Q6_K product took 123-128 ps per multiply-add, ~1.3x its bytes' time at one core's bandwidth, 94-100 with
# the prefetches; with its matrix in L2, 25-34 and 31-39 (a cost a decode step never meets: no model's matrix but
# stories260K's stays in L2 between steps). There Q4_0, Q4_K, Q8_0 and Q5_K gained nothing in the model and lost
# 20-35% in L2. One group at a time (AVX2 without VNNI, measured by compiling for it on the same machine), streamed:
# Q6_K 194-248 -> 140-163 ps, Q4_K 111-125 -> 85-92, Q5_K 143-175 -> 122-127, Q4_0 and Q8_0 no gain; in the model,
# 110M decode Q4_K_M 86-94 -> 96-108 tok/s, Q5_K_M 74-89 -> 89-94 (compiled for AVX-VNNI: 86-102 -> 107-116 and
# 87-88 -> 100-111). docs/quant.md, "A Q6_K decode walk asks for its next bytes" and "... and on AVX2, Q4_K and
# Q5_K too".
STREAM_PREFETCH = {True: ("Q6_K",), False: ("Q4_K", "Q5_K", "Q6_K")}  # keyed by the walk: pairs or not


@njit(inline="always")
def _prefetch_groups(w, g0, g1):
    """Ask for the cache lines of groups g0 .. g1 - 1 of w [G, group bytes] uint8 (a hint, no effect on results)."""
    for i in range(g0 * w.shape[1], g1 * w.shape[1], 64):
        prefetch(w, i)


def _interleaved_kernels(qtype: str, pairs: bool = PAIRED):
    """rows_into(w8, q, d, s, s16, T, out, col, n0, n1) of one interleaved type, n0 a multiple of 8: pairs of
    groups where `pairs` (PAIRED: the machine's walk), then single groups, then the rows of a last group that n1
    cuts (a matrix whose rows are not a multiple of 8: its last group is padded with zero rows, computed aside and
    not stored). For one token and a type of STREAM_PREFETCH[pairs], each step first asks for the groups two ahead
    (within n0 .. n1: a thread's own)."""
    walk8, walk16 = _group_walker(_block_accumulators(1)[qtype]), _group_walker(_block_accumulators(2)[qtype])
    ahead = qtype in STREAM_PREFETCH[pairs]

    @njit(fastmath=REASSOC, cache=True)
    def rows_into(w, q, d, s, s16, T, out, col, n0, n1):
        """out[t, col + n] for t < T, n0 <= n < n1 (out C-contiguous float32 [>=T, >=col + n1])."""
        g, end = n0 // 8, -(-n1 // 8)
        while pairs and g + 2 <= n1 // 8:
            if ahead and T == 1:
                _prefetch_groups(w, g + 2, min(g + 4, end))
            walk16(w, q, d, s, s16, T, out, col, g)
            g += 2
        aside = np.empty((T if n1 % 8 else 0, 8), np.float32)
        while g < end:
            if ahead and T == 1:
                _prefetch_groups(w, g + 2, min(g + 3, end))
            cut = 8 * g + 8 > n1  # a last group that n1 cuts: its eight rows into aside[t, 0:8] (one call site, so
            walk8(w, q, d, s, s16, T, aside if cut else out, -8 * g if cut else col, g)  # one inlined tile)
            g += 1
        for t in range(aside.shape[0]):
            for r in range(n1 % 8):
                out[t, col + n1 - n1 % 8 + r] = aside[t, r]

    return rows_into


(_rows_q8_0_x8, _rows_q4_0_x8, _rows_q4_k_x8, _rows_q6_k_x8, _rows_q5_k_x8, _rows_q4_1_x8, _rows_q5_0_x8,
 _rows_q5_1_x8, _rows_q2_k_x8, _rows_q3_k_x8) = (_interleaved_kernels(t) for t in INTERLEAVED_TYPES)

# The type ids of interleaved matrices in a model's table (models/numba.py): the GGML type id plus INTERLEAVED_CODE.
INTERLEAVED_CODE = 1000


INT8_ROWS_INTO, INT8_MATMUL_INTO = {}, {}
for _name, _acc in [("Q8_0", _acc_int8_q8_0), ("Q4_0", _acc_int8_q4_0), ("Q4_K", _acc_int8_q4_k),
                    ("Q5_K", _acc_int8_q5_k), ("Q6_K", _acc_int8_q6_k), ("Q4_1", _acc_int8_q4_1),
                    ("Q5_0", _acc_int8_q5_0), ("Q5_1", _acc_int8_q5_1)]:
    INT8_ROWS_INTO[_name], INT8_MATMUL_INTO[_name] = _int8_kernels(_acc, TYPES[_name].block_size)

INT8_KERNEL_TYPES = tuple(INT8_MATMUL_INTO)
(_rows_q8_0, _rows_q4_0, _rows_q4_k, _rows_q5_k, _rows_q6_k, _rows_q4_1, _rows_q5_0,
 _rows_q5_1) = (INT8_ROWS_INTO[t] for t in INT8_KERNEL_TYPES)
INT8_TYPE_CODES = tuple(TYPES[t].type_id for t in INT8_KERNEL_TYPES)  # GGML type ids with an int8 worker


@njit(cache=True)
def matmul_rows_interleaved(code, w, q, d, s, s16, T, out, col, n0, n1):
    """out[t, col + n] = W[n] . x[t] for t < T, n0 <= n < n1 (n0 a multiple of 8), W held as interleaved rows
    (quant.interleave_rows) of the type whose GGML id is code - INTERLEAVED_CODE, x given by
    quantize_activations_q8_into(x, T, q, d, s, s16) (once per input, shared by every row range and matrix), or for
    Q2_K and Q3_K by two_part_activations_into (q [>=T, 2K]: the two 8-bit parts): what the Numba model runs for
    every block type.
          # q [>=T, K] int8, d, s [>=T, K / 32] float32, s16 [>=T, K / 16] int32 -> out [>=T, >=col + n1] float32"""
    if code == 1008:  # INTERLEAVED_CODE + Q8_0's
        _rows_q8_0_x8(w, q, d, s, s16, T, out, col, n0, n1)
    elif code == 1002:  # INTERLEAVED_CODE + Q4_0's
        _rows_q4_0_x8(w, q, d, s, s16, T, out, col, n0, n1)
    elif code == 1012:  # INTERLEAVED_CODE + Q4_K's
        _rows_q4_k_x8(w, q, d, s, s16, T, out, col, n0, n1)
    elif code == 1014:  # INTERLEAVED_CODE + Q6_K's
        _rows_q6_k_x8(w, q, d, s, s16, T, out, col, n0, n1)
    elif code == 1013:  # INTERLEAVED_CODE + Q5_K's
        _rows_q5_k_x8(w, q, d, s, s16, T, out, col, n0, n1)
    elif code == 1003:  # INTERLEAVED_CODE + Q4_1's
        _rows_q4_1_x8(w, q, d, s, s16, T, out, col, n0, n1)
    elif code == 1006:  # INTERLEAVED_CODE + Q5_0's
        _rows_q5_0_x8(w, q, d, s, s16, T, out, col, n0, n1)
    elif code == 1007:  # INTERLEAVED_CODE + Q5_1's
        _rows_q5_1_x8(w, q, d, s, s16, T, out, col, n0, n1)
    elif code == 1010:  # INTERLEAVED_CODE + Q2_K's
        _rows_q2_k_x8(w, q, d, s, s16, T, out, col, n0, n1)
    elif code == 1011:  # INTERLEAVED_CODE + Q3_K's
        _rows_q3_k_x8(w, q, d, s, s16, T, out, col, n0, n1)
    else:
        raise ValueError("not the code of an interleaved type (INTERLEAVED_CODE + the id of one of "
                         "quant.INTERLEAVED_TYPES)")


@njit(cache=True)
def matmul_rows_int8(code, w, q, d, s, s16, T, out, col, n0, n1):
    """matmul_rows_interleaved for codes from INTERLEAVED_CODE on, and the one-row kernels of INT8_KERNEL_TYPES on
    rows in the file's layout: out[t, col + n] = W[n] . x[t] for t < T, n0 <= n < n1."""
    if code >= INTERLEAVED_CODE:
        matmul_rows_interleaved(code, w, q, d, s, s16, T, out, col, n0, n1)
    elif code == 8:
        _rows_q8_0(w, q, d, s, T, out, col, n0, n1)
    elif code == 2:
        _rows_q4_0(w, q, d, s, T, out, col, n0, n1)
    elif code == 12:
        _rows_q4_k(w, q, d, s, T, out, col, n0, n1)
    elif code == 13:
        _rows_q5_k(w, q, d, s, T, out, col, n0, n1)
    elif code == 14:
        _rows_q6_k(w, q, d, s, T, out, col, n0, n1)
    elif code == 3:
        _rows_q4_1(w, q, d, s, T, out, col, n0, n1)
    elif code == 6:
        _rows_q5_0(w, q, d, s, T, out, col, n0, n1)
    elif code == 7:
        _rows_q5_1(w, q, d, s, T, out, col, n0, n1)
    else:
        raise ValueError("no 8-bit-activation kernel for this GGML type (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and "
                         "Q6_K have one; Q2_K and Q3_K on interleaved rows only)")


@njit(cache=True)
def matvec_rows_int8(code, w, q, d, s, s16, out, col, n0, n1):
    """out[col + n] = W[n] . x for n0 <= n < n1: matmul_rows_int8 for one token (q [1, K], d, s [1, K / 32],
    s16 [1, K / 16]) into a vector out [>=col + n1]."""
    # T as np.int64(1), not a literal 1: no second compilation of matmul_rows_int8 (Numba specialises on literals)
    matmul_rows_int8(code, w, q, d, s, s16, np.int64(1), out.reshape(1, out.shape[0]), col, n0, n1)


def _check_int8(w: np.ndarray, qtype: str, K: int) -> None:
    if qtype not in INT8_MATMUL_INTO:
        raise QuantizationError(f"no 8-bit-activation kernel for {qtype} weights (npllm has "
                                f"{', '.join(INT8_KERNEL_TYPES)})")
    _check_rows(w, qtype, K)


def matvec_int8(w: np.ndarray, qtype: str, x: np.ndarray, threads: int = 1) -> np.ndarray:
    """W x with x quantized to 8-bit blocks (integer dot products).  # [N, row bytes] uint8, [K] float32 -> [N]"""
    return matmul_int8(w, qtype, np.asarray(x)[None, :], threads)[0]


def matmul_int8(w: np.ndarray, qtype: str, x: np.ndarray, threads: int = 1) -> np.ndarray:
    """x W^T with x quantized to 8-bit blocks.  # [N, row bytes] uint8, [T, K] float32 -> [T, N] float32"""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise QuantizationError(f"activations must be [T, K], not of shape {x.shape}")
    _check_int8(w, qtype, x.shape[1])
    if not np.all(np.isfinite(x)):
        raise QuantizationError("cannot quantize activations that are not finite (inf or NaN)")
    out = np.empty((x.shape[0], w.shape[0]), np.float32)
    INT8_MATMUL_INTO[qtype](x, w, out, x.shape[0], threads)
    return out



def matmul_int8_interleaved(w8: np.ndarray, qtype: str, x: np.ndarray, rows: int | None = None) -> np.ndarray:
    """x W^T with x quantized to 8-bit blocks (in two parts for quant.TWO_PART_ACTIVATION_TYPES), W's first `rows`
    rows (default all 8 G) held as quant.interleave_rows(w, qtype), on the calling thread.
                                                 # [G, interleaved row bytes] uint8, [T, K] float32 -> [T, rows]"""
    if qtype not in INTERLEAVED_TYPES:
        raise QuantizationError(f"npllm interleaves the rows of {', '.join(INTERLEAVED_TYPES)} only, not {qtype}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    T, K = x.shape
    N, t = 8 * w8.shape[0] if rows is None else rows, TYPES[qtype]
    if not 8 * w8.shape[0] - 8 < N <= 8 * w8.shape[0]:
        raise QuantizationError(f"{w8.shape[0]} interleaved groups hold {8 * w8.shape[0] - 7} to "
                                f"{8 * w8.shape[0]} rows, not {N}")
    if (w8.dtype != np.uint8 or w8.ndim != 2 or K % t.block_size
            or w8.shape[1] != K // t.block_size * INTERLEAVED_BLOCK_BYTES[qtype]):
        raise QuantizationError(f"interleaved {qtype} weights of shape {w8.shape} do not hold rows of {K} values")
    if not np.all(np.isfinite(x)):
        raise QuantizationError("cannot quantize activations that are not finite (inf or NaN)")
    q, d, s = np.empty((T, K), np.int8), np.empty((T, K // 32), np.float32), np.empty((T, K // 32), np.float32)
    s16 = np.empty((T, K // 16), np.int32)
    quantize_activations_q8_into(x, T, q, d, s, s16)
    if qtype in TWO_PART_ACTIVATION_TYPES:
        v, d_v, s_v, s16_v = np.empty((T, 2 * K), np.int8), np.empty_like(d), np.empty_like(s), np.empty_like(s16)
        two_part_activations_into(x, T, q, d, v, d_v, s_v, s16_v)
        q, d, s, s16 = v, d_v, s_v, s16_v
    out = np.empty((T, N), np.float32)
    matmul_rows_interleaved(INTERLEAVED_CODE + TYPES[qtype].type_id, w8, q, d, s, s16, T, out, 0, 0, N)
    return out

# ================================================================================================================
# Row-range workers: what npllm's Numba model (models/numba.py) calls, for every weight type a GGUF file holds.
#
#     matvec_rows_<type>(w, x, sums, out, col, n0, n1)   out[col + n] = W[n] . x            n0 <= n < n1
#         one token: w [N, row bytes] uint8, x [>= K] float32, sums [K // 16] float32 (x's sums of 16, taken once
#         per product: see the block kernels above), out 1-D float32
#     matmul_rows_<type>(w, x, T, out, col, n0, n1)      out[t, col + n] = W[n] . x[t]       t < T, n0 <= n < n1
#         T tokens: x [>= T, >= K] float32, out [>= T, >= col + n1] float32, n0 a multiple of PANEL
#
# K is the row's width, known from w (row bytes / block bytes * block size): x and out may be wider buffers.
# A worker runs on the calling thread; the model splits each product's rows over its threads (several matrices
# that read the same input in one parallel region). `matvec_rows`, `matmul_rows` and `decode_row` dispatch on the
# GGML type id, one branch per type: another implementation of a type with the same signature (integer dot
# products on 8-bit activations, say) is swapped in by changing that type's branch.
#
# Types with a block accumulator above (Q8_0, Q4_0, Q4_K, Q6_K) use it; the others decode each row into float32
# (one row at a time, in cache) and take its dot product with x; F32, F16 and BF16 rows are read 8 values at a
# time straight from their bytes. For T tokens every type decodes 16 rows into a panel and runs cpu.py's tile.

from .cpu import _dot as _dot_f32  # noqa: E402  (the vectorised dot product of two float32 rows)


def _float_lanes(kind: str):
    """f32x8 of the 8 values of a float row stored as `kind` ("F32", "F16" or "BF16") at bytes array.flat[index:]."""

    def typer(typingctx, array, index):
        if not (_is_byte_c_array(array) and isinstance(index, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            at = builder.gep(data, [args[1]])
            if kind == "F32":
                return builder.load(builder.bitcast(at, _vector(8).as_pointer()), align=1)
            if kind == "F16":
                halves = builder.load(builder.bitcast(at, ir.VectorType(ir.HalfType(), 8).as_pointer()), align=1)
                return builder.fpext(halves, _vector(8))
            i16x8, i32x8 = ir.VectorType(ir.IntType(16), 8), ir.VectorType(ir.IntType(32), 8)
            words = builder.zext(builder.load(builder.bitcast(at, i16x8.as_pointer()), align=1), i32x8)
            return builder.bitcast(builder.shl(words, ir.Constant(i32x8, [16] * 8)), _vector(8))

        return f32x8(array, index), codegen

    return typer


def _float_scalar(kind: str):
    """The one float stored as `kind` ("F32" or "BF16") at bytes array.flat[index:], as float32."""

    def typer(typingctx, array, index):
        if not (_is_byte_c_array(array) and isinstance(index, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            at = builder.gep(data, [args[1]])
            if kind == "F32":
                return builder.load(builder.bitcast(at, ir.FloatType().as_pointer()), align=1)
            word = builder.zext(builder.load(builder.bitcast(at, ir.IntType(16).as_pointer()), align=1),
                                ir.IntType(32))
            return builder.bitcast(builder.shl(word, ir.Constant(ir.IntType(32), 16)), ir.FloatType())

        return types.float32(array, index), codegen

    return typer


vload_f32_bytes, vload_f16_bytes, vload_bf16_bytes = (intrinsic(_float_lanes(k)) for k in ("F32", "F16", "BF16"))
load_f32, load_bf16 = intrinsic(_float_scalar("F32")), intrinsic(_float_scalar("BF16"))


# ---------------------------------------------------------------------------------- block decoders, more types
# _decode_<type>(w, n, b, buf, at) as above: block b of row n as float32 in buf[at : at + block_size], in the
# order and with the formula of npllm.quant's dequantizer.

@njit(inline="always")
def _decode_f32(w, n, b, buf, at):
    buf[at] = load_f32(w, n * w.shape[1] + 4 * b)


@njit(inline="always")
def _decode_f16(w, n, b, buf, at):
    buf[at] = load_half(w, n * w.shape[1] + 2 * b)


@njit(inline="always")
def _decode_bf16(w, n, b, buf, at):
    buf[at] = load_bf16(w, n * w.shape[1] + 2 * b)


@njit(inline="always")
def _decode_q4_1(w, n, b, buf, at):
    base = 20 * b
    d, m = load_half(w, n * w.shape[1] + base), load_half(w, n * w.shape[1] + base + 2)
    for j in range(16):
        byte = np.int32(w[n, base + 4 + j])
        buf[at + j] = d * np.float32(byte & 15) + m
        buf[at + j + 16] = d * np.float32(byte >> 4) + m


@njit(inline="always")
def _five_bits(w, n, qs, qh, j):
    """Values j and j + 16 (j < 16) of a Q5_0/Q5_1 block: 4 low bits from byte qs + j, fifth bits j and j + 16 of
    the little-endian u32 at qh."""
    byte = np.int32(w[n, qs + j])
    low = (byte & 15) | (((np.int32(w[n, qh + j // 8]) >> (j % 8)) & 1) << 4)
    high = (byte >> 4) | (((np.int32(w[n, qh + 2 + j // 8]) >> (j % 8)) & 1) << 4)
    return low, high


@njit(inline="always")
def _decode_q5_0(w, n, b, buf, at):
    base = 22 * b
    d = load_half(w, n * w.shape[1] + base)
    for j in range(16):
        low, high = _five_bits(w, n, base + 6, base + 2, j)
        buf[at + j] = d * np.float32(low - 16)
        buf[at + j + 16] = d * np.float32(high - 16)


@njit(inline="always")
def _decode_q5_1(w, n, b, buf, at):
    base = 24 * b
    d, m = load_half(w, n * w.shape[1] + base), load_half(w, n * w.shape[1] + base + 2)
    for j in range(16):
        low, high = _five_bits(w, n, base + 8, base + 4, j)
        buf[at + j] = d * np.float32(low) + m
        buf[at + j + 16] = d * np.float32(high) + m


@njit(inline="always")
def _decode_q5_k(w, n, b, buf, at):
    base = 176 * b
    d, dmin = load_half(w, n * w.shape[1] + base), load_half(w, n * w.shape[1] + base + 2)
    for s in range(8):
        sc, mn = _scale_min_q4_k(w, n, base + 4, s)
        scale, offset = d * np.float32(sc), dmin * np.float32(mn)
        r = s // 2
        for j in range(32):
            byte = np.int32(w[n, base + 48 + 32 * r + j])
            low = (byte >> 4) if s % 2 else (byte & 15)
            q = low | (((np.int32(w[n, base + 16 + j]) >> s) & 1) << 4)
            buf[at + 32 * s + j] = scale * np.float32(q) - offset


@njit(inline="always")
def _two_bits(w, n, qs, i):
    """Low 2 bits of value i (0..255) of a Q2_K/Q3_K block whose 64 bytes of 2-bit fields start at byte qs."""
    return (np.int32(w[n, qs + 32 * (i // 128) + i % 32]) >> (2 * ((i % 128) // 32))) & 3


@njit(inline="always")
def _decode_q2_k(w, n, b, buf, at):
    base = 84 * b
    d, dmin = load_half(w, n * w.shape[1] + base + 80), load_half(w, n * w.shape[1] + base + 82)
    for s in range(16):
        packed = np.int32(w[n, base + s])
        scale, offset = d * np.float32(packed & 15), dmin * np.float32(packed >> 4)
        for j in range(16):
            buf[at + 16 * s + j] = scale * np.float32(_two_bits(w, n, base + 16, 16 * s + j)) - offset


@njit(inline="always")
def _decode_q3_k(w, n, b, buf, at):
    base = 110 * b
    d = load_half(w, n * w.shape[1] + base + 108)
    for s in range(16):
        low4 = np.int32(w[n, base + 96 + s % 8]) >> (4 * (s // 8)) & 15
        high2 = (np.int32(w[n, base + 104 + s % 4]) >> (2 * (s // 4))) & 3
        scale = d * np.float32((low4 | (high2 << 4)) - 32)
        for j in range(16):
            i = 16 * s + j
            bit = (np.int32(w[n, base + i % 32]) >> (i // 32)) & 1
            buf[at + i] = scale * np.float32(_two_bits(w, n, base + 32, i) - (1 - bit) * 4)


# ---------------------------------------------------------------------------------------------- the workers
# Kept small on purpose: every function that calls these is compiled with all of them linked in, so the per-type
# code is only what must differ (a decoder, and a matvec where a type has a block accumulator or plain floats);
# the rest (decode-then-dot, the prefill panel and its register tile) is one shared function.

def _decode_row(decode, block_size: int, block_bytes: int):
    @njit(cache=True)
    def decode_row(w, n, out):
        """Row n of W as float32 into out[:K]."""
        for b in range(w.shape[1] // block_bytes):
            decode(w, n, b, out, b * block_size)

    return decode_row


def _accumulated_matvec_rows(acc_block, block_bytes: int):
    """matvec_rows from a block accumulator (the types with one)."""

    @njit(fastmath=REASSOC, cache=True)
    def matvec_rows(w, x, sums, out, col, n0, n1):
        nb = w.shape[1] // block_bytes
        for n in range(n0, n1):
            acc = vzero()
            offset = np.float32(0)
            for b in range(nb):
                acc, part = acc_block(acc, w, n, b, x, sums)
                offset += part
            out[col + n] = vsum(acc) + offset

    return matvec_rows


def _float_matvec_rows(lanes, decode, value_bytes: int):
    """matvec_rows for rows of plain floats (F32, F16, BF16): 8 values at a time from the bytes, then the tail."""

    @njit(fastmath=REASSOC, cache=True)
    def matvec_rows(w, x, sums, out, col, n0, n1):
        K = w.shape[1] // value_bytes
        full = K - K % 8
        tail = np.empty(1, np.float32)
        for n in range(n0, n1):
            acc = vzero()
            for k in range(0, full, 8):
                acc = vfmav(acc, lanes(w, n * w.shape[1] + value_bytes * k), vload(x, k))
            s = vsum(acc)
            for k in range(full, K):
                decode(w, n, k, tail, 0)
                s += tail[0] * x[k]
            out[col + n] = s

    return matvec_rows


_DECODERS = {"F32": _decode_f32, "F16": _decode_f16, "BF16": _decode_bf16, "Q8_0": _decode_q8_0,
             "Q4_0": _decode_q4_0, "Q4_1": _decode_q4_1, "Q5_0": _decode_q5_0, "Q5_1": _decode_q5_1,
             "Q2_K": _decode_q2_k, "Q3_K": _decode_q3_k, "Q4_K": _decode_q4_k, "Q5_K": _decode_q5_k,
             "Q6_K": _decode_q6_k}
(decode_row_f32, decode_row_f16, decode_row_bf16, decode_row_q8_0, decode_row_q4_0, decode_row_q4_1, decode_row_q5_0,
 decode_row_q5_1, decode_row_q2_k, decode_row_q3_k, decode_row_q4_k, decode_row_q5_k, decode_row_q6_k) = (
    _decode_row(decode, TYPES[name].block_size, TYPES[name].block_bytes) for name, decode in _DECODERS.items())
matvec_rows_q8_0 = _accumulated_matvec_rows(_acc_q8_0, 34)
matvec_rows_q4_0 = _accumulated_matvec_rows(_acc_q4_0, 18)
matvec_rows_q4_k = _accumulated_matvec_rows(_acc_q4_k, 144)
matvec_rows_q6_k = _accumulated_matvec_rows(_acc_q6_k, 210)
matvec_rows_f32 = _float_matvec_rows(vload_f32_bytes, _decode_f32, 4)
matvec_rows_f16 = _float_matvec_rows(vload_f16_bytes, _decode_f16, 2)
matvec_rows_bf16 = _float_matvec_rows(vload_bf16_bytes, _decode_bf16, 2)

# values and bytes per block, indexed by GGML type id
TYPE_BLOCK_SIZE = np.ones(31, np.int64)
TYPE_BLOCK_BYTES = np.ones(31, np.int64)
for _t in TYPES.values():
    TYPE_BLOCK_SIZE[_t.type_id], TYPE_BLOCK_BYTES[_t.type_id] = _t.block_size, _t.block_bytes

# GGML type ids, the codes the dispatchers take (quant.TYPES[name].type_id)
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 30
ROW_TYPES = tuple(_DECODERS)


@njit(cache=True)
def decode_row(code, w, n, out):
    """Row n of W (GGML type `code`) as float32 into out[:K]: an embedding lookup reads no other row."""
    if code == Q8_0:
        decode_row_q8_0(w, n, out)
    elif code == Q4_0:
        decode_row_q4_0(w, n, out)
    elif code == Q4_K:
        decode_row_q4_k(w, n, out)
    elif code == Q6_K:
        decode_row_q6_k(w, n, out)
    elif code == Q5_K:
        decode_row_q5_k(w, n, out)
    elif code == Q5_0:
        decode_row_q5_0(w, n, out)
    elif code == Q5_1:
        decode_row_q5_1(w, n, out)
    elif code == Q4_1:
        decode_row_q4_1(w, n, out)
    elif code == Q3_K:
        decode_row_q3_k(w, n, out)
    elif code == Q2_K:
        decode_row_q2_k(w, n, out)
    elif code == F16:
        decode_row_f16(w, n, out)
    elif code == BF16:
        decode_row_bf16(w, n, out)
    elif code == F32:
        decode_row_f32(w, n, out)



@njit(inline="always")
def _gather_words(w, at, r, words, row, to):
    """row[to + 4k + i] = w.flat[at + 32k + 4r + i], k < words, i < 4: lane r's bytes of a run of interleaved words."""
    for k in range(words):
        for i in range(4):
            row[to + 4 * k + i] = w[at + 32 * k + 4 * r + i]


@njit(cache=True)
def gather_interleaved_row(code, w8, n, row):
    """Row n of an interleaved matrix (quant.interleave_rows; code: INTERLEAVED_CODE + its GGML type id) back in its
    file's layout, into row [row bytes] uint8 (an embedding lookup on a table held interleaved for the LM head)."""
    w = w8.reshape(w8.size)
    g, r = n // 8, n % 8
    base = g * w8.shape[1]
    if code == INTERLEAVED_CODE + Q8_0:  # file block: d, q[32]; stored q + 128
        for b in range(w8.shape[1] // 272):
            at, to = base + 272 * b, 34 * b
            row[to], row[to + 1] = w[at + 2 * r], w[at + 2 * r + 1]
            _gather_words(w, at + 16, r, 8, row, to + 2)
            for j in range(to + 2, to + 34):
                row[j] ^= np.uint8(128)
    elif code == INTERLEAVED_CODE + Q4_0:  # d, 16 bytes of nibbles
        for b in range(w8.shape[1] // 144):
            at, to = base + 144 * b, 18 * b
            row[to], row[to + 1] = w[at + 2 * r], w[at + 2 * r + 1]
            _gather_words(w, at + 16, r, 4, row, to + 2)
    elif code == INTERLEAVED_CODE + Q4_K or code == INTERLEAVED_CODE + Q5_K:  # d, dmin, 12 bytes of 6-bit scales
        q5 = code == INTERLEAVED_CODE + Q5_K  # and mins, (Q5_K: qh[32],) qs[128]
        size, file_size = (1440, 176) if q5 else (1184, 144)
        for b in range(w8.shape[1] // size):
            at, to = base + size * b, file_size * b
            row[to], row[to + 1] = w[at + 2 * r], w[at + 2 * r + 1]
            row[to + 2], row[to + 3] = w[at + 16 + 2 * r], w[at + 17 + 2 * r]
            for j in range(4):  # quant._pack_scales_6bit: sc, mn[0..3] whole, sc, mn[4..7] split over bytes 8..11
                sc_lo, sc_hi = w[at + 32 + 8 * j + r], w[at + 32 + 8 * (j + 4) + r]
                mn_lo, mn_hi = w[at + 96 + 8 * j + r], w[at + 96 + 8 * (j + 4) + r]
                row[to + 4 + j] = (sc_lo & 63) | ((sc_hi >> 4) << 6)
                row[to + 8 + j] = (mn_lo & 63) | ((mn_hi >> 4) << 6)
                row[to + 12 + j] = (sc_hi & 15) | ((mn_hi & 15) << 4)
            for p in range(4):
                _gather_words(w, at + 160 + 256 * p, r, 8, row, to + (48 if q5 else 16) + 32 * p)
            if q5:
                _gather_words(w, at + 1184, r, 8, row, to + 16)
    elif code == INTERLEAVED_CODE + Q6_K:  # ql[128], qh[64], scales[16], d
        for b in range(w8.shape[1] // 1680):
            at, to = base + 1680 * b, 210 * b
            for c in range(4):
                _gather_words(w, at + 144 + 256 * c, r, 8, row, to + 32 * c)
            for h in range(2):
                _gather_words(w, at + 1168 + 256 * h, r, 8, row, to + 128 + 32 * h)
            for i in range(16):
                row[to + 192 + i] = w[at + 16 + 8 * i + r]
            row[to + 208], row[to + 209] = w[at + 2 * r], w[at + 2 * r + 1]
    elif code == INTERLEAVED_CODE + Q4_1 or code == INTERLEAVED_CODE + Q5_0 or code == INTERLEAVED_CODE + Q5_1:
        _gather_small_block_row(code - INTERLEAVED_CODE, w, base, r, w8.shape[1], row)
    elif code == INTERLEAVED_CODE + Q2_K:  # scales[16], qs[64], d, dmin
        for b in range(w8.shape[1] // 672):
            at, to = base + 672 * b, 84 * b
            for i in range(16):
                row[to + i] = w[at + 32 + 8 * i + r]
            for h in range(2):
                _gather_words(w, at + 160 + 256 * h, r, 8, row, to + 16 + 32 * h)
            row[to + 80], row[to + 81], row[to + 82], row[to + 83] = (w[at + 2 * r], w[at + 2 * r + 1],
                                                                      w[at + 16 + 2 * r], w[at + 17 + 2 * r])
    elif code == INTERLEAVED_CODE + Q3_K:  # hmask[32], qs[64], scales[12] (quant._pack_scales_q3_k), d
        for b in range(w8.shape[1] // 912):
            at, to = base + 912 * b, 110 * b
            _gather_words(w, at + 144, r, 8, row, to)
            for h in range(2):
                _gather_words(w, at + 400 + 256 * h, r, 8, row, to + 32 + 32 * h)
            row[to + 96:to + 108] = 0
            for i in range(16):
                u = (w[at + 16 + 8 * i + r] + np.uint8(32)) & np.uint8(63)  # the 6-bit scale: stored minus 32
                row[to + 96 + i % 8] |= (u & np.uint8(15)) << np.uint8(4 * (i // 8))
                row[to + 104 + i % 4] |= (u >> np.uint8(4)) << np.uint8(2 * (i // 4))
            row[to + 108], row[to + 109] = w[at + 2 * r], w[at + 2 * r + 1]
    else:
        raise ValueError("not the code of an interleaved type (INTERLEAVED_CODE + the id of one of "
                         "quant.INTERLEAVED_TYPES)")


@njit(inline="always")
def _gather_small_block_row(t, w, base, r, group_bytes, row):
    """gather_interleaved_row for Q4_1, Q5_0 and Q5_1 (type id t): d (, m), then (Q5) the four bytes of fifth bits
    put back in the file's order (interleaved: byte i bit k is value 4k + i's; file: bit v of a u32 is value v's),
    then the 16 bytes of nibbles."""
    scales = 1 if t == Q5_0 else 2
    fifth = t != Q4_1
    size, file_size = 16 * scales + (32 if fifth else 0) + 128, TYPE_BLOCK_BYTES[t]
    for b in range(group_bytes // size):
        at, to = base + size * b, file_size * b
        for k in range(scales):
            row[to + 2 * k], row[to + 2 * k + 1] = w[at + 16 * k + 2 * r], w[at + 16 * k + 2 * r + 1]
        words_at = at + 16 * scales
        if fifth:
            qh = to + 2 * scales
            row[qh:qh + 4] = 0
            for v in range(32):
                bit = (w[words_at + 4 * r + v % 4] >> np.uint8(v // 4)) & np.uint8(1)
                row[qh + v // 8] |= bit << np.uint8(v % 8)
            words_at += 32
        _gather_words(w, words_at, r, 4, row, to + file_size - 16)


@njit(cache=True)
def file_row_bytes(code, K):
    """Bytes a row of K values takes in its file's layout, for a GGML type id (+ INTERLEAVED_CODE: interleaved)."""
    t = code % INTERLEAVED_CODE
    return K // TYPE_BLOCK_SIZE[t] * TYPE_BLOCK_BYTES[t]


@njit(cache=True)
def decode_any_row(code, w, n, out, scratch):
    """decode_row, also for a matrix held interleaved (code >= INTERLEAVED_CODE): its row gathered into scratch
    [file_row_bytes(code, K)] uint8 first."""
    if code >= INTERLEAVED_CODE:
        gather_interleaved_row(code, w, n, scratch)
        decode_row(code - INTERLEAVED_CODE, scratch.reshape(1, scratch.size), 0, out)
    else:
        decode_row(code, w, n, out)

@njit(fastmath=REASSOC, cache=True)
def matvec_rows_decoded(code, w, x, sums, out, col, n0, n1):
    """matvec_rows for a type without its own: each row decoded into float32 (in cache), then dotted with x."""
    K = w.shape[1] // TYPE_BLOCK_BYTES[code] * TYPE_BLOCK_SIZE[code]
    row = np.empty(K, np.float32)
    for n in range(n0, n1):
        decode_row(code, w, n, row)
        out[col + n] = _dot_f32(row, 0, x, 0, K)


@njit(cache=True)
def matvec_rows(code, w, x, sums, out, col, n0, n1):
    """out[col + n] = W[n] . x for n0 <= n < n1, W of GGML type `code` (one branch per type with its own worker)."""
    if code == Q8_0:
        matvec_rows_q8_0(w, x, sums, out, col, n0, n1)
    elif code == Q4_0:
        matvec_rows_q4_0(w, x, sums, out, col, n0, n1)
    elif code == Q4_K:
        matvec_rows_q4_k(w, x, sums, out, col, n0, n1)
    elif code == Q6_K:
        matvec_rows_q6_k(w, x, sums, out, col, n0, n1)
    elif code == F16:
        matvec_rows_f16(w, x, sums, out, col, n0, n1)
    elif code == F32:
        matvec_rows_f32(w, x, sums, out, col, n0, n1)
    elif code == BF16:
        matvec_rows_bf16(w, x, sums, out, col, n0, n1)
    else:  # Q4_1, Q5_0, Q5_1, Q5_K, Q2_K, Q3_K
        matvec_rows_decoded(code, w, x, sums, out, col, n0, n1)


@njit(fastmath=REASSOC, cache=True)
def matmul_rows(code, w, x, T, out, col, n0, n1):
    """out[t, col + n] = W[n] . x[t] for t < T, n0 <= n < n1 (n0 a multiple of 16), W of GGML type `code`: 16 rows
    at a time decoded into one float32 panel (cpu.pack_panels' layout), then cpu.py's register tile over every
    token, so the decoding is paid once per row whatever T is."""
    K = w.shape[1] // TYPE_BLOCK_BYTES[code] * TYPE_BLOCK_SIZE[code]
    panel = np.zeros(K * PANEL, np.float32)
    row = np.empty(K, np.float32)
    tile = np.empty((T, PANEL), np.float32)
    for p0 in range(n0, n1, PANEL):
        rows = min(PANEL, n1 - p0)
        for j in range(rows):
            decode_row(code, w, p0 + j, row)
            for k in range(K):
                panel[k * PANEL + j] = row[k]
        for j in range(rows, PANEL):  # past the last row: zeros, computed and not stored
            for k in range(K):
                panel[k * PANEL + j] = 0
        for t in range(0, T, TILE_T):
            _tile_6x16(x, t, min(TILE_T, T - t), panel, 0, K, tile, 0)
        for t in range(T):
            for j in range(rows):
                out[t, col + p0 + j] = tile[t, j]
