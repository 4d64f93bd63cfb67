"""F32, F16 and BF16 rows: read 8 values at a time straight from their bytes, on float32 activations (the model's
products on these types: one token's rows dotted with x, several tokens' through cpu.py's panel tile)."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types

from ..cpu import REASSOC
from ..simd import f32_vector, f32x8, vfmav, vload, vsum, vzero
from .intrinsics import byte_reader, load_half
from .record import BlockKernels


def _f32_lanes(builder, at):
    return builder.load(builder.bitcast(at, f32_vector(8).as_pointer()), align=1)


def _f16_lanes(builder, at):
    return builder.fpext(builder.load(builder.bitcast(at, ir.VectorType(ir.HalfType(), 8).as_pointer()), align=1),
                         f32_vector(8))


def _bf16_lanes(builder, at):
    """BF16 is the high half of a float32: each 16-bit word shifted into the high half, exactly."""
    i16x8, i32x8 = ir.VectorType(ir.IntType(16), 8), ir.VectorType(ir.IntType(32), 8)
    words = builder.zext(builder.load(builder.bitcast(at, i16x8.as_pointer()), align=1), i32x8)
    return builder.bitcast(builder.shl(words, ir.Constant(i32x8, [16] * 8)), f32_vector(8))


def _f32_scalar(builder, at):
    return builder.load(builder.bitcast(at, ir.FloatType().as_pointer()), align=1)


def _bf16_scalar(builder, at):
    word = builder.zext(builder.load(builder.bitcast(at, ir.IntType(16).as_pointer()), align=1), ir.IntType(32))
    return builder.bitcast(builder.shl(word, ir.Constant(ir.IntType(32), 16)), ir.FloatType())


# v<kind>_bytes(array, index): f32x8 of the 8 values of a float row stored as F32, F16 or BF16 at bytes
# array.flat[index:]; load_<kind>(array, index): the one float stored there, as float32
vload_f32_bytes, vload_f16_bytes, vload_bf16_bytes = (byte_reader(f32x8, lanes)
                                                      for lanes in (_f32_lanes, _f16_lanes, _bf16_lanes))
load_f32, load_bf16 = byte_reader(types.float32, _f32_scalar), byte_reader(types.float32, _bf16_scalar)


@njit(inline="always")
def _decode_f32(w, n, b, buf, at):
    buf[at] = load_f32(w, n * w.shape[1] + 4 * b)


@njit(inline="always")
def _decode_f16(w, n, b, buf, at):
    buf[at] = load_half(w, n * w.shape[1] + 2 * b)


@njit(inline="always")
def _decode_bf16(w, n, b, buf, at):
    buf[at] = load_bf16(w, n * w.shape[1] + 2 * b)


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


F32 = BlockKernels(name="F32", decode=_decode_f32, matvec=_float_matvec_rows(vload_f32_bytes, _decode_f32, 4))
F16 = BlockKernels(name="F16", decode=_decode_f16, matvec=_float_matvec_rows(vload_f16_bytes, _decode_f16, 2))
BF16 = BlockKernels(name="BF16", decode=_decode_bf16, matvec=_float_matvec_rows(vload_bf16_bytes, _decode_bf16, 2))
RECORDS = (F32, F16, BF16)
