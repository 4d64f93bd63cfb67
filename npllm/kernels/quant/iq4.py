"""IQ4_NL's and IQ4_XS's kernels: decoders of the file's blocks, and the products of interleaved groups (quant/iq4.py
draws the layout) on 8-bit activations. A word's 4-bit indices become their codebook levels in one byte shuffle
(vpshufb: the 16 levels in each 128-bit lane), stored + 128 (1 .. 241, unsigned) for vpdpbusd, the dot starting from
-128 s_x as Q8_0's does; on AVX2 without VNNI the levels go back to signed and take the sign trick.

    IQ4_NL:  out[t, 8g + r] = sum_b  d_r d_x (sum_k lane r of (KVALUES[word k] . x[4k .. 4k+3]))
    IQ4_XS:  out[t, 8g + r] = sum_b sum_i (d_r (ls_ri - 32)) d_x (KVALUES[i_r] . q_x)      i: sub-block of 32
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ...quant import KVALUES, QK_K
from ...quant import iq4 as layouts
from ..cpu import REASSOC
from ..simd import vfma, vfmav, vzero, vzero16
from .expanded import EXPAND_FROM, in_order
from .intrinsics import (ask_ahead, byte_table, field_unpacker, gather_words, interleaved_idot, load_half, machine,
                         nibble_words, scale_loaders, store_floats)
from .legacy import blockwise, plus_128_bias, small_block_gather
from .record import BlockKernels, Expansion

# Each type's sizes, read from its NumPy record (quant/iq4.py): bytes of one file block, and of one block of a group
# of eight interleaved rows. Numba takes module globals as constants: the kernels compile as with literals.
IQ4_NL_BLOCK, IQ4_NL_GROUP = layouts.IQ4_NL.block_bytes, layouts.IQ4_NL.interleaved_bytes
IQ4_XS_BLOCK, IQ4_XS_GROUP = layouts.IQ4_XS.block_bytes, layouts.IQ4_XS.interleaved_bytes
_LEVELS = KVALUES.astype(np.float32)
_STORED_LEVELS = [int(v) + 128 for v in KVALUES]  # unsigned, for the machine's integer dot


# ---------------------------------------------------------------------------------------------- decoders

@njit(inline="always")
def _decode_iq4_nl(w, n, b, buf, at):
    """Block b (18 bytes: f16 d, 16 bytes of indices) as d * KVALUES[i]."""
    base = IQ4_NL_BLOCK * b
    d = load_half(w, n * w.shape[1] + base)
    for j in range(16):
        byte = np.int32(w[n, base + 2 + j])
        buf[at + j] = d * _LEVELS[byte & 15]
        buf[at + j + 16] = d * _LEVELS[byte >> 4]


@njit(inline="always")
def _iq4_xs_scale(w, n, base, s):
    """Sub-block s's 6-bit scale minus 32, of the IQ4_XS block at w[n, base:] (quant/iq4.py _iq4_xs_scales)."""
    low = (np.int32(w[n, base + 4 + s // 2]) >> (4 * (s % 2))) & 15
    high = (np.int32(w[n, base + 2 + s // 4]) >> (2 * (s % 4))) & 3
    return (low | (high << 4)) - 32


@njit(inline="always")
def _decode_iq4_xs(w, n, b, buf, at):
    """Block b (136 bytes) as (d (ls_s - 32)) KVALUES[i], sub-block s of 32 at a time."""
    base = IQ4_XS_BLOCK * b
    d = load_half(w, n * w.shape[1] + base)
    for s in range(8):
        scale = d * np.float32(_iq4_xs_scale(w, n, base, s))
        for j in range(16):
            byte = np.int32(w[n, base + 8 + 16 * s + j])
            buf[at + 32 * s + j] = scale * _LEVELS[byte & 15]
            buf[at + 32 * s + j + 16] = scale * _LEVELS[byte >> 4]


# ---------------------------------------------------------------------------------------------- interleaved dots

def _level_words(shuffle: bool):
    """The eight words of 32 values' indices (four packed words of nibbles) as their levels + 128."""

    def words(builder, context, array_type, w, iw, stride, groups, gfni):
        indices = nibble_words(builder, context, array_type, w, iw, stride, groups)
        return [byte_table(builder, word, _STORED_LEVELS, shuffle) for word in indices]

    return words


def idots(groups: int, avx2: bool, vnni: bool) -> dict:
    """{"iq4": idot(w, iw, stride, x, ix, start)}: intrinsics.interleaved_idot of the levels of the 32 indices at
    w.flat[iw:] (an IQ4_NL block's after its scales, or one IQ4_XS sub-block's), stored + 128; the byte shuffle
    where the walk has AVX2 (a pair: AVX-512), plain LLVM otherwise."""
    return {"iq4": interleaved_idot(_level_words(avx2), groups, avx2, vnni, 241, stored_plus_128=True)}


# ---------------------------------------------------------------------------------------------- tiles

def _iq4_xs_tile(groups: int):
    """tile(groups) of IQ4_XS: each sub-block i of 32 (activation block j = 8 b + i) adds (d_r sc_ri) (d_x
    (KVALUES[i_r] . q_x)), sc_ri = ls_ri - 32 a signed byte per row."""
    idot = idots(groups, *machine(groups))["iq4"]
    halves, _, int8s, _, _, _ = scale_loaders(groups)
    zero = vzero if groups == 1 else vzero16
    minus_bias = np.int32(-plus_128_bias(groups))

    @njit(fastmath=REASSOC, inline="always")
    def token(acc, w, iw, scale, q, d, s16, j, t):
        """acc[r] + (d_r sc_ri) (d_x (levels_r . q_x)) for activation block j."""
        start = minus_bias * (s16[t, 2 * j] + s16[t, 2 * j + 1])
        return vfmav(acc, scale, vfma(zero(), d[t, j], idot(w, iw, w.shape[1], q, t * q.shape[1] + 32 * j, start)))

    @njit(fastmath=REASSOC, inline="always")
    def tile(w, g, q, d, s, s16, t, n):
        a0, a1, a2, a3 = zero(), zero(), zero(), zero()
        for b in range(q.shape[1] // QK_K):
            at, stride = g * w.shape[1] + IQ4_XS_GROUP * b, w.shape[1]
            ask_ahead(w, at, IQ4_XS_GROUP, groups, t)
            d_w = halves(w, at, stride)
            for i in range(8):
                scale, iw, j = vfmav(zero(), d_w, int8s(w, at + 16 + 8 * i, stride)), at + 80 + 128 * i, 8 * b + i
                a0 = token(a0, w, iw, scale, q, d, s16, j, t)
                if n > 1:
                    a1 = token(a1, w, iw, scale, q, d, s16, j, t + 1)
                if n > 2:
                    a2 = token(a2, w, iw, scale, q, d, s16, j, t + 2)
                if n > 3:
                    a3 = token(a3, w, iw, scale, q, d, s16, j, t + 3)
        return a0, a1, a2, a3

    return tile


def _expand_iq4_xs():
    """IQ4_XS's group for a prefill's scratch (record.Expansion): run u = 8 b + i is sub-block i, its levels + 128
    (the low nibbles of its four packed words, then the high ones: nibble_words' order), its scales d_r sc_ri."""
    halves, _, int8s = scale_loaders(1)[:3]
    unpack = field_unpacker(4, 4, table=_STORED_LEVELS)

    @njit(fastmath=REASSOC, inline="always")
    def group(w, g, e, j):
        stride, row = w.shape[1], j * e.shape[1]
        K = stride // IQ4_XS_GROUP * QK_K
        for b in range(stride // IQ4_XS_GROUP):
            at = g * stride + IQ4_XS_GROUP * b
            d_w = halves(w, at, stride)
            for i in range(8):
                u = 8 * b + i
                store_floats(e, row + 8 * K + 32 * u, vfmav(vzero(), d_w, int8s(w, at + 16 + 8 * i, stride)))
                unpack(w, at + 80 + 128 * i, 0, 0, 0, e, row + 256 * u)
                unpack(w, at + 80 + 128 * i, 4, 0, 0, e, row + 256 * u + 128)

    return Expansion(group=group, size=32, mins=False, bias=plus_128_bias, most=241, plus_128=True, block=in_order,
                     tokens=EXPAND_FROM)


# ---------------------------------------------------------------------------------------------- gathers

@njit(inline="always")
def _gather_iq4_xs(w, base, r, group_bytes, row):
    """d, scales_h, scales_l (each sub-block's scale stored minus 32 put back as 6 bits), qs[128]."""
    for b in range(group_bytes // IQ4_XS_GROUP):
        at, to = base + IQ4_XS_GROUP * b, IQ4_XS_BLOCK * b
        row[to], row[to + 1] = w[at + 2 * r], w[at + 2 * r + 1]
        row[to + 2:to + 8] = 0
        for i in range(8):
            u = (w[at + 16 + 8 * i + r] + np.uint8(32)) & np.uint8(63)
            row[to + 2 + i // 4] |= (u >> np.uint8(4)) << np.uint8(2 * (i % 4))
            row[to + 4 + i // 2] |= (u & np.uint8(15)) << np.uint8(4 * (i % 2))
            gather_words(w, at + 80 + 128 * i, r, 4, row, to + 8 + 16 * i)


IQ4_NL = BlockKernels(name="IQ4_NL", decode=_decode_iq4_nl,
                      tile=blockwise("iq4", IQ4_NL_GROUP, plus_128_bias, dots=idots),
                      gather=small_block_gather(1, False, IQ4_NL_BLOCK))
IQ4_XS = BlockKernels(name="IQ4_XS", decode=_decode_iq4_xs, tile=_iq4_xs_tile, gather=_gather_iq4_xs,
                      expand=_expand_iq4_xs())
RECORDS = (IQ4_NL, IQ4_XS)
