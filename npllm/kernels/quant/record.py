"""The record of a block type's Numba pieces, beside its NumPy record (quant.QuantType) of the same name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
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
    prefetch the walks (True: pairs of groups, False: one group) whose one-token products ask for the bytes of the
             groups two ahead first (dispatch.py, STREAM_PREFETCH)
    """

    name: str
    decode: Callable
    tile: Callable | None = None
    gather: Callable | None = None
    matvec: Callable | None = None
    prefetch: tuple[bool, ...] = ()
