"""QuantizedMatrix: a weight matrix kept in its file type, standing in for a float32 array in the NumPy model."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .base import QuantizationError, blocks_of, half_at
from .table import TYPES, dequantize, quantize


@dataclass(frozen=True)
class QuantizedMatrix:
    """A weight matrix W [N, K] kept in its file type: N rows of K / block_size blocks, no float copy; or a stack
    of E such matrices [E, N, K] (a mixture of experts' w1_exps, as llama.cpp stores them: one 3-D tensor).

    `raw` is [N, K / block_size * block_bytes] uint8 ([E, N, ...] for a stack), typically a read-only view of a
    memory-mapped file. The NumPy reference multiplies by dequantizing (`matmul_t`); kernels/quant reads the same
    bytes directly.

    It stands in for a float32 weight array where the NumPy model uses one: `x @ W.T` (through `.T`), `W[ids]`
    (rows, as float32), `W[a:b]` (a block of rows, kept in its type: a fused projection split at load), `.shape`,
    `.dtype` (float32, the type it computes in); `np.asarray(W)` dequantizes it whole. A stack's `W[e]` is expert
    e's matrix, kept in its type.
    """

    __array_ufunc__ = None  # `x @ W` and ufuncs defer to this class instead of converting it
    dtype = np.dtype(np.float32)

    raw: np.ndarray
    qtype: str
    shape: tuple[int, ...]  # (N, K), or (E, N, K) for a stack of experts

    def __post_init__(self):
        t = TYPES.get(self.qtype)
        if t is None:
            raise QuantizationError(f"npllm cannot compute with type {self.qtype}")
        K = self.shape[-1]
        if len(self.shape) not in (2, 3) or K % t.block_size or self.raw.dtype != np.uint8 \
                or self.raw.shape != (*self.shape[:-1], K // t.block_size * t.block_bytes):
            raise QuantizationError(f"{self.qtype} bytes of shape {self.raw.shape} do not hold a "
                                    f"{list(self.shape)} matrix")

    @classmethod
    def from_values(cls, values: np.ndarray, qtype: str) -> "QuantizedMatrix":
        """Quantize a float matrix (or a stack of them).  # [N, K] or [E, N, K] -> QuantizedMatrix"""
        return cls(quantize(values, qtype).reshape(*values.shape[:-1], -1), qtype, tuple(values.shape))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return self.raw.nbytes

    @property
    def size(self) -> int:
        """Values held (N K, or E N K), as an array's size."""
        return int(np.prod(self.shape))

    def dequantize(self) -> np.ndarray:
        """W as float32.  # -> [N, K]"""
        return dequantize(self.raw, self.qtype, self.shape)

    def rows(self, ids) -> np.ndarray:
        """Only the rows asked for, as float32 (an embedding lookup reads no other row).  # [T] -> [T, K]"""
        self._matrix_only("rows")
        ids = np.asarray(ids, dtype=np.int64)
        return dequantize(self.raw[ids], self.qtype, (*ids.shape, self.shape[1]))

    def is_finite(self) -> bool:
        """Whether every value is finite, read from the float fields alone: a block's integers are finite, and a
        finite float16 scale (or min) times an integer of at most 8 bits stays finite in float32, so only the
        scales need looking at; F32/F16/BF16 rows are checked value by value, without widening them."""
        if self.qtype in ("F32", "F16"):
            return bool(np.isfinite(self.raw.view("<f4" if self.qtype == "F32" else "<f2")).all())
        if self.qtype == "BF16":
            return not ((self.raw.view("<u2") & 0x7F80) == 0x7F80).any()  # exponent all ones: inf or NaN
        blocks = blocks_of(self.raw.reshape(-1), TYPES[self.qtype].block_bytes)
        return all(np.isfinite(half_at(blocks, at)).all() for at in TYPES[self.qtype].scale_fields)

    def matmul_t(self, x: np.ndarray) -> np.ndarray:
        """x @ W.T, the reference: dequantize, then multiply.  # [T, K] -> [T, N]"""
        self._matrix_only("x @ W.T")
        return np.asarray(x, dtype=np.float32) @ self.dequantize().T

    @property
    def T(self) -> "_TransposedMatrix":
        return _TransposedMatrix(self)

    def __getitem__(self, key):
        """A stack's W[e]: expert e's matrix; W[a:b] (W[..., a:b, :]: every expert's): those rows, kept in the
        type; W[ids]: rows as float32 (rows())."""
        if isinstance(key, tuple) and len(key) in (2, 3) and key[-1] == slice(None) and isinstance(key[-2], slice) \
                and (len(key) == 2 and self.ndim == 2 or key[0] is Ellipsis):
            return self._row_block(key[-2])
        if self.ndim == 3:
            if not isinstance(key, (int, np.integer)):
                raise QuantizationError(f"a stack of {self.shape[0]} matrices is indexed by one expert, got {key!r}")
            return QuantizedMatrix(self.raw[key], self.qtype, self.shape[1:])
        return self._row_block(key) if isinstance(key, slice) else self.rows(key)

    def _row_block(self, rows: slice) -> "QuantizedMatrix":
        """Rows a:b of the matrix (of every expert's), a view of the same bytes.  # [.., N, K] -> [.., b - a, K]"""
        start, stop, step = rows.indices(self.shape[-2])
        if step != 1:
            raise QuantizationError("a block of rows of a QuantizedMatrix must be contiguous")
        return QuantizedMatrix(self.raw[..., start:stop, :], self.qtype, (*self.shape[:-2], max(stop - start, 0),
                                                                          self.shape[-1]))

    def _matrix_only(self, what: str) -> None:
        if self.ndim != 2:
            raise QuantizationError(f"{what} needs one matrix; this is a stack of {self.shape[0]} (index it first)")

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        dense = self.dequantize()
        return dense if dtype is None else dense.astype(dtype)


class _TransposedMatrix:
    """W.T of a QuantizedMatrix, only for `x @ W.T`."""

    __array_ufunc__ = None

    def __init__(self, matrix: QuantizedMatrix):
        self.matrix = matrix
        self.shape = matrix.shape[::-1]

    def __rmatmul__(self, x: np.ndarray) -> np.ndarray:
        return self.matrix.matmul_t(x)



def as_matrix(w) -> QuantizedMatrix:
    """A weight as the one matrix type: a QuantizedMatrix as it is, a float array as its float32 bytes (type F32, no
    copy when it is float32 already), a vector as one row.  # [N, K], [E, N, K] or [K] -> QuantizedMatrix"""
    if isinstance(w, QuantizedMatrix):
        return w
    values = np.ascontiguousarray(w, dtype=np.float32)
    values = values.reshape(1, -1) if values.ndim == 1 else values
    return QuantizedMatrix(values.view(np.uint8), "F32", values.shape)  # [..., 4 K] bytes: each row's floats


def matrix_bytes(w) -> np.ndarray:
    """The array holding a weight's bytes as stored (a QuantizedMatrix's raw blocks, else the array itself)."""
    return w.raw if isinstance(w, QuantizedMatrix) else w


def in_block_type(w) -> bool:
    """Whether a weight is kept in a file type other than float32 (a QuantizedMatrix not of type F32)."""
    return isinstance(w, QuantizedMatrix) and w.qtype != "F32"


def dequantized(weights: dict) -> dict:
    """Every QuantizedMatrix of a weights dict as a float32 array (its values; F32 ones as views of their bytes),
    other arrays as they are."""
    return {name: np.asarray(w) if isinstance(w, QuantizedMatrix) else w for name, w in weights.items()}


def stored_as(weights: dict, qtype: str) -> dict:
    """Every matrix (2-D weight, or 3-D stack of experts) of a weights dict in block type qtype: one already of that type as it is, any
    other rounded through float32 (QuantizedMatrix.from_values); vectors as they are. The same matrix object
    (a tied embedding and LM head) stays one object."""
    done: dict[int, QuantizedMatrix] = {}

    def convert(w):
        if w.ndim < 2 or (isinstance(w, QuantizedMatrix) and w.qtype == qtype):
            return w
        if id(w) not in done:
            done[id(w)] = QuantizedMatrix.from_values(np.asarray(w, dtype=np.float32), qtype)
        return done[id(w)]

    return {name: convert(w) for name, w in weights.items()}
