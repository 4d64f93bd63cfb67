"""The K-quants (Q2_K .. Q6_K): super-blocks of 256 values in sub-blocks of 16 or 32, each sub-block with its own
small scale (and min) times a float16 super-scale. Their quantizers are npllm's own (kfit.by_two_rules).
Interleaved (table.interleave_rows), a block of a group of eight rows is

    Q4_K (1184 bytes)  d_0 .. d_7 | dmin_0 .. dmin_7 (float16) | sc[s][r] (64 bytes) | mn[s][r] (64 bytes) |
                       run p = 0..3: word k = 0..7: qs_r[32p + 4k .. 32p + 4k+3] for r = 0..7
    Q5_K (1440 bytes)  Q4_K's 1184 bytes | qh run (qh_r[0:32], bit s of byte j: value j of sub-block s) as 8 words
    Q6_K (1680 bytes)  d_0 .. d_7 (float16) | sc[s][r] (s < 16, int8; 128 bytes) |
                       ql run c = 0..3 (ql_r[32c:][:32]) | qh run h = 0..1 (qh_r[32h:][:32]), each as 8 words
    Q2_K (672 bytes)   d_0 .. d_7 | dmin_0 .. dmin_7 (float16) | scales[s][r] (s < 16, the file's byte: sc in
                       the low nibble, mn in the high one; 128 bytes) | qs run n = 0..1 (qs_r[32n:][:32]), 8 words
    Q3_K (912 bytes)   d_0 .. d_7 | sc[s][r] - 32 (int8; 128 bytes) | hmask run (hmask_r, 8 words) | qs run
                       n = 0..1 (qs_r[32n:][:32]), 8 words each

sc, mn: a row's 6-bit scales and mins unpacked to a byte each (the file's 8 x 144, 8 x 176 and 8 x 110 plus 32).
"""

from __future__ import annotations

import numpy as np

from .base import QK_K, QuantType, as_half, bits_of, blocks_of, half_at, nibbles_of, per_row, words_of
from .kfit import (by_two_rules, covering_q3_k, covering_q6_k, covering_scale_min, fitted_scale_min,
                   fitted_signed_scale)


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
    blocks = blocks_of(raw, 144)
    d, dmin = half_at(blocks, 0), half_at(blocks, 2)
    sc, mn = _scales_6bit(blocks[:, 4:16])
    scale = (d * sc.astype(np.float32))[:, :, None]  # [nb, 8, 1]
    offset = (dmin * mn.astype(np.float32))[:, :, None]
    q = nibbles_of(blocks[:, 16:].reshape(-1, 4, 32)).reshape(-1, 8, 32).astype(np.float32)
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
    blocks = blocks_of(raw, 176)
    d, dmin = half_at(blocks, 0), half_at(blocks, 2)
    sc, mn = _scales_6bit(blocks[:, 4:16])
    scale = (d * sc.astype(np.float32))[:, :, None]
    offset = (dmin * mn.astype(np.float32))[:, :, None]
    low = nibbles_of(blocks[:, 48:].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    high = bits_of(blocks[:, 16:48], 8)  # [nb, 8, 32]
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
    blocks = blocks_of(raw, 210)
    d = half_at(blocks, 208)
    sc = blocks[:, 192:208].view(np.int8).astype(np.float32)
    scale = (d * sc)[:, :, None]  # [nb, 16, 1]
    ql = blocks[:, :128].reshape(-1, 2, 2, 32)  # [nb, half, run of 32, l]
    low = nibbles_of(ql).swapaxes(2, 3).reshape(-1, 2, 4, 32)  # [nb, half, nibble, run, l]: group = 2 nibble + run
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
    blocks = blocks_of(raw, 84)
    d, dmin = half_at(blocks, 80), half_at(blocks, 82)
    scales = blocks[:, :16]
    scale = (d * (scales & 0x0F).astype(np.float32))[:, :, None]
    offset = (dmin * (scales >> 4).astype(np.float32))[:, :, None]
    q = _sixteen_by_two_bits(blocks[:, 16:80]).astype(np.float32)
    return (scale * q - offset).reshape(-1)


def _scales_q3_k(packed: np.ndarray) -> np.ndarray:
    """Q3_K's sixteen 6-bit scales, minus 32 (dequantize_q3_k draws them).      # [n, 12] uint8 -> [n, 16] int8"""
    low4 = nibbles_of(packed[:, :8]).reshape(-1, 16)  # s < 8: low nibbles of bytes 0..7, s >= 8: high nibbles
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
    blocks = blocks_of(raw, 110)
    d = half_at(blocks, 108)
    scale = (d * _scales_q3_k(blocks[:, 96:108]).astype(np.float32))[:, :, None]
    low = _sixteen_by_two_bits(blocks[:, 32:96]).astype(np.int8)
    missing = (bits_of(blocks[:, :32], 8).reshape(-1, 16, 16) ^ 1).astype(np.int8) << 2  # 4 where the bit is clear
    return (scale * (low - missing).astype(np.float32)).reshape(-1)


def _pack_scales_6bit(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Inverse of _scales_6bit.  # [nb, 8] x2 in 0..63 -> [nb, 12]"""
    a = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    b = (mn[:, :4] & 0x3F) | ((mn[:, 4:] >> 4) << 6)
    c = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return np.concatenate([a, b, c], axis=1).astype(np.uint8)

def _pack_q4_k(d, dmin, sc, mn, q) -> np.ndarray:
    """Q4_K bytes from its fields.                                                              # -> [nb * 144]"""
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # run r: sub-block 2r low, 2r + 1 high
    return np.concatenate([as_half(d), as_half(dmin), _pack_scales_6bit(sc, mn), qs], axis=1).reshape(-1)


def _pack_q5_k(d, dmin, sc, mn, q) -> np.ndarray:
    """Q5_K bytes from its fields.                                                              # -> [nb * 176]"""
    qh = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for s in range(8):  # bit s of qh[j]: fifth bit of value j of sub-block s
        qh |= ((q[:, s] >> 4) & 1) << s
    low = q & 0x0F
    qs = (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(-1, 128)
    return np.concatenate([as_half(d), as_half(dmin), _pack_scales_6bit(sc, mn), qh, qs], axis=1).reshape(-1)


def _pack_q6_k(d, sc, k) -> np.ndarray:
    """Q6_K bytes from d [nb, 1], sc [nb, 16] int8 and k [nb, 16, 16] in -32..31.              # -> [nb * 210]"""
    q = (k + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # [nb, half, group, l]
    low, high = q & 0x0F, q >> 4
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), as_half(d)],
                          axis=1).reshape(-1)


def _pack_sixteen_by_two_bits(q: np.ndarray) -> np.ndarray:
    """_sixteen_by_two_bits undone: value j of sub-block s = 8 n + 2 k + h at bits 2 k of byte 32 n + 16 h + j.
                                                                            # [nb, 16, 16] in 0..3 -> [nb, 64]"""
    q = q.reshape(-1, 2, 4, 32)  # [nb, run n, shift k, byte 16 h + j]
    return (q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)).reshape(-1, 64)


def _pack_q2_k(d, dmin, sc, mn, q) -> np.ndarray:
    """Q2_K bytes from its fields (sub-blocks of 16, q in 0..3, 4-bit sc and mn).                  # -> [nb * 84]"""
    return np.concatenate([sc | (mn << 4), _pack_sixteen_by_two_bits(q), as_half(d), as_half(dmin)],
                          axis=1).reshape(-1)


def _pack_q3_k(d, sc, k) -> np.ndarray:
    """Q3_K bytes from d [nb, 1], sc [nb, 16] int8 in -31..31 and k [nb, 16, 16] in -4..3.       # -> [nb * 110]"""
    q = (k + 4).astype(np.uint8)
    third = ((q >> 2) & 1).reshape(-1, 8, 32)  # bit b of hmask[16 h + j]: value j of sub-block 2 b + h
    hmask = np.bitwise_or.reduce(third << np.arange(8, dtype=np.uint8)[:, None], axis=1)
    return np.concatenate([hmask, _pack_sixteen_by_two_bits(q & 3), _pack_scales_q3_k(sc), as_half(d)],
                          axis=1).reshape(-1)




# Each K-quant's two scale rules, as functions of the values giving bytes: (covering, fitted).
K_QUANT_RULES = {
    "Q2_K": (lambda v: _pack_q2_k(*covering_scale_min(v, 3, sub=16, scale_top=15)),
             lambda v: _pack_q2_k(*fitted_scale_min(v, 3, sub=16, scale_top=15))),
    "Q3_K": (lambda v: _pack_q3_k(*covering_q3_k(v)), lambda v: _pack_q3_k(*fitted_signed_scale(v, -4, 3, 31))),
    "Q4_K": (lambda v: _pack_q4_k(*covering_scale_min(v, 15)), lambda v: _pack_q4_k(*fitted_scale_min(v, 15))),
    "Q5_K": (lambda v: _pack_q5_k(*covering_scale_min(v, 31)), lambda v: _pack_q5_k(*fitted_scale_min(v, 31))),
    "Q6_K": (lambda v: _pack_q6_k(*covering_q6_k(v)), lambda v: _pack_q6_k(*fitted_signed_scale(v, -32, 31, 127))),
}


def _quantizer(name: str, dequantize, block_bytes: int):
    """quantize_<name>: [..., n] (n a multiple of 256) -> bytes, kfit.by_two_rules of K_QUANT_RULES[name]."""

    def quantize(values: np.ndarray) -> np.ndarray:
        return by_two_rules(values, K_QUANT_RULES[name], dequantize, block_bytes)

    quantize.__name__ = quantize.__qualname__ = f"quantize_{name.lower()}"
    quantize.__doc__ = f"[..., n] (n a multiple of 256) -> {name} bytes [nb * {block_bytes}] (kfit.by_two_rules)."
    return quantize


quantize_q2_k = _quantizer("Q2_K", dequantize_q2_k, 84)
quantize_q3_k = _quantizer("Q3_K", dequantize_q3_k, 110)
quantize_q4_k = _quantizer("Q4_K", dequantize_q4_k, 144)
quantize_q5_k = _quantizer("Q5_K", dequantize_q5_k, 176)
quantize_q6_k = _quantizer("Q6_K", dequantize_q6_k, 210)


# ---------------------------------------------------------------------------------------------------- interleaving

def _interleave_q4_k(blocks: np.ndarray) -> list:
    """Q4_K (d 0..1, dmin 2..3, scales and mins 4..15, qs 16..143): the 6-bit scales and mins a byte each."""
    sc, mn = _scales_6bit(blocks[..., 4:16].reshape(-1, 12))
    shape = blocks.shape[:3] + (8,)
    return [blocks[..., 0:2], blocks[..., 2:4], per_row(sc.reshape(shape)), per_row(mn.reshape(shape)),
            words_of(blocks[..., 16:144])]


def _interleave_q5_k(blocks: np.ndarray) -> list:
    """Q5_K (Q4_K's fields, qh 16..47, qs 48..175): Q4_K's parts, then the qh run."""
    sc, mn = _scales_6bit(blocks[..., 4:16].reshape(-1, 12))
    shape = blocks.shape[:3] + (8,)
    return [blocks[..., 0:2], blocks[..., 2:4], per_row(sc.reshape(shape)), per_row(mn.reshape(shape)),
            words_of(blocks[..., 48:176]), words_of(blocks[..., 16:48])]


def _interleave_q6_k(blocks: np.ndarray) -> list:
    """Q6_K (ql 0..127, qh 128..191, scales 192..207, d 208..209)."""
    return [blocks[..., 208:210], per_row(blocks[..., 192:208]), words_of(blocks[..., :128]),
            words_of(blocks[..., 128:192])]


def _interleave_q2_k(blocks: np.ndarray) -> list:
    """Q2_K (scales 0..15, qs 16..79, d 80..81, dmin 82..83)."""
    return [blocks[..., 80:82], blocks[..., 82:84], per_row(blocks[..., :16]), words_of(blocks[..., 16:80])]


def _interleave_q3_k(blocks: np.ndarray) -> list:
    """Q3_K (hmask 0..31, qs 32..95, scales 96..107, d 108..109): the scales minus 32 a signed byte each."""
    sc = _scales_q3_k(blocks[..., 96:108].reshape(-1, 12)).view(np.uint8).reshape(blocks.shape[:3] + (16,))
    return [blocks[..., 108:110], per_row(sc), words_of(blocks[..., :32]), words_of(blocks[..., 32:96])]


Q2_K = QuantType(name="Q2_K", type_id=10, block_size=QK_K, block_bytes=84, dequantize=dequantize_q2_k,
                 quantize=quantize_q2_k, scale_fields=(80, 82), interleave=_interleave_q2_k, interleaved_bytes=672,
                 activations="two_part")
Q3_K = QuantType(name="Q3_K", type_id=11, block_size=QK_K, block_bytes=110, dequantize=dequantize_q3_k,
                 quantize=quantize_q3_k, scale_fields=(108,), interleave=_interleave_q3_k, interleaved_bytes=912,
                 activations="two_part")
Q4_K = QuantType(name="Q4_K", type_id=12, block_size=QK_K, block_bytes=144, dequantize=dequantize_q4_k,
                 quantize=quantize_q4_k, scale_fields=(0, 2), interleave=_interleave_q4_k, interleaved_bytes=1184,
                 activations="int8")
Q5_K = QuantType(name="Q5_K", type_id=13, block_size=QK_K, block_bytes=176, dequantize=dequantize_q5_k,
                 quantize=quantize_q5_k, scale_fields=(0, 2), interleave=_interleave_q5_k, interleaved_bytes=1440,
                 activations="int8")
Q6_K = QuantType(name="Q6_K", type_id=14, block_size=QK_K, block_bytes=210, dequantize=dequantize_q6_k,
                 quantize=quantize_q6_k, scale_fields=(208,), interleave=_interleave_q6_k, interleaved_bytes=1680,
                 activations="int8")
RECORDS = (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)
