"""npllm.quant against the `gguf` package (the llama.cpp project's reference): every dequantizer bit-exact on
arbitrary blocks, the legacy quantizers byte-exact, and the K-quant quantizers within their proven error bound."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from npllm import quant
from npllm.quant import QK_K, QuantizationError, iq4, kfit

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

# byte offsets of the float16 scales in each block: the only fields whose bits can spell inf or NaN
HALF_FIELDS = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q2_K": [80, 82],
               "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_NL": [0], "IQ4_XS": [0]}
QUANTIZED = list(HALF_FIELDS)


def same_bits(a, b) -> bool:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def finite_halves(raw: np.ndarray, offsets, stride: int) -> np.ndarray:
    """Clear one exponent bit of every float16 field whose exponent is all ones (inf/NaN), keeping it finite."""
    raw = raw.copy().reshape(-1, stride)
    for at in offsets:
        high = raw[:, at + 1]
        raw[:, at + 1] = np.where((high & 0x7C) == 0x7C, high & ~np.uint8(0x40), high)
    return raw.reshape(-1)


def reference_dequantize(raw: np.ndarray, name: str) -> np.ndarray:
    t = quant.TYPES[name]
    return gguf.quants.dequantize(raw.reshape(-1, t.block_bytes) if t.block_size > 1 else raw, Q[name]).reshape(-1)


def test_type_table_agrees_with_the_gguf_package():
    for name, t in quant.TYPES.items():
        assert Q[name] == t.type_id
        assert gguf.GGML_QUANT_SIZES[Q[name]] == (t.block_size, t.block_bytes)
        assert quant.TYPES_BY_ID[t.type_id] is t
    from npllm.formats.gguf import GGML_TYPES

    for t in quant.TYPES.values():  # the reader's layout table (every ggml type) agrees on the ones npllm computes
        assert (GGML_TYPES[t.type_id].name, GGML_TYPES[t.type_id].block_size, GGML_TYPES[t.type_id].block_bytes) == (
            t.name, t.block_size, t.block_bytes)
    assert GGML_TYPES is quant.TYPES_BY_ID  # one table
    assert quant.TYPES["Q4_K"].bits_per_value == 4.5 and quant.TYPES["Q8_0"].nbytes((3, 64)) == 3 * 2 * 34
    assert {name: list(t.scale_fields) for name, t in quant.TYPES.items() if t.block_size > 1} == HALF_FIELDS


def test_every_list_of_types_derives_from_the_records():
    """The lists other modules read come from the QuantType records: what is read, written, interleaved, on which
    activations; the mixtures name types npllm writes; the CLI offers every type npllm writes and every mixture."""
    from npllm.cli import QUANTIZE_TYPES

    types = quant.TYPES.values()
    assert list(quant.QUANTIZE) == [t.name for t in types if t.quantize is not None]
    assert quant.INTERLEAVED_TYPES == tuple(t.name for t in types if t.interleaved_bytes)
    assert quant.TWO_PART_ACTIVATION_TYPES == ("Q2_K", "Q3_K")
    assert set(quant.INT8_ACTIVATION_TYPES) == set(quant.INTERLEAVED_TYPES)  # every block type, none of the floats
    assert {"IQ4_NL", "IQ4_XS"} <= set(quant.INTERLEAVED_TYPES) & set(quant.QUANTIZE)
    assert all(name in quant.QUANTIZE for pair in quant.MIXTURES.values() for name in pair)
    assert set(QUANTIZE_TYPES) == {name.lower() for name in (*quant.QUANTIZE, *quant.MIXTURES)}


@pytest.mark.parametrize("name", QUANTIZED)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_dequantize_is_bit_exact_on_arbitrary_blocks(name, data):
    t = quant.TYPES[name]
    n_blocks = data.draw(st.integers(1, 6), label="blocks")
    raw = np.frombuffer(data.draw(st.binary(min_size=n_blocks * t.block_bytes, max_size=n_blocks * t.block_bytes)),
                        dtype=np.uint8)
    raw = finite_halves(raw, HALF_FIELDS[name], t.block_bytes)
    ours = quant.dequantize(raw, name)
    assert ours.dtype == np.float32 and ours.shape == (n_blocks * t.block_size,)
    assert same_bits(ours, reference_dequantize(raw, name))


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("name", ["F16", "BF16"])
@given(raw=st.binary(min_size=2, max_size=64).filter(lambda b: len(b) % 2 == 0))
def test_float_types_are_bit_exact(name, raw):
    raw = np.frombuffer(raw, dtype=np.uint8)
    assert same_bits(quant.dequantize(raw, name), reference_dequantize(raw, name))


def test_dequantize_reshapes_and_refuses_partial_blocks():
    raw = quant.quantize(np.ones((2, 64), np.float32), "Q8_0")
    assert quant.dequantize(raw, "Q8_0", (2, 64)).shape == (2, 64)
    with pytest.raises(QuantizationError, match="whole number"):
        quant.dequantize(raw[:-1], "Q8_0")
    with pytest.raises(QuantizationError, match="cannot read type IQ2_XS"):
        quant.dequantize(raw, "IQ2_XS")


@st.composite
def weight_rows(draw, block_size):
    """Rows of realistic weights: values in [-1, 1] at a scale from 1e-3 to 1e3, some exact zeros, some blocks
    all zero (scale 0), none so small that 1 / scale overflows."""
    rows = draw(st.integers(1, 4))
    blocks = draw(st.integers(1, 3))
    x = draw(hnp.arrays(np.float32, (rows, blocks * block_size),
                        elements=st.floats(-1, 1, width=32) | st.just(np.float32(0))))
    scale = np.float32(10.0 ** draw(st.integers(-3, 3)))
    x = np.where(np.abs(x) < 1e-6, np.float32(0), x * scale).astype(np.float32)
    if draw(st.booleans()):
        x[0, :block_size] = 0
    return x


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_quantize_matches_the_reference_quantizer_byte_for_byte(name, data):
    x = data.draw(weight_rows(32))
    ours = quant.quantize(x, name)
    expected = gguf.quants.quantize(x, Q[name]).reshape(-1)
    assert ours.dtype == np.uint8 and np.array_equal(ours, expected)


def k_quant_bound(x: np.ndarray, name: str) -> np.ndarray:
    """The largest error the covering rule of npllm's K-quants allows, per value (quant.kfit.covering_scale_min):
    half a step, where the step exceeds the sub-block's covering step by at most one grid unit of each scale."""
    slack, tiny = 1 + 2.0**-10, 2.0**-24  # float16 rounding up of a super-scale: relative, or subnormal spacing
    x = x.astype(np.float64)
    if name == "Q6_K":
        sub = x.reshape(-1, QK_K // 16, 16)
        needed = np.abs(sub).max(axis=2) / 31
        d = needed.max(axis=1, keepdims=True) / 127 * slack + tiny
        step = needed + d
    elif name == "Q3_K":  # the smaller of a positive step (q - 4 up to 3) and a negative one
        sub = x.reshape(-1, QK_K // 16, 16)
        high, low = np.maximum(sub.max(axis=2), 0), np.maximum(-sub.min(axis=2), 0)
        needed = np.minimum(np.maximum(high / 3, low / 4), np.maximum(low / 3, high / 4))
        d = needed.max(axis=1, keepdims=True) / 31 * slack + tiny
        step = needed + d
    else:
        top, size, scale_top = {"Q2_K": (3, 16, 15), "Q4_K": (15, 32, 63), "Q5_K": (31, 32, 63)}[name]
        sub = x.reshape(-1, QK_K // size, size)
        mn = -np.minimum(sub.min(axis=2), 0)
        dmin = mn.max(axis=1, keepdims=True) / scale_top * slack + tiny
        needed = (sub.max(axis=2) + mn + dmin) / top
        d = needed.max(axis=1, keepdims=True) / scale_top * slack + tiny
        step = needed + d
    return np.repeat(step / 2, sub.shape[2], axis=1).reshape(x.shape) * (1 + 1e-6)


@pytest.mark.parametrize("name", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_k_quant_covering_rule_error_is_within_half_a_step(name, data):
    x = data.draw(weight_rows(QK_K))
    raw = quant.K_QUANT_RULES[name][0](x)
    assert raw.size == x.size // QK_K * quant.TYPES[name].block_bytes
    y = quant.dequantize(raw, name).reshape(x.shape)
    assert same_bits(y.reshape(-1), reference_dequantize(raw, name))  # the bytes mean what the reference reads
    error = np.abs(y.astype(np.float64) - x)
    assert np.all(error <= k_quant_bound(x, name))


def squared_error_per_super_block(raw: np.ndarray, name: str, x: np.ndarray) -> np.ndarray:
    y = reference_dequantize(raw, name).astype(np.float64).reshape(-1, QK_K)
    return ((y - x.astype(np.float64).reshape(-1, QK_K)) ** 2).sum(axis=1)


@pytest.mark.parametrize("name", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_k_quant_is_never_worse_than_its_covering_rule(name, data):
    """Per super-block, npllm's K-quant bytes (the closer of two scale rules) lie no further from the values, in
    squared error as the gguf package reads them, than the covering rule's, whose bound is tested above; and the
    fitted rule's own bytes are valid blocks of the type."""
    x = data.draw(weight_rows(QK_K))
    raw = quant.quantize(x, name)
    assert raw.size == x.size // QK_K * quant.TYPES[name].block_bytes
    assert same_bits(quant.dequantize(raw, name), reference_dequantize(raw, name))
    covering = squared_error_per_super_block(quant.K_QUANT_RULES[name][0](x), name, x)
    assert np.all(squared_error_per_super_block(raw, name, x) <= covering)
    fitted = quant.K_QUANT_RULES[name][1](x)
    assert same_bits(quant.dequantize(fitted, name), reference_dequantize(fitted, name))


def test_the_closer_rule_never_takes_a_block_that_reads_as_nan():
    """kfit.closest compares squared errors; a candidate block whose scale reads as NaN (an error of NaN) loses to
    any finite one, even listed first (argmin alone would pick the NaN)."""
    x = np.random.default_rng(3).standard_normal((2, QK_K)).astype(np.float32)
    good = quant.K_QUANT_RULES["Q4_K"][0](x)
    broken = good.copy().reshape(2, -1)
    broken[0, :2] = np.array([np.nan], np.float16).view(np.uint8)  # block 0's d: a float16 NaN
    chosen = kfit.closest(x, quant.dequantize_q4_k, 144, broken.reshape(-1), good)
    assert np.array_equal(chosen.reshape(2, -1)[0], good.reshape(2, -1)[0])
    assert np.array_equal(chosen.reshape(2, -1)[1], broken[1])  # a tie: the first candidate


@pytest.mark.parametrize("name,worst", [("Q2_K", 0.265), ("Q3_K", 0.145), ("Q4_K", 0.072), ("Q5_K", 0.0366),
                                        ("Q6_K", 0.0170), ("Q8_0", 0.0055), ("IQ4_NL", 0.074), ("IQ4_XS", 0.075)])
def test_relative_error_on_gaussian_weights(name, worst):
    """On weight-like data each type lands where its bits put it (relative RMS error ~ 2^-bits). The K-quants'
    fitted scales are what bring them under these bounds: by the covering rule alone they measure Q2_K 0.357,
    Q3_K 0.164, Q4_K 0.080, Q5_K 0.039, Q6_K 0.0197. The IQ4 types' non-linear levels land below Q4_0's 0.086 (by
    the plain rule alone: IQ4_NL 0.080, IQ4_XS 0.080)."""
    x = np.random.default_rng(0).standard_normal((64, 1024)).astype(np.float32)
    y = quant.dequantize(quant.quantize(x, name), name).reshape(x.shape)
    assert np.sqrt(np.mean((x - y) ** 2) / np.mean(x**2)) < worst


@pytest.mark.parametrize("name", ["IQ4_NL", "IQ4_XS"])
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_iq4_quantizers_choose_the_nearest_level_and_beat_the_plain_rule(name, data):
    """npllm's IQ4 bytes as the gguf package reads them: every value at the level nearest x / step for its block's
    (sub-block's) stored step, and per block (super-block) no further from the values, in squared error, than the
    plain rule's (the largest value at level -127)."""
    size = 32 if name == "IQ4_NL" else QK_K
    x = data.draw(weight_rows(size))
    raw = quant.quantize(x, name)
    assert raw.size == x.size // size * quant.TYPES[name].block_bytes
    y = reference_dequantize(raw, name).astype(np.float64).reshape(-1, size // 32 if size > 32 else 1, 32)
    blocks = raw.reshape(-1, quant.TYPES[name].block_bytes)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float64)
    if name == "IQ4_XS":
        d = d * iq4._iq4_xs_scales(blocks).astype(np.float64)  # [nb, 8]: each sub-block's step
    steps = d.reshape(y.shape[0], -1, 1)
    levels = quant.KVALUES.astype(np.float64)
    x64 = x.astype(np.float64).reshape(y.shape)
    nearest = np.abs(x64[..., None] - steps[..., None] * levels).min(axis=-1)
    assert np.all(np.abs(y - x64) <= nearest * (1 + 1e-6) + 1e-30)
    if name == "IQ4_NL":
        step = iq4.as_half(iq4.plain_step(x.reshape(-1, 32))[:, None]).copy().view(np.float16).astype(np.float32)
        plain_y = step * iq4._levels(iq4._nearest_indices(x.reshape(-1, 32), step[:, 0]))
        plain_error = ((plain_y.astype(np.float64) - x.reshape(-1, 32)) ** 2).sum(axis=1)
    else:
        plain_error = squared_error_per_super_block(iq4._iq4_xs_rule(False)(x), name, x)
    error = ((y - x64) ** 2).reshape(len(plain_error), -1).sum(axis=1)
    assert np.all(error <= plain_error)


@given(v=hnp.arrays(np.float32, 64, elements=st.floats(-300, 300, width=32)
                   | st.sampled_from([float(m) for m in iq4._MIDPOINTS])))
def test_the_nearest_level_table_is_the_nearest_level(v):
    """iq4's table of half-unit bins gives the index of the nearest level, the lower one on a tie (the midpoints
    themselves are drawn), as a search of the midpoints does."""
    expected = np.searchsorted(iq4._MIDPOINTS, v)  # side "left": v equal to a midpoint takes the lower level
    assert np.array_equal(iq4._nearest_indices(v[None], np.float32([1.0]))[0], expected)
    levels = quant.KVALUES.astype(np.float64)
    distance = np.abs(v[:, None].astype(np.float64) - levels)
    assert np.all(distance[np.arange(64), expected] == distance.min(axis=1))


@pytest.mark.parametrize("name", ["Q8_0", "Q4_K", "F16", "IQ4_NL", "IQ4_XS"])
def test_quantize_refuses_what_it_cannot_store(name):
    with pytest.raises(QuantizationError, match="not finite"):
        quant.quantize(np.full((1, 256), np.nan, np.float32), name)
    with pytest.raises(QuantizationError):
        quant.quantize(np.full((1, 256), 1e30, np.float32), name)
    with pytest.raises(QuantizationError, match="blocks"):
        quant.quantize(np.ones((2, 100), np.float32), "Q8_0" if name == "F16" else name)


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_K", "Q6_K", "F16"])
def test_quantized_matrix_reference_products_and_rows(name):
    rng = np.random.default_rng(2)
    W, x = rng.standard_normal((6, 512)).astype(np.float32), rng.standard_normal((3, 512)).astype(np.float32)
    m = quant.QuantizedMatrix.from_values(W, name)
    dense = m.dequantize()
    assert m.nbytes == quant.TYPES[name].nbytes(W.shape) and dense.shape == W.shape
    assert same_bits(m.matmul_t(x), x @ dense.T)
    assert same_bits(m.rows([4, 0, 4]), dense[[4, 0, 4]])
    with pytest.raises(QuantizationError, match="do not hold"):
        quant.QuantizedMatrix(m.raw[:, 1:], name, W.shape)
