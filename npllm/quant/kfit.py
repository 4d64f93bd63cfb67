"""How npllm chooses a super-block's scales (the K-quants; IQ4_XS's sub-block scales too): two rules per type, and
per super-block the closer of their results to the values (`closest`).

  - covering: each sub-block's range covered (nothing clipped, every error at most half a step), its scales rounded
    up onto their grid;
  - fitted: per sub-block a few candidate steps (and offsets), each refined by least squares on its levels, the
    least squared error kept, then rounded to the nearest point of the scales' grid (clipping where that lowers the
    squared error).
"""

from __future__ import annotations

import numpy as np

from .base import QK_K, QuantizationError, rows_of_blocks


def _half_at_least(v: np.ndarray) -> np.ndarray:
    """The smallest float16 >= v (v >= 0), as float32: a super-scale that never shrinks the range it must cover."""
    with np.errstate(over="ignore"):  # an overflow becomes inf, refused just below
        half = v.astype(np.float16)
    half = np.where(half.astype(np.float64) < v, np.nextafter(half, np.float16(np.inf)), half)
    if not np.all(np.isfinite(half)):
        raise QuantizationError("values too large for a float16 super-block scale (|x| must stay below about 1e6)")
    return half.astype(np.float32)


def _scales_on_grid(needed: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    """Round each sub-block's needed scale up onto the grid d * k, k in 0..top, with d a float16 >= max / top.

    Rounding up keeps every sub-block's range covered. d * k is exact in float32 (11 + 7 significant bits), so the
    decoder's float32 product gives back exactly the scale used here.  # [nb, S] -> d [nb, 1], k [nb, S] uint8
    """
    d = _half_at_least(needed.max(axis=1, keepdims=True).astype(np.float64) / top)
    with np.errstate(divide="ignore", invalid="ignore"):
        k = np.where(d > 0, np.ceil(needed / d.astype(np.float64)), 0)
    return d, np.clip(k, 0, top).astype(np.uint8)



def dot_last(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """sum over the last axis of a * b (einsum: ~4x faster than (a * b).sum(-1) on rows of 16 or 32).
                                                                                       # [..., n] x2 -> [...]"""
    return np.einsum("...i,...i->...", a, b)


def _sum_last(a: np.ndarray) -> np.ndarray:
    """sum over the last axis (einsum, as dot_last).                                    # [..., n] -> [...]"""
    return np.einsum("...i->...", a)


def extreme_last(a: np.ndarray, pick=np.maximum) -> np.ndarray:
    """max (or, with pick=np.minimum, min) over the last axis, a power of two long, by halving: log2(n) passes over
    half the data, where a.max(-1) runs a loop per row of 16 (~10 ns a value).            # [..., n] -> [...]"""
    while a.shape[-1] > 1:
        a = pick(a[..., : a.shape[-1] // 2], a[..., a.shape[-1] // 2:])
    return a[..., 0]


def _reciprocal(step: np.ndarray) -> np.ndarray:
    """1 / step, and 0 where the step is 0 (every level then 0), in the step's dtype; a reciprocal beyond that
    dtype's range is inf (the fit's float32 on subnormal steps), which its caller's checks discard."""
    with np.errstate(divide="ignore", over="ignore"):
        return np.where(step != 0, 1 / np.where(step != 0, step, 1), 0).astype(step.dtype)


def _affine_levels(x: np.ndarray, step: np.ndarray, offset: np.ndarray, top: int) -> np.ndarray:
    """q = clip(round((x + offset) / step), 0, top) (times 1 / step, once per sub-block: the division is the
    search's costliest pass), 0 where the step is 0.                         # [..., n], [...] x2 -> [..., n]"""
    q = x + offset[..., None]
    with np.errstate(invalid="ignore", over="ignore"):
        q *= _reciprocal(step)[..., None]
    np.round(q, out=q)
    return np.clip(q, 0, top, out=q)


def covering_scale_min(values: np.ndarray, top: int, sub: int = 32, scale_top: int = 63):
    """The covering rule for x = (d sc) q - dmin mn, q in 0..top, sub-blocks of `sub` values, sc and mn in
    0..scale_top (Q4_K: top 15, Q5_K: 31, sub-blocks of 32 with 6-bit sc and mn; Q2_K: top 3, sub-blocks of 16
    with 4-bit ones). Per sub-block:
      1. mn_needed = -min(0, min x): the offset that brings the smallest value to q = 0;
         dmin = smallest float16 >= max(mn_needed) / scale_top, mn = ceil(mn_needed / dmin) (so dmin mn >= mn_needed);
      2. sc_needed = (max x + dmin mn) / top: the step that reaches the largest value at q = top;
         d = smallest float16 >= max(sc_needed) / scale_top, sc = ceil(sc_needed / d);
      3. q = clip(round((x + dmin mn) / (d sc)), 0, top).
    The grid [-dmin mn, top d sc - dmin mn] contains every value of the sub-block, so nothing is clipped and each
    error is at most half a step d sc / 2.
    # [..., n] -> d, dmin [nb, 1]; sc, mn [nb, 256 / sub]; q [nb, 256 / sub, sub]
    """
    x = rows_of_blocks(values, QK_K).reshape(-1, QK_K // sub, sub).astype(np.float64)
    mn_needed = -np.minimum(extreme_last(x, np.minimum), 0.0)
    dmin, mn = _scales_on_grid(mn_needed, scale_top)
    offset = (dmin * mn.astype(np.float32)).astype(np.float64)  # exactly what the decoder computes
    d, sc = _scales_on_grid((extreme_last(x) + offset) / top, scale_top)
    step = (d * sc.astype(np.float32)).astype(np.float64)
    return d, dmin, sc, mn, _affine_levels(x, step, offset, top).astype(np.uint8)


# The fitted rule's first steps, in covering steps, each refined FIT_ROUNDS times by least squares. With an offset
# (Q2_K, Q4_K, Q5_K): the first centred on the range (clipping both ends), the others from the minimum; Q3_K and
# Q6_K scale their covering step of either sign by each. (Chosen on stories260K's and Gaussian weights; llama.cpp's
# Q4_K search lands at the same error.)
FIT_FACTORS = (0.7, 0.92, 1.0, 1.08)
FIT_ROUNDS = 4


def _least_squares_step_offset(x: np.ndarray, q: np.ndarray, step: np.ndarray, offset: np.ndarray):
    """The step s > 0 and offset m >= 0 that minimise sum (s q - m - x)^2 for these levels q; where the levels
    cannot tell them (all equal) or the fit leaves the allowed signs, the given ones.  # [.., n] x2, [..] x2 -> [..] x2

    Normal equations:  s = (n Sqx - Sq Sx) / (n Sqq - Sq^2),  m = (s Sq - Sx) / n;  with m held at 0: s = Sqx / Sqq.
    """
    n = x.shape[-1]  # the sums in x's dtype, the solve in float64 (n Sqq - Sq^2 cancels)
    sq, sx, sqq, sqx = (a.astype(np.float64) for a in (_sum_last(q), _sum_last(x), dot_last(q, q), dot_last(q, x)))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        s = (n * sqx - sq * sx) / (n * sqq - sq * sq)
        m = (s * sq - sx) / n
        s_at_zero = sqx / sqq
    s, m = np.where(m < 0, s_at_zero, s), np.where(m < 0, 0.0, m)
    keep = ~(np.isfinite(s) & np.isfinite(m) & (s > 0))
    return np.where(keep, step, s).astype(step.dtype), np.where(keep, offset, m).astype(offset.dtype)


def _affine_error(x: np.ndarray, step: np.ndarray, offset: np.ndarray, top: int) -> np.ndarray:
    """sum (x - (step q - offset))^2 per sub-block, q the levels _affine_levels gives.  # [..., n], [...] x2 -> [...]"""
    e = x - (step[..., None] * _affine_levels(x, step, offset, top) - offset[..., None])
    return dot_last(e, e)


def _fit_step_offset(x: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    """Per sub-block, the step s and offset m (x ~ s q - m, q in 0..top) with the least squared error among a few
    candidates: the covering pair, and for each f in FIT_FACTORS the covering step times f (the first centred on
    the range, the others from the minimum), refined by least squares on its levels. Searched in float32 (half the
    memory traffic of float64; the chosen bytes are compared in float64 by _closer).    # [..., n] -> [...] x2"""
    x = x.astype(np.float32)
    low, high = np.minimum(extreme_last(x, np.minimum), np.float32(0)), extreme_last(x)
    span = high - low
    best_s, best_m = span / top, -low
    best = _affine_error(x, best_s, best_m, top)
    for i, f in enumerate(FIT_FACTORS):
        s = span * np.float32(f / top)
        m = -low if i else np.maximum(-low - span * np.float32((1 - f) / 2), np.float32(0))  # the first: centred
        for _ in range(FIT_ROUNDS):
            s, m = _least_squares_step_offset(x, _affine_levels(x, s, m, top), s, m)
        error = _affine_error(x, s, m, top)
        better = error < best
        best, best_s, best_m = np.where(better, error, best), np.where(better, s, best_s), np.where(better, m, best_m)
    return best_s.astype(np.float64), best_m.astype(np.float64)


def scales_nearest(needed: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    """Each sub-block's scale rounded to the nearest of d * k, k in -top..top, d the float16 nearest max|v| / top.
                                                                 # [nb, S] -> d [nb, 1] float32, k [nb, S] float64"""
    with np.errstate(over="ignore"):
        d = (np.abs(needed).max(axis=1, keepdims=True) / top).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        k = np.where(d > 0, np.round(needed / d.astype(np.float64)), 0)
    return d, np.clip(k, -top, top)


def fitted_scale_min(values: np.ndarray, top: int, sub: int = 32, scale_top: int = 63):
    """The fitted rule for the types of covering_scale_min (same outputs): _fit_step_offset's step and offset per
    sub-block, each rounded to the nearest point of its 6-bit (4-bit) grid, then q for those exact grid values."""
    x = rows_of_blocks(values, QK_K).reshape(-1, QK_K // sub, sub).astype(np.float64)
    s, m = _fit_step_offset(x, top)
    dmin, mn = scales_nearest(m, scale_top)
    d, sc = scales_nearest(s, scale_top)
    mn, sc = mn.astype(np.uint8), sc.astype(np.uint8)
    offset = (dmin * mn.astype(np.float32)).astype(np.float64)
    step = (d * sc.astype(np.float32)).astype(np.float64)
    return d, dmin, sc, mn, _affine_levels(x, step, offset, top).astype(np.uint8)


def _signed_levels(x: np.ndarray, step: np.ndarray, low: int, high: int) -> np.ndarray:
    """k = clip(round(x / step), low, high), and 0 where the step is 0.      # [..., n], [...] -> [..., n]"""
    with np.errstate(invalid="ignore", over="ignore"):
        k = x * _reciprocal(step)[..., None]
    np.round(k, out=k)
    return np.clip(k, low, high, out=k)


def _fit_signed_step(x: np.ndarray, low: int, high: int) -> np.ndarray:
    """Per sub-block, the step s of either sign (x ~ s k, k in low..high, low = -high - 1) with the least squared
    error among: for each sign, the step that covers the sub-block times each f in FIT_FACTORS, refined by least
    squares on its levels (s = Sum k x / Sum k^2). Searched in float32, as _fit_step_offset.  # [..., n] -> [...]"""
    x = x.astype(np.float32)
    above, below = np.maximum(extreme_last(x), np.float32(0)), np.maximum(-extreme_last(x, np.minimum), np.float32(0))
    best, best_s = np.full(x.shape[:-1], np.inf, np.float32), np.zeros(x.shape[:-1], np.float32)
    for sign, reach in ((1.0, np.maximum(above / high, below / -low)), (-1.0, np.maximum(below / high, above / -low))):
        for f in FIT_FACTORS:
            s = reach * np.float32(sign * f)
            for _ in range(FIT_ROUNDS):
                k = _signed_levels(x, s, low, high)
                with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                    fit = (dot_last(k, x) / dot_last(k, k)).astype(np.float32)
                s = np.where(np.isfinite(fit) & (fit * sign > 0), fit, s)
            e = x - s[..., None] * _signed_levels(x, s, low, high)
            error = dot_last(e, e)
            better = error < best
            best, best_s = np.where(better, error, best), np.where(better, s, best_s)
    return best_s.astype(np.float64)


def fitted_signed_scale(values: np.ndarray, low: int, high: int, scale_top: int):
    """The fitted rule for Q3_K (k in -4..3, 6-bit signed sc) and Q6_K (k in -32..31, int8 sc): x = (d sc) k on
    sub-blocks of 16. _fit_signed_step per sub-block, rounded to the nearest d sc, then k for that exact step.
                                                            # [..., n] -> d [nb, 1], sc [nb, 16] int8, k [nb, 16, 16]"""
    x = rows_of_blocks(values, QK_K).reshape(-1, 16, 16).astype(np.float64)
    d, sc = scales_nearest(_fit_signed_step(x, low, high), scale_top)
    sc = sc.astype(np.int8)
    step = (d * sc.astype(np.float32)).astype(np.float64)
    return d, sc, _signed_levels(x, step, low, high)


def covering_q6_k(values: np.ndarray):
    """The covering rule for Q6_K: each sub-block of 16 needs step max|x| / 31 (so +-max|x| lie within k in
    -31..31); d = smallest float16 >= max(step) / 127, sc = ceil(step / d) (0..127); k = clip(round(x / (d sc)),
    -32, 31). Nothing is clipped and each error is at most d sc / 2.    # [..., n] -> d [nb, 1], sc, k [nb, 16, 16]"""
    x = rows_of_blocks(values, QK_K).reshape(-1, 16, 16).astype(np.float64)
    d, sc = _scales_on_grid(extreme_last(np.abs(x)) / 31, 127)
    step = (d * sc.astype(np.float32)).astype(np.float64)
    return d, sc.astype(np.int8), _signed_levels(x, step, -32, 31)


def covering_q3_k(values: np.ndarray):
    """The covering rule for Q3_K: x = step k with k in -4..3, so each sub-block of 16 takes the smaller of the two
    steps that cover it: a positive one of max(max x / 3, -min x / 4), or a negative one of magnitude
    max(-min x / 3, max x / 4); d = smallest float16 >= max |step| / 31, sc = ceil(|step| / d) with the step's
    sign (-31..31); k = clip(round(x / (d sc)), -4, 3). Nothing is clipped and each error is at most |d sc| / 2.
                                                                 # [..., n] -> d [nb, 1], sc [nb, 16], k [nb, 16, 16]"""
    x = rows_of_blocks(values, QK_K).reshape(-1, 16, 16).astype(np.float64)
    high, low = np.maximum(extreme_last(x), 0.0), np.maximum(-extreme_last(x, np.minimum), 0.0)
    positive, negative = np.maximum(high / 3, low / 4), np.maximum(low / 3, high / 4)
    d, magnitude = _scales_on_grid(np.minimum(positive, negative), 31)
    sc = np.where(negative < positive, -1, 1).astype(np.int8) * magnitude.astype(np.int8)
    step = (d * sc.astype(np.float32)).astype(np.float64)
    return d, sc, _signed_levels(x, step, -4, 3)



def closest(values: np.ndarray, dequantize, block_bytes: int, *candidates: np.ndarray) -> np.ndarray:
    """Per super-block, the candidate bytes whose dequantized values have the least sum of squared errors (the
    first on ties).                                      # [..., n], [nb * block_bytes] x c -> [nb * block_bytes]"""
    x = rows_of_blocks(values, QK_K).astype(np.float64)
    blocks = [c.reshape(x.shape[0], block_bytes) for c in candidates]
    errors = np.stack([((dequantize(b.reshape(-1)).reshape(x.shape) - x) ** 2).sum(1) for b in blocks])
    choice = np.nan_to_num(errors, nan=np.inf).argmin(axis=0)
    return np.take_along_axis(np.stack(blocks), choice[None, :, None], axis=0)[0].reshape(-1)


SUPER_BLOCK_CHUNK = 4096  # super-blocks quantized at a time: the fit's float64 temporaries stay at ~8 MB each


def by_two_rules(values: np.ndarray, rules, dequantize, block_bytes: int) -> np.ndarray:
    """values [..., n] as bytes: per super-block the closer of the covering rule's bytes (nothing clipped, each
    error at most half a step) and the fitted rule's (clipping where that lowers the squared error), so never worse
    than covering; chunk by chunk. rules: (covering, fitted), each values -> bytes."""
    blocks = rows_of_blocks(values, QK_K)
    covering, fitted = rules
    return np.concatenate([closest(chunk, dequantize, block_bytes, covering(chunk), fitted(chunk))
                           for chunk in np.split(blocks, range(SUPER_BLOCK_CHUNK, len(blocks), SUPER_BLOCK_CHUNK))])
