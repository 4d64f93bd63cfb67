"""GGUF weight types as readable NumPy: what each block of bytes means, and how numbers become blocks again.

A quantized matrix keeps its rows as runs of blocks. Each block stores `block_size` consecutive values of a row in
`block_bytes` bytes: a few float16 scales and the small integers they multiply. All scales and integers are
little-endian. Every `dequantize_*` function maps raw bytes [nb * block_bytes] (uint8) to [nb * block_size] float32
values, vectorised over blocks, and computes in float32 in the order llama.cpp's reference does, so the results are
the same bits (tests hold each one to the `gguf` package's dequantizers).

    type   id  values  bytes  bits/value  formula (q: the stored integer of one value)
    F32     0      1      4     32        x
    F16     1      1      2     16        x
    BF16   30      1      2     16        x (the high half of a float32)
    Q8_0    8     32     34      8.5      d * q                      q int8
    Q4_0    2     32     18      4.5      d * (q - 8)                q 0..15
    Q4_1    3     32     20      5        d * q + m                  q 0..15
    Q5_0    6     32     22      5.5      d * (q - 16)               q 0..31
    Q5_1    7     32     24      6        d * q + m                  q 0..31
    Q2_K   10    256     84      2.625    (d * sc) * q - dmin * mn   16 sub-blocks of 16, 4-bit sc and mn
    Q3_K   11    256    110      3.4375   (d * (sc - 32)) * (q - 4)  16 sub-blocks of 16, 6-bit sc, q 0..7
    Q4_K   12    256    144      4.5      (d * sc) * q - dmin * mn   8 sub-blocks of 32, 6-bit sc and mn
    Q5_K   13    256    176      5.5      (d * sc) * q - dmin * mn   8 sub-blocks of 32, 6-bit sc and mn
    Q6_K   14    256    210      6.5625   (d * sc) * (q - 32)        16 sub-blocks of 16, int8 sc

The quantizers (`quantize_*`) for Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 make the same bytes as llama.cpp's reference
quantizers. Those for the K-quants are npllm's own (_k_quantize): per super-block, the closer to the values of two
scale rules, one that covers each sub-block's range (nothing clipped, every error at most half a step) and one
fitted by least squares (clipping where that lowers the squared error).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import NpllmError

QK_K = 256  # values per K-quant super-block


class QuantizationError(NpllmError, ValueError):
    """Values cannot be stored in the requested type (not finite, rows not a whole number of blocks, too large)."""


@dataclass(frozen=True)
class QuantType:
    name: str
    type_id: int  # GGML type id, as stored in a GGUF tensor table
    block_size: int  # values per block
    block_bytes: int  # bytes per block

    @property
    def bits_per_value(self) -> float:
        return 8 * self.block_bytes / self.block_size

    def nbytes(self, shape: tuple[int, ...]) -> int:
        """Bytes of a tensor of this type in NumPy shape (..., row); rows must be whole blocks."""
        count = int(np.prod(shape, dtype=np.int64))
        return count // self.block_size * self.block_bytes


TYPES = {t.name: t for t in [
    QuantType("F32", 0, 1, 4), QuantType("F16", 1, 1, 2), QuantType("BF16", 30, 1, 2),
    QuantType("Q8_0", 8, 32, 34), QuantType("Q4_0", 2, 32, 18), QuantType("Q4_1", 3, 32, 20),
    QuantType("Q5_0", 6, 32, 22), QuantType("Q5_1", 7, 32, 24),
    QuantType("Q2_K", 10, QK_K, 84), QuantType("Q3_K", 11, QK_K, 110), QuantType("Q4_K", 12, QK_K, 144),
    QuantType("Q5_K", 13, QK_K, 176), QuantType("Q6_K", 14, QK_K, 210),
]}
TYPES_BY_ID = {t.type_id: t for t in TYPES.values()}


# ---------------------------------------------------------------------------------------------------- helpers

def _blocks(raw: np.ndarray, block_bytes: int) -> np.ndarray:
    """Raw bytes as one row per block.  # [nb * block_bytes] uint8 -> [nb, block_bytes]"""
    raw = np.asarray(raw)
    if raw.dtype != np.uint8:
        raw = raw.view(np.uint8)
    if raw.size % block_bytes:
        raise QuantizationError(f"{raw.size} bytes are not a whole number of {block_bytes}-byte blocks")
    return raw.reshape(-1, block_bytes)


def _half(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 stored at byte `at` of every block, widened to float32.  # [nb, bytes] -> [nb, 1]"""
    bits = blocks[:, at].astype(np.uint16) | (blocks[:, at + 1].astype(np.uint16) << 8)
    return bits.view(np.float16).astype(np.float32)[:, None]


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """Low nibbles then high nibbles of each run of bytes.  # [..., n] uint8 -> [..., 2, n]"""
    return np.stack([packed & 0x0F, packed >> 4], axis=-2)


def _bits(mask: np.ndarray, count: int) -> np.ndarray:
    """Bit i of each byte, for i < count.  # [..., n] uint8 -> [..., count, n] in {0, 1}"""
    shifts = np.arange(count, dtype=np.uint8)[:, None]
    return (mask[..., None, :] >> shifts) & 1


# ---------------------------------------------------------------------------------------------------- float types

def dequantize_f32(raw: np.ndarray) -> np.ndarray:
    out = np.asarray(raw).view("<f4")
    return out if out.flags.aligned else out.copy()


def dequantize_f16(raw: np.ndarray) -> np.ndarray:
    """IEEE half precision: sign, 5-bit exponent, 10-bit mantissa; widening to float32 is exact."""
    return np.asarray(raw).view("<f2").astype(np.float32)


def dequantize_bf16(raw: np.ndarray) -> np.ndarray:
    """bfloat16 is the high half of a float32: shift the 16-bit word up."""
    return (np.asarray(raw).view("<u2").astype(np.uint32) << 16).view(np.float32)


# ---------------------------------------------------------------------------------------------------- 32-value blocks

def dequantize_q8_0(raw: np.ndarray) -> np.ndarray:
    """Q8_0: 34 bytes per 32 values.

        bytes 0-1    d      float16 scale
        bytes 2-33   q[32]  int8, value j in byte 2 + j

        x[j] = d * q[j]                                           # [nb * 34] -> [nb * 32]
    """
    blocks = _blocks(raw, 34)
    d = _half(blocks, 0)  # [nb, 1]
    q = blocks[:, 2:].view(np.int8).astype(np.float32)  # [nb, 32]
    return (q * d).reshape(-1)


def dequantize_q4_0(raw: np.ndarray) -> np.ndarray:
    """Q4_0: 18 bytes per 32 values.

        bytes 0-1    d       float16 scale
        bytes 2-17   qs[16]  byte j: low nibble = value j, high nibble = value j + 16

        x[j] = d * (q[j] - 8)        q[j] in 0..15                # [nb * 18] -> [nb * 32]
    """
    blocks = _blocks(raw, 18)
    d = _half(blocks, 0)
    q = _nibbles(blocks[:, 2:]).reshape(-1, 32).astype(np.int8) - np.int8(8)  # [nb, 32]
    return (d * q.astype(np.float32)).reshape(-1)


def dequantize_q4_1(raw: np.ndarray) -> np.ndarray:
    """Q4_1: 20 bytes per 32 values; an offset m instead of Q4_0's fixed -8.

        bytes 0-1    d       float16 scale
        bytes 2-3    m       float16 offset (the block's minimum)
        bytes 4-19   qs[16]  byte j: low nibble = value j, high nibble = value j + 16

        x[j] = d * q[j] + m          q[j] in 0..15                # [nb * 20] -> [nb * 32]
    """
    blocks = _blocks(raw, 20)
    d, m = _half(blocks, 0), _half(blocks, 2)
    q = _nibbles(blocks[:, 4:]).reshape(-1, 32).astype(np.float32)
    return (d * q + m).reshape(-1)


def _five_bit(blocks: np.ndarray, qh_at: int) -> np.ndarray:
    """5-bit integers of a Q5_0/Q5_1 block: 4 low bits from the nibbles, the fifth from bit j of the u32 qh.

    # [nb, bytes] -> [nb, 32] in 0..31
    """
    low = _nibbles(blocks[:, qh_at + 4 : qh_at + 20]).reshape(-1, 32)
    high = _bits(blocks[:, qh_at : qh_at + 4], 8).transpose(0, 2, 1).reshape(-1, 32)  # byte k bit i -> value 8k+i
    return low | (high << 4)


def dequantize_q5_0(raw: np.ndarray) -> np.ndarray:
    """Q5_0: 22 bytes per 32 values.

        bytes 0-1    d       float16 scale
        bytes 2-5    qh      uint32 (little-endian): bit j = fifth (high) bit of value j
        bytes 6-21   qs[16]  byte j: low nibble = low 4 bits of value j, high nibble = those of value j + 16

        x[j] = d * (q[j] - 16)       q[j] = low4[j] | (bit j of qh) << 4, in 0..31      # [nb * 22] -> [nb * 32]
    """
    blocks = _blocks(raw, 22)
    d = _half(blocks, 0)
    q = _five_bit(blocks, 2).astype(np.int8) - np.int8(16)
    return (d * q.astype(np.float32)).reshape(-1)


def dequantize_q5_1(raw: np.ndarray) -> np.ndarray:
    """Q5_1: 24 bytes per 32 values.

        bytes 0-1    d       float16 scale
        bytes 2-3    m       float16 offset (the block's minimum)
        bytes 4-7    qh      uint32: bit j = fifth bit of value j
        bytes 8-23   qs[16]  byte j: low nibble = value j, high nibble = value j + 16 (low 4 bits)

        x[j] = d * q[j] + m          q[j] in 0..31                # [nb * 24] -> [nb * 32]
    """
    blocks = _blocks(raw, 24)
    d, m = _half(blocks, 0), _half(blocks, 2)
    q = _five_bit(blocks, 4).astype(np.float32)
    return (d * q + m).reshape(-1)


# ---------------------------------------------------------------------------------------------------- K-quants

def _scales_6bit(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Eight 6-bit scales and eight 6-bit mins from the 12 scale bytes of Q4_K/Q5_K.  # [nb, 12] -> 2 x [nb, 8]

        byte  0..3   sc[0..3] in bits 0-5; bits 6-7 = high 2 bits of sc[4..7]
        byte  4..7   mn[0..3] in bits 0-5; bits 6-7 = high 2 bits of mn[4..7]
        byte  8..11  low nibble = low 4 bits of sc[4..7], high nibble = low 4 bits of mn[4..7]
    """
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=1)
    return sc, mn


def dequantize_q4_k(raw: np.ndarray) -> np.ndarray:
    """Q4_K: 144 bytes per 256 values, eight sub-blocks of 32 each with its own 6-bit scale and min.

        bytes 0-1     d        float16 super-scale of the scales
        bytes 2-3     dmin     float16 super-scale of the mins
        bytes 4-15    scales   sc[8], mn[8], 6 bits each (see _scales_6bit)
        bytes 16-143  qs[128]  four runs of 32 bytes; run r: low nibbles = sub-block 2r, high = sub-block 2r + 1

        x[32 s + j] = (d * sc[s]) * q[32 s + j] - dmin * mn[s]     q in 0..15    # [nb * 144] -> [nb * 256]
    """
    blocks = _blocks(raw, 144)
    d, dmin = _half(blocks, 0), _half(blocks, 2)
    sc, mn = _scales_6bit(blocks[:, 4:16])
    scale = (d * sc.astype(np.float32))[:, :, None]  # [nb, 8, 1]
    offset = (dmin * mn.astype(np.float32))[:, :, None]
    q = _nibbles(blocks[:, 16:].reshape(-1, 4, 32)).reshape(-1, 8, 32).astype(np.float32)
    return (scale * q - offset).reshape(-1)


def dequantize_q5_k(raw: np.ndarray) -> np.ndarray:
    """Q5_K: 176 bytes per 256 values; Q4_K plus a fifth bit per value.

        bytes 0-1     d        float16 super-scale of the scales
        bytes 2-3     dmin     float16 super-scale of the mins
        bytes 4-15    scales   sc[8], mn[8], 6 bits each (see _scales_6bit)
        bytes 16-47   qh[32]   bit s of qh[j] = fifth bit of value j of sub-block s
        bytes 48-175  qs[128]  four runs of 32 bytes; run r: low nibbles = sub-block 2r, high = sub-block 2r + 1

        x[32 s + j] = (d * sc[s]) * q[32 s + j] - dmin * mn[s]     q in 0..31    # [nb * 176] -> [nb * 256]
    """
    blocks = _blocks(raw, 176)
    d, dmin = _half(blocks, 0), _half(blocks, 2)
    sc, mn = _scales_6bit(blocks[:, 4:16])
    scale = (d * sc.astype(np.float32))[:, :, None]
    offset = (dmin * mn.astype(np.float32))[:, :, None]
    low = _nibbles(blocks[:, 48:].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    high = _bits(blocks[:, 16:48], 8)  # [nb, 8, 32]
    q = (low | (high << 4)).astype(np.float32)
    return (scale * q - offset).reshape(-1)


def dequantize_q6_k(raw: np.ndarray) -> np.ndarray:
    """Q6_K: 210 bytes per 256 values, sixteen sub-blocks of 16 each with an int8 scale.

        bytes 0-127    ql[128]  low 4 bits; two halves of 64 bytes, one per 128 values
        bytes 128-191  qh[64]   high 2 bits; two halves of 32 bytes
        bytes 192-207  sc[16]   int8 scale of each sub-block of 16 values
        bytes 208-209  d        float16 super-scale

        Within half h (values 128 h + i), for l in 0..31, with ql = ql[64 h:], qh = qh[32 h:]:
            value l      : low nibble of ql[l]       | bits 0-1 of qh[l] << 4
            value l + 32 : low nibble of ql[l + 32]  | bits 2-3 of qh[l] << 4
            value l + 64 : high nibble of ql[l]      | bits 4-5 of qh[l] << 4
            value l + 96 : high nibble of ql[l + 32] | bits 6-7 of qh[l] << 4

        x[16 s + j] = (d * sc[s]) * (q[16 s + j] - 32)     q in 0..63    # [nb * 210] -> [nb * 256]
    """
    blocks = _blocks(raw, 210)
    d = _half(blocks, 208)
    sc = blocks[:, 192:208].view(np.int8).astype(np.float32)
    scale = (d * sc)[:, :, None]  # [nb, 16, 1]
    ql = blocks[:, :128].reshape(-1, 2, 2, 32)  # [nb, half, run of 32, l]
    low = _nibbles(ql).swapaxes(2, 3).reshape(-1, 2, 4, 32)  # [nb, half, nibble, run, l]: group = 2 nibble + run
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]
    high = (blocks[:, 128:192].reshape(-1, 2, 1, 32) >> shifts) & 3  # [nb, half, group, l]
    q = (low | (high << 4)).astype(np.int8) - np.int8(32)
    return (scale * q.reshape(-1, 16, 16).astype(np.float32)).reshape(-1)


def _sixteen_by_two_bits(qs: np.ndarray) -> np.ndarray:
    """2-bit fields of Q2_K/Q3_K: sub-block s (of 16) = bits 2 k of bytes 32 n + 16 h .. + 15, s = 8 n + 2 k + h.

    # [nb, 64] -> [nb, 16, 16] in 0..3
    """
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]
    return ((qs.reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, 16, 16)


def dequantize_q2_k(raw: np.ndarray) -> np.ndarray:
    """Q2_K: 84 bytes per 256 values, sixteen sub-blocks of 16 with a 4-bit scale and a 4-bit min.

        bytes 0-15   scales[16]  low nibble = sc[s], high nibble = mn[s]
        bytes 16-79  qs[64]      2 bits per value: two runs of 32 bytes (128 values each); within run n, the
                                 shift 2 k picks sub-blocks 8 n + 2 k (bytes 0-15) and 8 n + 2 k + 1 (bytes 16-31)
        bytes 80-81  d           float16 super-scale of the scales
        bytes 82-83  dmin        float16 super-scale of the mins

        x[16 s + j] = (d * sc[s]) * q[16 s + j] - dmin * mn[s]     q in 0..3    # [nb * 84] -> [nb * 256]
    """
    blocks = _blocks(raw, 84)
    d, dmin = _half(blocks, 80), _half(blocks, 82)
    scales = blocks[:, :16]
    scale = (d * (scales & 0x0F).astype(np.float32))[:, :, None]
    offset = (dmin * (scales >> 4).astype(np.float32))[:, :, None]
    q = _sixteen_by_two_bits(blocks[:, 16:80]).astype(np.float32)
    return (scale * q - offset).reshape(-1)


def _scales_q3_k(packed: np.ndarray) -> np.ndarray:
    """Q3_K's sixteen 6-bit scales, minus 32 (dequantize_q3_k draws them).      # [n, 12] uint8 -> [n, 16] int8"""
    low4 = _nibbles(packed[:, :8]).reshape(-1, 16)  # s < 8: low nibbles of bytes 0..7, s >= 8: high nibbles
    high2 = ((packed[:, 8:12, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)) & 3)  # [n, s % 4, s // 4]
    high2 = high2.transpose(0, 2, 1).reshape(-1, 16)
    return (low4 | (high2 << 4)).astype(np.int8) - np.int8(32)


def _pack_scales_q3_k(sc: np.ndarray) -> np.ndarray:
    """_scales_q3_k undone.                                                    # [n, 16] int8 -> [n, 12] uint8"""
    u = (sc.astype(np.int16) + 32).astype(np.uint8)
    low4, high2 = (u & 15).reshape(-1, 2, 8), (u >> 4).reshape(-1, 4, 4)  # [n, s // 8, s % 8], [n, s // 4, s % 4]
    high = high2[:, 0] | (high2[:, 1] << 2) | (high2[:, 2] << 4) | (high2[:, 3] << 6)
    return np.concatenate([low4[:, 0] | (low4[:, 1] << 4), high], axis=1)


def dequantize_q3_k(raw: np.ndarray) -> np.ndarray:
    """Q3_K: 110 bytes per 256 values, sixteen sub-blocks of 16 with a 6-bit scale stored offset by 32.

        bytes 0-31    hmask[32]  bit b of hmask[16 h + j] = third bit of value j of sub-block 2 b + h
        bytes 32-95   qs[64]     low 2 bits, laid out as in Q2_K
        bytes 96-107  scales     sc[s] low 4 bits: byte s (s < 8, low nibble) or byte s - 8 (high nibble);
                                 high 2 bits: bits 2 (s // 4) of byte 8 + s % 4
        bytes 108-109 d          float16 super-scale

        x[16 s + j] = (d * (sc[s] - 32)) * (q2 - (0 if the hmask bit is set else 4))    # [nb * 110] -> [nb * 256]
    """
    blocks = _blocks(raw, 110)
    d = _half(blocks, 108)
    scale = (d * _scales_q3_k(blocks[:, 96:108]).astype(np.float32))[:, :, None]
    low = _sixteen_by_two_bits(blocks[:, 32:96]).astype(np.int8)
    missing = (_bits(blocks[:, :32], 8).reshape(-1, 16, 16) ^ 1).astype(np.int8) << 2  # 4 where the bit is clear
    return (scale * (low - missing).astype(np.float32)).reshape(-1)


DEQUANTIZE = {
    "F32": dequantize_f32, "F16": dequantize_f16, "BF16": dequantize_bf16,
    "Q8_0": dequantize_q8_0, "Q4_0": dequantize_q4_0, "Q4_1": dequantize_q4_1,
    "Q5_0": dequantize_q5_0, "Q5_1": dequantize_q5_1,
    "Q2_K": dequantize_q2_k, "Q3_K": dequantize_q3_k, "Q4_K": dequantize_q4_k,
    "Q5_K": dequantize_q5_k, "Q6_K": dequantize_q6_k,
}


def dequantize(raw: np.ndarray, qtype: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """Raw bytes of a tensor of type `qtype` (a name in TYPES) as float32, reshaped to `shape` when given."""
    if qtype not in DEQUANTIZE:
        raise QuantizationError(f"npllm cannot read type {qtype} (it reads {', '.join(DEQUANTIZE)})")
    values = DEQUANTIZE[qtype](raw)
    return values if shape is None else values.reshape(shape)


# ---------------------------------------------------------------------------------------------------- quantizers

def _rows_of_blocks(values: np.ndarray, block_size: int) -> np.ndarray:
    """Finite float32 values as one row per block.  # [..., n] -> [n_total / block_size, block_size]"""
    values = np.asarray(values, dtype=np.float32)
    if values.ndim == 0 or values.shape[-1] % block_size:
        raise QuantizationError(f"rows of {values.shape[-1:]} values do not split into blocks of {block_size}")
    if not np.all(np.isfinite(values)):
        raise QuantizationError("cannot quantize values that are not finite (inf or NaN)")
    return values.reshape(-1, block_size)


def _as_half(d: np.ndarray) -> np.ndarray:
    """float32 scales [nb, 1] stored as float16 bytes [nb, 2]; a scale beyond float16's range is refused."""
    with np.errstate(over="ignore"):  # an overflow becomes inf, refused just below
        half = d.astype(np.float16)
    if not np.all(np.isfinite(half)):
        raise QuantizationError("values too large for a float16 block scale (|x| must stay below about 4e6)")
    return half.view(np.uint8).reshape(-1, 2)


def _inverse(d: np.ndarray) -> np.ndarray:
    """1 / d, and 0 for an all-zero block (every q then encodes 0)."""
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)


def _round_half_away(v: np.ndarray) -> np.ndarray:
    """C's roundf: halves round away from zero (float64 so that |v| + 0.5 is exact for these magnitudes)."""
    v = v.astype(np.float64)
    return np.sign(v) * np.floor(np.abs(v) + 0.5)


def _signed_absmax(blocks: np.ndarray) -> np.ndarray:
    """The value of largest magnitude in each block, with its sign (the first one on ties).  # [nb, n] -> [nb, 1]"""
    return np.take_along_axis(blocks, np.abs(blocks).argmax(axis=1)[:, None], axis=1)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """Values j and j + 16 of each 32 into byte j (low, high nibble).  # [nb, 32] in 0..15 (low 4 bits) -> [nb, 16]"""
    return (q[:, :16] & 0x0F) | (q[:, 16:] << 4)


def _pack_fifth_bits(q: np.ndarray) -> np.ndarray:
    """Bit 4 of value j into bit j of a little-endian u32.  # [nb, 32] in 0..31 -> [nb, 4]"""
    return np.packbits((q >> 4).astype(np.uint8), axis=1, bitorder="little")


def quantize_q8_0(values: np.ndarray) -> np.ndarray:
    """[..., n] float32 -> Q8_0 bytes [nb * 34]: d = max|x| / 127, q = round(x / d) (halves away from zero)."""
    x = _rows_of_blocks(values, 32)
    d = (np.abs(x).max(axis=1, keepdims=True) / np.float32(127)).astype(np.float32)
    q = _round_half_away(x * _inverse(d)).astype(np.int8).view(np.uint8)
    return np.concatenate([_as_half(d), q], axis=1).reshape(-1)


def quantize_q4_0(values: np.ndarray) -> np.ndarray:
    """[..., n] -> Q4_0 bytes: d = -m / 8 with m the block's value of largest magnitude (so m itself maps to q = 0,
    the far end of 0..15), q = min(15, trunc(x / d + 8.5))."""
    x = _rows_of_blocks(values, 32)
    d = (_signed_absmax(x) / np.float32(-8)).astype(np.float32)
    q = np.minimum(np.trunc(x * _inverse(d) + np.float32(8.5)), 15).astype(np.uint8)
    return np.concatenate([_as_half(d), _pack_nibbles(q)], axis=1).reshape(-1)


def quantize_q4_1(values: np.ndarray) -> np.ndarray:
    """[..., n] -> Q4_1 bytes: m = min x, d = (max x - m) / 15, q = min(15, trunc((x - m) / d + 0.5))."""
    x = _rows_of_blocks(values, 32)
    lo, hi = x.min(axis=1, keepdims=True), x.max(axis=1, keepdims=True)
    d = ((hi - lo) / np.float32(15)).astype(np.float32)
    q = np.minimum(np.trunc((x - lo) * _inverse(d) + np.float32(0.5)), 15).astype(np.uint8)
    return np.concatenate([_as_half(d), _as_half(lo), _pack_nibbles(q)], axis=1).reshape(-1)


def quantize_q5_0(values: np.ndarray) -> np.ndarray:
    """[..., n] -> Q5_0 bytes: d = -m / 16 (m: value of largest magnitude), q = min(31, trunc(x / d + 16.5))."""
    x = _rows_of_blocks(values, 32)
    d = (_signed_absmax(x) / np.float32(-16)).astype(np.float32)
    q = np.minimum(np.trunc(x * _inverse(d) + np.float32(16.5)), 31).astype(np.uint8)
    return np.concatenate([_as_half(d), _pack_fifth_bits(q), _pack_nibbles(q)], axis=1).reshape(-1)


def quantize_q5_1(values: np.ndarray) -> np.ndarray:
    """[..., n] -> Q5_1 bytes: m = min x, d = (max x - m) / 31, q = min(31, trunc((x - m) / d + 0.5))."""
    x = _rows_of_blocks(values, 32)
    lo, hi = x.min(axis=1, keepdims=True), x.max(axis=1, keepdims=True)
    d = ((hi - lo) / np.float32(31)).astype(np.float32)
    q = np.minimum(np.trunc((x - lo) * _inverse(d) + np.float32(0.5)), 31).astype(np.uint8)
    return np.concatenate([_as_half(d), _as_half(lo), _pack_fifth_bits(q), _pack_nibbles(q)], axis=1).reshape(-1)


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


def _pack_scales_6bit(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Inverse of _scales_6bit.  # [nb, 8] x2 in 0..63 -> [nb, 12]"""
    a = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    b = (mn[:, :4] & 0x3F) | ((mn[:, 4:] >> 4) << 6)
    c = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return np.concatenate([a, b, c], axis=1).astype(np.uint8)


def _dot_last(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """sum over the last axis of a * b (einsum: ~4x faster than (a * b).sum(-1) on rows of 16 or 32).
                                                                                       # [..., n] x2 -> [...]"""
    return np.einsum("...i,...i->...", a, b)


def _sum_last(a: np.ndarray) -> np.ndarray:
    """sum over the last axis (einsum, as _dot_last).                                    # [..., n] -> [...]"""
    return np.einsum("...i->...", a)


def _extreme_last(a: np.ndarray, pick=np.maximum) -> np.ndarray:
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


def _covering_scale_min(values: np.ndarray, top: int, sub: int = 32, scale_top: int = 63):
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
    x = _rows_of_blocks(values, QK_K).reshape(-1, QK_K // sub, sub).astype(np.float64)
    mn_needed = -np.minimum(_extreme_last(x, np.minimum), 0.0)
    dmin, mn = _scales_on_grid(mn_needed, scale_top)
    offset = (dmin * mn.astype(np.float32)).astype(np.float64)  # exactly what the decoder computes
    d, sc = _scales_on_grid((_extreme_last(x) + offset) / top, scale_top)
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
    sq, sx, sqq, sqx = (a.astype(np.float64) for a in (_sum_last(q), _sum_last(x), _dot_last(q, q), _dot_last(q, x)))
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
    return _dot_last(e, e)


def _fit_step_offset(x: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    """Per sub-block, the step s and offset m (x ~ s q - m, q in 0..top) with the least squared error among a few
    candidates: the covering pair, and for each f in FIT_FACTORS the covering step times f (the first centred on
    the range, the others from the minimum), refined by least squares on its levels. Searched in float32 (half the
    memory traffic of float64; the chosen bytes are compared in float64 by _closer).    # [..., n] -> [...] x2"""
    x = x.astype(np.float32)
    low, high = np.minimum(_extreme_last(x, np.minimum), np.float32(0)), _extreme_last(x)
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


def _scales_nearest(needed: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    """Each sub-block's scale rounded to the nearest of d * k, k in -top..top, d the float16 nearest max|v| / top.
                                                                 # [nb, S] -> d [nb, 1] float32, k [nb, S] float64"""
    with np.errstate(over="ignore"):
        d = (np.abs(needed).max(axis=1, keepdims=True) / top).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        k = np.where(d > 0, np.round(needed / d.astype(np.float64)), 0)
    return d, np.clip(k, -top, top)


def _fitted_scale_min(values: np.ndarray, top: int, sub: int = 32, scale_top: int = 63):
    """The fitted rule for the types of _covering_scale_min (same outputs): _fit_step_offset's step and offset per
    sub-block, each rounded to the nearest point of its 6-bit (4-bit) grid, then q for those exact grid values."""
    x = _rows_of_blocks(values, QK_K).reshape(-1, QK_K // sub, sub).astype(np.float64)
    s, m = _fit_step_offset(x, top)
    dmin, mn = _scales_nearest(m, scale_top)
    d, sc = _scales_nearest(s, scale_top)
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
    above, below = np.maximum(_extreme_last(x), np.float32(0)), np.maximum(-_extreme_last(x, np.minimum), np.float32(0))
    best, best_s = np.full(x.shape[:-1], np.inf, np.float32), np.zeros(x.shape[:-1], np.float32)
    for sign, reach in ((1.0, np.maximum(above / high, below / -low)), (-1.0, np.maximum(below / high, above / -low))):
        for f in FIT_FACTORS:
            s = reach * np.float32(sign * f)
            for _ in range(FIT_ROUNDS):
                k = _signed_levels(x, s, low, high)
                with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                    fit = (_dot_last(k, x) / _dot_last(k, k)).astype(np.float32)
                s = np.where(np.isfinite(fit) & (fit * sign > 0), fit, s)
            e = x - s[..., None] * _signed_levels(x, s, low, high)
            error = _dot_last(e, e)
            better = error < best
            best, best_s = np.where(better, error, best), np.where(better, s, best_s)
    return best_s.astype(np.float64)


def _fitted_signed_scale(values: np.ndarray, low: int, high: int, scale_top: int):
    """The fitted rule for Q3_K (k in -4..3, 6-bit signed sc) and Q6_K (k in -32..31, int8 sc): x = (d sc) k on
    sub-blocks of 16. _fit_signed_step per sub-block, rounded to the nearest d sc, then k for that exact step.
                                                            # [..., n] -> d [nb, 1], sc [nb, 16] int8, k [nb, 16, 16]"""
    x = _rows_of_blocks(values, QK_K).reshape(-1, 16, 16).astype(np.float64)
    d, sc = _scales_nearest(_fit_signed_step(x, low, high), scale_top)
    sc = sc.astype(np.int8)
    step = (d * sc.astype(np.float32)).astype(np.float64)
    return d, sc, _signed_levels(x, step, low, high)


def _closer(values: np.ndarray, qtype: str, *candidates: np.ndarray) -> np.ndarray:
    """Per super-block, the candidate bytes whose dequantized values have the least sum of squared errors (the
    first on ties).                                      # [..., n], [nb * block_bytes] x c -> [nb * block_bytes]"""
    x = _rows_of_blocks(values, QK_K).astype(np.float64)
    blocks = [c.reshape(x.shape[0], TYPES[qtype].block_bytes) for c in candidates]
    errors = np.stack([((DEQUANTIZE[qtype](b.reshape(-1)).reshape(x.shape) - x) ** 2).sum(1) for b in blocks])
    choice = np.nan_to_num(errors, nan=np.inf).argmin(axis=0)
    return np.take_along_axis(np.stack(blocks), choice[None, :, None], axis=0)[0].reshape(-1)


K_QUANT_CHUNK = 4096  # super-blocks quantized at a time: the fit's float64 temporaries stay at ~8 MB each


def _k_quantize(values: np.ndarray, qtype: str) -> np.ndarray:
    """values [..., n] as `qtype` bytes: per super-block the closer of the covering rule's bytes (nothing clipped,
    each error at most half a step) and the fitted rule's (clipping where that lowers the squared error), so
    never worse than covering; chunk by chunk."""
    blocks = _rows_of_blocks(values, QK_K)
    covering, fitted = K_QUANT_RULES[qtype]
    return np.concatenate([_closer(chunk, qtype, covering(chunk), fitted(chunk))
                           for chunk in np.split(blocks, range(K_QUANT_CHUNK, len(blocks), K_QUANT_CHUNK))])


def _pack_q4_k(d, dmin, sc, mn, q) -> np.ndarray:
    """Q4_K bytes from its fields.                                                              # -> [nb * 144]"""
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # run r: sub-block 2r low, 2r + 1 high
    return np.concatenate([_as_half(d), _as_half(dmin), _pack_scales_6bit(sc, mn), qs], axis=1).reshape(-1)


def _pack_q5_k(d, dmin, sc, mn, q) -> np.ndarray:
    """Q5_K bytes from its fields.                                                              # -> [nb * 176]"""
    qh = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for s in range(8):  # bit s of qh[j]: fifth bit of value j of sub-block s
        qh |= ((q[:, s] >> 4) & 1) << s
    low = q & 0x0F
    qs = (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(-1, 128)
    return np.concatenate([_as_half(d), _as_half(dmin), _pack_scales_6bit(sc, mn), qh, qs], axis=1).reshape(-1)


def _pack_q6_k(d, sc, k) -> np.ndarray:
    """Q6_K bytes from d [nb, 1], sc [nb, 16] int8 and k [nb, 16, 16] in -32..31.              # -> [nb * 210]"""
    q = (k + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # [nb, half, group, l]
    low, high = q & 0x0F, q >> 4
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), _as_half(d)],
                          axis=1).reshape(-1)


def _covering_q6_k(values: np.ndarray):
    """The covering rule for Q6_K: each sub-block of 16 needs step max|x| / 31 (so +-max|x| lie within k in
    -31..31); d = smallest float16 >= max(step) / 127, sc = ceil(step / d) (0..127); k = clip(round(x / (d sc)),
    -32, 31). Nothing is clipped and each error is at most d sc / 2.    # [..., n] -> d [nb, 1], sc, k [nb, 16, 16]"""
    x = _rows_of_blocks(values, QK_K).reshape(-1, 16, 16).astype(np.float64)
    d, sc = _scales_on_grid(_extreme_last(np.abs(x)) / 31, 127)
    step = (d * sc.astype(np.float32)).astype(np.float64)
    return d, sc.astype(np.int8), _signed_levels(x, step, -32, 31)


def _pack_sixteen_by_two_bits(q: np.ndarray) -> np.ndarray:
    """_sixteen_by_two_bits undone: value j of sub-block s = 8 n + 2 k + h at bits 2 k of byte 32 n + 16 h + j.
                                                                            # [nb, 16, 16] in 0..3 -> [nb, 64]"""
    q = q.reshape(-1, 2, 4, 32)  # [nb, run n, shift k, byte 16 h + j]
    return (q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)).reshape(-1, 64)


def _pack_q2_k(d, dmin, sc, mn, q) -> np.ndarray:
    """Q2_K bytes from its fields (sub-blocks of 16, q in 0..3, 4-bit sc and mn).                  # -> [nb * 84]"""
    return np.concatenate([sc | (mn << 4), _pack_sixteen_by_two_bits(q), _as_half(d), _as_half(dmin)],
                          axis=1).reshape(-1)


def _pack_q3_k(d, sc, k) -> np.ndarray:
    """Q3_K bytes from d [nb, 1], sc [nb, 16] int8 in -31..31 and k [nb, 16, 16] in -4..3.       # -> [nb * 110]"""
    q = (k + 4).astype(np.uint8)
    third = ((q >> 2) & 1).reshape(-1, 8, 32)  # bit b of hmask[16 h + j]: value j of sub-block 2 b + h
    hmask = np.bitwise_or.reduce(third << np.arange(8, dtype=np.uint8)[:, None], axis=1)
    return np.concatenate([hmask, _pack_sixteen_by_two_bits(q & 3), _pack_scales_q3_k(sc), _as_half(d)],
                          axis=1).reshape(-1)


def _covering_q3_k(values: np.ndarray):
    """The covering rule for Q3_K: x = step k with k in -4..3, so each sub-block of 16 takes the smaller of the two
    steps that cover it: a positive one of max(max x / 3, -min x / 4), or a negative one of magnitude
    max(-min x / 3, max x / 4); d = smallest float16 >= max |step| / 31, sc = ceil(|step| / d) with the step's
    sign (-31..31); k = clip(round(x / (d sc)), -4, 3). Nothing is clipped and each error is at most |d sc| / 2.
                                                                 # [..., n] -> d [nb, 1], sc [nb, 16], k [nb, 16, 16]"""
    x = _rows_of_blocks(values, QK_K).reshape(-1, 16, 16).astype(np.float64)
    high, low = np.maximum(_extreme_last(x), 0.0), np.maximum(-_extreme_last(x, np.minimum), 0.0)
    positive, negative = np.maximum(high / 3, low / 4), np.maximum(low / 3, high / 4)
    d, magnitude = _scales_on_grid(np.minimum(positive, negative), 31)
    sc = np.where(negative < positive, -1, 1).astype(np.int8) * magnitude.astype(np.int8)
    step = (d * sc.astype(np.float32)).astype(np.float64)
    return d, sc, _signed_levels(x, step, -4, 3)


# Each K-quant's two scale rules, as functions of the values giving bytes: (covering, fitted).
K_QUANT_RULES = {
    "Q2_K": (lambda v: _pack_q2_k(*_covering_scale_min(v, 3, sub=16, scale_top=15)),
             lambda v: _pack_q2_k(*_fitted_scale_min(v, 3, sub=16, scale_top=15))),
    "Q3_K": (lambda v: _pack_q3_k(*_covering_q3_k(v)), lambda v: _pack_q3_k(*_fitted_signed_scale(v, -4, 3, 31))),
    "Q4_K": (lambda v: _pack_q4_k(*_covering_scale_min(v, 15)), lambda v: _pack_q4_k(*_fitted_scale_min(v, 15))),
    "Q5_K": (lambda v: _pack_q5_k(*_covering_scale_min(v, 31)), lambda v: _pack_q5_k(*_fitted_scale_min(v, 31))),
    "Q6_K": (lambda v: _pack_q6_k(*_covering_q6_k(v)), lambda v: _pack_q6_k(*_fitted_signed_scale(v, -32, 31, 127))),
}


def quantize_q2_k(values: np.ndarray) -> np.ndarray:
    """[..., n] (n a multiple of 256) -> Q2_K bytes [nb * 84] (scales: _k_quantize)."""
    return _k_quantize(values, "Q2_K")


def quantize_q3_k(values: np.ndarray) -> np.ndarray:
    """[..., n] (n a multiple of 256) -> Q3_K bytes [nb * 110] (scales: _k_quantize)."""
    return _k_quantize(values, "Q3_K")


def quantize_q4_k(values: np.ndarray) -> np.ndarray:
    """[..., n] (n a multiple of 256) -> Q4_K bytes [nb * 144] (scales: _k_quantize)."""
    return _k_quantize(values, "Q4_K")


def quantize_q5_k(values: np.ndarray) -> np.ndarray:
    """[..., n] (n a multiple of 256) -> Q5_K bytes [nb * 176] (scales: _k_quantize)."""
    return _k_quantize(values, "Q5_K")


def quantize_q6_k(values: np.ndarray) -> np.ndarray:
    """[..., n] (n a multiple of 256) -> Q6_K bytes [nb * 210] (scales: _k_quantize)."""
    return _k_quantize(values, "Q6_K")


def quantize_f16(values: np.ndarray) -> np.ndarray:
    values = np.asarray(values, dtype=np.float32)
    if not np.all(np.isfinite(values)) or np.abs(values).max(initial=0) > np.finfo(np.float16).max:
        raise QuantizationError("values are not finite or beyond float16's range (65504)")
    return values.astype("<f2").view(np.uint8).reshape(-1)


def quantize_f32(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values, dtype="<f4").view(np.uint8).reshape(-1)


QUANTIZE = {
    "F32": quantize_f32, "F16": quantize_f16, "Q8_0": quantize_q8_0, "Q4_0": quantize_q4_0,
    "Q4_1": quantize_q4_1, "Q5_0": quantize_q5_0, "Q5_1": quantize_q5_1,
    "Q2_K": quantize_q2_k, "Q3_K": quantize_q3_k, "Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k,
    "Q6_K": quantize_q6_k,
}


def quantize(values: np.ndarray, qtype: str) -> np.ndarray:
    """float32 values [..., n] as the raw bytes of type `qtype` (rows of n values are whole blocks)."""
    if qtype not in QUANTIZE:
        raise QuantizationError(f"npllm cannot write type {qtype} (it writes {', '.join(QUANTIZE)})")
    return QUANTIZE[qtype](values)


# ---------------------------------------------------------------------------------------------------- matrices

# Where each block keeps its float16 scales and mins (byte offsets in the block), as the dequantizers read them.
SCALE_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q2_K": (80, 82),
                "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


@dataclass(frozen=True)
class QuantizedMatrix:
    """A weight matrix W [N, K] kept in its file type: N rows of K / block_size blocks, no float copy.

    `raw` is [N, K / block_size * block_bytes] uint8, typically a read-only view of a memory-mapped file. The
    NumPy reference multiplies by dequantizing (`matmul_t`); kernels/quant.py reads the same bytes directly.

    It stands in for a float32 weight array where the NumPy model uses one: `x @ W.T` (through `.T`), `W[ids]`
    (rows), `.shape`, `.dtype` (float32, the type it computes in); `np.asarray(W)` dequantizes it whole.
    """

    __array_ufunc__ = None  # `x @ W` and ufuncs defer to this class instead of converting it
    dtype = np.dtype(np.float32)
    ndim = 2

    raw: np.ndarray
    qtype: str
    shape: tuple[int, int]

    def __post_init__(self):
        t = TYPES.get(self.qtype)
        N, K = self.shape
        if t is None or self.qtype not in DEQUANTIZE:
            raise QuantizationError(f"npllm cannot compute with type {self.qtype}")
        if K % t.block_size or self.raw.dtype != np.uint8 or self.raw.shape != (N, K // t.block_size * t.block_bytes):
            raise QuantizationError(f"{self.qtype} bytes of shape {self.raw.shape} do not hold a [{N}, {K}] matrix")

    @classmethod
    def from_values(cls, values: np.ndarray, qtype: str) -> "QuantizedMatrix":
        """Quantize a float matrix.  # [N, K] -> QuantizedMatrix"""
        N, K = values.shape
        return cls(quantize(values, qtype).reshape(N, -1), qtype, (N, K))

    @property
    def nbytes(self) -> int:
        return self.raw.nbytes

    @property
    def size(self) -> int:
        """Values held (N K), as an array's size."""
        return self.shape[0] * self.shape[1]

    def dequantize(self) -> np.ndarray:
        """W as float32.  # -> [N, K]"""
        return dequantize(self.raw, self.qtype, self.shape)

    def rows(self, ids) -> np.ndarray:
        """Only the rows asked for, as float32 (an embedding lookup reads no other row).  # [T] -> [T, K]"""
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
        blocks = _blocks(self.raw.reshape(-1), TYPES[self.qtype].block_bytes)
        return all(np.isfinite(_half(blocks, at)).all() for at in SCALE_FIELDS[self.qtype])

    def matmul_t(self, x: np.ndarray) -> np.ndarray:
        """x @ W.T, the reference: dequantize, then multiply.  # [T, K] -> [T, N]"""
        return np.asarray(x, dtype=np.float32) @ self.dequantize().T

    @property
    def T(self) -> "_TransposedMatrix":
        return _TransposedMatrix(self)

    def __getitem__(self, ids) -> np.ndarray:
        return self.rows(ids)

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


# ---------------------------------------------------------------------------------------------------- 8-bit activations
# The integer-dot path (kernels/quant.py, "8-bit activations"): the activations of a product are quantized per block
# of 32 to int8 as Q8_0 quantizes weights, and each weight block meets its activation block in an integer dot
# product. This is the readable reference those kernels are held to.

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
    q = np.clip(_round_half_away(ratio), -127, 127).astype(np.int8)
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
    return q, _round_half_away(second).astype(np.int8).reshape(q.shape), d


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


# The types whose matrix products npllm's Numba model computes on 8-bit activations (every block type, on rows
# interleaved by eight: kernels/quant.py matmul_rows_interleaved, models/numba.py products_into); the others (F32,
# F16, BF16) take float32 activations.
INT8_ACTIVATION_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K")
# Of those, the types whose products take their activations in two 8-bit parts (quantize_activations_two_part):
# files of Q2_K and Q3_K matrices (llama.cpp's Q2_K and Q3_K_S/M presets) missed the quality bar on one 8-bit part
# (mean KL 1e-3 to 2.3e-3 from the exact dequantized model, top-1 96.2-98.0%; docs/quant.md), at twice the dots.
TWO_PART_ACTIVATION_TYPES = ("Q2_K", "Q3_K")
# (Until the K-quants were held as interleaved rows, calls of many tokens multiplied Q4_K, Q5_K and Q6_K rows decoded
# into float32 by float32 activations: the decoded rows were faster from 16-100 tokens a call. The interleaved
# kernels are faster at every length, so these types take 8-bit activations in every call.)


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
    the Numba model computes for TWO_PART_ACTIVATION_TYPES."""

    def matmul_t(self, x: np.ndarray) -> np.ndarray:
        """(x^ + x^') W^T.  # [T, K] -> [T, N]"""
        return matmul_t_two_part_activations(self.raw, self.qtype, self.shape, x).astype(np.float32)


def with_int8_activations(tensors: dict) -> dict:
    """The same weights, each matrix of an INT8_ACTIVATION_TYPES type multiplying as the Numba model does: on one
    8-bit part, or on two for TWO_PART_ACTIVATION_TYPES."""
    def as_numba(w):
        if not isinstance(w, QuantizedMatrix) or w.qtype not in INT8_ACTIVATION_TYPES:
            return w
        kind = TwoPartActivationMatrix if w.qtype in TWO_PART_ACTIVATION_TYPES else Int8ActivationMatrix
        return kind(w.raw, w.qtype, w.shape)

    return {name: as_numba(w) for name, w in tensors.items()}


# ================================================================================================================
# Rows interleaved by eight: how the Numba model holds the integer-dot types' matrices in memory (kernels/quant.py's
# "interleaved rows"). The same values regrouped so that ONE 32-byte vector holds four values of each of eight rows:
# an integer dot against four activations broadcast to every lane then advances eight rows at once, and one float
# multiply-add per block (the K-quants: per sub-block) applies the eight rows' scales.
INTERLEAVED_TYPES = ("Q8_0", "Q4_0", "Q4_K", "Q6_K", "Q5_K", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K")
INTERLEAVE = 8  # rows per group
# bytes of one block of a group of eight rows: the file's 8 x 34, 8 x 18, 8 x 210, 8 x 20, 8 x 22, 8 x 24 and 8 x 84
# (reordered); Q4_K's 8 x 144, Q5_K's 8 x 176 and Q3_K's 8 x 110 plus 32, their 6-bit scales unpacked to a byte each
INTERLEAVED_BLOCK_BYTES = {"Q8_0": 272, "Q4_0": 144, "Q4_K": 1184, "Q6_K": 1680, "Q5_K": 1440, "Q4_1": 160,
                           "Q5_0": 176, "Q5_1": 192, "Q2_K": 672, "Q3_K": 912}
_SIGN_FLIP = {"Q8_0": 0x80, "Q4_0": 0}  # stored Q8_0 values are q + 128 (unsigned)
# Q4_1, Q5_0, Q5_1 blocks: where the file's scale(s), fifth bits and nibbles start
_SMALL_BLOCK_FIELDS = {"Q4_1": ((0, 2), None, 4), "Q5_0": ((0,), 2, 6), "Q5_1": ((0, 2), 4, 8)}


def _check_interleave(qtype: str) -> None:
    if qtype not in INTERLEAVED_TYPES:
        raise QuantizationError(f"npllm interleaves the rows of {', '.join(INTERLEAVED_TYPES)} only, not {qtype}")


def _words(runs: np.ndarray) -> np.ndarray:
    """Runs of 32 bytes of 8 rows as 8 words: word k, lane r = bytes 4k .. 4k+3 of row r.
                                                                                   # [..., 8, 32] -> [..., 256]"""
    shape = runs.shape[:-2]
    return runs.reshape(*shape, 8, 8, 4).swapaxes(-3, -2).reshape(*shape, 256)


def _runs(words: np.ndarray) -> np.ndarray:
    """_words undone.                                                              # [..., 256] -> [..., 8, 32]"""
    shape = words.shape[:-1]
    return words.reshape(*shape, 8, 8, 4).swapaxes(-3, -2).reshape(*shape, 8, 32)


def _fifth_bits_by_word(qh: np.ndarray, undo: bool = False) -> np.ndarray:
    """A Q5_0/Q5_1 block's fifth bits reordered for its interleaved words: byte i, bit k holds value 4k + i's (the
    file's u32 has value v's at bit v). Word k of an interleaved block holds values 4k .. 4k + 3 of each row, so its
    fifth bits are bit k of each of the four bytes: one shift for the word, the same in every byte.
                                                                                       # [..., 4] -> [..., 4] uint8"""
    bits = np.unpackbits(qh, axis=-1, bitorder="little")
    shape = (4, 8) if undo else (8, 4)
    bits = bits.reshape(*bits.shape[:-1], *shape).swapaxes(-1, -2).reshape(bits.shape)
    return np.packbits(bits, axis=-1, bitorder="little")


def _interleave_small_blocks(blocks: np.ndarray, qtype: str) -> list:
    """Q4_1, Q5_0, Q5_1 blocks [G, b, r, block bytes] as the parts of interleaved ones (interleave_rows)."""
    scales, qh, qs = _SMALL_BLOCK_FIELDS[qtype]
    G, nb = blocks.shape[:2]
    parts = [blocks[..., at:at + 2] for at in scales]
    if qh is not None:
        parts.append(_fifth_bits_by_word(blocks[..., qh:qh + 4]))
    parts.append(blocks[..., qs:qs + 16].reshape(G, nb, 8, 4, 4).swapaxes(2, 3))  # [G, b, word, r, 4]
    return parts


def _deinterleave_small_blocks(blocks: np.ndarray, qtype: str) -> np.ndarray:
    """_interleave_small_blocks undone: [G, b, interleaved block bytes] -> the rows' blocks [G, b, r, block bytes]."""
    scales, qh, qs = _SMALL_BLOCK_FIELDS[qtype]
    G, nb = blocks.shape[:2]
    out = np.empty((G, nb, 8, TYPES[qtype].block_bytes), np.uint8)
    for k, at in enumerate(scales):
        out[..., at:at + 2] = blocks[..., 16 * k:16 * k + 16].reshape(G, nb, 8, 2)
    words_at = 16 * len(scales)
    if qh is not None:
        out[..., qh:qh + 4] = _fifth_bits_by_word(blocks[..., words_at:words_at + 32].reshape(G, nb, 8, 4), undo=True)
        words_at += 32
    out[..., qs:] = blocks[..., words_at:].reshape(G, nb, 4, 8, 4).swapaxes(2, 3).reshape(G, nb, 8, 16)
    return out


def _runs_as_words(field: np.ndarray) -> np.ndarray:
    """Each row's runs of 32 bytes as a group's words (_words), run by run.    # [G, b, r, n 32] -> [G, b, n, 256]"""
    G, nb = field.shape[:2]
    return _words(field.reshape(G, nb, 8, -1, 32).swapaxes(2, 3))


def _interleave_k_quant_blocks(blocks: np.ndarray, qtype: str) -> list:
    """Q2_K .. Q6_K blocks [G, b, r, block bytes] as the parts of interleaved ones (interleave_rows); a scale byte
    per row and sub-block as [G, b, s, r]."""
    if qtype == "Q6_K":  # ql 0..127, qh 128..191, scales 192..207, d 208..209
        return [blocks[..., 208:210], blocks[..., 192:208].swapaxes(2, 3), _runs_as_words(blocks[..., :128]),
                _runs_as_words(blocks[..., 128:192])]
    if qtype == "Q2_K":  # scales 0..15, qs 16..79, d 80..81, dmin 82..83
        return [blocks[..., 80:82], blocks[..., 82:84], blocks[..., :16].swapaxes(2, 3),
                _runs_as_words(blocks[..., 16:80])]
    if qtype == "Q3_K":  # hmask 0..31, qs 32..95, scales 96..107, d 108..109
        sc = _scales_q3_k(blocks[..., 96:108].reshape(-1, 12)).view(np.uint8).reshape(blocks.shape[:3] + (16,))
        return [blocks[..., 108:110], sc.swapaxes(2, 3), _runs_as_words(blocks[..., :32]),
                _runs_as_words(blocks[..., 32:96])]
    # Q4_K, Q5_K: d 0..1, dmin 2..3, scales and mins 4..15, (Q5_K: qh 16..47,) qs
    sc, mn = _scales_6bit(blocks[..., 4:16].reshape(-1, 12))
    shape = blocks.shape[:3] + (8,)
    parts = [blocks[..., 0:2], blocks[..., 2:4], sc.reshape(shape).swapaxes(2, 3), mn.reshape(shape).swapaxes(2, 3),
             _runs_as_words(blocks[..., 16 if qtype == "Q4_K" else 48:])]
    return parts + ([_runs_as_words(blocks[..., 16:48])] if qtype == "Q5_K" else [])


def interleave_rows(raw: np.ndarray, qtype: str) -> np.ndarray:
    """Rows of one of INTERLEAVED_TYPES regrouped by eight.
                                                     # [N, row bytes] uint8 -> [N / 8, nb INTERLEAVED_BLOCK_BYTES] uint8

    Group g holds rows 8g .. 8g + 7 (r below), block by block; block b of the group is

        Q8_0 (272 bytes)   d_0 .. d_7 (8 x float16) | word k = 0..7 (32 bytes): q_r[4k .. 4k+3] + 128 for r = 0..7
        Q4_0 (144 bytes)   d_0 .. d_7 (8 x float16) | word m = 0..3 (32 bytes): byte_r[4m .. 4m+3] for r = 0..7
        Q4_K (1184 bytes)  d_0 .. d_7 | dmin_0 .. dmin_7 (float16) | sc[s][r] (64 bytes) | mn[s][r] (64 bytes) |
                           run p = 0..3: word k = 0..7: qs_r[32p + 4k .. 32p + 4k+3] for r = 0..7
        Q6_K (1680 bytes)  d_0 .. d_7 (float16) | sc[s][r] (s < 16, int8; 128 bytes) |
                           ql run c = 0..3 (ql_r[32c:][:32]) | qh run h = 0..1 (qh_r[32h:][:32]), each as 8 words
        Q5_K (1440 bytes)  Q4_K's 1184 bytes | qh run (qh_r[0:32], bit s of byte j: value j of sub-block s) as 8 words
        Q4_1 (160 bytes)   d_0 .. d_7 | m_0 .. m_7 (float16) | word m = 0..3: byte_r[4m .. 4m+3] for r = 0..7
        Q5_0 (176 bytes)   d_0 .. d_7 | word: h_r for r = 0..7 | word m = 0..3: byte_r[4m .. 4m+3] for r = 0..7
        Q5_1 (192 bytes)   d_0 .. d_7 | m_0 .. m_7 | word: h_r for r = 0..7 | word m = 0..3: byte_r[4m .. 4m+3]
        Q2_K (672 bytes)   d_0 .. d_7 | dmin_0 .. dmin_7 (float16) | scales[s][r] (s < 16, the file's byte: sc in
                           the low nibble, mn in the high one; 128 bytes) | qs run n = 0..1 (qs_r[32n:][:32]), 8 words
        Q3_K (912 bytes)   d_0 .. d_7 | sc[s][r] - 32 (int8; 128 bytes) | hmask run (hmask_r, 8 words) | qs run
                           n = 0..1 (qs_r[32n:][:32]), 8 words each

    Rows past the last (to a multiple of 8) are zero bytes: zero scales, zero products, never stored by the kernels.

    where q_r are row r's 32 int8 values of block b, byte_r its 16 bytes of nibbles (byte j: value j in the low
    nibble, value j + 16 in the high one), qs_r its 128 bytes of Q4_K nibbles (run p: sub-block 2p in the low
    nibbles, 2p + 1 in the high ones) and sc, mn its eight 6-bit scales and mins, one byte each. So lane r (bytes
    4r .. 4r + 3) of a word always holds four consecutive values (or two nibbles' worth) of row r; h_r is row r's
    four bytes of Q5_0/Q5_1 fifth bits, byte i bit k value 4k + i's (_fifth_bits_by_word). Q8_0's values
    are stored unsigned, q + 128 (the sign bit flipped), as the nibbles are: the machine's integer dot multiplies
    unsigned bytes by signed activations.
    """
    _check_interleave(qtype)
    if raw.shape[0] % INTERLEAVE:
        raw = np.concatenate([raw, np.zeros((-raw.shape[0] % INTERLEAVE, raw.shape[1]), np.uint8)])
    N, t = raw.shape[0], TYPES[qtype]
    nb = raw.shape[1] // t.block_bytes
    blocks = raw.reshape(N // 8, 8, nb, t.block_bytes).swapaxes(1, 2)  # [G, b, r, block bytes]
    if qtype in _SMALL_BLOCK_FIELDS:
        parts = _interleave_small_blocks(blocks, qtype)
    elif qtype.endswith("_K"):
        parts = _interleave_k_quant_blocks(blocks, qtype)
    else:
        runs = (blocks[..., 2:] ^ np.uint8(_SIGN_FLIP[qtype])).reshape(N // 8, nb, 8, 1, -1)  # one run of 32 or 16
        words = runs.reshape(N // 8, nb, 8, -1, 4).swapaxes(2, 3)  # [G, b, word, r, 4]
        parts = [blocks[..., 0:2], words]
    return np.concatenate([p.reshape(N // 8, nb, -1) for p in parts], axis=2).reshape(N // 8, -1)


def deinterleave_rows(grouped: np.ndarray, qtype: str, rows: int | None = None) -> np.ndarray:
    """interleave_rows undone: the first `rows` rows (default all 8 G).
                                                   # [G, nb INTERLEAVED_BLOCK_BYTES] uint8 -> [rows, row bytes] uint8"""
    _check_interleave(qtype)
    G, t = grouped.shape[0], TYPES[qtype]
    nb = grouped.shape[1] // INTERLEAVED_BLOCK_BYTES[qtype]
    blocks = grouped.reshape(G, nb, -1)
    if qtype == "Q6_K":
        ql = _runs(blocks[..., 144:1168].reshape(G, nb, 4, 256)).swapaxes(2, 3).reshape(G, nb, 8, 128)
        qh = _runs(blocks[..., 1168:].reshape(G, nb, 2, 256)).swapaxes(2, 3).reshape(G, nb, 8, 64)
        by_row = np.concatenate([ql, qh, blocks[..., 16:144].reshape(G, nb, 16, 8).swapaxes(2, 3),
                                 blocks[..., :16].reshape(G, nb, 8, 2)], axis=3)
    elif qtype in ("Q4_K", "Q5_K"):
        sc = blocks[..., 32:96].reshape(G, nb, 8, 8).swapaxes(2, 3).reshape(-1, 8)  # [G b r, s]
        mn = blocks[..., 96:160].reshape(G, nb, 8, 8).swapaxes(2, 3).reshape(-1, 8)
        scales = _pack_scales_6bit(sc, mn).reshape(G, nb, 8, 12)
        qs = _runs(blocks[..., 160:1184].reshape(G, nb, 4, 256)).swapaxes(2, 3).reshape(G, nb, 8, 128)
        qh = [_runs(blocks[..., 1184:])] if qtype == "Q5_K" else []  # [G, nb, 8, 32]
        by_row = np.concatenate([blocks[..., 0:16].reshape(G, nb, 8, 2), blocks[..., 16:32].reshape(G, nb, 8, 2),
                                 scales, *qh, qs], axis=3)
    elif qtype in _SMALL_BLOCK_FIELDS:
        by_row = _deinterleave_small_blocks(blocks, qtype)
    elif qtype == "Q2_K":
        qs = _runs(blocks[..., 160:].reshape(G, nb, 2, 256)).swapaxes(2, 3).reshape(G, nb, 8, 64)
        by_row = np.concatenate([blocks[..., 32:160].reshape(G, nb, 16, 8).swapaxes(2, 3), qs,
                                 blocks[..., :16].reshape(G, nb, 8, 2), blocks[..., 16:32].reshape(G, nb, 8, 2)],
                                axis=3)
    elif qtype == "Q3_K":
        sc = blocks[..., 16:144].reshape(G, nb, 16, 8).swapaxes(2, 3).reshape(-1, 16).view(np.int8)
        qs = _runs(blocks[..., 400:].reshape(G, nb, 2, 256)).swapaxes(2, 3).reshape(G, nb, 8, 64)
        by_row = np.concatenate([_runs(blocks[..., 144:400]), qs, _pack_scales_q3_k(sc).reshape(G, nb, 8, 12),
                                 blocks[..., :16].reshape(G, nb, 8, 2)], axis=3)
    else:
        words = (blocks[..., 16:] ^ np.uint8(_SIGN_FLIP[qtype])).reshape(G, nb, -1, 8, 4).swapaxes(2, 3)
        by_row = np.concatenate([blocks[..., :16].reshape(G, nb, 8, 2), words.reshape(G, nb, 8, -1)], axis=3)
    out = by_row.swapaxes(1, 2).reshape(G * 8, nb * t.block_bytes)
    return np.ascontiguousarray(out if rows is None else out[:rows])
