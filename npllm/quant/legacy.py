"""The 32-value blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1): one float16 scale (and an offset m for the _1 types) per 32
values. Their quantizers make the same bytes as llama.cpp's reference quantizers. Interleaved (table.interleave_rows),
a block of a group of eight rows holds the eight scales (8 x float16), the eight offsets where the type has them,
Q5's fifth bits as one word, then the values as words of 32 bytes, four bytes of each row:

    Q8_0 (272 bytes)   d_0 .. d_7 | word k = 0..7: q_r[4k .. 4k+3] + 128 for r = 0..7 (stored unsigned)
    Q4_0 (144 bytes)   d_0 .. d_7 | word m = 0..3: byte_r[4m .. 4m+3] for r = 0..7
    Q4_1 (160 bytes)   d_0 .. d_7 | m_0 .. m_7 | word m = 0..3: byte_r[4m .. 4m+3]
    Q5_0 (176 bytes)   d_0 .. d_7 | word: h_r for r = 0..7 | word m = 0..3: byte_r[4m .. 4m+3]
    Q5_1 (192 bytes)   d_0 .. d_7 | m_0 .. m_7 | word: h_r | word m = 0..3: byte_r[4m .. 4m+3]

byte_r: row r's 16 bytes of nibbles (byte j: value j low, value j + 16 high); h_r: its four bytes of fifth bits,
byte i bit k value 4k + i's (_fifth_bits_by_word), so that word k's fifth bits are one shift in every byte.
"""

from __future__ import annotations

import numpy as np

from .base import (QuantType, as_half, bits_of, blocks_of, half_at, inverse_scale, nibbles_of, pack_nibbles,
                   rows_of_blocks, round_half_away, signed_absmax, words_of)


def dequantize_q8_0(raw: np.ndarray) -> np.ndarray:
    """Q8_0: 34 bytes per 32 values.

        bytes 0-1    d      float16 scale
        bytes 2-33   q[32]  int8, value j in byte 2 + j

        x[j] = d * q[j]                                           # [nb * 34] -> [nb * 32]
    """
    blocks = blocks_of(raw, 34)
    d = half_at(blocks, 0)  # [nb, 1]
    q = blocks[:, 2:].view(np.int8).astype(np.float32)  # [nb, 32]
    return (q * d).reshape(-1)


def dequantize_q4_0(raw: np.ndarray) -> np.ndarray:
    """Q4_0: 18 bytes per 32 values.

        bytes 0-1    d       float16 scale
        bytes 2-17   qs[16]  byte j: low nibble = value j, high nibble = value j + 16

        x[j] = d * (q[j] - 8)        q[j] in 0..15                # [nb * 18] -> [nb * 32]
    """
    blocks = blocks_of(raw, 18)
    d = half_at(blocks, 0)
    q = nibbles_of(blocks[:, 2:]).reshape(-1, 32).astype(np.int8) - np.int8(8)  # [nb, 32]
    return (d * q.astype(np.float32)).reshape(-1)


def dequantize_q4_1(raw: np.ndarray) -> np.ndarray:
    """Q4_1: 20 bytes per 32 values; an offset m instead of Q4_0's fixed -8.

        bytes 0-1    d       float16 scale
        bytes 2-3    m       float16 offset (the block's minimum)
        bytes 4-19   qs[16]  byte j: low nibble = value j, high nibble = value j + 16

        x[j] = d * q[j] + m          q[j] in 0..15                # [nb * 20] -> [nb * 32]
    """
    blocks = blocks_of(raw, 20)
    d, m = half_at(blocks, 0), half_at(blocks, 2)
    q = nibbles_of(blocks[:, 4:]).reshape(-1, 32).astype(np.float32)
    return (d * q + m).reshape(-1)


def _five_bit(blocks: np.ndarray, qh_at: int) -> np.ndarray:
    """5-bit integers of a Q5_0/Q5_1 block: 4 low bits from the nibbles, the fifth from bit j of the u32 qh.

    # [nb, bytes] -> [nb, 32] in 0..31
    """
    low = nibbles_of(blocks[:, qh_at + 4 : qh_at + 20]).reshape(-1, 32)
    high = bits_of(blocks[:, qh_at : qh_at + 4], 8).transpose(0, 2, 1).reshape(-1, 32)  # byte k bit i -> value 8k+i
    return low | (high << 4)


def dequantize_q5_0(raw: np.ndarray) -> np.ndarray:
    """Q5_0: 22 bytes per 32 values.

        bytes 0-1    d       float16 scale
        bytes 2-5    qh      uint32 (little-endian): bit j = fifth (high) bit of value j
        bytes 6-21   qs[16]  byte j: low nibble = low 4 bits of value j, high nibble = those of value j + 16

        x[j] = d * (q[j] - 16)       q[j] = low4[j] | (bit j of qh) << 4, in 0..31      # [nb * 22] -> [nb * 32]
    """
    blocks = blocks_of(raw, 22)
    d = half_at(blocks, 0)
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
    blocks = blocks_of(raw, 24)
    d, m = half_at(blocks, 0), half_at(blocks, 2)
    q = _five_bit(blocks, 4).astype(np.float32)
    return (d * q + m).reshape(-1)



def _pack_fifth_bits(q: np.ndarray) -> np.ndarray:
    """Bit 4 of value j into bit j of a little-endian u32.  # [nb, 32] in 0..31 -> [nb, 4]"""
    return np.packbits((q >> 4).astype(np.uint8), axis=1, bitorder="little")


def quantize_q8_0(values: np.ndarray) -> np.ndarray:
    """[..., n] float32 -> Q8_0 bytes [nb * 34]: d = max|x| / 127, q = round(x / d) (halves away from zero)."""
    x = rows_of_blocks(values, 32)
    d = (np.abs(x).max(axis=1, keepdims=True) / np.float32(127)).astype(np.float32)
    q = round_half_away(x * inverse_scale(d)).astype(np.int8).view(np.uint8)
    return np.concatenate([as_half(d), q], axis=1).reshape(-1)


def quantize_q4_0(values: np.ndarray) -> np.ndarray:
    """[..., n] -> Q4_0 bytes: d = -m / 8 with m the block's value of largest magnitude (so m itself maps to q = 0,
    the far end of 0..15), q = min(15, trunc(x / d + 8.5))."""
    x = rows_of_blocks(values, 32)
    d = (signed_absmax(x) / np.float32(-8)).astype(np.float32)
    q = np.minimum(np.trunc(x * inverse_scale(d) + np.float32(8.5)), 15).astype(np.uint8)
    return np.concatenate([as_half(d), pack_nibbles(q)], axis=1).reshape(-1)


def quantize_q4_1(values: np.ndarray) -> np.ndarray:
    """[..., n] -> Q4_1 bytes: m = min x, d = (max x - m) / 15, q = min(15, trunc((x - m) / d + 0.5))."""
    x = rows_of_blocks(values, 32)
    lo, hi = x.min(axis=1, keepdims=True), x.max(axis=1, keepdims=True)
    d = ((hi - lo) / np.float32(15)).astype(np.float32)
    q = np.minimum(np.trunc((x - lo) * inverse_scale(d) + np.float32(0.5)), 15).astype(np.uint8)
    return np.concatenate([as_half(d), as_half(lo), pack_nibbles(q)], axis=1).reshape(-1)


def quantize_q5_0(values: np.ndarray) -> np.ndarray:
    """[..., n] -> Q5_0 bytes: d = -m / 16 (m: value of largest magnitude), q = min(31, trunc(x / d + 16.5))."""
    x = rows_of_blocks(values, 32)
    d = (signed_absmax(x) / np.float32(-16)).astype(np.float32)
    q = np.minimum(np.trunc(x * inverse_scale(d) + np.float32(16.5)), 31).astype(np.uint8)
    return np.concatenate([as_half(d), _pack_fifth_bits(q), pack_nibbles(q)], axis=1).reshape(-1)


def quantize_q5_1(values: np.ndarray) -> np.ndarray:
    """[..., n] -> Q5_1 bytes: m = min x, d = (max x - m) / 31, q = min(31, trunc((x - m) / d + 0.5))."""
    x = rows_of_blocks(values, 32)
    lo, hi = x.min(axis=1, keepdims=True), x.max(axis=1, keepdims=True)
    d = ((hi - lo) / np.float32(31)).astype(np.float32)
    q = np.minimum(np.trunc((x - lo) * inverse_scale(d) + np.float32(0.5)), 31).astype(np.uint8)
    return np.concatenate([as_half(d), as_half(lo), _pack_fifth_bits(q), pack_nibbles(q)], axis=1).reshape(-1)



# ---------------------------------------------------------------------------------------------------- interleaving

def _fifth_bits_by_word(qh: np.ndarray) -> np.ndarray:
    """A Q5_0/Q5_1 block's fifth bits reordered for its interleaved words: byte i, bit k holds value 4k + i's (the
    file's u32 has value v's at bit v). Word k of an interleaved block holds values 4k .. 4k + 3 of each row, so its
    fifth bits are bit k of each of the four bytes: one shift for the word, the same in every byte.
                                                                                       # [..., 4] -> [..., 4] uint8"""
    bits = np.unpackbits(qh, axis=-1, bitorder="little")
    bits = bits.reshape(*bits.shape[:-1], 8, 4).swapaxes(-1, -2).reshape(bits.shape)
    return np.packbits(bits, axis=-1, bitorder="little")


def _scaled_words(scales: tuple[int, ...], qh: int | None, qs: int):
    """The interleave of a 32-value block whose float16 scale (and offset) lie at `scales`, its fifth bits' u32 at
    qh (None: no fifth bits) and its 16 bytes of nibbles at qs: the parts of interleave_rows's block."""

    def interleave(blocks: np.ndarray) -> list:
        parts = [blocks[..., at:at + 2] for at in scales]
        if qh is not None:
            parts.append(_fifth_bits_by_word(blocks[..., qh:qh + 4]))
        return parts + [words_of(blocks[..., qs:qs + 16])]

    return interleave


def _interleave_q8_0(blocks: np.ndarray) -> list:
    """Q8_0's scales, then its values as words, stored q + 128 (the sign bit flipped: the machine's integer dot
    multiplies unsigned bytes by signed activations)."""
    return [blocks[..., 0:2], words_of(blocks[..., 2:] ^ np.uint8(0x80))]


Q8_0 = QuantType(name="Q8_0", type_id=8, block_size=32, block_bytes=34, dequantize=dequantize_q8_0,
                 quantize=quantize_q8_0, scale_fields=(0,), interleave=_interleave_q8_0, interleaved_bytes=272,
                 activations="int8")
Q4_0 = QuantType(name="Q4_0", type_id=2, block_size=32, block_bytes=18, dequantize=dequantize_q4_0,
                 quantize=quantize_q4_0, scale_fields=(0,), interleave=_scaled_words((0,), None, 2),
                 interleaved_bytes=144, activations="int8")
Q4_1 = QuantType(name="Q4_1", type_id=3, block_size=32, block_bytes=20, dequantize=dequantize_q4_1,
                 quantize=quantize_q4_1, scale_fields=(0, 2), interleave=_scaled_words((0, 2), None, 4),
                 interleaved_bytes=160, activations="int8")
Q5_0 = QuantType(name="Q5_0", type_id=6, block_size=32, block_bytes=22, dequantize=dequantize_q5_0,
                 quantize=quantize_q5_0, scale_fields=(0,), interleave=_scaled_words((0,), 2, 6),
                 interleaved_bytes=176, activations="int8")
Q5_1 = QuantType(name="Q5_1", type_id=7, block_size=32, block_bytes=24, dequantize=dequantize_q5_1,
                 quantize=quantize_q5_1, scale_fields=(0, 2), interleave=_scaled_words((0, 2), 4, 8),
                 interleaved_bytes=192, activations="int8")
RECORDS = (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1)
