"""The record of a GGML block type, and the byte helpers every family of types shares.

A `QuantType` holds everything npllm knows about one type in NumPy: its GGML id and name, values and bytes per
block, its dequantizer and quantizer, where its float16 scales lie (the only fields that can spell inf or NaN), how
its blocks are regrouped when eight rows are interleaved (the layout the Numba model multiplies), and what its
products take as activations. The types' Numba pieces (decoder, dot tile, gather) are kernels/quant's records of the
same names. The table of every record is quant/table.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..errors import NpllmError

QK_K = 256  # values per K-quant super-block
INTERLEAVE = 8  # rows per interleaved group


class QuantizationError(NpllmError, ValueError):
    """Values cannot be stored in the requested type (not finite, rows not a whole number of blocks, too large)."""


@dataclass(frozen=True, kw_only=True)
class QuantType:
    """One GGML tensor type, built by keyword (every record names its fields). Only name, id and sizes for a type
    npllm lays out but does not compute (Q8_K, I32...)."""

    name: str
    type_id: int  # GGML type id, as stored in a GGUF tensor table
    block_size: int  # values per block
    block_bytes: int  # bytes per block
    dequantize: Callable | None = None  # raw bytes [nb * block_bytes] uint8 -> [nb * block_size] float32
    quantize: Callable | None = None  # float32 [..., n] -> raw bytes [nb * block_bytes] uint8
    scale_fields: tuple[int, ...] = ()  # byte offsets of the float16 scales (and mins) in a block
    interleave: Callable | None = None  # blocks [G, b, 8, block_bytes] -> parts of interleaved ones (interleave_rows)
    interleaved_bytes: int = 0  # bytes of one block of a group of eight interleaved rows
    activations: str = "float"  # what the Numba model's products take: "float", "int8" or "two_part" (8-bit parts)

    @property
    def bits_per_value(self) -> float:
        return 8 * self.block_bytes / self.block_size

    def nbytes(self, shape: tuple[int, ...]) -> int:
        """Bytes of a tensor of this type in NumPy shape (..., row); rows must be whole blocks."""
        count = int(np.prod(shape, dtype=np.int64))
        return count // self.block_size * self.block_bytes


# ---------------------------------------------------------------------------------------------------- reading

def blocks_of(raw: np.ndarray, block_bytes: int) -> np.ndarray:
    """Raw bytes as one row per block.  # [nb * block_bytes] uint8 -> [nb, block_bytes]"""
    raw = np.asarray(raw)
    if raw.dtype != np.uint8:
        raw = raw.view(np.uint8)
    if raw.size % block_bytes:
        raise QuantizationError(f"{raw.size} bytes are not a whole number of {block_bytes}-byte blocks")
    return raw.reshape(-1, block_bytes)


def half_at(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 stored at byte `at` of every block, widened to float32.  # [nb, bytes] -> [nb, 1]"""
    bits = blocks[:, at].astype(np.uint16) | (blocks[:, at + 1].astype(np.uint16) << 8)
    return bits.view(np.float16).astype(np.float32)[:, None]


def nibbles_of(packed: np.ndarray) -> np.ndarray:
    """Low nibbles then high nibbles of each run of bytes.  # [..., n] uint8 -> [..., 2, n]"""
    return np.stack([packed & 0x0F, packed >> 4], axis=-2)


def bits_of(mask: np.ndarray, count: int) -> np.ndarray:
    """Bit i of each byte, for i < count.  # [..., n] uint8 -> [..., count, n] in {0, 1}"""
    shifts = np.arange(count, dtype=np.uint8)[:, None]
    return (mask[..., None, :] >> shifts) & 1


# ---------------------------------------------------------------------------------------------------- writing

def rows_of_blocks(values: np.ndarray, block_size: int) -> np.ndarray:
    """Finite float32 values as one row per block.  # [..., n] -> [n_total / block_size, block_size]"""
    values = np.asarray(values, dtype=np.float32)
    if values.ndim == 0 or values.shape[-1] % block_size:
        raise QuantizationError(f"rows of {values.shape[-1:]} values do not split into blocks of {block_size}")
    if not np.all(np.isfinite(values)):
        raise QuantizationError("cannot quantize values that are not finite (inf or NaN)")
    return values.reshape(-1, block_size)


def as_half(d: np.ndarray) -> np.ndarray:
    """float32 scales [nb, 1] stored as float16 bytes [nb, 2]; a scale beyond float16's range is refused."""
    with np.errstate(over="ignore"):  # an overflow becomes inf, refused just below
        half = d.astype(np.float16)
    if not np.all(np.isfinite(half)):
        raise QuantizationError("values too large for a float16 block scale (|x| must stay below about 4e6)")
    return half.view(np.uint8).reshape(-1, 2)


def inverse_scale(d: np.ndarray) -> np.ndarray:
    """1 / d, and 0 for an all-zero block (every q then encodes 0)."""
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)


def round_half_away(v: np.ndarray) -> np.ndarray:
    """C's roundf: halves round away from zero (float64 so that |v| + 0.5 is exact for these magnitudes)."""
    v = v.astype(np.float64)
    return np.sign(v) * np.floor(np.abs(v) + 0.5)


def signed_absmax(blocks: np.ndarray) -> np.ndarray:
    """The value of largest magnitude in each block, with its sign (the first one on ties).  # [nb, n] -> [nb, 1]"""
    return np.take_along_axis(blocks, np.abs(blocks).argmax(axis=1)[:, None], axis=1)


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """Values j and j + 16 of each 32 into byte j (low, high nibble).  # [nb, 32] in 0..15 (low 4 bits) -> [nb, 16]"""
    return (q[:, :16] & 0x0F) | (q[:, 16:] << 4)


# ---------------------------------------------------------------------------------------------------- interleaving
# Rows interleaved by eight (table.interleave_rows): a group's words of 32 bytes hold four bytes of each of its eight
# rows, lane r (bytes 4r .. 4r + 3) row r's.

def words_of(field: np.ndarray) -> np.ndarray:
    """Each row's bytes of a field as a group's words: word k, lane r = bytes 4k .. 4k+3 of row r (so a run of 32
    bytes of each row is eight words).                                           # [G, b, r, 4 n] -> [G, b, n, r, 4]"""
    G, nb = field.shape[:2]
    return field.reshape(G, nb, 8, -1, 4).swapaxes(2, 3)


def per_row(field: np.ndarray) -> np.ndarray:
    """A field of one byte per sub-block, the eight rows side by side: sub-block s's byte of row r at 8 s + r.
                                                                                       # [G, b, r, s] -> [G, b, s, r]"""
    return field.swapaxes(2, 3)
