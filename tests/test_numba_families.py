"""The Numba backend on every other family's options (config.py: GeGLU, embedding and residual multipliers, score
scale and soft-caps, q/k norms per head or over the projection, sandwich and post norms, per-layer sliding windows
and RoPE bases, longrope, YaRN, dynamic NTK, partial rotary, NoPE layers, mixtures of experts), against the NumPy
reference in float64, on small random models built here from npllm.tensors.expected_shapes; prefill against decode
bit for bit; float32 matrices (as panels) and matrices kept in their file types alike, through the one model class
and its one compiled forward. Then the transformers fixtures (tests/fixtures/hf/<family>/) and llama.cpp's
conversions of them (tests/fixtures/gguf_arch/) on the Numba backend, and GGUF files whose experts are 3-D stacks of
blocks."""

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_formats_gguf_families import write_family

import npllm
from npllm.config import ModelConfig, RopeScaling
from npllm.formats import read_checkpoint
from npllm.models import make_model
from npllm.models.numba import NumbaTransformer
from npllm.models.reference import Transformer
from npllm.quant import dequantized, stored_as
from npllm.tensors import expected_shapes

seeds = st.integers(0, 2**32 - 1)


@st.composite
def family_configs(draw, experts=st.sampled_from([0, 0, 1, 3, 4])):
    """A small model using any mix of the options (each drawn on or off, with values in their usual ranges)."""
    K = draw(st.integers(1, 2), label="K")
    H = K * draw(st.sampled_from([1, 2, 4]), label="group")
    Dh = 2 * draw(st.integers(1, 10), label="Dh/2")
    L = draw(st.integers(1, 3), label="L")
    E = draw(experts, label="E")
    window = draw(st.one_of(st.none(), st.integers(1, 12)), label="sliding_window")
    per_layer = window is not None and draw(st.booleans(), label="per-layer windows")
    # partial rotary (the first half of each head), layers without RoPE, and the RoPE scalings
    partial = Dh % 4 == 0 and draw(st.booleans(), label="partial rotary")
    nope = tuple(draw(st.booleans()) for _ in range(L)) if draw(st.booleans(), label="NoPE layers") else ()
    r = Dh // 2 if partial else Dh
    kinds = ["none", "longrope", "yarn"]
    kind = draw(st.sampled_from(kinds + ["dynamic"] if r > 2 else kinds), label="rope scaling")
    factors = st.lists(st.floats(1.0, 4.0), min_size=r // 2, max_size=r // 2).map(tuple)
    original = draw(st.integers(4, 40), label="original context")
    rope_scaling = {
        "none": None,
        "longrope": lambda: RopeScaling("longrope", 1.0, original_max_position_embeddings=original,
                                        short_factor=draw(factors), long_factor=draw(factors),
                                        attention_factor=draw(st.floats(0.8, 1.3))),
        "yarn": lambda: RopeScaling("yarn", draw(st.floats(1.0, 8.0)), original_max_position_embeddings=original,
                                    beta_fast=draw(st.sampled_from([32.0, 8.0])),
                                    beta_slow=draw(st.sampled_from([1.0, 0.5])),
                                    truncate=draw(st.booleans()), attention_factor=draw(st.floats(0.8, 1.3))),
        "dynamic": lambda: RopeScaling("dynamic", draw(st.floats(1.0, 4.0)), original_max_position_embeddings=original),
    }[kind]
    rope_scaling = rope_scaling() if callable(rope_scaling) else rope_scaling
    return ModelConfig(
        dim=draw(st.sampled_from([H * Dh, 24, 7])), hidden_dim=draw(st.integers(1, 40)), n_layers=L, n_heads=H,
        n_kv_heads=K, vocab_size=draw(st.integers(2, 50)), max_seq_len=64, head_dim=Dh,
        tied_embeddings=draw(st.booleans()), rope_layout=draw(st.sampled_from(["interleaved", "half"])),
        attention_bias=draw(st.booleans()), sliding_window=window,
        sliding_layers=tuple(draw(st.booleans()) for _ in range(L)) if per_layer else (),
        rope_local_theta=draw(st.sampled_from([0.0, 100.0])), rope_scaling=rope_scaling,
        partial_rotary_factor=0.5 if partial else 1.0, rope_layers=nope,
        ffn_activation=draw(st.sampled_from(["silu", "gelu_tanh"])),
        embedding_multiplier=draw(st.sampled_from([1.0, 0.5, 4.9])),
        residual_multiplier=draw(st.sampled_from([1.0, 0.22])),
        attention_scale=draw(st.sampled_from([0.0, 0.0625, 0.8])),
        attn_logit_softcap=draw(st.sampled_from([0.0, 1.5, 50.0])),
        final_logit_softcap=draw(st.sampled_from([0.0, 3.0])), logit_multiplier=draw(st.sampled_from([1.0, 0.125])),
        qk_norm=draw(st.sampled_from(["", "head", "projection"])),
        block_norms=draw(st.sampled_from(["pre", "sandwich", "post"])),
        n_experts=E, n_experts_used=draw(st.integers(1, E)) if E else 0,
        expert_hidden_dim=draw(st.integers(0, 30)) if E else 0, expert_weights_norm=draw(st.booleans()))


def family_weights(config: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """Random float32 weights under their canonical names: matrices N(0, 1/fan_in), norm gains near 1, small biases."""
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in expected_shapes(config).items():
        kind = name.rsplit(".", 1)[-1]
        if kind.endswith("norm"):
            weights[name] = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        elif kind in ("bq", "bk", "bv"):
            weights[name] = (0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            weights[name] = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    return weights


def reference(config, weights) -> Transformer:
    return Transformer(config, {name: np.asarray(w, np.float64) for name, w in dequantized(weights).items()})


def assert_near(got, want):
    """The tolerance of the Llama models' Numba-vs-reference tests (test_kernels_model.py)."""
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=2e-4 * max(1.0, np.abs(want).max()))


@given(family_configs(), seeds, st.integers(1, 40), st.one_of(st.none(), st.integers(1, 30)))
@settings(max_examples=60, deadline=None)
def test_logits_match_the_numpy_model(config, seed, T, capacity):
    weights = family_weights(config, seed)
    fast, ref = NumbaTransformer(config, weights), reference(config, weights)
    tokens = np.random.default_rng(seed).integers(0, config.vocab_size, T)
    assert_near(fast.logits(tokens, cache=fast.new_cache(capacity)), ref.logits(tokens, cache=ref.new_cache(capacity)))


@given(family_configs(), seeds, st.integers(1, 30), st.one_of(st.none(), st.integers(1, 20)))
@settings(max_examples=25, deadline=None)
def test_weights_in_file_types_match_the_numpy_model(config, seed, T, capacity):
    """NumbaTransformer on matrices kept as F16 blocks ( the experts' 3-D tensors as float32) against the reference
    on the same values."""
    weights = stored_as(family_weights(config, seed), "F16")
    fast, ref = NumbaTransformer(config, weights), reference(config, weights)
    tokens = np.random.default_rng(seed).integers(0, config.vocab_size, T)
    assert_near(fast.logits(tokens, cache=fast.new_cache(capacity)), ref.logits(tokens, cache=ref.new_cache(capacity)))


@given(family_configs(), seeds, st.integers(1, 30), st.one_of(st.none(), st.integers(1, 20)),
       st.lists(st.integers(1, 9), min_size=1, max_size=5), st.booleans())
@settings(max_examples=30, deadline=None)
def test_prefill_equals_decode_bit_for_bit(config, seed, T, capacity, chunk_sizes, in_file_types):
    """Every option keeps the float32 panels' promise: a prefill, one-token steps and chunks give the same bits
    (experts: each token adds its experts in the same order, whatever the call's tokens). Weights in file types
    keep theirs, as test_numba_quantized.py holds it: one token's products are summed in another order (matvec),
    so they are held to the reference's tolerance."""
    weights = family_weights(config, seed)
    fast = NumbaTransformer(config, stored_as(weights, "F16") if in_file_types else weights)
    tokens = np.random.default_rng(seed).integers(0, config.vocab_size, T)
    prefill = fast.logits(tokens, cache=fast.new_cache(capacity))
    one_by_one, chunked = fast.new_cache(capacity), fast.new_cache(capacity)
    decoded = np.concatenate([fast.logits(tokens[t:t + 1], [t], one_by_one) for t in range(T)])
    pieces, start = [], 0
    for size in chunk_sizes * T:
        if start >= T:
            break
        pieces.append(fast.logits(tokens[start:start + size], np.arange(start, min(start + size, T)), chunked))
        start += size
    same = assert_near if in_file_types else np.testing.assert_array_equal
    same(decoded, prefill)
    same(np.concatenate(pieces), prefill)


@given(family_configs(experts=st.just(4)), seeds, st.integers(2, 4), st.integers(1, 8))
@settings(max_examples=15, deadline=None)
def test_a_ragged_batch_equals_each_sequence_alone(config, seed, B, prompt):
    """Prompts of several sequences in one call (experts grouped over all their tokens) give each its own logits."""
    fast = NumbaTransformer(config, family_weights(config, seed))
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, prompt + 1, B)
    seqs = [rng.integers(0, config.vocab_size, n) for n in lengths]
    h = fast.lm_head(fast.forward(np.concatenate(seqs), np.concatenate([np.arange(n) for n in lengths]),
                                  fast.new_cache(16, slots=B), np.repeat(np.arange(B), lengths)))
    ends = np.cumsum(lengths)
    for b in range(B):
        np.testing.assert_array_equal(h[ends[b] - lengths[b]:ends[b]], fast.logits(seqs[b], cache=fast.new_cache(16)))


def test_every_option_is_declared():
    """The Numba backend runs what the reference runs (check_runs refuses nothing)."""
    assert NumbaTransformer.FEATURES == Transformer.FEATURES


# ---------------------------------------------------------------------------------------------------------------
# Real families' checkpoints

FIXTURES = Path(__file__).parent / "fixtures"
FAMILIES = ["gemma2", "gemma3", "phi3", "phi3_short", "qwen3", "qwen3_moe", "qwen3_moe_unnormed", "mixtral", "olmo2",
            "granite", "qwen2_yarn", "llama_dynamic", "phi3_partial", "smollm3_nope", "phi3_partial_longrope",
            "smollm3_yarn"]
CONVERTED = sorted((FIXTURES / "gguf_arch").glob("*.gguf"))


@pytest.mark.parametrize("name", FAMILIES)
def test_numba_logits_match_transformers(name):
    """Each family's tiny transformers checkpoint on the Numba backend, with a context of exactly the sequence
    (longrope picks its factors by the context), as test_families.py holds the reference to it."""
    reference = np.load(FIXTURES / "hf" / name / "reference.npz")
    llm = npllm.load(FIXTURES / "hf" / name, backend="numba", context=len(reference["tokens"]))
    assert type(llm.model).__name__ == "NumbaTransformer"
    got = llm.model.logits(reference["tokens"])
    assert np.abs(got - reference["logits"]).max() < 1e-4


@pytest.mark.skipif(not CONVERTED, reason="no tests/fixtures/gguf_arch/*.gguf (made by llama.cpp's converter)")
@pytest.mark.parametrize("path", CONVERTED, ids=[p.stem for p in CONVERTED])
def test_numba_runs_llama_cpps_conversions_as_the_reference_does(path):
    """llama.cpp's conversions of the same fixtures: the Numba backend's logits are the NumPy backend's (which
    test_formats_gguf_families.py holds to transformers' within 1e-4)."""
    config, weights = read_checkpoint(path)
    tokens = np.load(FIXTURES / "hf" / path.stem / "reference.npz")["tokens"]
    config = config.replace(max_seq_len=len(tokens))  # the context transformers chose longrope's factors by
    fast, ref = make_model(config, weights, backend="numba"), make_model(config, weights, backend="numpy")
    assert np.abs(fast.logits(tokens) - ref.logits(tokens)).max() < 1e-4


@pytest.mark.parametrize("name, types", [
    ("qwen3moe", {"w1_exps": "F16", "w2_exps": "F16", "w3_exps": "F16", "router": "F16"}),
    ("mixtral", {"w1_exps": "Q4_0", "w2_exps": "Q8_0", "w3_exps": "Q4_0"}),
    ("granitemoe", {"w1_exps": "Q8_0", "w2_exps": "Q4_1", "w3_exps": "Q5_0"}),
])
def test_experts_kept_as_stacks_of_blocks(tmp_path, name, types):
    """A GGUF file's 3-D expert tensors in their block types (QuantizedMatrix [E, Fe, D]) run on
    the Numba model, each expert's matrix read from the pool as stored: F16 ones (float32 activations) to
    float32 rounding of the reference on the same values, block types within their 8-bit activations' rounding
    (test_numba_quantized.py's bound)."""
    write_family(tmp_path / "m.gguf", name, types)
    config, weights = read_checkpoint(tmp_path / "m.gguf")
    fast = make_model(config, weights, backend="numba")
    assert isinstance(fast, NumbaTransformer) and set(types.values()) <= set(fast.weight_types)
    tokens = np.random.default_rng(7).integers(0, config.vocab_size, 20)
    want = make_model(config, weights, backend="numpy").logits(tokens)
    got = fast.logits(tokens)
    scale = np.abs(want).max()
    if set(types.values()) == {"F16"}:
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5 * scale)
    else:
        np.testing.assert_allclose(got, want, rtol=0, atol=0.03 * scale)
        assert np.abs(got - want).mean() < 5e-3 * scale


def test_a_decode_step_reads_the_experts_a_token_uses():
    """weight_bytes (what bench divides by a step's time) counts k of the E experts' matrices, not all of them."""
    base = dict(dim=32, hidden_dim=48, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=40, max_seq_len=16)
    dense = NumbaTransformer(ModelConfig(**base), family_weights(ModelConfig(**base), 0))
    moe_config = ModelConfig(**base, n_experts=4, n_experts_used=1)
    moe = NumbaTransformer(moe_config, family_weights(moe_config, 0))
    assert moe.weight_bytes == dense.weight_bytes + 4 * moe_config.n_layers * moe_config.n_experts * moe_config.dim
