"""IQ4_NL and IQ4_XS: 4-bit indices into one fixed codebook of 16 non-linear levels (denser near zero, where most
weights lie), instead of 16 evenly spaced ones.

    KVALUES = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]    (int8)

The levels are int8, so the Numba model's products look each index up (one byte shuffle per word) and take integer
dots with 8-bit activations, as for Q8_0. Quantizing: per group of values (a block of 32, a sub-block of 32) the step s
of x ~ s KVALUES[i] with the least squared error among a few candidates (the largest value at either end of the
codebook, times each of kfit.FIT_FACTORS), each refined by least squares on its indices (s = Sum k x / Sum k^2).
Interleaved (table.interleave_rows), a block of a group of eight rows is

    IQ4_NL (144 bytes)   d_0 .. d_7 (float16) | word m = 0..3: byte_r[4m .. 4m+3] for r = 0..7      (Q4_0's layout)
    IQ4_XS (1104 bytes)  d_0 .. d_7 (float16) | sc[s][r] = ls - 32 (int8; 64 bytes) |
                         sub-block s = 0..7: word m = 0..3: qs_r[16 s + 4m .. 16 s + 4m+3] for r = 0..7
"""

from __future__ import annotations

import numpy as np

from .base import QK_K, QuantType, as_half, blocks_of, half_at, nibbles_of, pack_nibbles, per_row, rows_of_blocks, \
    words_of
from .kfit import FIT_FACTORS, FIT_ROUNDS, by_two_rules, dot_last, scales_nearest

KVALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
_LEVELS = KVALUES.astype(np.float32)
# The nearest level of v: every boundary between two levels (their midpoint) is a multiple of 1/2, so v's half-unit
# bin ceil(2 v) (the bin (k - 1) / 2 < v <= k / 2) lies on one side of each; a tie goes to the lower level. Bins are
# clipped to the codebook's range.
_MIDPOINTS = (KVALUES[1:].astype(np.float32) + KVALUES[:-1]) / 2
_BINS = np.arange(-256, 257)  # ceil(2 v), clipped
_NEAREST = np.searchsorted(_MIDPOINTS, _BINS / 2).astype(np.uint8)  # [513]: the index nearest each bin
_NEAREST_LEVEL = _LEVELS[_NEAREST]


def _levels(indices: np.ndarray) -> np.ndarray:
    """The codebook's level of each 4-bit index, as float32.                        # [...] uint8 -> [...] float32"""
    return _LEVELS[indices]


def dequantize_iq4_nl(raw: np.ndarray) -> np.ndarray:
    """IQ4_NL: 18 bytes per 32 values.

        bytes 0-1    d       float16 scale
        bytes 2-17   qs[16]  byte j: low nibble = index of value j, high nibble = index of value j + 16

        x[j] = d * KVALUES[i[j]]       i[j] in 0..15                   # [nb * 18] -> [nb * 32]
    """
    blocks = blocks_of(raw, 18)
    d = half_at(blocks, 0)
    return (d * _levels(nibbles_of(blocks[:, 2:]).reshape(-1, 32))).reshape(-1)


def _iq4_xs_scales(blocks: np.ndarray) -> np.ndarray:
    """IQ4_XS's eight 6-bit sub-block scales minus 32.                              # [nb, 136] -> [nb, 8] int8

        bytes 2-3    scales_h  u16: bits 2 s, 2 s + 1 = high 2 bits of ls[s]
        bytes 4-7    scales_l  byte k: low nibble = low 4 bits of ls[2k], high nibble = those of ls[2k + 1]
    """
    low = nibbles_of(blocks[:, 4:8]).swapaxes(1, 2).reshape(-1, 8)  # sub-block 2k + h: nibble h of byte k
    high = blocks[:, 2].astype(np.uint16) | (blocks[:, 3].astype(np.uint16) << 8)
    high = (high[:, None] >> (2 * np.arange(8, dtype=np.uint16))) & 3
    return (low | (high.astype(np.uint8) << 4)).astype(np.int8) - np.int8(32)


def dequantize_iq4_xs(raw: np.ndarray) -> np.ndarray:
    """IQ4_XS: 136 bytes per 256 values, eight sub-blocks of 32 each with a 6-bit scale.

        bytes 0-1     d         float16 super-scale
        bytes 2-7     scales    ls[8], 6 bits each (see _iq4_xs_scales)
        bytes 8-135   qs[128]   sub-block s in bytes 16 s .. 16 s + 15: low nibbles = values 0..15, high = 16..31

        x[32 s + j] = (d * (ls[s] - 32)) * KVALUES[i[32 s + j]]             # [nb * 136] -> [nb * 256]
    """
    blocks = blocks_of(raw, 136)
    scale = (half_at(blocks, 0) * _iq4_xs_scales(blocks).astype(np.float32))[:, :, None]  # [nb, 8, 1]
    indices = nibbles_of(blocks[:, 8:].reshape(-1, 8, 16)).reshape(-1, 8, 32)
    return (scale * _levels(indices)).reshape(-1)


# ---------------------------------------------------------------------------------------------------- quantizers

def _bins(x: np.ndarray, step: np.ndarray) -> np.ndarray:
    """ceil(2 x / step) clipped to -256..256, plus 256: the row of _NEAREST of each value (x / step = 0, level 1,
    where the step is 0: every value then 0).                                   # [..., n], [...] -> [..., n] int"""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        inverse = np.where(step != 0, 2 / np.where(step != 0, step, 1), 0).astype(np.float32)
        v = x * inverse[..., None]
    np.ceil(v, out=v)
    np.clip(v, -256, 256, out=v)
    return np.nan_to_num(v, copy=False).astype(np.intp) + 256  # NaN: 0 x an inverse beyond float32 (inf)


def _nearest_indices(x: np.ndarray, step: np.ndarray) -> np.ndarray:
    """The index of the level nearest x / step (the lower one on a tie).     # [..., n], [...] -> [..., n] uint8"""
    return _NEAREST[_bins(x, step)]


def _nearest_levels(x: np.ndarray, step: np.ndarray) -> np.ndarray:
    """The level nearest x / step, as float32.                               # [..., n], [...] -> [..., n] float32"""
    return _NEAREST_LEVEL[_bins(x, step)]


def _squared_error(x: np.ndarray, step: np.ndarray) -> np.ndarray:
    """sum (x - step KVALUES[i])^2 per group, i the nearest indices.                   # [..., n], [...] -> [...]"""
    e = x - step[..., None] * _nearest_levels(x, step)
    return dot_last(e, e)


def fit_codebook_step(x: np.ndarray) -> np.ndarray:
    """Per group, the step s (of either sign) of x ~ s KVALUES[i] with the least squared error among: the value of
    largest magnitude at level -127 or at level 113, times each f in FIT_FACTORS, each refined FIT_ROUNDS times by
    least squares on its nearest indices (s = Sum k x / Sum k^2, k = KVALUES[i]).        # [..., n] -> [...] float32"""
    x = x.astype(np.float32)
    largest = np.take_along_axis(x, np.abs(x).argmax(axis=-1)[..., None], axis=-1)[..., 0]
    best, best_s = np.full(x.shape[:-1], np.inf, np.float32), np.zeros(x.shape[:-1], np.float32)
    for end in (KVALUES[0], KVALUES[-1]):
        for f in FIT_FACTORS:
            s = (largest * np.float32(f / end)).astype(np.float32)
            for _ in range(FIT_ROUNDS):
                k = _nearest_levels(x, s)
                with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                    fit = (dot_last(k, x) / dot_last(k, k)).astype(np.float32)
                s = np.where(np.isfinite(fit) & (fit != 0), fit, s)
            error = _squared_error(x, s)
            better = error < best
            best, best_s = np.where(better, error, best), np.where(better, s, best_s)
    return best_s


def plain_step(x: np.ndarray) -> np.ndarray:
    """The plain rule's step: the value of largest magnitude at level -127.            # [..., n] -> [...] float32"""
    x = x.astype(np.float32)
    return np.take_along_axis(x, np.abs(x).argmax(axis=-1)[..., None], axis=-1)[..., 0] / np.float32(-127)


def quantize_iq4_nl(values: np.ndarray) -> np.ndarray:
    """[..., n] -> IQ4_NL bytes [nb * 18]: per block of 32 the scale d (stored as float16) of fit_codebook_step or
    of plain_step, whichever leaves the smaller squared error once stored, and each value the index of the level
    nearest x / d (d as stored)."""
    x = rows_of_blocks(values, 32)
    halves = [as_half(step(x)[:, None]) for step in (fit_codebook_step, plain_step)]  # [nb, 2] each
    steps = [h.copy().view(np.float16).astype(np.float32)[:, 0] for h in halves]
    fitted_closer = _squared_error(x, steps[0]) <= _squared_error(x, steps[1])
    d, step = np.where(fitted_closer[:, None], *halves), np.where(fitted_closer, *steps)
    return np.concatenate([d, pack_nibbles(_nearest_indices(x, step))], axis=1).reshape(-1)


def _pack_iq4_xs(d: np.ndarray, k: np.ndarray, x: np.ndarray) -> np.ndarray:
    """IQ4_XS bytes from d [nb, 1] float32 (a float16's value), the sub-block scales k [nb, 8] in -32..31 and the
    values x [nb, 8, 32]: each value the index nearest x / (d k), the step the decoder computes.  # -> [nb * 136]"""
    ls = (k.astype(np.int16) + 32).astype(np.uint8)  # 0..63
    step = d * k.astype(np.float32)  # [nb, 8], float32 as the decoder multiplies
    indices = _nearest_indices(x.astype(np.float32), step)  # [nb, 8, 32]
    qs = (indices[..., :16] | (indices[..., 16:] << 4)).reshape(-1, 128)
    high = ((ls.astype(np.uint16) >> 4) << (2 * np.arange(8, dtype=np.uint16))).sum(axis=1, dtype=np.uint16)
    low = (ls[:, 0::2] & 15) | ((ls[:, 1::2] & 15) << 4)
    return np.concatenate([as_half(d), high.astype("<u2").view(np.uint8).reshape(-1, 2), low, qs],
                          axis=1).reshape(-1)


def _iq4_xs_rule(fitted: bool):
    """The plain rule (each sub-block's step puts its largest value at level -127) or the fitted one
    (fit_codebook_step), the steps then rounded to the nearest d k, d the float16 nearest max |step| / 31."""

    def rule(values: np.ndarray) -> np.ndarray:
        x = rows_of_blocks(values, QK_K).reshape(-1, 8, 32).astype(np.float32)
        steps = fit_codebook_step(x) if fitted else plain_step(x)
        d, k = scales_nearest(steps.astype(np.float64), 31)
        return _pack_iq4_xs(d, k.astype(np.int8), x)

    return rule


def quantize_iq4_xs(values: np.ndarray) -> np.ndarray:
    """[..., n] (n a multiple of 256) -> IQ4_XS bytes [nb * 136]: per super-block the closer of the plain and the
    fitted rule's bytes (kfit.by_two_rules)."""
    return by_two_rules(values, (_iq4_xs_rule(False), _iq4_xs_rule(True)), dequantize_iq4_xs, 136)


# ---------------------------------------------------------------------------------------------------- interleaving

def _interleave_iq4_nl(blocks: np.ndarray) -> list:
    """IQ4_NL (d 0..1, qs 2..17): Q4_0's layout, the indices as words."""
    return [blocks[..., 0:2], words_of(blocks[..., 2:18])]


def _interleave_iq4_xs(blocks: np.ndarray) -> list:
    """IQ4_XS (d 0..1, scales 2..7, qs 8..135): each sub-block's scale minus 32 a signed byte."""
    sc = _iq4_xs_scales(blocks.reshape(-1, 136)).view(np.uint8).reshape(blocks.shape[:3] + (8,))
    return [blocks[..., 0:2], per_row(sc), words_of(blocks[..., 8:136])]


IQ4_NL = QuantType(name="IQ4_NL", type_id=20, block_size=32, block_bytes=18, dequantize=dequantize_iq4_nl,
                   quantize=quantize_iq4_nl, scale_fields=(0,), interleave=_interleave_iq4_nl, interleaved_bytes=144,
                   activations="int8")
IQ4_XS = QuantType(name="IQ4_XS", type_id=23, block_size=QK_K, block_bytes=136, dequantize=dequantize_iq4_xs,
                   quantize=quantize_iq4_xs, scale_fields=(0,), interleave=_interleave_iq4_xs, interleaved_bytes=1104,
                   activations="int8")
RECORDS = (IQ4_NL, IQ4_XS)
