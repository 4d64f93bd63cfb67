"""The Numba kernels on quantized blocks against the NumPy reference (dequantize, then @), under Hypothesis over
shapes, thread counts, arbitrary block bytes and activations."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from npllm import quant
from npllm.kernels import quant as kq
from npllm.quant import QuantizationError

HALF_FIELDS = quant.SCALE_FIELDS  # the float16 scales' bytes of each block type


@st.composite
def quantized_matrix(draw, qtype):
    """Arbitrary bytes for N rows of `qtype` blocks, every float16 scale finite (subnormals included)."""
    t = quant.TYPES[qtype]
    N = draw(st.integers(1, 24), label="N")
    blocks = draw(st.integers(1, 3 if t.block_size == 256 else 6), label="blocks per row")
    raw = draw(hnp.arrays(np.uint8, (N * blocks, t.block_bytes)))
    for at in HALF_FIELDS[qtype]:
        scale = draw(hnp.arrays(np.float16, N * blocks, elements=st.floats(-4, 4, width=16)))
        raw[:, at : at + 2] = scale.view(np.uint8).reshape(-1, 2)
    return raw.reshape(N, -1), blocks * t.block_size


def activations(draw, shape):
    return draw(hnp.arrays(np.float32, shape, elements=st.floats(-8, 8, width=32)))


def close(got, reference_w, x):
    """Within float32 rounding of sums of |w x| (the kernels regroup the sums)."""
    exact = x.astype(np.float64) @ reference_w.astype(np.float64).T
    scale = np.abs(x.astype(np.float64)) @ np.abs(reference_w.astype(np.float64)).T
    return got.dtype == np.float32 and got.shape == exact.shape and np.all(np.abs(got - exact) <= 2e-5 * scale + 1e-30)


@pytest.mark.parametrize("qtype", kq.KERNEL_TYPES)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_matvec_is_the_reference(qtype, data):
    w, K = data.draw(quantized_matrix(qtype))
    x = activations(data.draw, (K,))
    threads = data.draw(st.integers(1, 3), label="threads")
    reference = quant.dequantize(w, qtype, (w.shape[0], K))
    assert close(kq.matvec(w, qtype, x, threads), reference, x)


@pytest.mark.parametrize("qtype", kq.KERNEL_TYPES)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_matmul_is_the_reference(qtype, data):
    w, K = data.draw(quantized_matrix(qtype))
    T = data.draw(st.integers(1, 7), label="T")
    x = activations(data.draw, (T, K))
    threads = data.draw(st.integers(1, 3), label="threads")
    reference = quant.dequantize(w, qtype, (w.shape[0], K))
    got = kq.matmul(w, qtype, x, threads)
    assert close(got, reference, x)
    # decode and prefill regroup the same sums differently: equal to float32 rounding of sum |w x| (the sums may
    # cancel to far less than their terms, so not relative to the result)
    scale = np.abs(x[0].astype(np.float64)) @ np.abs(reference.astype(np.float64)).T
    assert np.all(np.abs(got[0] - kq.matvec(w, qtype, x[0], threads)) <= 4e-5 * scale + 1e-30)


def test_kernels_on_quantized_weights():
    """The path a model takes: float weights quantized by npllm, then multiplied."""
    rng = np.random.default_rng(0)
    W, x = rng.standard_normal((40, 512)).astype(np.float32), rng.standard_normal((3, 512)).astype(np.float32)
    for qtype in kq.KERNEL_TYPES:
        w = quant.quantize(W, qtype).reshape(40, -1)
        reference = quant.dequantize(w, qtype, W.shape)
        assert close(kq.matmul(w, qtype, x, 2), reference, x)
        assert close(kq.matvec(w, qtype, x[1], 2), reference, x[1])


def test_kernels_refuse_mismatched_shapes_and_types():
    w = quant.quantize(np.ones((2, 64), np.float32), "Q8_0").reshape(2, -1)
    with pytest.raises(QuantizationError, match="rows of 32"):
        kq.matvec(w, "Q8_0", np.ones(32, np.float32))
    with pytest.raises(QuantizationError, match="no kernel for Q5_1"):
        kq.matvec(w, "Q5_1", np.ones(64, np.float32))


def _q4_0_case():
    values = np.zeros((1, 256), np.float32)
    values[0, 0] = -0.7  # the one nonzero weight
    x = np.zeros(256, np.float32)
    x[0], x[24] = 1e-4, 2.3
    return quant.quantize(values, "Q4_0").reshape(1, -1), x


def _q6_k_case():  # Hypothesis's example: every byte 16 (q - 32 = 0 at value 24), one qh byte 2, d = 1.705
    w = np.full((1, 210), 16, np.uint8)
    w[0, 152], w[0, 208:] = 2, (210, 62)
    x = np.zeros(256, np.float32)
    x[0], x[24] = 2.0**-14, 2.0
    return w, x


@pytest.mark.parametrize("qtype, case", [("Q4_0", _q4_0_case), ("Q6_K", _q6_k_case)])
def test_a_zero_weight_beside_a_large_activation_costs_no_digits(qtype, case):
    """Found by Hypothesis: with the fixed offset taken as -8 (or -32) d (sum of x), a weight of 0 meeting a large
    activation cancelled against that sum and left ~3 correct digits of a small result. The offset is now subtracted
    from the small integers before the product, so the result is exact to float32 rounding of ITS terms."""
    w, x = case()
    reference = quant.dequantize(w, qtype, (1, 256)).astype(np.float64)
    assert reference[0, 24] == 0.0 and reference[0, 0] != 0.0
    exact = reference[0] @ x.astype(np.float64)
    np.testing.assert_allclose(kq.matvec(w, qtype, x, 1), [exact], rtol=1e-6)
    np.testing.assert_allclose(kq.matmul(w, qtype, np.stack([x, x]), 1)[:, 0], [exact, exact], rtol=1e-6)
