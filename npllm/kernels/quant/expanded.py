"""A prefill's products on groups decoded once (Q4_K, Q5_K, Q6_K, IQ4_XS; record.Expansion): the unpacking of a
type's bit fields (nibbles, Q5_K's fifth bits, Q6_K's ql and qh, IQ4's codebook levels) paid once per group, not
once per four tokens.

From Expansion.tokens tokens on (EXPAND_FROM; Q5_K from 8), the walk (dispatch.interleaved_kernels) decodes each
group (a pair's two) into a row of a scratch e [2, expanded_bytes(K)] uint8 that stays in the cache:

    bytes 0 .. 8K          run u of 32 values (u < K/32): 256 bytes, word k's lane r = values 4k .. 4k+3 of row r
                           (Q8_0's layout), unsigned: q + bias (IQ4's levels + 128, Expansion.plus_128)
    8K + 32 i              f32x8: the eight rows' scales of run i of `size` values (d_r sc_ri)
    8K + 32 K/size + 32 u  f32x8 (types with mins): the mins' factors of run u (dmin_r mn_ru)

and its 4-token tiles read only that: per run of `size` values one integer dot starting at -bias s_x (intrinsics.
interleaved_idot: four or eight plain words, as lean as Q8_0's) and one float multiply-add, per run of 32 the mins'
term -(dmin_r mn_ru) (d_x s_x). The float sums are the type's own tile's, in its order (record.Expansion.block), so
the products are the same bits as without the scratch, and as the one-token walk's.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..cpu import REASSOC
from ..simd import vfma, vfmav, vzero, vzero16
from .intrinsics import group_bytes_of, interleaved_idot, machine, scale_loaders
from .record import Expansion

# Tokens from which a walk decodes each group once (record.Expansion.tokens; below: the type's own tile). One thread,
# 2048 x 768, old / new time at 8 tokens: Q4_K 0.90, Q5_K 1.10, Q6_K 1.00, IQ4_XS 0.98; at 16: 1.00, 1.19, 1.09,
# 1.06 (docs/quant.md, "A prefill decodes each group once").
EXPAND_FROM = 16


@njit(inline="always")
def expanded_bytes(K, size, mins):
    """Bytes of one group's row of the scratch, for rows of K values (the layout above)."""
    return 8 * K + 32 * (K // size) + (K if mins else 0)


def _plain_words(count: int):
    """words(...) for intrinsics.interleaved_idot: `count` stored words as they are."""

    def words(builder, context, array_type, w, iw, stride, groups, gfni):
        return [group_bytes_of(builder, context, array_type, w, iw, stride, groups, 32 * k) for k in range(count)]

    return words


def expanded_tile(x: Expansion):
    """tile(groups) -> njit tile(e, g, q, d, minus_ds, starts, t, n) (record.BlockKernels' tile signature, s and
    s16 replaced by expand_starts' -(d_x s_x) and starts for this walk's bias) over row g (a pair: rows g, g + 1) of
    a scratch filled by x.group."""

    def make(groups: int):
        idot = interleaved_idot(_plain_words(x.size // 4), groups, *machine(groups), x.most, x.plus_128)
        floats = scale_loaders(groups)[5]
        zero = vzero if groups == 1 else vzero16
        size, parts, block, mins = x.size, 32 // x.size, x.block, x.mins

        if x.bias(groups):
            @njit(inline="always")
            def start(starts, t, j, h):
                """-bias times the sum of the run's activations (expand_starts)."""
                return starts[t, parts * j + h]
        else:
            @njit(inline="always")
            def start(starts, t, j, h):
                return np.int32(0)

        @njit(fastmath=REASSOC, inline="always")
        def token(acc, e, iw, scale, q, d, starts, j, h, t):
            """acc[r] + scale_r (d_x (values_r . q_x)) for half h (size 16; 0 for 32) of activation block j."""
            ix = t * q.shape[1] + 32 * j + size * h
            return vfmav(acc, scale, vfma(zero(), d[t, j], idot(e, iw, e.shape[1], q, ix, start(starts, t, j, h))))

        @njit(fastmath=REASSOC, inline="always")
        def tile(e, g, q, d, s, starts, t, n):
            K, stride = q.shape[1], e.shape[1]
            at = g * stride
            scales_at, mins_at = at + 8 * K, at + 8 * K + 32 * (K // size)
            a0, a1, a2, a3 = zero(), zero(), zero(), zero()
            for u in range(K // 32):
                j = block(u)
                for h in range(parts):
                    scale, iw = floats(e, scales_at + 32 * (parts * u + h), stride), at + 256 * u + 8 * size * h
                    a0 = token(a0, e, iw, scale, q, d, starts, j, h, t)
                    if n > 1:
                        a1 = token(a1, e, iw, scale, q, d, starts, j, h, t + 1)
                    if n > 2:
                        a2 = token(a2, e, iw, scale, q, d, starts, j, h, t + 2)
                    if n > 3:
                        a3 = token(a3, e, iw, scale, q, d, starts, j, h, t + 3)
                if mins:  # s: expand_starts' -(d_x s_x)
                    mn = floats(e, mins_at + 32 * u, stride)
                    a0 = vfma(a0, s[t, j], mn)
                    if n > 1:
                        a1 = vfma(a1, s[t + 1, j], mn)
                    if n > 2:
                        a2 = vfma(a2, s[t + 2, j], mn)
                    if n > 3:
                        a3 = vfma(a3, s[t + 3, j], mn)
            return a0, a1, a2, a3

        return tile

    return make


@njit
def expand_starts(d, s, s16, T, bias, size, minus_ds, starts):
    """starts[t, i] = -bias (the sum of token t's activations in run i of `size`), from s16 [T, K / 16]
    (activations.py's sums of 16), and minus_ds[t, j] = -(d[t, j] s[t, j]) (the mins' factor, where minus_ds has
    columns), for t < T: computed once, read by the tiles from memory (a broadcast load), not computed and broadcast
    for every group."""
    for t in range(T):
        for j in range(minus_ds.shape[1]):
            minus_ds[t, j] = -(d[t, j] * s[t, j])
        for i in range(starts.shape[1]):
            if size == 32:
                starts[t, i] = np.int32(-bias) * (s16[t, 2 * i] + s16[t, 2 * i + 1])
            else:
                starts[t, i] = np.int32(-bias) * s16[t, i]


@njit(inline="always")
def in_order(u):
    """record.Expansion.block of a type whose runs are summed in the activations' order."""
    return u
