"""The K-quants' kernels (Q2_K .. Q6_K): decoders of the file's super-blocks, and the products of interleaved groups
(quant/kquants.py draws the layout) on 8-bit activations. Each sub-block of 32 (Q4_K, Q5_K; Q6_K's groups of two
sub-blocks of 16) meets its activation block in one interleaved integer dot; per sub-block one float multiply-add
applies the eight rows' scales (d_r sc_ri), and the mins' term -(dmin_r mn_ri) (d_x s_x) where the type has mins.
Q2_K and Q3_K meet activations in two 8-bit parts (15 bits; quant.oracle.quantize_activations_two_part).
"""

from __future__ import annotations

from functools import partial

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from ...quant import QK_K
from ...quant import kquants as layouts
from ..cpu import REASSOC
from ..simd import f32_vector, vfma, vfmav, vzero, vzero16
from .expanded import EXPAND_FROM, in_order
from .intrinsics import (F32XN_IR, I32_IR, GFNI, broadcast4, chained_dots, field_of, group_bytes_of, high_bits_ir,
                         idot_args_ok, as_int8, ivec, offset_of, splat32, ask_ahead, field_unpacker, gather_words,
                         load_half, machine, scale_loaders, store_floats)
from .record import BlockKernels, Expansion

# Each type's sizes, read from its NumPy record (quant/kquants.py): bytes of one file block, and of one block of a
# group of eight interleaved rows. Numba takes module globals as constants: the kernels compile as with literals.
Q2_K_BLOCK, Q2_K_GROUP = layouts.Q2_K.block_bytes, layouts.Q2_K.interleaved_bytes
Q3_K_BLOCK, Q3_K_GROUP = layouts.Q3_K.block_bytes, layouts.Q3_K.interleaved_bytes
Q4_K_BLOCK, Q4_K_GROUP = layouts.Q4_K.block_bytes, layouts.Q4_K.interleaved_bytes
Q5_K_BLOCK, Q5_K_GROUP = layouts.Q5_K.block_bytes, layouts.Q5_K.interleaved_bytes
Q6_K_BLOCK, Q6_K_GROUP = layouts.Q6_K.block_bytes, layouts.Q6_K.interleaved_bytes

# ---------------------------------------------------------------------------------------------- decoders
# _decode_<type>(w, n, b, buf, at): block b of row n as float32 in buf[at : at + 256] (record.BlockKernels).

@njit(inline="always")
def _scale_min_q4_k(w, n, at, s):
    """6-bit scale and min of sub-block s from the 12 scale bytes at w[n, at:] (see quant.kquants._scales_6bit)."""
    if s < 4:
        return np.int32(w[n, at + s]) & 63, np.int32(w[n, at + 4 + s]) & 63
    c = np.int32(w[n, at + 4 + s])
    sc = (c & 15) | ((np.int32(w[n, at + s - 4]) >> 6) << 4)
    mn = (c >> 4) | ((np.int32(w[n, at + s]) >> 6) << 4)
    return sc, mn


@njit(inline="always")
def _decode_q4_k(w, n, b, buf, at):
    base = Q4_K_BLOCK * b
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


@njit(inline="always")
def _decode_q5_k(w, n, b, buf, at):
    base = Q5_K_BLOCK * b
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
def _q6_k(w, n, at, h, g, l):
    """6-bit value (0..63) of group g (0..3), lane l (0..31) of half h of the Q6_K block at w[n, at:]."""
    ql = np.int32(w[n, at + 64 * h + 32 * (g & 1) + l])
    low = (ql >> 4) if g >= 2 else (ql & 15)
    high = (np.int32(w[n, at + 128 + 32 * h + l]) >> (2 * g)) & 3
    return low | (high << 4)


@njit(inline="always")
def _decode_q6_k(w, n, b, buf, at):
    base = Q6_K_BLOCK * b
    d = load_half(w, n * w.shape[1] + base + 208)
    for h in range(2):
        for g in range(4):
            for l in range(32):
                i = 128 * h + 32 * g + l
                scale = d * np.float32(as_int8(w[n, base + 192 + i // 16]))
                buf[at + i] = scale * np.float32(_q6_k(w, n, base, h, g, l) - 32)


@njit(inline="always")
def _two_bits(w, n, qs, i):
    """Low 2 bits of value i (0..255) of a Q2_K/Q3_K block whose 64 bytes of 2-bit fields start at byte qs."""
    return (np.int32(w[n, qs + 32 * (i // 128) + i % 32]) >> (2 * ((i % 128) // 32))) & 3


@njit(inline="always")
def _decode_q2_k(w, n, b, buf, at):
    base = Q2_K_BLOCK * b
    d, dmin = load_half(w, n * w.shape[1] + base + 80), load_half(w, n * w.shape[1] + base + 82)
    for s in range(16):
        packed = np.int32(w[n, base + s])
        scale, offset = d * np.float32(packed & 15), dmin * np.float32(packed >> 4)
        for j in range(16):
            buf[at + 16 * s + j] = scale * np.float32(_two_bits(w, n, base + 16, 16 * s + j)) - offset


@njit(inline="always")
def _decode_q3_k(w, n, b, buf, at):
    base = Q3_K_BLOCK * b
    d = load_half(w, n * w.shape[1] + base + 108)
    for s in range(16):
        low4 = np.int32(w[n, base + 96 + s % 8]) >> (4 * (s // 8)) & 15
        high2 = (np.int32(w[n, base + 104 + s % 4]) >> (2 * (s // 4))) & 3
        scale = d * np.float32((low4 | (high2 << 4)) - 32)
        for j in range(16):
            i = 16 * s + j
            bit = (np.int32(w[n, base + i % 32]) >> (i // 32)) & 1
            buf[at + i] = scale * np.float32(_two_bits(w, n, base + 32, i) - (1 - bit) * 4)


# ---------------------------------------------------------------------------------------------- interleaved dots

def _interleaved_nibble_idot(groups: int, avx2: bool, vnni: bool, fifth: bool = False):
    """idot(w, iw, stride, shift, x, ix) -> f32x8 (f32x16 for a pair): lane r = the exact integer dot of
    (byte >> shift) & 15 of row r's bytes in the eight words at w.flat[iw:] (a Q4_K run: shift 0 its even
    sub-block, 4 its odd one) with x.flat[ix : ix + 32]. With `fifth`, idot(w, iw, stride, shift, iqh, qh_shift, x,
    ix): each value also takes ((qh >> qh_shift) & 1) << 4 from the words at w.flat[iqh:] (Q5_K's fifth bits of
    sub-block qh_shift; high_bits_ir)."""

    gfni = avx2 and GFNI  # avx2 is only set for a pair where the machine has AVX-512 (X16_IDOTS)

    def codegen(context, builder, signature, args):
        w_type, w, iw, stride, shift = signature.args[0], *args[:4]
        ws = [field_of(builder, group_bytes_of(builder, context, w_type, w, iw, stride, groups, 32 * k), shift, 15)
              for k in range(8)]
        if fifth:
            qhs = [group_bytes_of(builder, context, w_type, w, args[4], stride, groups, 32 * k) for k in range(8)]
            ws = [builder.or_(word, high_bits_ir(builder, qh, args[5], 1, gfni)) for word, qh in zip(ws, qhs)]
        x_type, x, ix = signature.args[-2], args[-2], args[-1]
        xs = [broadcast4(builder, context, x_type, x, offset_of(builder, ix, 4 * k), 8 * groups) for k in range(8)]
        zero = ir.Constant(ivec(I32_IR, 8 * groups), [0] * 8 * groups)
        dots = chained_dots(builder, zero, ws, xs, False, avx2, vnni, 31 if fifth else 15)
        return builder.sitofp(dots, f32_vector(8 * groups))

    if fifth:
        def typer(typingctx, w, iw, stride, shift, iqh, qh_shift, x, ix):
            if idot_args_ok(w, (iw, stride, shift, iqh, qh_shift), x, ix):
                return F32XN_IR[groups](w, iw, stride, shift, iqh, qh_shift, x, ix), codegen
    else:
        def typer(typingctx, w, iw, stride, shift, x, ix):
            if idot_args_ok(w, (iw, stride, shift), x, ix):
                return F32XN_IR[groups](w, iw, stride, shift, x, ix), codegen

    return intrinsic(typer)


def _interleaved_split_idot(groups: int, avx2: bool, vnni: bool, part: int, bits: int = 4, high_bits: int = 2,
                            two_part: bool = False):
    """idot(w, iql, ql_shift, iqh, qh_shift, stride, x, ix, start) -> f32x8 (f32x16 for a pair): lane r = start +
    the exact integer dot of row r's 16 values 16 part .. 16 part + 15 of one group of 32, q = (ql >> ql_shift) &
    (2^bits - 1) | ((qh >> qh_shift) & (2^high_bits - 1)) << bits from the ql and qh runs at w.flat[iql:] and
    w.flat[iqh:] (8 words each; no qh where high_bits = 0), with x.flat[ix + 16 part:][:16]. Q6_K: bits 4, high
    bits 2 (and a start of -32 times the activations' sum: the dot of q - 32).
    two_part (Q3_K: 2 and 1, a start of -4 times the sum; Q2_K: 2 and 0): idot(w, iql, ql_shift, iqh, qh_shift,
    stride, x, ix, ix2, start), the activations in two 8-bit parts (quant.oracle.quantize_activations_two_part), the dot
    with the 15-bit v = 128 x.flat[ix:] + x.flat[ix2:] taken as 128 times the first part's plus the second's: the
    words are unpacked once for both."""

    def codegen(context, builder, signature, args):
        w_type, w, iql, ql_shift, iqh, qh_shift, stride = signature.args[0], *args[:6]
        ws = []
        for k in range(4 * part, 4 * part + 4):
            low = field_of(builder, group_bytes_of(builder, context, w_type, w, iql, stride, groups, 32 * k),
                         ql_shift, 2 ** bits - 1)
            if high_bits:
                high = high_bits_ir(builder, group_bytes_of(builder, context, w_type, w, iqh, stride, groups, 32 * k),
                                  qh_shift, high_bits, avx2 and GFNI, to=bits)
                low = builder.or_(low, high)
            ws.append(low)
        x_type, x, starts = signature.args[6], args[6], args[7:-1]

        def dots(ix, start):
            xs = [broadcast4(builder, context, x_type, x, offset_of(builder, ix, 4 * k), 8 * groups)
                  for k in range(4 * part, 4 * part + 4)]
            return chained_dots(builder, start, ws, xs, False, avx2, vnni, 2 ** (bits + high_bits) - 1)

        start = splat32(builder, builder.trunc(args[-1], I32_IR) if args[-1].type.width > 32 else args[-1], 8 * groups)
        if not two_part:
            return builder.sitofp(dots(starts[0], start), f32_vector(8 * groups))
        zero = ir.Constant(start.type, [0] * 8 * groups)
        first = builder.shl(dots(starts[0], zero), ir.Constant(start.type, [7] * 8 * groups))
        return builder.sitofp(builder.add(first, dots(starts[1], start)), f32_vector(8 * groups))

    if two_part:
        def typer(typingctx, w, iql, ql_shift, iqh, qh_shift, stride, x, ix, ix2, start):
            if (idot_args_ok(w, (iql, ql_shift, iqh, qh_shift, stride, ix), x, ix2)
                    and start in (types.int32, types.int64)):
                return F32XN_IR[groups](w, iql, ql_shift, iqh, qh_shift, stride, x, ix, ix2, start), codegen
    else:
        def typer(typingctx, w, iql, ql_shift, iqh, qh_shift, stride, x, ix, start):
            if idot_args_ok(w, (iql, ql_shift, iqh, qh_shift, stride), x, ix) and start in (types.int32, types.int64):
                return F32XN_IR[groups](w, iql, ql_shift, iqh, qh_shift, stride, x, ix, start), codegen

    return intrinsic(typer)


def idots(groups: int, avx2: bool, vnni: bool) -> dict:
    """The interleaved dots of this family, by name: a Q4_K run's nibbles (q4_k(w, iw, stride, shift, x, ix)), with
    Q5_K's fifth bits (q5_k(w, iw, stride, shift, iqh, qh_shift, x, ix)); the first or last 16 of a Q6_K group's 32
    values (q6_k_low / _high(w, iql, ql_shift, iqh, qh_shift, stride, x, ix, start)); Q3_K's and Q2_K's as Q6_K's,
    on 3 and 2 bits and two-part activations (q3_k_low ... (w, iql, ql_shift, iqh, qh_shift, stride, x, ix, ix2,
    start))."""
    split = partial(_interleaved_split_idot, groups, avx2, vnni)
    return {"q4_k": _interleaved_nibble_idot(groups, avx2, vnni), "q6_k_low": split(0), "q6_k_high": split(1),
            "q5_k": _interleaved_nibble_idot(groups, avx2, vnni, fifth=True),
            "q3_k_low": split(0, 2, 1, two_part=True), "q3_k_high": split(1, 2, 1, two_part=True),
            "q2_k_low": split(0, 2, 0, two_part=True), "q2_k_high": split(1, 2, 0, two_part=True)}


def _closed_over(groups: int):
    """(the family's dots, the scale loaders, the zero vector) of one group or a pair: what the tiles use."""
    return idots(groups, *machine(groups)), scale_loaders(groups), (vzero if groups == 1 else vzero16)


# ---------------------------------------------------------------------------------------------- tiles
# tile(groups) -> njit tile(w, g, q, d, s, s16, t, n) (record.BlockKernels).

def _k_quant_32(block_bytes: int, fifth: bool):
    """Q4_K, and Q5_K (its fifth bits from the qh run after the nibbles): each sub-block i of 32 (activation
    block j = 8 b + i) adds (d_r sc_ri) (d_x (u_r . q_x)) and takes (dmin_r mn_ri) (d_x s_x), the mins' term.
    (The mins' terms go straight into the token's sum: summed apart and taken once per block, they held four
    more vector registers, and the tile spilled: ~4% of Q4_K's time, ~6% of Q5_K's.)"""

    def make(groups: int):
        found, (halves, bytes_, int8s, low_nibbles, high_nibbles, _), zero = _closed_over(groups)
        idot_q4_k, idot_q5_k = found["q4_k"], found["q5_k"]

        @njit(fastmath=REASSOC, inline="always")
        def token(acc, w, iw, shift, iqh, scales, q, d, s, j, i, t):
            """acc[r] + (d_r sc_ri) (d_x (u_r . q_x)) - (dmin_r mn_ri) (d_x s_x), for sub-block j; scales: the pair
            (d_r sc_ri, dmin_r mn_ri) of scale_min."""
            scale, mn = scales
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
                ask_ahead(w, at, block_bytes, groups, t)
                d_w, dmin, iqh = halves(w, at, stride), halves(w, at + 16, stride), at + 1184
                for p in range(4):  # run p: sub-block 2p in the low nibbles, 2p + 1 in the high ones
                    # The two written out, not a loop: each nibble shift is then a constant, and a low nibble costs
                    # one mask and a high one one instruction, not a shift and a mask each (measured: 0.8-0.85x the
                    # time). (A helper holding the four tokens' branches would not do: Numba counts references to
                    # the arrays passed into an inlined function with branches, at ~7x the cost of the products.)
                    i, iw = 2 * p, at + 160 + 256 * p
                    scales = scale_min(w, at, d_w, dmin, i)
                    a0 = token(a0, w, iw, 0, iqh, scales, q, d, s, 8 * b + i, i, t)
                    if n > 1:
                        a1 = token(a1, w, iw, 0, iqh, scales, q, d, s, 8 * b + i, i, t + 1)
                    if n > 2:
                        a2 = token(a2, w, iw, 0, iqh, scales, q, d, s, 8 * b + i, i, t + 2)
                    if n > 3:
                        a3 = token(a3, w, iw, 0, iqh, scales, q, d, s, 8 * b + i, i, t + 3)
                    scales = scale_min(w, at, d_w, dmin, i + 1)
                    a0 = token(a0, w, iw, 4, iqh, scales, q, d, s, 8 * b + i + 1, i + 1, t)
                    if n > 1:
                        a1 = token(a1, w, iw, 4, iqh, scales, q, d, s, 8 * b + i + 1, i + 1, t + 1)
                    if n > 2:
                        a2 = token(a2, w, iw, 4, iqh, scales, q, d, s, 8 * b + i + 1, i + 1, t + 2)
                    if n > 3:
                        a3 = token(a3, w, iw, 4, iqh, scales, q, d, s, 8 * b + i + 1, i + 1, t + 3)
            return a0, a1, a2, a3

        return tile

    return make


def _q6_k_tile(groups: int):
    """tile(groups) of Q6_K (record.BlockKernels)."""
    found, (halves, bytes_, int8s, low_nibbles, high_nibbles, _), zero = _closed_over(groups)
    idot_q6_k_low, idot_q6_k_high = found["q6_k_low"], found["q6_k_high"]

    @njit(fastmath=REASSOC, inline="always")
    def q6_k_token(acc, w, ql, ql_shift, qh, qh_shift, scales, q, d, s16, j, t):
        """acc[r] += (d_r sc_ri) (d_x ((q - 32)_r . q_x)) for the two sub-blocks of 16 of group j of 32; scales: the
        pair (d_r sc_ri, d_r sc_r(i+1)) of q6_k_scales."""
        scale_low, scale_high = scales
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
            at = g * w.shape[1] + Q6_K_GROUP * b
            ask_ahead(w, at, Q6_K_GROUP, groups, t)
            d_w = halves(w, at, w.shape[1])
            for h in range(2):
                ql, qh, i, j = at + 144 + 512 * h, at + 1168 + 256 * h, 8 * h, 8 * b + 4 * h
                scales = q6_k_scales(w, at, d_w, i)  # groups 0, 2, 1, 3: q6_k's order, so the same bits
                acc = q6_k_token(acc, w, ql, 0, qh, 0, scales, q, d, s16, j, t)
                scales = q6_k_scales(w, at, d_w, i + 4)
                acc = q6_k_token(acc, w, ql, 4, qh, 4, scales, q, d, s16, j + 2, t)
                scales = q6_k_scales(w, at, d_w, i + 2)
                acc = q6_k_token(acc, w, ql + 256, 0, qh, 2, scales, q, d, s16, j + 1, t)
                scales = q6_k_scales(w, at, d_w, i + 6)
                acc = q6_k_token(acc, w, ql + 256, 4, qh, 6, scales, q, d, s16, j + 3, t)
        return acc

    @njit(fastmath=REASSOC, inline="always")
    def q6_k(w, g, q, d, s, s16, t, n):
        """Q6_K: group gg of half h (activation block j = 8 b + 4 h + gg) holds sub-blocks i = 8 h + 2 gg and
        i + 1 of 16."""
        if n == 1:
            return q6_k_one(w, g, q, d, s16, t), zero(), zero(), zero()
        a0, a1, a2, a3 = zero(), zero(), zero(), zero()
        for b in range(q.shape[1] // QK_K):
            at = g * w.shape[1] + Q6_K_GROUP * b
            ask_ahead(w, at, Q6_K_GROUP, groups, t)
            d_w = halves(w, at, w.shape[1])
            for h in range(2):
                for k in range(2):
                    # Groups gg = k and k + 2 share ql run 2h + k, the first its low nibbles, the second its high
                    # ones: written out, so that the nibble shifts are constants (as in k_quant_32; all four
                    # groups written out ran out of registers). The high bits: bits 2gg of qh run h.
                    ql, qh, i, j = at + 144 + 256 * (2 * h + k), at + 1168 + 256 * h, 8 * h + 2 * k, 8 * b + 4 * h + k
                    scales = q6_k_scales(w, at, d_w, i)
                    a0 = q6_k_token(a0, w, ql, 0, qh, 2 * k, scales, q, d, s16, j, t)
                    if n > 1:
                        a1 = q6_k_token(a1, w, ql, 0, qh, 2 * k, scales, q, d, s16, j, t + 1)
                    if n > 2:
                        a2 = q6_k_token(a2, w, ql, 0, qh, 2 * k, scales, q, d, s16, j, t + 2)
                    if n > 3:
                        a3 = q6_k_token(a3, w, ql, 0, qh, 2 * k, scales, q, d, s16, j, t + 3)
                    scales = q6_k_scales(w, at, d_w, i + 4)
                    a0 = q6_k_token(a0, w, ql, 4, qh, 2 * k + 4, scales, q, d, s16, j + 2, t)
                    if n > 1:
                        a1 = q6_k_token(a1, w, ql, 4, qh, 2 * k + 4, scales, q, d, s16, j + 2, t + 1)
                    if n > 2:
                        a2 = q6_k_token(a2, w, ql, 4, qh, 2 * k + 4, scales, q, d, s16, j + 2, t + 2)
                    if n > 3:
                        a3 = q6_k_token(a3, w, ql, 4, qh, 2 * k + 4, scales, q, d, s16, j + 2, t + 3)
        return a0, a1, a2, a3

    return q6_k


def _q3_k_tile(groups: int):
    """tile(groups) of Q3_K (record.BlockKernels), on activations in two 8-bit parts."""
    found, (halves, bytes_, int8s, low_nibbles, high_nibbles, _), zero = _closed_over(groups)
    idot_q3_k_low, idot_q3_k_high = found["q3_k_low"], found["q3_k_high"]

    # Q3_K and Q2_K meet activations in two 8-bit parts (quant.oracle.quantize_activations_two_part): q [T, 2K] holds
    # each token's first part then its second, d the scale of their 15-bit sum v = 128 q + q' (the first part's
    # over 128), s16 the sums of v (two_part_activations_into).

    @njit(fastmath=REASSOC, inline="always")
    def q3_k_token(acc, w, iqs, qs_shift, ihm, hm_shift, scales, q, d, s16, j, t):
        """acc[r] += (d_r sc_ri) (d_x ((q - 4)_r . v_x)) for the two sub-blocks of 16 of activation block j; scales:
        the pair (d_r sc_ri, d_r sc_r(i+1))."""
        scale_low, scale_high = scales
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
            at, stride = g * w.shape[1] + Q3_K_GROUP * b, w.shape[1]
            ask_ahead(w, at, Q3_K_GROUP, groups, t)
            d_w, ihm = halves(w, at, stride), at + 144
            for i in range(8):
                iqs, shift, j = at + 400 + 256 * (i // 4), 2 * (i % 4), 8 * b + i
                scales = (vfmav(zero(), d_w, int8s(w, at + 16 + 16 * i, stride)),
                          vfmav(zero(), d_w, int8s(w, at + 24 + 16 * i, stride)))
                a0 = q3_k_token(a0, w, iqs, shift, ihm, i, scales, q, d, s16, j, t)
                if n > 1:
                    a1 = q3_k_token(a1, w, iqs, shift, ihm, i, scales, q, d, s16, j, t + 1)
                if n > 2:
                    a2 = q3_k_token(a2, w, iqs, shift, ihm, i, scales, q, d, s16, j, t + 2)
                if n > 3:
                    a3 = q3_k_token(a3, w, iqs, shift, ihm, i, scales, q, d, s16, j, t + 3)
        return a0, a1, a2, a3

    return q3_k


def _q2_k_tile(groups: int):
    """tile(groups) of Q2_K (record.BlockKernels), on activations in two 8-bit parts."""
    found, (halves, bytes_, int8s, low_nibbles, high_nibbles, _), zero = _closed_over(groups)
    idot_q2_k_low, idot_q2_k_high = found["q2_k_low"], found["q2_k_high"]

    @njit(fastmath=REASSOC, inline="always")
    def q2_k_token(acc, w, iqs, qs_shift, scales, mins, q, d, s16, j, t):
        """acc[r] += (d_r sc_ri) (d_x (q_r . v_x)) - (dmin_r mn_ri) (d_x s_x) for the two sub-blocks of 16 of
        activation block j (s_x the sum of the 16 activations a sub-block meets); scales and mins: the pairs
        (d_r sc_ri, d_r sc_r(i+1)) and (dmin_r mn_ri, dmin_r mn_r(i+1))."""
        (scale_low, scale_high), (min_low, min_high) = scales, mins
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
            at, stride = g * w.shape[1] + Q2_K_GROUP * b, w.shape[1]
            ask_ahead(w, at, Q2_K_GROUP, groups, t)
            d_w, dmin = halves(w, at, stride), halves(w, at + 16, stride)
            for i in range(8):
                iqs, shift, j, sc = at + 160 + 256 * (i // 4), 2 * (i % 4), 8 * b + i, at + 32 + 16 * i
                scales = (vfmav(zero(), d_w, low_nibbles(w, sc, stride)), vfmav(zero(), d_w, low_nibbles(w, sc + 8,
                                                                                                         stride)))
                mins = (vfmav(zero(), dmin, high_nibbles(w, sc, stride)), vfmav(zero(), dmin, high_nibbles(w, sc + 8,
                                                                                                           stride)))
                a0 = q2_k_token(a0, w, iqs, shift, scales, mins, q, d, s16, j, t)
                if n > 1:
                    a1 = q2_k_token(a1, w, iqs, shift, scales, mins, q, d, s16, j, t + 1)
                if n > 2:
                    a2 = q2_k_token(a2, w, iqs, shift, scales, mins, q, d, s16, j, t + 2)
                if n > 3:
                    a3 = q2_k_token(a3, w, iqs, shift, scales, mins, q, d, s16, j, t + 3)
        return a0, a1, a2, a3

    return q2_k


# ---------------------------------------------------------------------------------------------- expansions
# group(w, g, e, j): group g decoded into row j of a prefill's scratch (record.Expansion, expanded.py).

def _expand_scale_min(block_bytes: int, fifth: bool):
    """Q4_K's and Q5_K's group: run u = 8 b + i is sub-block i of super-block b (the nibbles of run i // 2 at
    shift 4 (i % 2), Q5_K's fifth bits bit i of the qh run), its scales d_r sc_ri, its mins' factors dmin_r mn_ri
    (what _k_quant_32's scale_min computes)."""
    halves, bytes_ = scale_loaders(1)[:2]
    unpack = field_unpacker(8, 4, 1 if fifth else 0)

    @njit(fastmath=REASSOC, inline="always")
    def group(w, g, e, j):
        stride, row = w.shape[1], j * e.shape[1]
        K = stride // block_bytes * QK_K
        for b in range(stride // block_bytes):
            at = g * stride + block_bytes * b
            d_w, dmin = halves(w, at, stride), halves(w, at + 16, stride)
            for i in range(8):
                u = 8 * b + i
                store_floats(e, row + 8 * K + 32 * u, vfmav(vzero(), d_w, bytes_(w, at + 32 + 8 * i, stride)))
                store_floats(e, row + 9 * K + 32 * u, vfmav(vzero(), dmin, bytes_(w, at + 96 + 8 * i, stride)))
                unpack(w, at + 160 + 256 * (i // 2), 4 * (i % 2), at + 1184, i, e, row + 256 * u)

    return Expansion(group=group, size=32, mins=True, bias=lambda groups: 0, most=31 if fifth else 15, plus_128=False,
                     block=in_order, tokens=8 if fifth else EXPAND_FROM)


@njit(inline="always")
def _q6_k_block(u):
    """Run u of a Q6_K scratch: groups 0, 2, 1, 3 of each half (q6_k's order of summation)."""
    return (u & ~3) | ((u & 1) << 1) | ((u >> 1) & 1)


def _expand_q6_k():
    """Q6_K's group: run u = 8 b + 4 h + p is group gg (p = 0, 1, 2, 3: gg = 0, 2, 1, 3) of half h of super-block b,
    its values q (0..63, bias 32: the dot of q - 32), its two runs of 16 scaled by d_r sc_ri, i = 8 h + 2 gg and
    i + 1 (what q6_k_scales computes)."""
    halves, _, int8s = scale_loaders(1)[:3]
    unpack = field_unpacker(8, 4, 2)

    @njit(fastmath=REASSOC, inline="always")
    def group(w, g, e, j):
        stride, row = w.shape[1], j * e.shape[1]
        K = stride // Q6_K_GROUP * QK_K
        for b in range(stride // Q6_K_GROUP):
            at = g * stride + Q6_K_GROUP * b
            d_w = halves(w, at, stride)
            for h in range(2):
                for p in range(4):
                    u, gg = 8 * b + 4 * h + p, ((p & 1) << 1) | (p >> 1)
                    i = 8 * h + 2 * gg
                    store_floats(e, row + 8 * K + 64 * u, vfmav(vzero(), d_w, int8s(w, at + 16 + 8 * i, stride)))
                    store_floats(e, row + 8 * K + 64 * u + 32, vfmav(vzero(), d_w, int8s(w, at + 24 + 8 * i,
                                                                                           stride)))
                    unpack(w, at + 144 + 256 * (2 * h + (gg & 1)), 4 * (gg >> 1), at + 1168 + 256 * h, 2 * gg, e,
                           row + 256 * u)

    return Expansion(group=group, size=16, mins=False, bias=lambda groups: 32, most=63, plus_128=False,
                     block=_q6_k_block, tokens=EXPAND_FROM)


# ---------------------------------------------------------------------------------------------- gathers
# gather(w, base, r, group_bytes, row): row r of the group at w.flat[base:] back in the file's layout.

def _gather_scale_min(q5: bool):
    """Q4_K's and Q5_K's gather: d, dmin, the 12 bytes of 6-bit scales and mins (repacked as quant/kquants.py's
    _pack_scales_6bit: sc, mn[0..3] whole, sc, mn[4..7] split over bytes 8..11), (Q5_K: qh[32],) qs[128]."""
    size, file_size = (Q5_K_GROUP, Q5_K_BLOCK) if q5 else (Q4_K_GROUP, Q4_K_BLOCK)

    @njit(inline="always")
    def gather(w, base, r, group_bytes, row):
        for b in range(group_bytes // size):
            at, to = base + size * b, file_size * b
            row[to], row[to + 1] = w[at + 2 * r], w[at + 2 * r + 1]
            row[to + 2], row[to + 3] = w[at + 16 + 2 * r], w[at + 17 + 2 * r]
            for j in range(4):
                sc_lo, sc_hi = w[at + 32 + 8 * j + r], w[at + 32 + 8 * (j + 4) + r]
                mn_lo, mn_hi = w[at + 96 + 8 * j + r], w[at + 96 + 8 * (j + 4) + r]
                row[to + 4 + j] = (sc_lo & 63) | ((sc_hi >> 4) << 6)
                row[to + 8 + j] = (mn_lo & 63) | ((mn_hi >> 4) << 6)
                row[to + 12 + j] = (sc_hi & 15) | ((mn_hi & 15) << 4)
            for p in range(4):
                gather_words(w, at + 160 + 256 * p, r, 8, row, to + (48 if q5 else 16) + 32 * p)
            if q5:
                gather_words(w, at + 1184, r, 8, row, to + 16)

    return gather


@njit(inline="always")
def _gather_q6_k(w, base, r, group_bytes, row):
    """ql[128], qh[64], scales[16], d."""
    for b in range(group_bytes // Q6_K_GROUP):
        at, to = base + Q6_K_GROUP * b, Q6_K_BLOCK * b
        for c in range(4):
            gather_words(w, at + 144 + 256 * c, r, 8, row, to + 32 * c)
        for h in range(2):
            gather_words(w, at + 1168 + 256 * h, r, 8, row, to + 128 + 32 * h)
        for i in range(16):
            row[to + 192 + i] = w[at + 16 + 8 * i + r]
        row[to + 208], row[to + 209] = w[at + 2 * r], w[at + 2 * r + 1]


@njit(inline="always")
def _gather_q2_k(w, base, r, group_bytes, row):
    """scales[16], qs[64], d, dmin."""
    for b in range(group_bytes // Q2_K_GROUP):
        at, to = base + Q2_K_GROUP * b, Q2_K_BLOCK * b
        for i in range(16):
            row[to + i] = w[at + 32 + 8 * i + r]
        for h in range(2):
            gather_words(w, at + 160 + 256 * h, r, 8, row, to + 16 + 32 * h)
        row[to + 80], row[to + 81], row[to + 82], row[to + 83] = (w[at + 2 * r], w[at + 2 * r + 1],
                                                                  w[at + 16 + 2 * r], w[at + 17 + 2 * r])


@njit(inline="always")
def _gather_q3_k(w, base, r, group_bytes, row):
    """hmask[32], qs[64], scales[12] (quant/kquants.py's _pack_scales_q3_k of the scales stored minus 32), d."""
    for b in range(group_bytes // Q3_K_GROUP):
        at, to = base + Q3_K_GROUP * b, Q3_K_BLOCK * b
        gather_words(w, at + 144, r, 8, row, to)
        for h in range(2):
            gather_words(w, at + 400 + 256 * h, r, 8, row, to + 32 + 32 * h)
        row[to + 96:to + 108] = 0
        for i in range(16):
            u = (w[at + 16 + 8 * i + r] + np.uint8(32)) & np.uint8(63)  # the 6-bit scale: stored minus 32
            row[to + 96 + i % 8] |= (u & np.uint8(15)) << np.uint8(4 * (i // 8))
            row[to + 104 + i % 4] |= (u >> np.uint8(4)) << np.uint8(2 * (i // 4))
        row[to + 108], row[to + 109] = w[at + 2 * r], w[at + 2 * r + 1]


Q2_K = BlockKernels(name="Q2_K", decode=_decode_q2_k, tile=_q2_k_tile, gather=_gather_q2_k)
Q3_K = BlockKernels(name="Q3_K", decode=_decode_q3_k, tile=_q3_k_tile, gather=_gather_q3_k)
Q4_K = BlockKernels(name="Q4_K", decode=_decode_q4_k, tile=_k_quant_32(Q4_K_GROUP, False),
                    gather=_gather_scale_min(False), expand=_expand_scale_min(Q4_K_GROUP, False))
Q5_K = BlockKernels(name="Q5_K", decode=_decode_q5_k, tile=_k_quant_32(Q5_K_GROUP, True),
                    gather=_gather_scale_min(True), expand=_expand_scale_min(Q5_K_GROUP, True))
Q6_K = BlockKernels(name="Q6_K", decode=_decode_q6_k, tile=_q6_k_tile, gather=_gather_q6_k, expand=_expand_q6_k())
RECORDS = (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)
