"""F32, F16 and BF16: one value per "block", no scale. Their products take float32 activations."""

from __future__ import annotations

import numpy as np

from .base import QuantizationError, QuantType


def dequantize_f32(raw: np.ndarray) -> np.ndarray:
    out = np.asarray(raw).view("<f4")
    return out if out.flags.aligned else out.copy()


def dequantize_f16(raw: np.ndarray) -> np.ndarray:
    """IEEE half precision: sign, 5-bit exponent, 10-bit mantissa; widening to float32 is exact."""
    return np.asarray(raw).view("<f2").astype(np.float32)


def dequantize_bf16(raw: np.ndarray) -> np.ndarray:
    """bfloat16 is the high half of a float32: shift the 16-bit word up."""
    return (np.asarray(raw).view("<u2").astype(np.uint32) << 16).view(np.float32)


def quantize_f16(values: np.ndarray) -> np.ndarray:
    values = np.asarray(values, dtype=np.float32)
    if not np.all(np.isfinite(values)) or np.abs(values).max(initial=0) > np.finfo(np.float16).max:
        raise QuantizationError("values are not finite or beyond float16's range (65504)")
    return values.astype("<f2").view(np.uint8).reshape(-1)


def quantize_f32(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values, dtype="<f4").view(np.uint8).reshape(-1)


F32 = QuantType(name="F32", type_id=0, block_size=1, block_bytes=4, dequantize=dequantize_f32, quantize=quantize_f32)
F16 = QuantType(name="F16", type_id=1, block_size=1, block_bytes=2, dequantize=dequantize_f16, quantize=quantize_f16)
BF16 = QuantType(name="BF16", type_id=30, block_size=1, block_bytes=2, dequantize=dequantize_bf16)
RECORDS = (F32, F16, BF16)
