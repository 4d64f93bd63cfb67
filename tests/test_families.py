"""The other model families (Gemma 2/3, Phi-3, Qwen3, Qwen3-MoE, Mixtral, OLMo 2, Granite; the long-context RoPE
variants YaRN, dynamic NTK, partial rotary and NoPE layers, whose own laws are in test_long_rope.py): the laws of the
ops they add, and the end-to-end acceptance on tiny random-weight checkpoints that transformers made and computed
(scripts/fixtures/make_arch_fixtures.py): npllm's logits within 1e-4 of transformers' over sequences longer than
the sliding windows, and greedy generation identical for 32 tokens."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import npllm
from npllm import ops
from npllm.config import ModelConfig
from npllm.errors import ConfigError
from npllm.formats.hf import read_hf, to_interleaved
from npllm.models import make_model
from npllm.models.reference import Transformer
from npllm.tensors import expected_shapes
from test_formats_hf import load_reference  # the same fixture folder: tokens, transformers' logits, greedy run

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
FAMILIES = ["gemma2", "gemma3", "phi3", "phi3_short", "qwen3", "qwen3_moe", "qwen3_moe_unnormed", "mixtral", "olmo2",
            "granite", "qwen2_yarn", "llama_dynamic", "phi3_partial", "smollm3_nope", "phi3_partial_longrope",
            "smollm3_yarn"]
# transformers' generate() re-bases dynamic NTK at every step past the original context (keys cached with the base
# of their own step); npllm takes one base from its context, which matches one forward over a whole prompt only
GREEDY = [name for name in FAMILIES if name != "llama_dynamic"]
seeds = st.integers(0, 2**32 - 1)


# --------------------------------------------------------------------------------------------------------------
# Laws of the new ops


@given(seeds, st.floats(0.5, 50.0))
def test_softcap_is_an_odd_monotone_squash_into_the_cap(seed, cap):
    x = np.sort(np.random.default_rng(seed).normal(0, 3 * cap, 200))
    y = ops.softcap(x, cap)
    assert np.all(np.abs(y) < cap + 1e-9) and np.all(np.diff(y) >= 0)
    np.testing.assert_allclose(ops.softcap(-x, cap), -y)
    small = np.abs(x) < cap / 100  # ~identity near 0: tanh(u) = u - u^3/3 + ...
    np.testing.assert_allclose(y[small], x[small], rtol=1e-4)
    assert ops.softcap(x, 0.0) is x  # cap 0: off


@given(seeds)
def test_gelu_tanh_is_within_its_approximation_of_the_exact_gelu(seed):
    x = np.random.default_rng(seed).normal(0, 3, 100)
    exact = np.array([v * 0.5 * (1 + math.erf(v / math.sqrt(2))) for v in x])  # x Phi(x)
    assert np.abs(ops.gelu_tanh(x) - exact).max() < 2e-3  # the tanh form's known error is below 1e-3 or so


@settings(deadline=None, max_examples=30)
@given(seeds, st.integers(1, 8), st.integers(2, 8), st.data(), st.booleans())
def test_routed_ffn_is_the_dense_sum_with_weights_zero_outside_the_top_k(seed, T, E, data, normalize):
    """MoE law: sum over chosen experts == sum over *all* experts, each weighted by its router probability (or
    renormalised share) where chosen and by 0 elsewhere."""
    k = data.draw(st.integers(1, E))
    rng = np.random.default_rng(seed)
    D, F = 8, 6
    x, router = rng.normal(size=(T, D)), rng.normal(size=(E, D))
    w1, w2, w3 = rng.normal(size=(E, F, D)), rng.normal(size=(E, D, F)), rng.normal(size=(E, F, D))
    chosen, weights = ops.route(x, router, k, normalize)
    p = ops.softmax(x @ router.T)  # [T, E]
    dense_weights = np.zeros((T, E))
    np.put_along_axis(dense_weights, chosen, np.take_along_axis(p, chosen, -1), -1)
    if normalize:
        dense_weights /= dense_weights.sum(-1, keepdims=True)
    dense = sum(dense_weights[:, e, None] * ops.swiglu(x, w1[e], w2[e], w3[e]) for e in range(E))
    np.testing.assert_allclose(ops.moe_ffn(x, chosen, weights, w1, w2, w3), dense, rtol=1e-10, atol=1e-10)
    # the chosen are the k most probable, and no other expert is more probable than a chosen one
    assert np.all(np.take_along_axis(p, chosen, -1).min(-1) >= np.sort(p, -1)[:, E - k])
    if normalize:
        np.testing.assert_allclose(weights.sum(-1), 1.0)


def test_features_name_what_a_config_uses_and_backends_refuse_what_they_lack():
    base = dict(dim=32, hidden_dim=32, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=32, max_seq_len=16)
    assert ModelConfig(**base).features == frozenset()
    c = ModelConfig(**base, qk_norm="head", attn_logit_softcap=30.0, sliding_window=4, sliding_layers=(True, False))
    assert c.features == {"qk_norm", "attn_logit_softcap", "sliding_layers"}
    assert [c.is_sliding(l) for l in range(2)] == [True, False]
    weights = {name: np.ones(shape, np.float32) for name, shape in expected_shapes(c).items()}
    assert make_model(c, weights, backend="numpy").config is c
    from npllm.models.base import check_runs
    from npllm.models.cuda import CudaTransformer

    moe = ModelConfig(**base, n_experts=4, n_experts_used=2)
    check_runs(CudaTransformer, c)  # every family's options run on the GPU
    check_runs(CudaTransformer, moe)

    class LlamaOnly(CudaTransformer):
        FEATURES = CudaTransformer.FEATURES - {"n_experts", "qk_norm"}

    with pytest.raises(ConfigError, match="cuda backend does not run n_experts, qk_norm"):
        check_runs(LlamaOnly, moe.replace(qk_norm="head"))


def test_bad_feature_values_are_config_errors():
    base = dict(dim=32, hidden_dim=32, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=32, max_seq_len=16)
    for change, fragment in [({"ffn_activation": "relu"}, "ffn_activation"), ({"block_norms": "middle"}, "block_norms"),
                             ({"sliding_layers": (True,)}, "each of the 2 layers"),
                             ({"sliding_layers": (True, False)}, "sliding_window is not set"),
                             ({"n_experts": 4, "n_experts_used": 5}, "n_experts_used"),
                             ({"residual_multiplier": 0.0}, "residual_multiplier")]:
        with pytest.raises(ConfigError, match=fragment):
            ModelConfig(**base, **change)


# --------------------------------------------------------------------------------------------------------------
# Against transformers


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_match_transformers(name):
    tokens, expected, _ = load_reference(name)
    # a context of exactly the sequence: longrope picks its factors by the context the model runs with, as
    # transformers does by the sequence's length
    llm = npllm.load(FIXTURES / name, backend="numpy", context=len(tokens))
    got = llm.model.logits(tokens)
    assert np.abs(got - expected).max() < 1e-4


@pytest.mark.parametrize("name", GREEDY)
def test_greedy_32_tokens_match_transformers_generate(name):
    _, _, greedy = load_reference(name)
    # transformers chose longrope's factors by the length of each call: past the original context for phi3's
    # prompt, within it for phi3_short's whole run; a context of the run's length chooses the same
    llm = npllm.load(FIXTURES / name, backend="numpy", context=len(greedy["prompt_ids"]) + 32)
    got = list(llm.generate_ids(greedy["prompt_ids"], max_new_tokens=32, temperature=0))
    assert got == greedy["generated_ids"]


@pytest.mark.parametrize("name", ["gemma3", "qwen3", "olmo2"])
def test_q_k_norms_follow_the_rope_layout(name):
    """Permuting q/k rows into the interleaved layout permutes their norm gains the same way: same logits."""
    tokens, expected, _ = load_reference(name)
    config, weights = read_hf(FIXTURES / name)
    inter_config, inter_weights = to_interleaved(config, weights)
    got = Transformer(inter_config, inter_weights).logits(tokens, cache=None)
    assert np.abs(got - expected).max() < 1e-4


def test_gemma3_multimodal_checkpoint_reads_as_its_language_model(tmp_path):
    """Gemma 3 4B and up ship as Gemma3ForConditionalGeneration: config.json nests the text model's config and the
    parameters carry a language-model prefix beside an image tower. Rewritten so, the text fixture computes the same
    logits; the image tower's tensors are skipped."""
    from npllm.formats.safetensors import read_safetensors
    from test_formats_safetensors import encode

    source = FIXTURES / "gemma3"
    config = json.loads((source / "config.json").read_text())
    outer = {"model_type": "gemma3", "text_config": {k: v for k, v in config.items() if k != "eos_token_id"},
             "eos_token_id": config["eos_token_id"], "architectures": ["Gemma3ForConditionalGeneration"]}
    _, tensors = read_safetensors(source / "model.safetensors")
    renamed = {name.replace("model.", "model.language_model.", 1): ("F32", np.asarray(a, np.float32))
               for name, a in tensors.items()}
    renamed["model.vision_tower.vision_model.embeddings.patch_embedding.weight"] = ("F32", np.ones((2, 3), np.float32))
    (tmp_path / "config.json").write_text(json.dumps(outer))
    (tmp_path / "model.safetensors").write_bytes(encode(renamed))
    (tmp_path / "tokenizer.json").write_bytes((source / "tokenizer.json").read_bytes())
    tokens, expected, _ = load_reference("gemma3")
    llm = npllm.load(tmp_path, backend="numpy", context=len(tokens))
    assert llm.model.config.arch == "gemma3_text" and llm.model.config.eos_ids == tuple(np.atleast_1d(config["eos_token_id"]))
    got = llm.model.logits(tokens)
    assert np.abs(got - expected).max() < 1e-4


def test_the_context_a_model_runs_with_chooses_longrope_factors_and_is_checked():
    """npllm.load(context=N): the KV caches hold N positions, and Phi-3 takes its short factors within the original
    context, its long ones past it (llama.cpp's -c rule); a context that is no positive count is a ConfigError."""
    short = npllm.load(FIXTURES / "phi3_short", backend="numpy", context=24)
    long = npllm.load(FIXTURES / "phi3_short", backend="numpy")
    scaling = short.model.config.rope_scaling
    assert short.model.config.max_seq_len == 24 and short.model.new_cache().capacity == 24
    assert long.model.config.max_seq_len > scaling.original_max_position_embeddings >= 24
    inv = ops.rope_inv_freq(short.model.config.head_dim, short.model.config.rope_theta)
    np.testing.assert_allclose(short.model.rope_frequencies()[0], inv / np.array(scaling.short_factor))
    np.testing.assert_allclose(long.model.rope_frequencies()[0], inv / np.array(scaling.long_factor))
    for bad in (0, -5, 2.5, True):
        with pytest.raises(ConfigError, match="context"):
            npllm.load(FIXTURES / "phi3_short", backend="numpy", context=bad)
