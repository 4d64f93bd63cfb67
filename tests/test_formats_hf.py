"""Hugging Face checkpoints: config.json mapping, weight names, RoPE layouts, bad checkpoints, and the end-to-end
acceptance: npllm's logits within 1e-4 of transformers' and greedy generation identical for 32 tokens, on tiny
random-weight fixtures made by scripts/fixtures/make_hf_fixtures.py (the references were computed by transformers)."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import npllm
from npllm.config import RopeScaling
from npllm.errors import ConfigError, FormatError
from npllm.formats import read_checkpoint
from npllm.formats.hf import config_from_hf, read_hf, to_interleaved
from npllm.models.reference import Transformer
from npllm.tensors import permute_qk_half_to_interleaved, permute_qk_interleaved_to_half
from test_formats_safetensors import encode

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
NAMES = ["llama_gqa", "llama3_tied", "mistral_window", "qwen2_bias", "llama_bf16", "llama_sharded"]

LLAMA = {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320, "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
}


# --------------------------------------------------------------------------------------------------------------
# config.json -> ModelConfig


def test_llama_config_maps_every_field():
    c = config_from_hf({**LLAMA, "rope_theta": 5e5, "tie_word_embeddings": True, "head_dim": 32})
    assert (c.dim, c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads) == (64, 96, 2, 4, 2)
    assert (c.vocab_size, c.max_seq_len, c.head_dim, c.norm_eps, c.rope_theta) == (320, 128, 32, 1e-5, 5e5)
    assert c.tied_embeddings and not c.attention_bias and c.sliding_window is None and c.rope_scaling is None
    assert (c.bos_id, c.eos_ids, c.arch, c.rope_layout) == (1, (2,), "llama", "half")


def test_defaults_kv_heads_head_dim_theta_tie():
    cfg = {k: v for k, v in LLAMA.items() if k != "num_key_value_heads"}
    c = config_from_hf(cfg)
    assert c.n_kv_heads == 4 and c.head_dim == 16 and c.rope_theta == 10000.0 and not c.tied_embeddings


@pytest.mark.parametrize("spelling", ["rope_scaling:type", "rope_scaling:rope_type", "rope_parameters"])
def test_llama3_scaling_in_every_spelling(spelling):
    params = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    key, _, type_key = spelling.partition(":")
    if key == "rope_parameters":
        cfg = {**LLAMA, "rope_parameters": {**params, "rope_type": "llama3", "rope_theta": 5e5}}
    else:
        cfg = {**LLAMA, "rope_theta": 5e5, "rope_scaling": {**params, type_key: "llama3"}}
    c = config_from_hf(cfg)
    assert c.rope_theta == 5e5
    assert c.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 64)


def test_linear_scaling_and_default_type():
    assert config_from_hf({**LLAMA, "rope_scaling": {"type": "linear", "factor": 2}}).rope_scaling == \
        RopeScaling("linear", 2.0)
    assert config_from_hf({**LLAMA, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}).rope_scaling \
        is None


def test_eos_int_or_list_and_missing_bos():
    assert config_from_hf({**LLAMA, "eos_token_id": [128001, 128008, 128009]}).eos_ids == (128001, 128008, 128009)
    c = config_from_hf({**LLAMA, "bos_token_id": None, "eos_token_id": 7})
    assert c.bos_id == 7 and c.eos_ids == (7,)


def test_mistral_window_and_qwen2_bias():
    m = config_from_hf({**LLAMA, "model_type": "mistral", "sliding_window": 16})
    assert m.sliding_window == 16 and m.arch == "mistral" and not m.attention_bias
    q = config_from_hf({**LLAMA, "model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False,
                        "max_window_layers": 28})
    assert q.attention_bias and q.sliding_window is None and q.arch == "qwen2"
    q = config_from_hf({**LLAMA, "model_type": "qwen2", "sliding_window": 32, "use_sliding_window": True,
                        "max_window_layers": 0})
    assert q.sliding_window == 32
    assert config_from_hf({**LLAMA, "sliding_window": 16}).sliding_window is None  # llama has no window
    # Qwen2 slides from max_window_layers on: the layers before it attend to everything
    q = config_from_hf({**LLAMA, "num_hidden_layers": 3, "model_type": "qwen2", "sliding_window": 8,
                        "use_sliding_window": True, "max_window_layers": 1})
    assert q.sliding_window == 8 and q.sliding_layers == (False, True, True)
    assert [q.is_sliding(l) for l in range(3)] == [False, True, True]


@pytest.mark.parametrize("change, fragment", [
    ({"model_type": "gpt2"}, "model_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_hidden_layers": None}, "num_hidden_layers"),
    ({"hidden_size": "64"}, "hidden_size"),
    ({"rms_norm_eps": None}, "rms_norm_eps"),
    ({"eos_token_id": []}, "eos_token_id"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
    ({"rope_scaling": {"type": "mrope", "factor": 4}}, "mrope"),
    ({"rope_scaling": {"type": "yarn", "factor": 4, "beta_fast": 1, "beta_slow": 2}}, "beta_slow < beta_fast"),
    ({"rope_scaling": {"type": "llama3", "factor": 8}}, "low_freq_factor"),
    ({"rope_theta": 1e4, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}, "disagrees"),
    ({"num_attention_heads": 5}, "divisible"),
    ({"num_key_value_heads": 3}, "multiple"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"model_type": "mistral", "layer_types": ["sliding_attention", "chunked_attention"], "sliding_window": 8},
     "unknown layer types"),
    ({"model_type": "gemma2", "hidden_act": "gelu_pytorch_tanh", "query_pre_attn_scalar": 16,
      "layer_types": ["sliding_attention", "full_attention"]}, "sliding_window"),
    ({"model_type": "gemma2", "query_pre_attn_scalar": 16}, "hidden_act 'silu'"),
    ({"partial_rotary_factor": 0.3}, "partial_rotary_factor"),
    ({"model_type": "phi3", "rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]},
      "original_max_position_embeddings": 64}, "rotated dims / 2"),
    ({"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
      "mlp_only_layers": [0]}, "mlp_only_layers"),
    ({"model_type": "mixtral", "num_local_experts": 2, "num_experts_per_tok": 3}, "n_experts_used"),
    ({"model_type": "mistral", "layer_types": ["full_attention"]}, "layer_types"),
])
def test_bad_configs_are_config_errors(change, fragment):
    cfg = {**LLAMA, **change}
    cfg = {k: v for k, v in cfg.items() if v is not None}
    with pytest.raises(ConfigError, match=fragment):
        config_from_hf(cfg, "config.json")


# --------------------------------------------------------------------------------------------------------------
# RoPE layouts


@given(heads=st.integers(1, 4), half=st.integers(1, 8), cols=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_permutes_are_inverse_permutations(heads, half, cols, seed):
    dh = 2 * half
    shape = (heads * dh,) + ((cols,) if cols else ())
    w = np.random.default_rng(seed).standard_normal(shape)
    p = permute_qk_half_to_interleaved(w, heads, dh)
    assert sorted(p.ravel()) == sorted(w.ravel())
    np.testing.assert_array_equal(permute_qk_interleaved_to_half(p, heads, dh), w)
    np.testing.assert_array_equal(permute_qk_half_to_interleaved(permute_qk_interleaved_to_half(w, heads, dh),
                                                                 heads, dh), w)


def rotate_half(x, pos, theta=10000.0):
    """HF's rotation written out: dimension i pairs with i + Dh/2."""
    dh = x.shape[-1]
    inv = theta ** (-np.arange(dh // 2) * 2 / dh)
    a = pos * inv
    x1, x2 = x[: dh // 2], x[dh // 2:]
    return np.concatenate([x1 * np.cos(a) - x2 * np.sin(a), x2 * np.cos(a) + x1 * np.sin(a)])


def rotate_interleaved(x, pos, theta=10000.0):
    """Meta's rotation written out: dimensions (2i, 2i+1) form a pair."""
    dh = x.shape[-1]
    inv = theta ** (-np.arange(dh // 2) * 2 / dh)
    a = pos * inv
    out = np.empty_like(x)
    out[0::2] = x[0::2] * np.cos(a) - x[1::2] * np.sin(a)
    out[1::2] = x[1::2] * np.cos(a) + x[0::2] * np.sin(a)
    return out


@given(seed=st.integers(0, 2**16), pos=st.integers(0, 500))
def test_permuted_projection_under_interleaved_rope_equals_half_rope(seed, pos):
    """Per head: rotate_interleaved(P w x) == P rotate_half(w x), so attention scores agree between layouts."""
    rng = np.random.default_rng(seed)
    heads, dh, d = 2, 8, 5
    w, x = rng.standard_normal((heads * dh, d)), rng.standard_normal(d)
    half_out = (w @ x).reshape(heads, dh)
    inter_out = (permute_qk_half_to_interleaved(w, heads, dh) @ x).reshape(heads, dh)
    for h in range(heads):
        expect = permute_qk_half_to_interleaved(rotate_half(half_out[h], pos), 1, dh)
        np.testing.assert_allclose(rotate_interleaved(inter_out[h], pos), expect, atol=1e-12)


def test_permute_rejects_bad_shapes():
    with pytest.raises(ConfigError):
        permute_qk_half_to_interleaved(np.zeros((10, 4)), 2, 4)
    with pytest.raises(ConfigError):
        permute_qk_half_to_interleaved(np.zeros((6, 4)), 2, 3)


# --------------------------------------------------------------------------------------------------------------
# Fixtures: configs, weights, logits, greedy generation


def test_fixture_configs():
    cfgs = {name: read_hf(FIXTURES / name)[0] for name in NAMES}
    assert cfgs["llama3_tied"].rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    assert cfgs["llama3_tied"].tied_embeddings and cfgs["llama3_tied"].rope_theta == 5e5
    assert cfgs["mistral_window"].sliding_window == 16
    assert cfgs["qwen2_bias"].attention_bias and cfgs["qwen2_bias"].rope_theta == 1e6
    assert all(c.rope_layout == "half" and c.n_kv_heads < c.n_heads for n, c in cfgs.items() if n != "llama_sharded")


def test_tied_checkpoint_has_no_output_and_bf16_widens_exactly():
    _, tied = read_hf(FIXTURES / "llama3_tied")
    assert "output" not in tied
    _, w = read_hf(FIXTURES / "llama_bf16")
    for array in w.values():  # widened bf16: the low 16 bits of every float32 are zero
        assert array.dtype == np.float32 and not np.any(array.view(np.uint32) & 0xFFFF)


def test_sharded_checkpoint_reads_every_shard():
    shards = sorted((FIXTURES / "llama_sharded").glob("model-*.safetensors"))
    assert len(shards) > 1
    config, w = read_checkpoint(FIXTURES / "llama_sharded" / "model.safetensors.index.json")
    assert len(w) == 2 + 1 + 9 * config.n_layers


def load_reference(name):
    ref = np.load(FIXTURES / name / "reference.npz")
    greedy = json.loads((FIXTURES / name / "greedy.json").read_text())
    return ref["tokens"], ref["logits"], greedy


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(name):
    tokens, expected, _ = load_reference(name)
    llm = npllm.load(FIXTURES / name)
    got = llm.logits(tokens)
    assert got.shape == expected.shape
    assert np.abs(got - expected).max() < 1e-4


@pytest.mark.parametrize("name", NAMES)
def test_greedy_32_tokens_match_transformers_generate(name):
    _, _, greedy = load_reference(name)
    llm = npllm.load(FIXTURES / name)
    assert llm.tokenizer.encode(greedy["prompt"]) == greedy["prompt_ids"]  # tokenizer.json found beside weights
    got = list(llm.generate_ids(greedy["prompt_ids"], max_new_tokens=32, temperature=0))
    assert got == greedy["generated_ids"]


@pytest.mark.parametrize("name", ["llama3_tied", "qwen2_bias"])
def test_both_rope_layouts_give_the_same_logits(name):
    tokens, expected, _ = load_reference(name)
    config, weights = read_hf(FIXTURES / name)
    inter_config, inter_weights = to_interleaved(config, weights)
    assert inter_config.rope_layout == "interleaved"
    assert not np.array_equal(inter_weights["layers.0.wq"], weights["layers.0.wq"])
    half = Transformer(config, weights).logits(tokens)
    inter = Transformer(inter_config, inter_weights).logits(tokens)
    assert np.abs(half - inter).max() < 1e-4  # float32 sums in another order
    # and the layout matters: interleaved rotation of unpermuted weights is a different model
    wrong = Transformer(inter_config, weights).logits(tokens)
    assert np.abs(wrong - expected).max() > 1e-2


# --------------------------------------------------------------------------------------------------------------
# Bad checkpoints


def copy_fixture(tmp_path, name="llama_gqa") -> Path:
    dest = tmp_path / name
    shutil.copytree(FIXTURES / name, dest)
    return dest


def rewrite_weights(directory: Path, edit) -> None:
    """Re-save model.safetensors after `edit(dict of HF name -> float32 array)`."""
    from npllm.formats.safetensors import read_safetensors

    _, tensors = read_safetensors(directory / "model.safetensors")
    tensors = {k: np.array(v) for k, v in tensors.items()}
    edit(tensors)
    (directory / "model.safetensors").write_bytes(encode({k: ("F32", v) for k, v in tensors.items()}))


def test_missing_tensor(tmp_path):
    d = copy_fixture(tmp_path)
    rewrite_weights(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(FormatError, match=r"missing weight 'layers\.1\.w3'"):
        read_hf(d)


def test_unknown_tensor(tmp_path):
    d = copy_fixture(tmp_path)
    rewrite_weights(d, lambda t: t.__setitem__("model.layers.0.self_attn.o_proj.bias", np.zeros(64, np.float32)))
    with pytest.raises(FormatError, match="o_proj.bias"):
        read_hf(d)


def test_wrong_vocab_size(tmp_path):
    d = copy_fixture(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["vocab_size"] = 321
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FormatError, match="vocabulary size"):
        read_hf(d)


def test_wrong_layer_count(tmp_path):
    d = copy_fixture(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] = 1
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FormatError, match="layers.1"):
        read_hf(d)


def test_missing_config_and_missing_weights(tmp_path):
    d = copy_fixture(tmp_path)
    (d / "config.json").unlink()
    with pytest.raises(FormatError, match="config.json"):
        read_hf(d)
    d = copy_fixture(tmp_path, "llama3_tied")
    (d / "model.safetensors").unlink()
    with pytest.raises(FormatError, match="no model.safetensors"):
        read_hf(d)


def test_sharded_index_problems(tmp_path):
    d = copy_fixture(tmp_path, "llama_sharded")
    shard = sorted(d.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(FormatError, match="listed but not present"):
        read_hf(d)
    d = copy_fixture(tmp_path / "b", "llama_sharded")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = "model-00001-of-00005.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FormatError, match="no shard holds it"):
        read_hf(d)
    index["weight_map"] = {"a": "../elsewhere.safetensors"}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FormatError, match="plain file name"):
        read_hf(d)


def test_bad_config_json(tmp_path):
    d = copy_fixture(tmp_path)
    (d / "config.json").write_text("{not json")
    with pytest.raises(FormatError, match="cannot read as JSON"):
        read_hf(d)
