"""The 32-value blocks' kernels (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1): decoders of the file's blocks, and the products of
interleaved groups (quant/legacy.py draws the layout) on 8-bit activations:

    Q8_0:  out[t, 8g + r] = sum_b  d_r d_x (sum_k lane r of (word k . x[4k .. 4k+3]) - 128 s_x)
    Q4_0:  out[t, 8g + r] = sum_b  d_r d_x (sum_k lane r of (nibbles of word k . x[4k .. 4k+3]) - 8 s_x)
    Q5_0:  the same with the nibbles' fifth bits, - 16 s_x
    Q4_1, Q5_1 (W = d u + m):  sum_b d_r d_x (u_r . q_x) + m_r d_x s_x

vpdpbusd and vpmaddubsw multiply unsigned bytes by signed ones, so the stored values are unsigned: the nibbles u, and
Q8_0's q + 128. Each dot starts from -bias s_x, s_x the activation block's sum of q_x, which turns it into the dot of
u - bias in the same exact integer. (Without VNNI, Q8_0's bytes go back to q and take the sign trick: vpmaddubsw's
pairs of 255 x 127 would saturate.)
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit

from ...quant import legacy as layouts
from ..cpu import REASSOC
from ..simd import vfma, vfmav, vzero, vzero16
from .intrinsics import (I32_IR, Q8_0_BIAS, as_int8, ask_ahead, gather_words, group_bytes_of, high_bits_ir,
                         interleaved_idot, load_half, machine, nibble_words, scale_loaders)
from .record import BlockKernels

# Each type's sizes, read from its NumPy record (quant/legacy.py): bytes of one file block, and of one block of a
# group of eight interleaved rows. Numba takes module globals as constants: the kernels compile as with literals.
Q8_0_BLOCK, Q8_0_GROUP = layouts.Q8_0.block_bytes, layouts.Q8_0.interleaved_bytes
Q4_0_BLOCK, Q4_0_GROUP = layouts.Q4_0.block_bytes, layouts.Q4_0.interleaved_bytes
Q4_1_BLOCK, Q4_1_GROUP = layouts.Q4_1.block_bytes, layouts.Q4_1.interleaved_bytes
Q5_0_BLOCK, Q5_0_GROUP = layouts.Q5_0.block_bytes, layouts.Q5_0.interleaved_bytes
Q5_1_BLOCK, Q5_1_GROUP = layouts.Q5_1.block_bytes, layouts.Q5_1.interleaved_bytes

# ---------------------------------------------------------------------------------------------- decoders
# _decode_<type>(w, n, b, buf, at): block b of row n as float32 in buf[at : at + 32] (record.BlockKernels).

@njit(inline="always")
def _decode_q8_0(w, n, b, buf, at):
    base = Q8_0_BLOCK * b
    d = load_half(w, n * w.shape[1] + base)
    for j in range(32):
        buf[at + j] = np.float32(as_int8(w[n, base + 2 + j])) * d


@njit(inline="always")
def _decode_q4_0(w, n, b, buf, at):
    base = Q4_0_BLOCK * b
    d = load_half(w, n * w.shape[1] + base)
    for j in range(16):
        byte = np.int32(w[n, base + 2 + j])
        buf[at + j] = np.float32((byte & 15) - 8) * d
        buf[at + j + 16] = np.float32((byte >> 4) - 8) * d


@njit(inline="always")
def _decode_q4_1(w, n, b, buf, at):
    base = Q4_1_BLOCK * b
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
    base = Q5_0_BLOCK * b
    d = load_half(w, n * w.shape[1] + base)
    for j in range(16):
        low, high = _five_bits(w, n, base + 6, base + 2, j)
        buf[at + j] = d * np.float32(low - 16)
        buf[at + j + 16] = d * np.float32(high - 16)


@njit(inline="always")
def _decode_q5_1(w, n, b, buf, at):
    base = Q5_1_BLOCK * b
    d, m = load_half(w, n * w.shape[1] + base), load_half(w, n * w.shape[1] + base + 2)
    for j in range(16):
        low, high = _five_bits(w, n, base + 8, base + 4, j)
        buf[at + j] = d * np.float32(low) + m
        buf[at + j + 16] = d * np.float32(high) + m


# ---------------------------------------------------------------------------------------------- interleaved dots

def _q8_0_words(builder, context, array_type, w, iw, stride, groups, gfni):
    """Q8_0's eight words as stored (q + 128)."""
    return [group_bytes_of(builder, context, array_type, w, iw, stride, groups, 32 * k) for k in range(8)]


def _q4_words(builder, context, array_type, w, iw, stride, groups, gfni):
    """The nibbles of Q4_0's and Q4_1's four packed words."""
    return nibble_words(builder, context, array_type, w, iw, stride, groups)


def _q5_words(builder, context, array_type, w, iw, stride, groups, gfni):
    """Q5_0's and Q5_1's values: the nibbles of the four packed words after the fifth bits' word, each with its
    fifth bit from that word (byte i, bit k: value 4k + i's)."""
    nibbles = nibble_words(builder, context, array_type, w, iw, stride, groups, 32)
    qh = group_bytes_of(builder, context, array_type, w, iw, stride, groups, 0)
    return [builder.or_(word, high_bits_ir(builder, qh, ir.Constant(I32_IR, k), 1, gfni))
            for k, word in enumerate(nibbles)]


def idots(groups: int, avx2: bool, vnni: bool) -> dict:
    """The interleaved dots of this family, by name: idot(w, iw, stride, x, ix, start) (intrinsics.interleaved_idot)
    on Q8_0's stored bytes, Q4's nibbles and Q5's 5-bit values."""
    return {"q8_0": interleaved_idot(_q8_0_words, groups, avx2, vnni, 255, stored_plus_128=True),
            "q4_0": interleaved_idot(_q4_words, groups, avx2, vnni, 15),
            "q5_0": interleaved_idot(_q5_words, groups, avx2, vnni, 31)}


def blockwise(idot_name: str, block_bytes: int, bias, with_min: bool = False, dots=idots):
    """tile(groups) for blocks of 32 with one scale (Q8_0, Q4_0, Q5_0, IQ4_NL): acc[r] += d_r (d_x (dot of row r's
    32 stored values with q_x, from -bias s_x)); with_min (Q4_1, Q5_1: W = d u + m, m_r the eight float16 after the
    d_r) also + m_r (d_x s_x). bias(groups): the bias of the walk's stored values. (The tokens' terms are written
    out, not a function called four times: Numba's reference counting of the arrays passed into a function inlined
    under a branch costs more than a block's products.)"""

    def make(groups: int):
        idot = dots(groups, *machine(groups))[idot_name]
        halves = scale_loaders(groups)[0]
        zero = vzero if groups == 1 else vzero16
        minus_bias = np.int32(-bias(groups))
        values_at = 32 if with_min else 16  # the words (Q5: its fifth bits' word first) after the scales

        @njit(fastmath=REASSOC, inline="always")
        def tile(w, g, q, d, s, s16, t, n):
            stride, K = w.shape[1], q.shape[1]
            a0, a1, a2, a3 = zero(), zero(), zero(), zero()
            for b in range(K // 32):
                at = g * stride + block_bytes * b
                ask_ahead(w, at, block_bytes, groups, t)
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

        return tile

    return make


def plus_128_bias(groups: int) -> int:
    """The bias of values stored + 128 (Q8_0's, IQ4's) in a walk: 128, 0 where they go back to signed ones (AVX2
    without VNNI: intrinsics.interleaved_idot)."""
    return 128 if groups == 2 else Q8_0_BIAS


# ---------------------------------------------------------------------------------------------- gathers
# gather(w, base, r, group_bytes, row): row r of the group at w.flat[base:] back in the file's layout.

@njit(inline="always")
def _gather_q8_0(w, base, r, group_bytes, row):
    """File block: d, q[32]; stored q + 128."""
    for b in range(group_bytes // Q8_0_GROUP):
        at, to = base + Q8_0_GROUP * b, Q8_0_BLOCK * b
        row[to], row[to + 1] = w[at + 2 * r], w[at + 2 * r + 1]
        gather_words(w, at + 16, r, 8, row, to + 2)
        for j in range(to + 2, to + 34):
            row[j] ^= np.uint8(128)


def small_block_gather(scales: int, fifth: bool, file_size: int):
    """gather for a block of 32 with `scales` float16 fields (d, m), (fifth:) four bytes of fifth bits put back in
    the file's order (interleaved: byte i bit k is value 4k + i's; file: bit v of a u32 is value v's), then the 16
    bytes of nibbles (Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL)."""
    size = 16 * scales + (32 if fifth else 0) + 128

    @njit(inline="always")
    def gather(w, base, r, group_bytes, row):
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
            gather_words(w, words_at, r, 4, row, to + file_size - 16)

    return gather


Q8_0 = BlockKernels(name="Q8_0", decode=_decode_q8_0, tile=blockwise("q8_0", Q8_0_GROUP, plus_128_bias),
                    gather=_gather_q8_0)
Q4_0 = BlockKernels(name="Q4_0", decode=_decode_q4_0, tile=blockwise("q4_0", Q4_0_GROUP, lambda groups: 8),
                    gather=small_block_gather(1, False, Q4_0_BLOCK))
Q4_1 = BlockKernels(name="Q4_1", decode=_decode_q4_1,
                    tile=blockwise("q4_0", Q4_1_GROUP, lambda groups: 0, with_min=True),
                    gather=small_block_gather(2, False, Q4_1_BLOCK))
Q5_0 = BlockKernels(name="Q5_0", decode=_decode_q5_0, tile=blockwise("q5_0", Q5_0_GROUP, lambda groups: 16),
                    gather=small_block_gather(1, True, Q5_0_BLOCK))
Q5_1 = BlockKernels(name="Q5_1", decode=_decode_q5_1,
                    tile=blockwise("q5_0", Q5_1_GROUP, lambda groups: 0, with_min=True),
                    gather=small_block_gather(2, True, Q5_1_BLOCK))
RECORDS = (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1)
