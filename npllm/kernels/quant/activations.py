"""A product's activations quantized to 8 bits per block of 32 (quant.oracle.quantize_activations_q8: d = max|x| / 127,
q = round(x / d), s = sum q), once per input for every matrix and row range that reads it, or in two 8-bit parts
(quant.oracle.quantize_activations_two_part, for the types of activations "two_part"). The same float64 quotients
and roundings as the NumPy statement, so the same integers.

    quantize_activations_q8_into(x, T, q, d, s, s16)          q [T, K] int8, d, s [T, K/32] float32, s16 [T, K/16]
    two_part_activations_into(x, T, q, d, v, d_v, s_v, s16_v)  v [T, 2K]: each token's q, then its second part
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from ..simd import is_f32_c_array, lane_pointer
from .intrinsics import I8_IR, I32_IR, ivec, splat, llvm_intrinsic


@intrinsic
def quantize_block_q8(typingctx, x, ix, q, iq):
    """(d, s_low, s_high): quant.oracle.quantize_activations_q8 of the block of 32 float32 activations at x.flat[ix:], its
    integers stored at q.flat[iq:][:32], with its scale and the sums of its first and last 16 integers. The NumPy
    statement's operations, on vectors: max |x| as the largest of the values' bits without their sign bit (the bits
    of non-negative floats order as their values do; a NaN's lie above every number's), d = max / 127 in float32,
    each quotient in float64, |quotient| + 1/2 floored and capped at 127, the sign put back, 0 where d = 0.
    (Element by element in Numba, with a float64 division each, this took ~3x as long: ~2.5 us per 768 values.)"""
    if not (is_f32_c_array(x) and isinstance(ix, types.Integer) and isinstance(q, types.Array)
            and q.dtype == types.int8 and q.layout == "C" and isinstance(iq, types.Integer)):
        return None

    def call(builder, name, result, arguments, values):
        # (any LLVM intrinsic, not only x86's)
        return builder.call(llvm_intrinsic(builder, name, result, arguments), values)

    def codegen(context, builder, signature, args):
        i32x32, f64x32, f32 = ivec(I32_IR, 32), ir.VectorType(ir.DoubleType(), 32), ir.FloatType()
        values = builder.load(lane_pointer(context, builder, signature.args[0], args[0], args[1], 32), align=4)
        bits = builder.and_(builder.bitcast(values, i32x32), ir.Constant(i32x32, [0x7FFFFFFF] * 32))
        largest = call(builder, "llvm.vector.reduce.umax.v32i32", I32_IR, [i32x32], [bits])
        d = builder.fdiv(builder.bitcast(largest, f32), ir.Constant(f32, 127.0))
        ratio = builder.fdiv(builder.fpext(values, f64x32), splat(builder, builder.fpext(d, ir.DoubleType()), 32))
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
        pointer = builder.bitcast(builder.gep(q_data, [args[3]]), ivec(I8_IR, 32).as_pointer())
        builder.store(builder.trunc(integers, ivec(I8_IR, 32)), pointer, align=1)
        halves = [builder.shuffle_vector(integers, integers, ir.Constant(ivec(I32_IR, 16), list(range(h, h + 16))))
                  for h in (0, 16)]
        sums = [call(builder, "llvm.vector.reduce.add.v16i32", I32_IR, [ivec(I32_IR, 16)], [half]) for half in halves]
        return context.make_tuple(builder, signature.return_type, [d, *sums])

    return types.Tuple((types.float32, types.int32, types.int32))(x, ix, q, iq), codegen


@njit(cache=True)
def quantize_activations_q8_into(x, T, q, d, s, s16):
    """quant.oracle.quantize_activations_q8 of x[:T], into q [>=T, K] int8, d [>=T, K / 32] float32, s [>=T, K / 32]
    float32 (the integer sums, exact in float32), and s16 [>=T, K / 16] int32, the sums of each half block (what
    the interleaved kernels start their dots from). Same float64 quotient and rounding, so the same integers."""
    K = q.shape[1]
    for t in range(T):
        for b in range(K // 32):
            scale, low, high = quantize_block_q8(x, t * x.shape[1] + 32 * b, q, t * K + 32 * b)
            d[t, b], s16[t, 2 * b], s16[t, 2 * b + 1], s[t, b] = scale, low, high, low + high


@njit(cache=True, error_model="numpy")  # x / 0 is a float, not an exception (an all-zero block's, overwritten)
def two_part_activations_into(x, T, q, d, v, d_v, s_v, s16_v):
    """quant.oracle.quantize_activations_two_part of x[:T], given its first part (q, d from quantize_activations_q8_into):
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
