"""The record of a block type's Numba pieces, beside its NumPy record (quant.QuantType) of the same name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True, kw_only=True)
class BlockKernels:
    """What kernels/quant computes a GGML type with; dispatch.py builds every dispatcher from these records.

    decode   njit (w, n, b, buf, at): block b of row n of w [N, row bytes] (the file's layout) as float32 into
             buf[at : at + block_size], in the order and with the formula of the type's NumPy dequantizer
    tile     (interleaved types) tile(groups) -> njit (w, g, q, d, s, s16, t, n) -> (a0, a1, a2, a3): the products
             of group g of interleaved rows (groups 1) or of the pair g, g + 1 (groups 2) with tokens t .. t + n - 1
             (n <= 4) of 8-bit activations (activations.py), one f32x8 (f32x16) accumulator per token
    gather   (interleaved types) njit (w, base, r, group_bytes, row): row r of the group whose bytes start at
             w.flat[base] (group_bytes long), back in the file's layout into row [row bytes] uint8
    matvec   (float types) njit (w, x, sums, out, col, n0, n1): out[col + n] = W[n] . x on float32 activations
    expand   (interleaved types whose tiles unpack bit fields) an Expansion: how a prefill decodes each group once
             into plain bytes for its tiles (expanded.py)
    """

    name: str
    decode: Callable
    tile: Callable | None = None
    gather: Callable | None = None
    matvec: Callable | None = None
    expand: Expansion | None = None


@dataclass(frozen=True, kw_only=True)
class Expansion:
    """A type's group decoded once into plain bytes (expanded.py draws the scratch's layout).

    group    njit (w, g, e, j): group g of interleaved w [G, group bytes] decoded into row j of e [2, expanded bytes]
             uint8: each run u of 32 values as 256 bytes (Q8_0's word layout) stored + bias, then the f32x8 scales
             of each run of `size` values, then (mins) the f32x8 mins' factors of each run of 32
    size     values per scale: 32, or 16 (Q6_K)
    mins     whether the type takes -(mins' factor) (d_x s_x) per run of 32 (Q4_K, Q5_K)
    bias     bias(groups) -> what the stored values are above the ones they stand for (the dot starts at -bias s_x)
    most     the largest stored value (AVX2 without VNNI sums products in int16 runs: intrinsics._run_length)
    plus_128 the values are signed ones stored + 128 (IQ4's levels: intrinsics.interleaved_idot)
    block    njit block(u) -> the activation block that run u meets (the runs in the order the type's own tile sums
             them, so that a prefill's sums are the one-token walk's bits)
    tokens   the products of at least this many tokens expand (fewer: the type's own tile; where the decoding pays
             back, measured: expanded.py)
    """

    group: Callable
    size: int
    mins: bool
    bias: Callable
    most: int
    plus_128: bool
    block: Callable
    tokens: int
