"""The 8-bit-activation (integer dot product) kernels on interleaved rows: the compiled activation quantizer is the
NumPy one integer for integer; each layout's integer dot is exact, on the machine's instructions, on AVX2 and in plain
LLVM; each type's products are the NumPy oracle (quantized activations times dequantized weights) to float32
rounding, which is the exact product x dequantize(W)^T to within the activations' rounding; stories260K on them meets
the issue's quality bar."""

import functools

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from numba import njit
from numba.core.errors import TypingError

from npllm import quant
from npllm.kernels import quant as kq
from npllm.kernels.quant import iq4 as iq4_kernels
from npllm.kernels.quant import kquants as kquant_kernels
from npllm.kernels.quant import legacy as legacy_kernels
from npllm.kernels.simd import prefetch, vstore
from npllm.quant import QuantizationError, iq4, kquants, oracle
from tests_support import bench_script

@st.composite
def quantized_matrix(draw, qtype):
    """Arbitrary bytes for N rows of `qtype` blocks, every float16 scale finite (subnormals included)."""
    t = quant.TYPES[qtype]
    N = draw(st.integers(1, 24), label="N")
    blocks = draw(st.integers(1, 3 if t.block_size == 256 else 6), label="blocks per row")
    raw = draw(hnp.arrays(np.uint8, (N * blocks, t.block_bytes)))
    for at in t.scale_fields:
        scale = draw(hnp.arrays(np.float16, N * blocks, elements=st.floats(-4, 4, width=16)))
        raw[:, at : at + 2] = scale.view(np.uint8).reshape(-1, 2)
    return raw.reshape(N, -1), blocks * t.block_size


def activations(draw, shape):
    return draw(hnp.arrays(np.float32, shape, elements=st.floats(-8, 8, width=32)))


def deinterleave(grouped, qtype, rows=None):
    """interleave_rows undone, row by row through the kernels' gather (an embedding lookup's; the gather is held to
    the file's rows in test_a_row_gathers_back_from_its_group).     # [G, group bytes] -> [rows (8 G), row bytes]"""
    t = quant.TYPES[qtype]
    out = np.empty((8 * len(grouped) if rows is None else rows, grouped.shape[1] // t.interleaved_bytes * t.block_bytes),
                   np.uint8)
    for n in range(len(out)):
        kq.gather_interleaved_row(kq.INTERLEAVED_CODE + t.type_id, np.ascontiguousarray(grouped), n, out[n])
    return out


int8_quality = bench_script("int8_quality")
llama_cpp_files = bench_script("llama_cpp_files")  # its widen(): stories260K at the K-quants' width


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_compiled_activation_quantizer_is_the_reference(data):
    T, blocks = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 4))
    scale = data.draw(st.sampled_from([1e-30, 1e-3, 1.0, 1e4]))
    x = (activations(data.draw, (T, 32 * blocks)) * np.float32(scale)).astype(np.float32)
    q, d, s = oracle.quantize_activations_q8(x)
    s16 = q.reshape(T, -1, 16).astype(np.int32).sum(axis=2)  # the sums of each half block
    q2, d2, s2, h2 = np.empty_like(q), np.empty_like(d), np.empty(d.shape, np.float32), np.empty_like(s16)
    kq.quantize_activations_q8_into(x, T, q2, d2, s2, h2)
    assert np.array_equal(q, q2) and np.array_equal(d, d2) and np.array_equal(s, s2) and np.array_equal(s16, h2)
    q3, d3, s3, h3 = np.empty_like(q), np.empty_like(d), np.empty(d.shape, np.float32), np.empty_like(s16)
    kq.quantize_activations_q8_parallel(x, T, q3, d3, s3, h3, data.draw(st.integers(1, 4), label="threads"))
    assert np.array_equal(q, q3) and np.array_equal(d, d3) and np.array_equal(s, s3) and np.array_equal(s16, h3)
    # the law the error bounds rest on: every value within half a step of d q, |q| <= 127
    err = np.abs(x.reshape(T, -1, 32).astype(np.float64) - d[..., None].astype(np.float64) * q.reshape(T, -1, 32))
    assert np.all(np.abs(q.astype(np.int32)) <= 127)
    assert np.all(err <= d[..., None].astype(np.float64) * (0.5 + 1e-6) + 1e-44)


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_two_part_activations_hold_15_bits(data):
    """The second 8-bit part is what the first leaves in steps of d / 128 (|q'| <= 64), so that the 15-bit
    v = 128 q + q' with the scale d / 128 is within d / 256 of x, against one part's d / 2; the compiled quantizer
    gives the same integers, in one thread or several, and v's sums."""
    T, blocks = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 4))
    scale = data.draw(st.sampled_from([1e-30, 1e-3, 1.0, 1e4]))
    x = (activations(data.draw, (T, 32 * blocks)) * np.float32(scale)).astype(np.float32)
    q, q_r, d = oracle.quantize_activations_two_part(x)
    assert np.array_equal(q, oracle.quantize_activations_q8(x)[0]) and np.all(np.abs(q_r.astype(np.int32)) <= 64)
    v = 128 * q.astype(np.int32) + q_r
    err = np.abs(x.astype(np.float64) - oracle.dequantize_activations_q8(v, d / np.float32(128))).reshape(T, -1, 32)
    assert np.all(err <= d[..., None].astype(np.float64) * (1 / 256) * (1 + 1e-6) + 1e-40)  # d / 128 subnormal
    K = x.shape[1]
    q8, d8, s8, h8 = np.empty_like(q), np.empty_like(d), np.empty(d.shape, np.float32), np.empty((T, K // 16), np.int32)
    kq.quantize_activations_q8_into(x, T, q8, d8, s8, h8)
    for threads in (None, data.draw(st.integers(1, 4), label="threads")):
        got = np.empty((T, 2 * K), np.int8), np.empty_like(d), np.empty(d.shape, np.float32), np.empty_like(h8)
        if threads is None:
            kq.two_part_activations_into(x, T, q8, d8, *got)
        else:
            kq.two_part_activations_parallel(x, T, q8, d8, *got, threads)
        assert np.array_equal(got[0], np.concatenate([q, q_r], axis=1)) and np.array_equal(got[1], d / 128)
        assert np.array_equal(got[3], v.reshape(T, -1, 16).sum(axis=2))
        assert np.array_equal(got[2], v.reshape(T, -1, 32).sum(axis=2))


# bytes of each type's small integers: zeroed, a block dequantizes to its offsets (Q4_0's -8 d, Q4_K's -dmin mn)
INTEGER_BYTES = {"Q4_0": slice(2, 18), "Q4_K": slice(16, 144), "Q5_K": slice(16, 176), "Q2_K": slice(16, 80)}


def bounds(w, qtype, K, x):
    """(float32 rounding bound against the reference, activation rounding bound against x dequantize(W)^T), per
    output. The kernels sum (a d_x)(u . q_x) and (m d_x) s separately, |a u| <= |W| + |m|, so both parts are within
    sum_j (|W_j| + 2 |m_j|) |x^_j|; float32 block sums round that by far less than 1e-5 of it."""
    N = w.shape[0]
    W = np.abs(quant.dequantize(w, qtype, (N, K)).astype(np.float64))
    offsets = np.zeros_like(W)
    if qtype in INTEGER_BYTES:
        t = quant.TYPES[qtype]
        zeroed = w.reshape(-1, t.block_bytes).copy()
        zeroed[:, INTEGER_BYTES[qtype]] = 0
        offsets = np.abs(quant.dequantize(zeroed, qtype, (N, K)).astype(np.float64))
    q_x, d_x, _ = oracle.quantize_activations_q8(x)
    x_hat = np.abs(oracle.dequantize_activations_q8(q_x, d_x))
    rounding = np.einsum("tb,nb->tn", d_x / 2.0, W.reshape(N, -1, 32).sum(axis=-1))
    float32_sums = np.abs(x.astype(np.float64)) @ W.T
    return 1e-5 * (x_hat @ (W + 2 * offsets).T) + 1e-30, rounding * (1 + 1e-6) + 2e-5 * float32_sums + 1e-30


def test_activations_refuse_blocks_that_do_not_split():
    with pytest.raises(QuantizationError, match="blocks of 32"):
        oracle.quantize_activations_q8(np.ones(40, np.float32))


def test_stories260k_on_int8_activations_meets_the_quality_bar(stories260k):
    """Issue 12's bar, llama.cpp's --kl-divergence measure: mean KL(dequantized || int8 activations) <= 1e-3 and
    top-1 agreement >= 98%, on stories260K (FFN padded to 192) in each 32-value type with integer dots, over text
    sampled from it."""
    from npllm.evaluate import kl_divergence
    from npllm.formats.llama2c import read_llama2c
    from npllm.tokenizer import load_tokenizer

    config, weights = int8_quality.pad_ffn(*read_llama2c(stories260k), 192)
    ids = int8_quality.sampled_text(config, weights, load_tokenizer(stories260k.parent / "tok512.bin"), 12)
    for qtype in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):  # the 64-wide rows do not split into the K-quants' 256s
        int8_model, exact_model = int8_quality.models(config, weights, qtype)
        assert set(int8_model.weight_types) == {qtype}
        d = kl_divergence(int8_model, exact_model, ids, 128)
        print(f"{qtype}: mean KL {d.mean_kl:.2e}, top-1 {d.top1_agreement:.4f} over {d.tokens} positions")
        assert d.tokens >= 1000  # a sample where one disagreement moves top-1 by at most 0.1%
        assert d.mean_kl <= 1e-3 and d.top1_agreement >= 0.98


def test_stories260k_widened_in_q2_k_and_q3_k_meets_the_quality_bar(stories260k):
    """The same bar for the types whose products take two-part activations, on stories260K widened to 256 (the
    K-quants' rows; the output projection's rows of 64 fall back to Q8_0) and quantized by npllm: every other matrix
    Q2_K, or Q3_K. On one 8-bit part they missed it (Q2_K: mean KL 7.6e-3, top-1 95.4%; Q3_K 1.1e-3, 97.6%)."""
    from npllm.evaluate import kl_divergence
    from npllm.formats.llama2c import read_llama2c
    from npllm.tokenizer import load_tokenizer

    config, weights = llama_cpp_files.widen(*read_llama2c(stories260k), 256, 256)
    ids = int8_quality.sampled_text(config, weights, load_tokenizer(stories260k.parent / "tok512.bin"), 12)
    for qtype in quant.TWO_PART_ACTIVATION_TYPES:
        model, exact_model = int8_quality.models(config, weights, qtype)
        assert set(model.weight_types) == {qtype, "Q8_0"}
        d = kl_divergence(model, exact_model, ids, 128)
        print(f"{qtype}: mean KL {d.mean_kl:.2e}, top-1 {d.top1_agreement:.4f} over {d.tokens} positions")
        assert d.tokens >= 1000 and d.mean_kl <= 1e-3 and d.top1_agreement >= 0.98


@pytest.mark.parametrize("qtype", ["Q4_0", "Q3_K", "IQ4_XS"])
def test_row_range_workers_fill_their_rows_at_their_column(qtype):
    """The walk a model calls, by type code: row ranges (n0 a multiple of 8) written at an offset column, the same
    numbers as the whole product, nothing outside; a code without a kernel is refused."""
    rng = np.random.default_rng(1)
    t = quant.TYPES[qtype]
    N, K, T, col = 19, 512, 3, 5
    w = quant.quantize(rng.standard_normal((N, K)).astype(np.float32), qtype).reshape(N, -1)
    x = rng.standard_normal((T, K)).astype(np.float32)
    whole = kq.matmul_int8_interleaved(quant.interleave_rows(w, qtype), qtype, x, N)
    q, d, s = np.empty((T, K), np.int8), np.empty((T, K // 32), np.float32), np.empty((T, K // 32), np.float32)
    s16 = np.empty((T, K // 16), np.int32)
    kq.quantize_activations_q8_into(x, T, q, d, s, s16)
    if t.activations == "two_part":
        v, d_v, s_v, s16_v = np.empty((T, 2 * K), np.int8), np.empty_like(d), np.empty_like(s), np.empty_like(s16)
        kq.two_part_activations_into(x, T, q, d, v, d_v, s_v, s16_v)
        q, d, s, s16 = v, d_v, s_v, s16_v
    out = np.full((T, col + N + 2), np.nan, np.float32)
    w8, code = quant.interleave_rows(w, qtype), kq.INTERLEAVED_CODE + t.type_id
    kq.matmul_rows_interleaved(code, w8, q, d, s, s16, T, out, col, 0, 8)
    kq.matmul_rows_interleaved(code, w8, q, d, s, s16, T, out, col, 8, N)
    np.testing.assert_array_equal(out[:, col: col + N], whole)
    assert np.isnan(out[:, :col]).all() and np.isnan(out[:, col + N:]).all()
    with pytest.raises(ValueError, match="no kernel for this type code"):
        kq.matmul_rows_interleaved(t.type_id, w8, q, d, s, s16, T, out, col, 0, N)  # the file's layout: no kernel


# ------------------------------------------------------------------------------------------------ interleaved rows

def test_every_type_has_its_kernel_record_and_the_dispatchers_take_each():
    """Every type npllm computes has one BlockKernels record of its name: a tile and a gather where its QuantType
    interleaves (and only there), a float matvec for the float types; the dispatchers cover exactly those."""
    assert set(kq.KERNELS) == set(quant.TYPES)
    for name, t in quant.TYPES.items():
        k = kq.KERNELS[name]
        assert (k.tile is not None) == (k.gather is not None) == bool(t.interleaved_bytes), name
        assert (k.matvec is not None) == (t.activations == "float"), name
    assert kq.INTERLEAVED_TYPES == quant.INTERLEAVED_TYPES and set(kq.ROW_TYPES) == set(quant.TYPES)
    assert all(kq.takes_two_parts(kq.INTERLEAVED_CODE + quant.TYPES[name].type_id) for name in ("Q2_K", "Q3_K"))
    assert not kq.takes_two_parts(quant.TYPES["Q3_K"].type_id)  # held in the file's layout: float activations



@pytest.mark.parametrize("qtype", quant.INTERLEAVED_TYPES)
@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_a_row_gathers_back_from_its_group(qtype, data):
    """gather_interleaved_row: any row of an interleaved matrix, back in its file's bytes (an embedding lookup on a
    table held interleaved for a tied LM head), and decode_any_row decodes it as the file's row."""
    t = quant.TYPES[qtype]
    groups, blocks = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3))
    raw = data.draw(hnp.arrays(np.uint8, (8 * groups, blocks * t.block_bytes)))
    for at in quant.SCALE_FIELDS[qtype]:  # finite float16 scales, so that the decoded rows compare
        raw.reshape(-1, t.block_bytes)[:, at + 1] &= np.uint8(0x3B)
    grouped, code = quant.interleave_rows(raw, qtype), kq.INTERLEAVED_CODE + t.type_id
    K = blocks * t.block_size
    row = np.empty(kq.file_row_bytes(code, K), np.uint8)
    out, expected = np.empty(K, np.float32), np.empty(K, np.float32)
    for n in range(raw.shape[0]):
        kq.gather_interleaved_row(code, grouped, n, row)
        np.testing.assert_array_equal(row, raw[n])
        kq.decode_any_row(code, grouped, n, out, row)
        kq.decode_row(t.type_id, raw, n, expected)
        np.testing.assert_array_equal(out, expected)
    with pytest.raises(ValueError, match="no kernel for this type code"):
        kq.gather_interleaved_row(t.type_id, grouped, 0, row)


@pytest.mark.parametrize("qtype", quant.INTERLEAVED_TYPES)
@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_interleaving_is_the_drawn_reordering(qtype, data):
    t = quant.TYPES[qtype]
    groups, blocks = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 3))
    raw = data.draw(hnp.arrays(np.uint8, (8 * groups, blocks * t.block_bytes)))
    grouped = quant.interleave_rows(raw, qtype)
    size = quant.INTERLEAVED_BLOCK_BYTES[qtype]
    assert grouped.shape == (groups, blocks * size)
    # the drawing in interleave_rows' docstring: row r's scale(s) of block b, and its values in lane r of each word
    # (Q8_0's as q + 128: the sign bit flipped)
    g, r, b = data.draw(st.integers(0, groups - 1)), data.draw(st.integers(0, 7)), data.draw(st.integers(0, blocks - 1))
    block = grouped[g, size * b:size * (b + 1)]
    row = raw[8 * g + r, t.block_bytes * b:t.block_bytes * (b + 1)]
    if qtype == "Q6_K":  # d | sc[s][r] | ql runs | qh runs
        np.testing.assert_array_equal(block[2 * r:2 * r + 2], row[208:210])
        np.testing.assert_array_equal(block[16 + r:144:8], row[192:208])
        for c, (at, start) in enumerate([(144 + 256 * c, 32 * c) for c in range(4)] + [(1168, 128), (1424, 160)]):
            for k in range(8):
                np.testing.assert_array_equal(block[at + 32 * k + 4 * r:at + 32 * k + 4 * r + 4],
                                              row[start + 4 * k:start + 4 * k + 4])
        return
    if qtype in ("Q2_K", "Q3_K"):  # d (| dmin) | scales[s][r] (| hmask run) | qs runs
        d_at, first_run = (80, 160) if qtype == "Q2_K" else (108, 400)
        np.testing.assert_array_equal(block[2 * r:2 * r + 2], row[d_at:d_at + 2])
        if qtype == "Q2_K":
            np.testing.assert_array_equal(block[16 + 2 * r:18 + 2 * r], row[82:84])  # dmin
            np.testing.assert_array_equal(block[32 + r:160:8], row[:16])  # sc | mn << 4, as in the file
        else:
            np.testing.assert_array_equal(block[16 + r:144:8].view(np.int8), kquants._scales_q3_k(row[None, 96:108])[0])
        runs = [(first_run + 256 * n, (16 if qtype == "Q2_K" else 32) + 32 * n) for n in range(2)]
        for at, start in runs + ([(144, 0)] if qtype == "Q3_K" else []):  # qs runs, Q3_K's hmask
            for k in range(8):
                np.testing.assert_array_equal(block[at + 32 * k + 4 * r:at + 32 * k + 4 * r + 4],
                                              row[start + 4 * k:start + 4 * k + 4])
        return
    np.testing.assert_array_equal(block[2 * r:2 * r + 2], row[:2])
    if qtype in ("Q4_K", "Q5_K"):
        np.testing.assert_array_equal(block[16 + 2 * r:18 + 2 * r], row[2:4])  # dmin
        sc, mn = kquants._scales_6bit(row[None, 4:16])
        np.testing.assert_array_equal(block[32 + r:96:8], sc[0])
        np.testing.assert_array_equal(block[96 + r:160:8], mn[0])
        qs = 16 if qtype == "Q4_K" else 48  # Q5_K: qh[32] first in the file, its run last in the group's block
        for p in range(4):
            for k in range(8):
                at = 160 + 256 * p + 32 * k + 4 * r
                np.testing.assert_array_equal(block[at:at + 4], row[qs + 32 * p + 4 * k:qs + 32 * p + 4 * k + 4])
        if qtype == "Q5_K":
            for k in range(8):
                np.testing.assert_array_equal(block[1184 + 32 * k + 4 * r:1188 + 32 * k + 4 * r],
                                              row[16 + 4 * k:20 + 4 * k])
        return
    if qtype == "IQ4_XS":  # d | sc[s][r] = ls - 32 | sub-block s: four words of 16 bytes of indices
        np.testing.assert_array_equal(block[2 * r:2 * r + 2], row[:2])
        np.testing.assert_array_equal(block[16 + r:80:8].view(np.int8), iq4._iq4_xs_scales(row[None])[0])
        for m in range(32):
            np.testing.assert_array_equal(block[80 + 32 * m + 4 * r:84 + 32 * m + 4 * r], row[8 + 4 * m:12 + 4 * m])
        return
    if qtype in ("Q4_1", "Q5_0", "Q5_1"):  # d | (m |) (fifth bits |) nibbles
        scales, words_at = (1, 16) if qtype == "Q5_0" else (2, 32)
        if scales == 2:
            np.testing.assert_array_equal(block[16 + 2 * r:18 + 2 * r], row[2:4])  # m
        if qtype != "Q4_1":  # value v's fifth bit: bit v of the file's u32, bit v // 4 of byte v % 4 of lane r
            file_bits = np.unpackbits(row[2 * scales:2 * scales + 4], bitorder="little")
            lane = block[words_at + 4 * r:words_at + 4 * r + 4]
            np.testing.assert_array_equal([(lane[v % 4] >> (v // 4)) & 1 for v in range(32)], file_bits)
            words_at += 32
        for m in range(4):
            np.testing.assert_array_equal(block[words_at + 32 * m + 4 * r:words_at + 32 * m + 4 * r + 4],
                                          row[t.block_bytes - 16 + 4 * m:t.block_bytes - 12 + 4 * m])
        return
    flip = np.uint8(128 if qtype == "Q8_0" else 0)
    for k in range((t.block_bytes - 2) // 4):
        np.testing.assert_array_equal(block[16 + 32 * k + 4 * r:16 + 32 * k + 4 * r + 4],
                                      row[2 + 4 * k:6 + 4 * k] ^ flip)


def test_interleaving_refuses_what_it_cannot_regroup():
    w = quant.quantize(np.ones((12, 64), np.float32), "Q8_0").reshape(12, -1)
    grouped = quant.interleave_rows(w, "Q8_0")  # 12 rows: a second group padded with 4 zero rows
    assert grouped.shape == (2, 272 * 2)
    np.testing.assert_array_equal(deinterleave(grouped, "Q8_0", 12), w)
    assert not quant.dequantize(deinterleave(grouped, "Q8_0")[12:], "Q8_0").any()  # padding: zero scales
    with pytest.raises(QuantizationError, match="2 interleaved groups hold 9 to 16 rows, not 8"):
        kq.matmul_int8_interleaved(grouped, "Q8_0", np.ones((1, 64), np.float32), rows=8)
    with pytest.raises(QuantizationError, match="Q4_1, .*, IQ4_XS only, not F16"):
        quant.interleave_rows(w[:8], "F16")
    with pytest.raises(QuantizationError, match="IQ4_XS only, not F16"):
        kq.matmul_int8_interleaved(quant.interleave_rows(w[:8], "Q8_0"), "F16", np.ones((1, 64), np.float32))
    with pytest.raises(QuantizationError, match="do not hold rows of 96 values"):
        kq.matmul_int8_interleaved(quant.interleave_rows(w[:8], "Q8_0"), "Q8_0", np.ones((1, 96), np.float32))
    with pytest.raises(QuantizationError, match="do not hold rows of 64 values"):  # Q8_0's groups read as Q4_0's
        kq.matmul_int8_interleaved(quant.interleave_rows(w[:8], "Q8_0"), "Q4_0", np.ones((1, 64), np.float32))


@pytest.mark.parametrize("qtype", quant.INTERLEAVED_TYPES)
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_interleaved_kernels_are_the_reference(qtype, data):
    """The kernels on interleaved rows: the NumPy oracle (Q2_K, Q3_K: on two-part activations) to float32
    rounding; each token's row the same bits whether it comes alone (decode) or in tiles of four (prefill); any number of rows
    (the last group's zero padding computed aside, not stored)."""
    w, K = data.draw(quantized_matrix(qtype))
    T = data.draw(st.integers(1, 9), label="T")
    x = activations(data.draw, (T, K))
    N = w.shape[0]
    got = kq.matmul_int8_interleaved(quant.interleave_rows(w, qtype), qtype, x, N)
    statement = (oracle.matmul_t_two_part_activations if qtype in quant.TWO_PART_ACTIVATION_TYPES
                 else oracle.matmul_t_q8_activations)
    reference = statement(w, qtype, (w.shape[0], K), x)
    to_reference, _ = bounds(w, qtype, K, x)
    assert got.dtype == np.float32 and got.shape == (T, w.shape[0])
    assert np.all(np.abs(got - reference) <= to_reference)
    one_by_one = np.concatenate([kq.matmul_int8_interleaved(quant.interleave_rows(w, qtype), qtype, x[t:t + 1], N)
                                 for t in range(T)])
    np.testing.assert_array_equal(got, one_by_one)


# The types whose one-group walk is compiled here too (each compile takes tens of seconds): the K-quants with mins
# and Q6_K's split words, whose tiles differ most between one group and a pair
ONE_GROUP_CHECKED = ("Q4_K", "Q5_K", "Q6_K")


@functools.lru_cache(maxsize=None)
def one_group_walk(qtype):
    """rows_into of `qtype` walking one group of eight rows at a time, as machines without a 512-bit vpdpbusd do,
    whatever this machine's walk."""
    return kq.interleaved_kernels(qtype, pairs=False)


@pytest.mark.parametrize("qtype", ONE_GROUP_CHECKED)
@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_the_one_group_walk_with_its_prefetches_is_the_machines_walk(qtype, data):
    """Decode products over the rows a thread owns (any n0 .. n1, n0 a multiple of 8; each tile asking for the
    bytes ahead of its groups, past n1 and past the matrix's end too) are the NumPy reference to float32 rounding,
    give the bits of the walk this machine runs (pairs of groups on AVX-512 VNNI), and write nothing outside their
    rows."""
    w, K = data.draw(quantized_matrix(qtype))
    N = w.shape[0]
    n0 = 8 * data.draw(st.integers(0, (N - 1) // 8), label="n0 / 8")
    n1 = data.draw(st.integers(n0 + 1, N), label="n1")
    x = activations(data.draw, (1, K))
    q, d = np.empty((1, K), np.int8), np.empty((1, K // 32), np.float32)
    s, s16 = np.empty((1, K // 32), np.float32), np.empty((1, K // 16), np.int32)
    kq.quantize_activations_q8_into(x, 1, q, d, s, s16)
    w8 = quant.interleave_rows(w, qtype)
    got = np.full((1, N + 3), np.float32(7))
    one_group_walk(qtype)(w8, q, d, s, s16, 1, got, 3, n0, n1)
    machine = kq.matmul_int8_interleaved(w8, qtype, x, N)
    reference = oracle.matmul_t_q8_activations(w, qtype, (N, K), x)
    to_reference, _ = bounds(w, qtype, K, x)
    assert np.all(np.abs(got[0, 3 + n0:3 + n1] - reference[0, n0:n1]) <= to_reference[0, n0:n1])
    np.testing.assert_array_equal(got[0, 3 + n0:3 + n1], machine[0, n0:n1])
    assert np.all(got[0, :3 + n0] == 7) and np.all(got[0, 3 + n1:] == 7)


@njit
def _prefetch_every_seventh(a):
    for i in range(0, a.size, 7):
        prefetch(a, i)


def test_prefetch_takes_kv_arrays_and_weight_bytes_and_refuses_others():
    """simd.prefetch is a hint: on the arrays it takes (float32 or uint16 KV arrays, uint8 weight bytes as the Q6_K
    decode walk passes them, 2-D) it leaves every value as it was; any other array is a typing error at compile
    time, not a silent no-op."""
    for a in (np.arange(96, dtype=np.float32), np.arange(96, dtype=np.uint16),
              np.arange(96, dtype=np.uint8).reshape(8, 12)):
        before = a.copy()
        _prefetch_every_seventh(a)
        np.testing.assert_array_equal(a, before)
    with pytest.raises(TypingError):
        _prefetch_every_seventh(np.arange(96, dtype=np.float64))


def interleaved_dots(w, x, y):
    """The exact integer dots each interleaved intrinsic below must give for one group's 256 bytes w: [13, 8] (one row
    per intrinsic call in interleaved_lanes, one column per row of the group); Q3_K's and Q2_K's with the two-part
    activations v = 128 x + y; IQ4's the levels of Q4_0's nibbles."""
    q8 = deinterleave(np.concatenate([np.zeros(16, np.uint8), w])[None], "Q8_0")[:, 2:].view(np.int8)
    q4 = deinterleave(np.concatenate([np.zeros(16, np.uint8), w[:128]])[None], "Q4_0")[:, 2:]
    u4 = np.concatenate([q4 & 15, q4 >> 4], axis=1).astype(np.int64)  # nibble j, then j + 16
    run = w.reshape(8, 8, 4).swapaxes(0, 1).reshape(8, 32)  # a run's 32 bytes of each row (Q4_K's qs, Q6_K's ql)
    qh_run = np.roll(w, 77).reshape(8, 8, 4).swapaxes(0, 1).reshape(8, 32)  # the intrinsics read it from w[179:]...
    q6 = (((run >> 4) & 15) | (((qh_run >> 2) & 3) << 4)).astype(np.int64) - 32  # ql_shift 4, qh_shift 2
    q5 = ((run >> 4) | (((qh_run >> 2) & 1) << 4)).astype(np.int64)  # the high nibbles, fifth bits of sub-block 2
    q5_0 = deinterleave(np.concatenate([np.zeros(16, np.uint8), w[:160]])[None], "Q5_0")  # [8, 22]
    fifth = np.unpackbits(q5_0[:, 2:6], axis=1, bitorder="little").astype(np.int64)  # value v's: bit v of the u32
    u5 = np.concatenate([q5_0[:, 6:] & 15, q5_0[:, 6:] >> 4], axis=1).astype(np.int64) | (fifth << 4)
    q3 = (((run >> 2) & 3) | (((qh_run >> 5) & 1) << 2)).astype(np.int64) - 4  # qs_shift 2, hm_shift 5
    q2 = ((run >> 6) & 3).astype(np.int64)  # qs_shift 6
    x64, v = x.astype(np.int64), 128 * x.astype(np.int64) + y
    return np.array([q8.astype(np.int64) @ x64, (u4 - 8) @ x64, (run & 15).astype(np.int64) @ x64,
                     (run >> 4).astype(np.int64) @ x64, q6[:, :16] @ x64[:16], q6[:, 16:] @ x64[16:], q5 @ x64,
                     (u5 - 16) @ x64, q3[:, :16] @ v[:16], q3[:, 16:] @ v[16:], q2[:, :16] @ v[:16],
                     q2[:, 16:] @ v[16:], quant.KVALUES.astype(np.int64)[u4] @ x64], np.float32)


DOT_NAMES = ("q8_0", "q4_0", "q4_k", "q6_k_low", "q6_k_high", "q5_k", "q5_0", "q3_k_low", "q3_k_high", "q2_k_low",
             "q2_k_high", "iq4")


@functools.lru_cache(maxsize=None)
def family_idots(groups, avx2, vnni):
    """Every family's interleaved dots compiled for (avx2, vnni), in DOT_NAMES' order."""
    found = {}
    for family in (legacy_kernels, kquant_kernels, iq4_kernels):
        found.update(family.idots(groups, avx2, vnni))
    return tuple(found[name] for name in DOT_NAMES)


@settings(max_examples=30, deadline=None)
@given(w=hnp.arrays(np.uint8, 512), x=hnp.arrays(np.int8, 32, elements=st.integers(-127, 127)),
       y=hnp.arrays(np.int8, 32, elements=st.integers(-64, 64)))
@example(w=np.full(512, 255, np.uint8), x=np.full(32, 127, np.int8), y=np.full(32, 64, np.int8))  # every value
@example(w=np.full(512, 255, np.uint8), x=np.full(32, -127, np.int8), y=np.full(32, -64, np.int8))  # at its most
def test_interleaved_integer_dots_are_the_integer_dot(w, x, y):
    """Lane r of an interleaved block's dot: the exact integer dot of row r's 32 values (Q8_0's q, Q4_0's u - 8, a
    Q4_K run's low or high nibbles; a Q6_K group's first or last 16, q - 32; a Q5_K run's nibbles with their fifth
    bits; Q5_0's u - 16; Q3_K's and Q2_K's as Q6_K's, q - 4 and q, with two parts v = 128 x + y; IQ4's levels of
    the nibbles, stored + 128 as Q8_0's values) with x, each from its start (minus the bias
    times the activations' sum); for one group, on the machine's instructions, on AVX2 without VNNI where the
    machine has it, and in plain LLVM; for a pair of groups (rows 8 .. 15 from the second, stride bytes on), on the
    machine's 512-bit instructions where it has them, and in plain LLVM."""
    expected = [interleaved_dots(w[:256], x, y), interleaved_dots(w[256:], x, y)]
    total, halves = int(x.astype(np.int32).sum()), x.astype(np.int32).reshape(2, 16).sum(axis=1)
    v_halves = (128 * x.astype(np.int32) + y).reshape(2, 16).sum(axis=1)
    machines = [(family_idots(1, kq.AVX2, kq.VNNI), 1, kq.Q8_0_BIAS), (family_idots(1, False, False), 1, 128),
                (family_idots(2, kq.PAIRED, kq.PAIRED), 2, 128), (family_idots(2, False, False), 2, 128)]
    if kq.AVX2:  # on a VNNI machine the kernels take vpdpbusd: check AVX2 without it here too
        machines.append((family_idots(1, True, False), 1, 0))  # Q8_0's bytes back to q, the sign trick: no bias
    for idots, groups, q8_0_bias in machines:
        starts = np.array([-q8_0_bias * total, -8 * total, -32 * halves[0], -32 * halves[1], -16 * total,
                           -4 * v_halves[0], -4 * v_halves[1]], np.int32)
        got = interleaved_lanes(*idots)(w, np.concatenate([x, y]), starts)
        np.testing.assert_array_equal(got[:, :8 * groups], np.concatenate(expected[:groups], axis=1))


@functools.lru_cache(maxsize=None)  # one compilation per set of intrinsics, not one per example
def interleaved_lanes(q8_0, q4_0, q4_k, q6_k_low, q6_k_high, q5_k, q5_0, q3_k_low, q3_k_high, q2_k_low, q2_k_high,
                      iq4):
    @njit
    def lanes(w, x, starts):
        """[13, 16]: each intrinsic's 8 lanes (16 for a pair) in a row, from one group or a pair."""
        out = np.zeros((13, 16), np.float32)
        wrapped = np.concatenate((w[:256], w[:256], w[256:], w[256:]))  # each group twice, the second at 512:
        vstore(out, 0, q8_0(wrapped, 0, 512, x, 0, starts[0]))  # w rolled by 77 is its qh run, from 256 - 77 = 179
        vstore(out, 16, q4_0(wrapped, 0, 512, x, 0, starts[1]))
        vstore(out, 32, q4_k(wrapped, 0, 512, 0, x, 0))
        vstore(out, 48, q4_k(wrapped, 0, 512, 4, x, 0))
        vstore(out, 64, q6_k_low(wrapped, 0, 4, 179, 2, 512, x, 0, starts[2]))
        vstore(out, 80, q6_k_high(wrapped, 0, 4, 179, 2, 512, x, 0, starts[3]))
        vstore(out, 96, q5_k(wrapped, 0, 512, 4, 179, 2, x, 0))
        vstore(out, 112, q5_0(wrapped, 0, 512, x, 0, starts[4]))  # fifth bits' word at 0, the nibbles' from 32
        vstore(out, 128, q3_k_low(wrapped, 0, 2, 179, 5, 512, x, 0, 32, starts[5]))  # two parts: x[:32], x[32:]
        vstore(out, 144, q3_k_high(wrapped, 0, 2, 179, 5, 512, x, 0, 32, starts[6]))
        vstore(out, 160, q2_k_low(wrapped, 0, 6, 179, 0, 512, x, 0, 32, np.int32(0)))
        vstore(out, 176, q2_k_high(wrapped, 0, 6, 179, 0, 512, x, 0, 32, np.int32(0)))
        vstore(out, 192, iq4(wrapped, 0, 512, x, 0, starts[0]))  # the bias of values stored + 128: Q8_0's
        return out

    return lanes


# ------------------------------------------------------------------------------------------------ expanded groups

EXPANDED_TYPES = tuple(name for name in kq.INTERLEAVED_TYPES if kq.KERNELS[name].expand is not None)


@functools.lru_cache(maxsize=None)
def group_expander(qtype):
    """A compiled call of `qtype`'s Expansion.group (an inlined piece, reached from Python through this)."""
    group = kq.KERNELS[qtype].expand.group

    @njit
    def expand(w8, g, e, j):
        group(w8, g, e, j)

    return expand


def test_the_types_that_unpack_bit_fields_expand():
    """A prefill decodes the groups of every type whose tile unpacks bit fields (the K-quants on one-part
    activations, IQ4_XS) once; the types read as stored bytes or nibbles alone do not."""
    assert set(EXPANDED_TYPES) == {"Q4_K", "Q5_K", "Q6_K", "IQ4_XS"}


@pytest.mark.parametrize("qtype", EXPANDED_TYPES)
@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_a_group_expands_to_its_dequantized_values(qtype, data):
    """Expansion.group writes each row's values, stored + bias in Q8_0's word layout, run u meeting activation block
    block(u), with their scales and (Q4_K, Q5_K) mins' factors: scale (v - bias) - min is the NumPy dequantizer's
    value of every weight, to float32 rounding; the other row of the scratch is left as it was."""
    w, K = data.draw(quantized_matrix(qtype))
    x, N = kq.KERNELS[qtype].expand, w.shape[0]
    w8 = quant.interleave_rows(w, qtype)
    g, j = data.draw(st.integers(0, len(w8) - 1), label="group"), data.draw(st.integers(0, 1), label="row")
    e = np.full((2, kq.expanded_bytes(K, x.size, x.mins)), 7, np.uint8)
    group_expander(qtype)(w8, g, e, j)
    assert np.all(e[1 - j] == 7)
    values = e[j, :8 * K].reshape(K // 32, 8, 8, 4).transpose(2, 0, 1, 3).reshape(8, K // 32, 32).astype(np.float64)
    scales = e[j, 8 * K:8 * K + 32 * (K // x.size)].view(np.float32).reshape(K // x.size, 8).T.astype(np.float64)
    mins = (e[j, 8 * K + 32 * (K // x.size):].view(np.float32).reshape(K // 32, 8).T.astype(np.float64) if x.mins
            else np.zeros((8, K // 32)))
    got = (values - (128 if x.plus_128 else x.bias(1))).reshape(8, K // x.size, x.size) * scales[:, :, None]
    got = got.reshape(8, K // 32, 32) - mins[:, :, None]
    order = [x.block(u) for u in range(K // 32)]
    assert sorted(order) == list(range(K // 32))
    padded = np.zeros((8 * len(w8), K), np.float32)
    padded[:N] = quant.dequantize(w, qtype, (N, K))
    want = padded[8 * g:8 * g + 8].reshape(8, K // 32, 32)[:, order].astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("qtype", EXPANDED_TYPES)
@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_a_prefill_on_expanded_groups_is_the_reference_and_the_decode_bits(qtype, data):
    """From the type's Expansion.tokens on (odd counts, the threshold itself, one below), the walk over expanded
    groups (pairs, single groups and a last group that n1 cuts, on the machine's walk and on one group at a time where that walk is
    compiled) is the NumPy oracle to float32 rounding, gives each token the bits of its one-token product, and writes
    only the rows n0 .. n1 it owns."""
    w, K = data.draw(quantized_matrix(qtype))
    N = w.shape[0]
    tokens = kq.KERNELS[qtype].expand.tokens
    T = data.draw(st.integers(tokens - 1, tokens + 5), label="T")
    n0 = 8 * data.draw(st.integers(0, (N - 1) // 8), label="n0 / 8")
    n1 = data.draw(st.integers(n0 + 1, N), label="n1")
    x = activations(data.draw, (T, K))
    q, d = np.empty((T, K), np.int8), np.empty((T, K // 32), np.float32)
    s, s16 = np.empty((T, K // 32), np.float32), np.empty((T, K // 16), np.int32)
    kq.quantize_activations_q8_into(x, T, q, d, s, s16)
    w8, code = quant.interleave_rows(w, qtype), kq.INTERLEAVED_CODE + quant.TYPES[qtype].type_id
    walks = [functools.partial(kq.matmul_rows_interleaved, code)]
    if qtype in ONE_GROUP_CHECKED:
        walks.append(one_group_walk(qtype))  # compiled for the decode test above: reused
    one_by_one = np.concatenate([kq.matmul_int8_interleaved(w8, qtype, x[t:t + 1], N) for t in range(T)])
    reference = oracle.matmul_t_q8_activations(w, qtype, (N, K), x)
    to_reference, _ = bounds(w, qtype, K, x)
    for walk in walks:
        got = np.full((T, N + 3), np.float32(7))
        walk(w8, q, d, s, s16, T, got, 3, n0, n1)
        assert np.all(np.abs(got[:, 3 + n0:3 + n1] - reference[:, n0:n1]) <= to_reference[:, n0:n1])
        np.testing.assert_array_equal(got[:, 3 + n0:3 + n1], one_by_one[:, n0:n1])
        assert np.all(got[:, :3 + n0] == 7) and np.all(got[:, 3 + n1:] == 7)
