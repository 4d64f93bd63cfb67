"""NumbaTransformer against the NumPy Transformer, prefill against decode, batches against single sequences, and the
stories260K golden text with the Numba backend.

- Logits match the float64 NumPy model within 2e-4 of the logits' scale (float32 arithmetic through a few layers).
- Prefill of T tokens and T one-token decode steps give the SAME bits, also after the ring wraps (capacity < T),
  in chunks of any size, and for a sequence decoded next to others in a batch: every sum has an order fixed by
  its own position (kernels/cpu.py). The issue asks for <= 1e-5; equality is what the design promises.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import npllm
from npllm.cli import main
from npllm.cache import RingKVCache
from npllm.config import ModelConfig
from npllm.errors import ConfigError, GenerationError
from npllm.formats.random import NAMED_SHAPES, random_weights
from npllm.models import make_model
from npllm.models.numba import NumbaTransformer
from npllm.models.reference import Transformer

seeds = st.integers(0, 2**32 - 1)


@st.composite
def configs(draw):
    K = draw(st.integers(1, 3))
    H = K * draw(st.sampled_from([1, 2, 4, 8]))
    Dh = 2 * draw(st.integers(1, 12))
    return ModelConfig(dim=H * Dh, hidden_dim=draw(st.integers(1, 80)), n_layers=draw(st.integers(1, 3)),
                       n_heads=H, n_kv_heads=K, vocab_size=draw(st.integers(2, 70)), max_seq_len=64,
                       head_dim=Dh, tied_embeddings=draw(st.booleans()),
                       rope_layout=draw(st.sampled_from(["interleaved", "half"])),
                       attention_bias=draw(st.booleans()),
                       sliding_window=draw(st.one_of(st.none(), st.integers(1, 20))))


def models(config, seed):
    weights = random_weights(config, seed)
    return NumbaTransformer(config, weights), Transformer(config, {k: v.astype(np.float64) for k, v in
                                                                   weights.items()})


@given(configs(), seeds, st.integers(1, 40), st.one_of(st.none(), st.integers(1, 30)))
@settings(max_examples=40)
def test_logits_match_the_numpy_model(config, seed, T, capacity):
    fast, ref = models(config, seed)
    tokens = np.random.default_rng(seed).integers(0, config.vocab_size, T)
    want = ref.logits(tokens, cache=ref.new_cache(capacity))
    got = fast.logits(tokens, cache=fast.new_cache(capacity))
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=2e-4 * max(1.0, np.abs(want).max()))


@given(configs(), seeds, st.integers(1, 40), st.one_of(st.none(), st.integers(1, 30)),
       st.lists(st.integers(1, 9), min_size=1, max_size=8))
@settings(max_examples=40)
def test_prefill_equals_decode_bit_for_bit(config, seed, T, capacity, chunk_sizes):
    fast, _ = models(config, seed)
    tokens = np.random.default_rng(seed).integers(0, config.vocab_size, T)
    prefill = fast.logits(tokens, cache=fast.new_cache(capacity))
    one_by_one, chunked = fast.new_cache(capacity), fast.new_cache(capacity)
    decoded = np.concatenate([fast.logits(tokens[t:t + 1], [t], one_by_one) for t in range(T)])
    pieces, start = [], 0
    for size in chunk_sizes * T:  # chunk sizes drawn by Hypothesis, cycled until the tokens run out
        if start >= T:
            break
        pieces.append(fast.logits(tokens[start:start + size], np.arange(start, min(start + size, T)), chunked))
        start += size
    np.testing.assert_array_equal(decoded, prefill)
    np.testing.assert_array_equal(np.concatenate(pieces), prefill)
    np.testing.assert_array_equal(one_by_one.k, chunked.k)
    np.testing.assert_array_equal(one_by_one.positions, chunked.positions)


def test_prefill_equals_decode_after_the_ring_wraps_on_stories260k_shape():
    """The acceptance check: stories260K's shape, a ring of 24 positions, 100 tokens; max |diff| must be <= 1e-5."""
    config = NAMED_SHAPES["stories260K"]
    fast = NumbaTransformer(config, random_weights(config, seed=3))
    tokens = np.random.default_rng(3).integers(0, config.vocab_size, 100)
    prefill = fast.logits(tokens, cache=fast.new_cache(24))
    cache = fast.new_cache(24)
    decoded = np.concatenate([fast.logits(tokens[t:t + 1], [t], cache) for t in range(100)])
    assert np.abs(prefill - decoded).max() <= 1e-5
    np.testing.assert_array_equal(prefill, decoded)


@given(configs(), seeds, st.integers(2, 5), st.integers(1, 12), st.integers(1, 6))
@settings(max_examples=30)
def test_a_batch_step_equals_each_sequence_alone(config, seed, B, prompt, steps):
    """B sequences with prompts of different lengths, prefilled in one ragged call, then decoded one token per
    slot per call (slots listed out of order), give each sequence's own logits exactly."""
    fast, _ = models(config, seed)
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, prompt + 1, B)
    seqs = [rng.integers(0, config.vocab_size, n + steps) for n in lengths]
    cache = fast.new_cache(40, slots=B)
    tokens = np.concatenate([s[:n] for s, n in zip(seqs, lengths)])
    positions = np.concatenate([np.arange(n) for n in lengths])
    slots = np.repeat(np.arange(B), lengths)
    batched = [[] for _ in range(B)]
    h = fast.lm_head(fast.forward(tokens, positions, cache, slots))
    ends = np.cumsum(lengths)
    for b in range(B):
        batched[b].append(h[ends[b] - lengths[b]:ends[b]])
    for i in range(steps):
        order = rng.permutation(B)
        h = fast.lm_head(fast.forward([seqs[b][lengths[b] + i] for b in order], lengths[order] + i, cache, order))
        for row, b in enumerate(order):
            batched[b].append(h[row:row + 1])
    for b in range(B):
        alone = fast.logits(seqs[b][:lengths[b] + steps], cache=fast.new_cache(40))
        np.testing.assert_array_equal(np.concatenate(batched[b]), alone)


@pytest.mark.parametrize("tied", [False, True])
def test_float32_matrices_are_panels_multiplied_as_the_float32_kernels_multiply(monkeypatch, tied):
    """A float32 model is the one Numba model with F32 matrices held as cpu.pack_panels' panels (PANELS_CODE): its
    products are cpu.matmul's bits (the float32 kernels), for one token and several, with a last panel cut (rows
    not a multiple of 16) and on two threads, a layer's q, k and v (gate and up) one run of panels (as the float32
    kernels' fused matrices); the embedding table stays as stored, or, tied, its rows are gathered
    back from the LM head's panels."""
    import npllm.models.numba as numba_model
    from npllm.kernels import cpu
    from npllm.kernels import quant as kq

    monkeypatch.setattr(numba_model, "PARALLEL_MIN_SECONDS", 0.0)  # a tiny model: run every region on the threads
    config = ModelConfig(dim=24, hidden_dim=20, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=37, max_seq_len=8,
                         tied_embeddings=tied)
    weights = random_weights(config, 5)
    model = NumbaTransformer(config, weights, threads=2)
    p, V = model.packed, config.vocab_size
    codes = set(p.mats[:, 1]) - {0} if not tied else set(p.mats[:, 1])
    assert codes == {kq.PANELS_CODE} and p.table.shape == ((0, 0) if tied else (V, 4 * config.dim))
    H, K, Dh, F = config.n_heads, config.n_kv_heads, config.head_dim, config.hidden_dim
    assert list(p.mats[:7, 2]) == [(H + 2 * K) * Dh, 0, 0, config.dim, 2 * F, 0, config.dim]  # q|k|v, gate|up: runs
    head = weights["output"] if not tied else weights["tok_embeddings"]
    for T in (1, 7):
        h = np.random.default_rng(T).standard_normal((T, config.dim)).astype(np.float32)
        want = cpu.lm_head(h, cpu.pack_panels(head), V, 2)
        np.testing.assert_array_equal(model.head_logits(h), want)
    if tied:  # the lookups' rows, gathered back from the head's panels
        panels = p.pool[p.mats[-1, 0]:].reshape(-1)[:-(-V // 16) * 16 * 4 * config.dim].reshape(-(-V // 16), -1)
        rows = np.empty((V, config.dim), np.float32)
        for n in range(V):
            kq.panel_row(panels, n, rows[n])
        np.testing.assert_array_equal(rows, weights["tok_embeddings"])
    else:
        np.testing.assert_array_equal(p.table.view(np.float32), weights["tok_embeddings"])


def test_bad_calls_raise_the_numpy_models_errors():
    config = NAMED_SHAPES["stories260K"]
    fast = NumbaTransformer(config, random_weights(config))
    reference = Transformer(config, random_weights(config))
    for model in (fast, reference):
        cache = model.new_cache(slots=2)
        for tokens, positions, slots, message in [([1, 2], [0], None, "one length"), ([512], [0], None, "token ids"),
                                                  ([1], [0], [2], "slots"), ([1], [-1], None, "positions")]:
            with pytest.raises(GenerationError, match=message):
                model.forward(tokens, positions, cache, slots)
    cache = fast.new_cache()
    assert fast.forward([], [], cache).shape == (0, config.dim) == reference.forward([], [], cache).shape
    with pytest.raises(GenerationError, match="consecutive"):
        fast.forward([1, 2], [0, 2], cache)
    with pytest.raises(GenerationError, match="new_cache"):
        fast.forward([1], [0], RingKVCache(config, dtype=np.float64))
    with pytest.raises(ConfigError, match="threads"):
        NumbaTransformer(config, random_weights(config), threads=10_000)
    with pytest.raises(ConfigError, match="backend"):
        npllm.load("stories260K", backend="fortran")
    with pytest.raises(ConfigError, match="weight_dtype"):
        make_model(config, random_weights(config), "numba", weight_dtype="bfloat16")


def test_two_slots_positions_and_lengths_are_committed():
    config = NAMED_SHAPES["stories260K"]
    fast = NumbaTransformer(config, random_weights(config))
    cache = fast.new_cache(capacity=4, slots=2)
    fast.forward([1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 0], cache, [0, 0, 0, 0, 0, 1])
    np.testing.assert_array_equal(cache.positions, [[4, 1, 2, 3], [0, -1, -1, -1]])
    np.testing.assert_array_equal(cache.lengths, [5, 1])


def test_stories260k_golden_text_with_the_numba_backend(stories260k, golden_200):
    llm = npllm.load(stories260k, backend="numba")
    assert type(llm.model).__name__ == "NumbaTransformer"
    assert llm.generate("", max_new_tokens=200, temperature=0) == golden_200


def test_stories260k_matches_the_numpy_backend(stories260k):
    fast, ref = npllm.load(stories260k, backend="numba"), npllm.load(stories260k, backend="numpy")
    ids = fast.tokenizer.encode("Once upon a time, Lily met a big dog.", bos=True)
    want = ref.logits(ids)
    np.testing.assert_allclose(fast.logits(ids), want, atol=1e-4 * np.abs(want).max())


def test_cli_golden_with_backend_and_threads(stories260k, golden_200, capsys):
    assert main(["generate", "--model", str(stories260k), "--temperature", "0", "--max-new-tokens", "200",
                 "--backend", "numba", "--threads", "1"]) == 0
    assert capsys.readouterr().out == golden_200 + "\n"


AVX2_CHECK = """
import numpy as np
from npllm.kernels import cpu, simd
from npllm.formats.random import NAMED_SHAPES, random_weights
from npllm.models.numba import NumbaTransformer
assert not simd.WIDE
rng = np.random.default_rng(0)
x, w = rng.standard_normal((13, 37)).astype(np.float32), rng.standard_normal((70, 37)).astype(np.float32)
got = cpu.matmul(x, cpu.pack_panels(w), 70, 2)
exact = x.astype(np.float64) @ w.T.astype(np.float64)
assert np.all(np.abs(got - exact) <= 2 * 37 * 2.0**-24 * (np.abs(x) @ np.abs(w).T) + 1e-30)
c = NAMED_SHAPES["stories260K"]
m = NumbaTransformer(c, random_weights(c, seed=2))
tokens = rng.integers(0, c.vocab_size, 30)
prefill = m.logits(tokens, cache=m.new_cache(12))
cache = m.new_cache(12)
decode = np.concatenate([m.logits(tokens[t:t + 1], [t], cache) for t in range(30)])
assert np.array_equal(prefill, decode)
"""


# a Haswell's features, named whole: the environment's own NUMBA_CPU_FEATURES (set to emulate another CPU) must not
# leak into the child
HASWELL_FEATURES = ("+64bit,+avx,+avx2,+bmi,+bmi2,+cmov,+cx16,+f16c,+fma,+fsgsbase,+fxsr,+lzcnt,+mmx,+movbe,+popcnt,"
                    "+sahf,+sse,+sse2,+sse3,+sse4.1,+sse4.2,+ssse3,+xsave,+xsaveopt")


def test_the_avx2_tiles_on_a_machine_without_avx512(tmp_path):
    """Compiled for a Haswell (AVX2, no AVX-512: the 6 x 16 tile everywhere), in a fresh process with its own
    kernel cache: products within the float32 bound, prefill == decode bit for bit after the ring wraps."""
    env = dict(os.environ, NUMBA_CPU_NAME="haswell", NUMBA_CPU_FEATURES=HASWELL_FEATURES,
               NUMBA_CACHE_DIR=str(tmp_path), PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    result = subprocess.run([sys.executable, "-c", AVX2_CHECK], env=env, capture_output=True, text=True,
                            timeout=540)
    assert result.returncode == 0, result.stderr[-3000:]
