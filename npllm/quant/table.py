"""The table of GGML block types: one QuantType record per type (quant/base.py), each family's records from its own
module, and every list npllm keeps about types derived from it: the GGUF reader's layouts, what npllm reads and
writes, which types the Numba model interleaves and on which activations. Adding a type adds its record to a family
(and its Numba pieces to kernels/quant's table), nothing here.
"""

from __future__ import annotations

import numpy as np

from . import floats, iq4, kquants, legacy
from .base import INTERLEAVE, QuantizationError, QuantType

# Types npllm lays out (to validate a GGUF file and describe it) but does not compute.
LAYOUT_ONLY = tuple(QuantType(name=name, type_id=type_id, block_size=size, block_bytes=nbytes)
                    for name, type_id, size, nbytes in (("Q8_1", 9, 32, 36), ("Q8_K", 15, 256, 292), ("I8", 24, 1, 1),
                                                        ("I16", 25, 1, 2), ("I32", 26, 1, 4), ("I64", 27, 1, 8),
                                                        ("F64", 28, 1, 8)))
BLOCK_TYPES = floats.RECORDS + legacy.RECORDS + kquants.RECORDS + iq4.RECORDS + LAYOUT_ONLY

TYPES_BY_ID = {t.type_id: t for t in BLOCK_TYPES}  # every type npllm lays out, by GGML id (the GGUF reader's table)
TYPES = {t.name: t for t in BLOCK_TYPES if t.dequantize is not None}  # every type npllm computes, by name
DEQUANTIZE = {name: t.dequantize for name, t in TYPES.items()}
QUANTIZE = {name: t.quantize for name, t in TYPES.items() if t.quantize is not None}
SCALE_FIELDS = {name: t.scale_fields for name, t in TYPES.items() if t.block_size > 1}
# The types whose matrices the Numba model holds interleaved by eight rows and multiplies on 8-bit activations
# (kernels/quant); of those, the types whose products take their activations in two 8-bit parts: files of Q2_K and
# Q3_K matrices (llama.cpp's Q2_K and Q3_K_S/M presets) missed the quality bar on one 8-bit part (mean KL 1e-3 to
# 2.3e-3 from the exact dequantized model, top-1 96.2-98.0%; docs/quant.md), at twice the dots. The others (F32, F16,
# BF16) take float32 activations.
INTERLEAVED_TYPES = tuple(name for name, t in TYPES.items() if t.interleaved_bytes)
INTERLEAVED_BLOCK_BYTES = {name: TYPES[name].interleaved_bytes for name in INTERLEAVED_TYPES}
INT8_ACTIVATION_TYPES = tuple(name for name, t in TYPES.items() if t.activations in ("int8", "two_part"))
TWO_PART_ACTIVATION_TYPES = tuple(name for name, t in TYPES.items() if t.activations == "two_part")

# The mixtures people download most (the presets of these names in llama.cpp): a base type for most matrices, and
# one with more bits where an error costs the most: the LM head (the output matrix, or the embedding a tied model
# reads it from), and the value and FFN-down projections of the first and last eighth of the layers and of every
# third layer between them.
MIXTURES = {"Q4_K_M": ("Q4_K", "Q6_K"), "Q5_K_M": ("Q5_K", "Q6_K")}


def dequantize(raw: np.ndarray, qtype: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """Raw bytes of a tensor of type `qtype` (a name in TYPES) as float32, reshaped to `shape` when given."""
    if qtype not in DEQUANTIZE:
        raise QuantizationError(f"npllm cannot read type {qtype} (it reads {', '.join(DEQUANTIZE)})")
    values = DEQUANTIZE[qtype](raw)
    return values if shape is None else values.reshape(shape)


def quantize(values: np.ndarray, qtype: str) -> np.ndarray:
    """float32 values [..., n] as the raw bytes of type `qtype` (rows of n values are whole blocks)."""
    if qtype not in QUANTIZE:
        raise QuantizationError(f"npllm cannot write type {qtype} (it writes {', '.join(QUANTIZE)})")
    return QUANTIZE[qtype](values)


def interleave_rows(raw: np.ndarray, qtype: str) -> np.ndarray:
    """Rows of one of INTERLEAVED_TYPES regrouped by eight, as the Numba model holds them: the same bytes (a few
    fields unpacked) regrouped so that ONE 32-byte word holds four bytes of each of eight rows, lane r (bytes
    4r .. 4r + 3) row r's: an integer dot of a word with four activations broadcast to every lane advances eight
    rows at once, and one float multiply-add per block (per sub-block) applies the eight rows' scales.
                                                     # [N, row bytes] uint8 -> [N / 8, nb interleaved_bytes] uint8

    Group g holds rows 8g .. 8g + 7, block by block; each family's module draws its types' blocks (legacy.py,
    kquants.py, iq4.py). Rows past the last (to a multiple of 8) are zero bytes: zero scales, zero products, never
    stored by the kernels.
    """
    t = TYPES.get(qtype)
    if t is None or not t.interleaved_bytes:
        raise QuantizationError(f"npllm interleaves the rows of {', '.join(INTERLEAVED_TYPES)} only, not {qtype}")
    if raw.shape[0] % INTERLEAVE:
        raw = np.concatenate([raw, np.zeros((-raw.shape[0] % INTERLEAVE, raw.shape[1]), np.uint8)])
    G, nb = raw.shape[0] // INTERLEAVE, raw.shape[1] // t.block_bytes
    blocks = raw.reshape(G, INTERLEAVE, nb, t.block_bytes).swapaxes(1, 2)  # [G, b, r, block bytes]
    parts = t.interleave(blocks)
    return np.concatenate([p.reshape(G, nb, -1) for p in parts], axis=2).reshape(G, -1)
