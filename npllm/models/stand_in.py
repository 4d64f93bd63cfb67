"""What runs in the Numba backend's place while its code is compiled behind the run (models/__init__.py,
make_model's cold_start): the NumPy reference (reference.Transformer) on the weights as the Numba model computes
with them, so that greedy decoding gives the same tokens where it can.

- Float32 weights: the reference as it is. On stories260K it gives run.c's tokens for every golden, and the Numba
  model's for 100 prompts x 200 tokens (tests/test_cold_start.py; docs/bench.md, "A first token before the
  compile"). The two sum in other orders, so a near-tie of two logits within float32 rounding (~1e-5 here; the
  goldens' closest top-2 gap is 1e-3) could still pick another token.
- A GGUF file's matrices (quant.QuantizedMatrix): dequantized once to float32 (the reference would otherwise decode
  every matrix at every call), and those of quant.INT8_ACTIVATION_TYPES multiply as the Numba model's kernels do,
  on activations rounded to 8-bit blocks (two 8-bit parts for Q2_K, Q3_K): quant.oracle.matmul_t_q8_activations's
  product, in float32. Rounding to 8 bits is a step function, so float32 sums in another order move an activation
  across a step now and then (tests/test_numba_quantized.py), and greedy tokens part: in 39 / 49 of 100 prompts
  within 200 tokens on stories260K as Q8_0 / Q4_0. Hence make_model's cold_start "exact" leaves quantized models to
  wait for the compile. The decoded copy takes 4 bytes a weight (4.4 GB for a 1.1B model) for the run; the Numba
  model reads the file's blocks.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import numpy as np

from .. import quant
from ..quant import oracle
from ..config import ModelConfig
from .reference import Transformer


@dataclass(frozen=True)
class DecodedInt8Matrix(oracle.Int8ActivationMatrix):
    """An Int8ActivationMatrix decoded once: `values` is W as float32, and x @ W.T is x^ W^T in float32, x^ the
    activations as the Numba model's 8-bit kernels take them (two_part: in two parts)."""

    values: np.ndarray | None = None  # [N, K] float32: dequantize(raw)
    two_part: bool = False

    def dequantize(self) -> np.ndarray:
        return self.values

    def rows(self, ids) -> np.ndarray:
        return self.values[np.asarray(ids, dtype=np.int64)]

    def matmul_t(self, x: np.ndarray) -> np.ndarray:
        """x^ W^T.  # [T, K] -> [T, N] float32"""
        rounded = oracle.two_part_activations(x) if self.two_part else oracle.q8_activations(x)
        return rounded.astype(np.float32) @ self.values.T


CHUNK_VALUES = 1 << 16  # values decoded at a time: temporaries that stay in cache (2.2 ns a Q4_0 value, not 3.7)


def small_pages(N: int, K: int) -> np.ndarray:
    """An uninitialised [N, K] float32 array in its own anonymous mapping. NumPy asks the kernel for huge pages for
    large arrays (MADV_HUGEPAGE), and finding free 2 MiB pages (the kernel compacts memory for them, in the page
    fault) made writing a 1.1B model's 4.4 GB take 7-10 s on a 2-core VM, against 1-3.5 s on 4 KiB pages; products
    over either run at the same speed."""
    return np.frombuffer(mmap.mmap(-1, max(4 * N * K, 1)), np.float32, count=N * K).reshape(N, K)


def decoded_values(w: quant.QuantizedMatrix) -> np.ndarray:
    """W as float32 (quant.dequantize), decoded CHUNK_VALUES values' worth of rows at a time.    # -> [N, K]"""
    N, K = w.shape
    rows = max(1, CHUNK_VALUES // K)
    out = small_pages(N, K)
    for i in range(0, N, rows):
        out[i:i + rows] = quant.dequantize(w.raw[i:i + rows], w.qtype, (min(rows, N - i), K))
    return out


def numba_weights(config: ModelConfig, weights: dict) -> dict:
    """A format reader's weights as the Numba model computes with them, for the NumPy reference: float32 ones
    (arrays, F32 matrices) as they are, matrices in block types decoded to float32 once, those of the 8-bit
    activation types as DecodedInt8Matrix. An embedding table that is not also the LM head (config.tied_embeddings) stays as it is: a lookup decodes
    the rows it reads."""
    lookup_only = not config.tied_embeddings
    done: dict[int, object] = {}  # by id: a tied LM head is the embedding's one matrix, decoded once

    def decoded(name, w):
        if not quant.in_block_type(w) or (name == "tok_embeddings" and lookup_only):
            return w
        if id(w) not in done:
            values = decoded_values(w)
            two_part = w.qtype in quant.TWO_PART_ACTIVATION_TYPES
            done[id(w)] = (DecodedInt8Matrix(w.raw, w.qtype, w.shape, values, two_part)
                           if w.qtype in quant.INT8_ACTIVATION_TYPES else values)
        return done[id(w)]

    return {name: decoded(name, w) for name, w in weights.items()}


def stand_in(config: ModelConfig, weights: dict) -> Transformer:
    """The NumPy reference computing as the Numba model would on `weights` (see the module's docstring)."""
    return Transformer(config, numba_weights(config, weights))
