"""A float16 KV cache (kv_dtype="float16"): keys and values rounded to float16 when stored, widened when read.

Tolerances:
- kernels: exact. simd.store_kv rounds as NumPy's astype(float16) does (to nearest, ties to even, overflow to inf),
  and widening a float16 is exact, so attention over a float16 cache equals attention over a float32 cache that
  holds the same float16 values, bit for bit.
- models: a float16 cache changes each stored key and value by at most 2^-11 relative (half a float16 step). On
  stories260K (logits up to ~20) the logits then move by ~1e-2; the tests allow 8 * 2^-11 * max|logits| (~0.08) and
  require a change (the cache really is float16).
"""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import njit

import npllm
from npllm.cli import main
from npllm.errors import ConfigError
from npllm.formats.llama2c import read_llama2c
from npllm.kernels import cpu
from npllm.kernels.simd import load_kv, store_kv
from npllm.models import make_model

from test_kernels import normal

F16_STEP = 2.0**-11  # float16 unit roundoff


@njit
def store_all(x, out):
    """out.flat[i] = x[i] through simd.store_kv (out: float32, or uint16 float16 bits)."""
    for i in range(x.shape[0]):
        store_kv(out, i, x[i])


@njit
def load_all(a):
    """a.flat[i] widened through simd.load_kv."""
    out = np.empty(a.shape[0], np.float32)
    for i in range(a.shape[0]):
        out[i] = load_kv(a, i)
    return out


finite_or_huge = st.floats(width=32, allow_nan=False)


@given(st.lists(finite_or_huge, min_size=1, max_size=40))
@settings(max_examples=50)
def test_store_kv_rounds_as_numpy_and_load_kv_widens_exactly(values):
    x = np.array(values, np.float32)
    bits = np.zeros(len(x), np.uint16)
    store_all(x, bits)
    with np.errstate(over="ignore"):  # beyond 65504: inf, in both
        half = x.astype(np.float16)
    np.testing.assert_array_equal(bits, half.view(np.uint16))
    np.testing.assert_array_equal(load_all(bits), half.astype(np.float32))
    same = np.zeros(len(x), np.float32)
    store_all(x, same)  # a float32 cache stores the value as it is
    np.testing.assert_array_equal(same, x)


def ring_attention(q, k, v, past: int, storage):
    """cpu.attention_ring_into, as the model calls it, over a one-slot ring holding `past` earlier positions of k, v
    and then this call's T: returns (outputs [T, H Dh], ring keys, ring values) with the ring stored as `storage`
    (float32, or uint16 holding float16 bits).    # q [T, H, Dh], k, v [past + T, K, Dh]"""
    T, H, Dh = q.shape
    S, K, _ = k.shape
    wide = np.float16 if storage == np.uint16 else np.float32
    ring_k, ring_v = np.zeros((1, S, K, Dh), wide), np.zeros((1, S, K, Dh), wide)
    ring_k[0, :past], ring_v[0, :past] = k[:past], v[:past]
    ring_pos = np.full((1, S), -1, np.int64)
    ring_pos[0, :past] = np.arange(past)
    qkv = np.concatenate([q.reshape(T, -1), k[past:].reshape(T, -1), v[past:].reshape(T, -1)], axis=1)
    positions, order, starts, slots = np.arange(past, S), np.arange(T), np.array([0, T]), np.array([0])
    valid_from = np.empty(1, np.int64)
    seqs = cpu.Sequences(order, starts, slots)
    cpu.valid_from_into(positions, seqs, ring_pos, S, valid_from)
    out = np.empty((T, H * Dh), np.float32)
    cpu.attention_ring_into(qkv, H, K, positions, seqs, valid_from,
                            cpu.LayerRing(ring_k.view(storage), ring_v.view(storage), ring_pos),
                            cpu.AttentionOptions(S, 1.0 / np.sqrt(Dh), 0.0), out)
    return out, ring_k.astype(np.float32), ring_v.astype(np.float32)


@given(st.integers(0, 2**32 - 1), st.integers(1, 20), st.integers(0, 140), st.sampled_from([1, 2, 4]),
       st.integers(1, 2), st.integers(1, 20))
@settings(max_examples=20)
def test_attention_over_a_float16_ring_equals_a_float32_ring_of_the_same_values(seed, T, past, group, K, Dh):
    """The model's attention kernel (score and value loops: vector lanes and tails, Dh up to 20; query blocks of
    16) stores this call's keys and values as float16 and reads them back exactly: given keys and values that
    float16 holds, a float16 ring and a float32 ring give the same bits and hold the same values."""
    rng = np.random.default_rng(seed)
    H = K * group
    q = normal(rng, T, H, Dh)
    k, v = (normal(rng, past + T, K, Dh).astype(np.float16).astype(np.float32) for _ in range(2))
    half = ring_attention(q, k, v, past, np.uint16)
    full = ring_attention(q, k, v, past, np.float32)
    for got, want in zip(half, full):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(half[1][0], k)  # every position stored


@pytest.fixture(scope="module")
def checkpoint(stories260k):
    return read_llama2c(stories260k)


PROMPT = np.array([1, 403, 407, 261, 378, 271, 365, 286, 268, 362, 327, 417, 281, 266, 288, 289, 264, 406, 275, 260])


@pytest.mark.parametrize("backend", ["numba", "numpy"])
def test_float16_cache_logits_within_float16_rounding_of_float32(checkpoint, backend):
    model = make_model(*checkpoint, backend, kv_dtype="float16")
    half, full = model.new_cache(), model.new_cache(kv_dtype="float32")
    assert half.k.dtype == np.float16 and full.k.dtype == np.float32
    assert half.nbytes * 2 == full.nbytes
    got, want = model.logits(PROMPT, cache=half), model.logits(PROMPT, cache=full)
    difference = np.abs(got - want).max()
    assert 0 < difference <= 8 * F16_STEP * np.abs(want).max()
    assert np.array_equal(got.argmax(-1), want.argmax(-1))


def test_numba_float16_cache_prefill_equals_decode_bits(checkpoint):
    """Keys are rounded when stored, so a prefill and one-token steps see the same keys: the same bits."""
    model = make_model(*checkpoint, "numba", kv_dtype="float16")
    prefill = model.logits(PROMPT)
    cache = model.new_cache()
    steps = np.concatenate([model.lm_head(model.forward(PROMPT[i:i + 1], [i], cache)) for i in range(len(PROMPT))])
    np.testing.assert_array_equal(steps, prefill)
    assert cache.k.dtype == np.float16


def test_stories260k_float16_cache_follows_greedy_200(checkpoint, stories260k, golden_200):
    """All 200 greedy tokens of greedy_200.txt with a float16 cache (measured: 200 of 200, numba and numpy)."""
    llm = npllm.load(stories260k, backend="numba", kv_dtype="float16")
    assert llm.model.new_cache().k.dtype == np.float16
    assert llm.generate("", max_new_tokens=200, temperature=0) == golden_200


def test_bad_kv_dtype_is_a_config_error(checkpoint):
    with pytest.raises(ConfigError, match="kv_dtype must be one of float32, float16"):
        make_model(*checkpoint, "numpy", kv_dtype="int8")
    with pytest.raises(ConfigError, match="kv_dtype"):
        make_model(*checkpoint, "numpy").new_cache(kv_dtype="bfloat16")


def test_cli_kv_dtype_on_generate_and_bench(stories260k, golden_200, capsys):
    assert main(["generate", "--model", str(stories260k), "--max-new-tokens", "20", "--temperature", "0",
                 "--kv-dtype", "float16"]) == 0
    assert golden_200.startswith(capsys.readouterr().out.strip())
    assert main(["bench", "--model", "stories260K", "--batch", "2", "--prompt-len", "5", "--gen-len", "3",
                 "--repeat", "1", "--bandwidth-mib", "8", "--threads", "1", "--kv-dtype", "float32", "float16",
                 "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["kv_dtype"] for r in lines] == ["float32", "float16"]
    assert lines[0]["kv_cache_mib"] == 2 * lines[1]["kv_cache_mib"]
