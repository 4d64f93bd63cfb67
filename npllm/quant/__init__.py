"""GGUF weight types as readable NumPy: what each block of bytes means, and how numbers become blocks again.

A quantized matrix keeps its rows as runs of blocks. Each block stores `block_size` consecutive values of a row in
`block_bytes` bytes: a few float16 scales and the small integers they multiply. All scales and integers are
little-endian. Every `dequantize_*` function maps raw bytes [nb * block_bytes] (uint8) to [nb * block_size] float32
values, vectorised over blocks, and computes in float32 in the order llama.cpp's reference does, so the results are
the same bits (tests hold each one to the `gguf` package's dequantizers).

    type    id  values  bytes  bits/value  formula (q: the stored integer of one value)
    F32      0      1      4     32        x
    F16      1      1      2     16        x
    BF16    30      1      2     16        x (the high half of a float32)
    Q8_0     8     32     34      8.5      d * q                      q int8
    Q4_0     2     32     18      4.5      d * (q - 8)                q 0..15
    Q4_1     3     32     20      5        d * q + m                  q 0..15
    Q5_0     6     32     22      5.5      d * (q - 16)               q 0..31
    Q5_1     7     32     24      6        d * q + m                  q 0..31
    Q2_K    10    256     84      2.625    (d * sc) * q - dmin * mn   16 sub-blocks of 16, 4-bit sc and mn
    Q3_K    11    256    110      3.4375   (d * (sc - 32)) * (q - 4)  16 sub-blocks of 16, 6-bit sc, q 0..7
    Q4_K    12    256    144      4.5      (d * sc) * q - dmin * mn   8 sub-blocks of 32, 6-bit sc and mn
    Q5_K    13    256    176      5.5      (d * sc) * q - dmin * mn   8 sub-blocks of 32, 6-bit sc and mn
    Q6_K    14    256    210      6.5625   (d * sc) * (q - 32)        16 sub-blocks of 16, int8 sc
    IQ4_NL  20     32     18      4.5      d * KVALUES[q]             q 0..15, a fixed non-linear codebook
    IQ4_XS  23    256    136      4.25     (d * (ls - 32)) * KVALUES[q]  8 sub-blocks of 32, 6-bit ls

One record per type (QuantType, base.py) holds its id, sizes, dequantizer, quantizer, scale fields, interleaved
layout and activation kind; table.py gathers them and derives every list. The modules, one per family:

    base.py      the record, the byte helpers           floats.py   F32, F16, BF16
    legacy.py    Q8_0, Q4_0, Q4_1, Q5_0, Q5_1           kquants.py  Q2_K .. Q6_K
    kfit.py      how the K-quants' scales are chosen    iq4.py      IQ4_NL, IQ4_XS
    table.py     every record, the lists derived        matrix.py   QuantizedMatrix
    oracle.py    the NumPy statement of the Numba products on 8-bit activations (for tests)

The quantizers for Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 make the same bytes as llama.cpp's reference quantizers. Those for
the K-quants and IQ4_XS are npllm's own (kfit.by_two_rules): per super-block, the closer to the values of two scale
rules; IQ4_NL's is a least-squares search per block (iq4.fit_codebook_step).
"""

from .base import INTERLEAVE, QK_K, QuantizationError, QuantType
from .floats import dequantize_bf16, dequantize_f16, dequantize_f32, quantize_f16, quantize_f32
from .iq4 import KVALUES, dequantize_iq4_nl, dequantize_iq4_xs, quantize_iq4_nl, quantize_iq4_xs
from .kquants import (K_QUANT_RULES, dequantize_q2_k, dequantize_q3_k, dequantize_q4_k, dequantize_q5_k,
                      dequantize_q6_k, quantize_q2_k, quantize_q3_k, quantize_q4_k, quantize_q5_k, quantize_q6_k)
from .legacy import (dequantize_q4_0, dequantize_q4_1, dequantize_q5_0, dequantize_q5_1, dequantize_q8_0, quantize_q4_0,
                     quantize_q4_1, quantize_q5_0, quantize_q5_1, quantize_q8_0)
from .matrix import QuantizedMatrix, as_matrix, dequantized, in_block_type, matrix_bytes, stored_as
from .table import (BLOCK_TYPES, DEQUANTIZE, INT8_ACTIVATION_TYPES, INTERLEAVED_BLOCK_BYTES, INTERLEAVED_TYPES, MIXTURES,
                    QUANTIZE, SCALE_FIELDS, TWO_PART_ACTIVATION_TYPES, TYPES, TYPES_BY_ID, dequantize, interleave_rows,
                    quantize)
