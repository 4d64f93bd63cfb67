"""The NumPy statement of what the Numba model's products compute on quantized weights (kernels/quant): activations
quantized per block of 32 to int8, as Q8_0 quantizes weights (or in two 8-bit parts, for the types whose products
take them), each weight block meeting its activation block in an integer dot product. The oracle the kernels and
the Numba model's logits are held to (tests, scripts/bench/int8_quality.py), and what the cold-start stand-in
(models/stand_in.py) computes while the kernels compile.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .base import QuantizationError, round_half_away
from .matrix import QuantizedMatrix
from .table import TYPES, dequantize

Q8_BLOCK = 32  # activation values per scale


def quantize_activations_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Activations as int8 blocks of 32 with one float32 scale each, and each block's sum of integers.

        d_b = max_j |x_bj| / 127          (float32)
        q_bj = round(x_bj / d_b)          (float64 quotient, halves away from zero; 0 where d_b = 0), |q| <= 127
        s_b = sum_j q_bj                  (what an offset type's -8 etc. multiplies)

    so x_bj = d_b (q_bj + e_bj) with |e_bj| <= 1/2: each value is off by at most d_b / 2.
        # [..., K] float32 -> q [..., K] int8, d [..., K / 32] float32, s [..., K / 32] int32
    """
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 0 or x.shape[-1] % Q8_BLOCK:
        raise QuantizationError(f"activations of {x.shape[-1:]} values do not split into blocks of {Q8_BLOCK}")
    if not np.all(np.isfinite(x)):
        raise QuantizationError("cannot quantize activations that are not finite (inf or NaN)")
    blocks = x.reshape(*x.shape[:-1], -1, Q8_BLOCK)
    d = (np.abs(blocks).max(axis=-1) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(d[..., None] == 0, 0.0, blocks.astype(np.float64) / d[..., None].astype(np.float64))
    q = np.clip(round_half_away(ratio), -127, 127).astype(np.int8)
    return q.reshape(x.shape), d, q.astype(np.int32).sum(axis=-1)


def dequantize_activations_q8(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """The values int8 activation blocks stand for: d_b q_bj.   # [..., K] int8, [..., K / 32] -> [..., K] float64"""
    return (q.reshape(*d.shape, Q8_BLOCK) * d[..., None].astype(np.float64)).reshape(q.shape)


def matmul_t_q8_activations(raw: np.ndarray, qtype: str, shape: tuple[int, int], x: np.ndarray) -> np.ndarray:
    """x W^T with x quantized to 8-bit blocks: x^ W^T in float64, x^ = dequantize_activations_q8(q, d), W the
    dequantized weights.                                              # [T, K] float32 -> [T, N] float64

    The kernels compute the same sum block by block in integers: for a weight block stored as W_j = a u_j - m
    (a scale, u small integers, m an offset; a = d_w, m = 0 for Q8_0), sum_j W_j d_x q_xj = (a d_x) (u . q_x) -
    (m d_x) s, with u . q_x an exact integer dot product and s = sum_j q_xj. The only rounding against the exact
    product x W^T is the activations', so
        |out[t, n] - (x W^T)[t, n]| <= sum_b (d_x[t, b] / 2) sum_j |W[n, 32 b + j]|.
    """
    return q8_activations(np.atleast_2d(x)) @ dequantize(raw, qtype, shape).astype(np.float64).T


def q8_activations(x: np.ndarray) -> np.ndarray:
    """The values x stands for once quantized to 8-bit blocks: x^ = d q (quantize_activations_q8).
                                                                           # [..., K] float32 -> [..., K] float64"""
    q_x, d_x, _ = quantize_activations_q8(x)
    return dequantize_activations_q8(q_x, d_x)


def quantize_activations_two_part(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Activations in TWO 8-bit parts, x ~ d q + (d / 128) q': the first quantize_activations_q8(x), the second
    what it leaves, r = x - d q, in steps of d / 128:

        q'_bj = round(r_bj / (d_b / 128))   (float64, halves away from zero; 0 where d_b = 0), |q'_bj| <= 64

    since |r_bj| <= d_b / 2. Together they are the 15-bit integers v = 128 q + q' with the scale d / 128, each value
    within d_b / 256 of x (against one part's d_b / 2). A weight's integer dot with v is 128 times its dot with q
    plus its dot with q': two dot-product instructions on the weights unpacked once.
                                             # [..., K] float32 -> q, q' [..., K] int8, d [..., K / 32] float32"""
    x = np.asarray(x, dtype=np.float32)
    q, d, _ = quantize_activations_q8(x)
    r = (x.astype(np.float64) - dequantize_activations_q8(q, d)).reshape(*d.shape, Q8_BLOCK)
    # the step in float32, as the kernels scale v (below d = 2^-119 it is a subnormal, rounded: the bound above
    # then holds to within ~1e-41)
    step = (d / np.float32(128)).astype(np.float64)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        second = np.where(step == 0, 0.0, r / step)
    return q, round_half_away(second).astype(np.int8).reshape(q.shape), d


def matmul_t_two_part_activations(raw: np.ndarray, qtype: str, shape: tuple[int, int], x: np.ndarray) -> np.ndarray:
    """x W^T with x in two 8-bit parts (quantize_activations_two_part): x^ W^T in float64, x^ = (d / 128) (128 q +
    q'), W the dequantized weights; the kernels compute it as matmul_t_q8_activations states, with v = 128 q + q'
    for q_x and d / 128 for d_x.                                           # [T, K] float32 -> [T, N] float64"""
    return two_part_activations(np.atleast_2d(x)) @ dequantize(raw, qtype, shape).astype(np.float64).T


def two_part_activations(x: np.ndarray) -> np.ndarray:
    """The values x stands for in two 8-bit parts: (d / 128) (128 q + q') (quantize_activations_two_part).
                                                                           # [..., K] float32 -> [..., K] float64"""
    q, q_r, d = quantize_activations_two_part(x)
    return dequantize_activations_q8(128 * q.astype(np.int32) + q_r, d / np.float32(128))



@dataclass(frozen=True)
class Int8ActivationMatrix(QuantizedMatrix):
    """A QuantizedMatrix whose products quantize their input to 8-bit blocks first (matmul_t_q8_activations): the
    NumPy statement of what the Numba model computes for these types, and so the oracle its logits are held to."""

    def matmul_t(self, x: np.ndarray) -> np.ndarray:
        """x^ W^T, x^ = x quantized per block of 32.  # [T, K] -> [T, N]"""
        return matmul_t_q8_activations(self.raw, self.qtype, self.shape, x).astype(np.float32)


@dataclass(frozen=True)
class TwoPartActivationMatrix(Int8ActivationMatrix):
    """A QuantizedMatrix whose products take their input as two 8-bit parts (matmul_t_two_part_activations): what
    the Numba model computes for the types of activations "two_part"."""

    def matmul_t(self, x: np.ndarray) -> np.ndarray:
        """(x^ + x^') W^T.  # [T, K] -> [T, N]"""
        return matmul_t_two_part_activations(self.raw, self.qtype, self.shape, x).astype(np.float32)


def with_int8_activations(tensors: dict) -> dict:
    """The same weights, each matrix of a type with 8-bit activations multiplying as the Numba model does: on one
    8-bit part, or on two (activations "two_part")."""
    kinds = {"int8": Int8ActivationMatrix, "two_part": TwoPartActivationMatrix}

    def as_numba(w):
        if not isinstance(w, QuantizedMatrix) or TYPES[w.qtype].activations not in kinds:
            return w
        return kinds[TYPES[w.qtype].activations](w.raw, w.qtype, w.shape)

    return {name: as_numba(w) for name, w in tensors.items()}
