"""Matrix products on quantized weights, reading the blocks of npllm.quant straight from their bytes.

The Numba model holds every block type's matrices as rows interleaved by eight (quant.interleave_rows) and multiplies
them on 8-bit activations: each product's input is quantized once per block of 32 (activations.py; in two 8-bit
parts for the types of activations "two_part"), and a word of 32 bytes holding four values of each of eight rows
meets four activations broadcast to every lane in one integer dot (intrinsics.py), eight rows at once; one float
multiply-add per block (per sub-block) applies the eight rows' scales. F16 and BF16 matrices take float32
activations (floats.py); F32 ones are held as float32 panels of 16 rows and multiplied by cpu.py's register tiles
(dispatch.PANELS_CODE). Embedding rows are decoded one by one, from the file's blocks or gathered back from an
interleaved table.

    intrinsics.py   the byte-vector intrinsics, and what the machine offers (AVX2, VNNI, a 512-bit pair, GFNI)
    activations.py  activations quantized to 8 bits per block of 32 (one part or two)
    record.py       BlockKernels: a type's decoder, dot tile and gather
    floats.py       F32, F16, BF16                       legacy.py   Q8_0, Q4_0, Q4_1, Q5_0, Q5_1
    kquants.py      Q2_K .. Q6_K                         iq4.py      IQ4_NL, IQ4_XS
    expanded.py     a prefill's groups decoded once into plain bytes (Q4_K, Q5_K, Q6_K, IQ4_XS: record.Expansion)
    dispatch.py     the table of records, and the dispatchers generated from it (by type code)

Results match the NumPy statement (quant.oracle: quantized activations times dequantized weights) to float32
rounding of the block sums; integer dots are exact. Rows are split over threads by the model (models/numba_products.py).
"""

from .activations import (quantize_activations_q8_into, quantize_activations_q8_parallel, two_part_activations_into,
                          two_part_activations_parallel)
from .dispatch import (FLOAT_TYPES, INTERLEAVED_CODE, INTERLEAVED_TYPES, KERNELS, PANEL_TYPES, PANELS_CODE, ROW_TYPES,
                       decode_any_row, decode_row, file_row_bytes, gather_interleaved_row, held_in_panels,
                       held_interleaved, interleaved_kernels, matmul_int8_interleaved, matmul_rows,
                       matmul_rows_interleaved, matvec_rows, panel_row, takes_two_parts)
from .expanded import EXPAND_FROM, expanded_bytes
from .intrinsics import AVX2, GFNI, PAIRED, Q8_0_BIAS, ROWS_AT_ONCE, VNNI
