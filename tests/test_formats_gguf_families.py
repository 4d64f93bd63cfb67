"""GGUF files of the other families (issue 43): files written here as llama.cpp's converter writes them (its metadata
keys and tensor names, spelled out below from llama.cpp's src/llama-arch.cpp rather than taken from the reader under
test; fused tensors fused, norms stored as the gains applied), with random weights. Each must give (a) the config
the model was built with and (b) the logits of the same model built directly from canonical names.

Then llama.cpp's own conversions of the transformers fixtures (tests/fixtures/gguf_arch/<family>.gguf, made by
convert_hf_to_gguf.py from tests/fixtures/hf/<family>/) reproduce transformers' logits (reference.npz) within 1e-4.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest

from npllm.config import ModelConfig, RopeScaling
from npllm.errors import ConfigError, FormatError
from npllm.formats import read_checkpoint
from npllm.formats.gguf import config_from_gguf, read_gguf_file
from npllm.formats.gguf_write import TensorData, write_gguf_file
from npllm.formats.random import random_weights
from npllm.models import make_model
from npllm.quant import QuantizedMatrix, quantize

FIXTURES = Path(__file__).parent / "fixtures"

# llama.cpp's tensor names (src/llama-arch.cpp), after "blk.{l}." for a layer's
LAYER = {"attention_norm": "attn_norm.weight", "wq": "attn_q.weight", "wk": "attn_k.weight", "wv": "attn_v.weight",
         "wo": "attn_output.weight", "bq": "attn_q.bias", "bk": "attn_k.bias", "bv": "attn_v.bias",
         "ffn_norm": "ffn_norm.weight", "w1": "ffn_gate.weight", "w2": "ffn_down.weight", "w3": "ffn_up.weight",
         "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight",
         "post_attention_norm": "post_attention_norm.weight", "post_ffn_norm": "post_ffw_norm.weight",
         "router": "ffn_gate_inp.weight", "w1_exps": "ffn_gate_exps.weight", "w2_exps": "ffn_down_exps.weight",
         "w3_exps": "ffn_up_exps.weight"}
GLOBAL = {"tok_embeddings": "token_embd.weight", "norm": "output_norm.weight", "output": "output.weight"}

BASE = dict(dim=64, hidden_dim=96, n_layers=6, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=128, max_seq_len=64,
            rope_layout="half")
TOKENS = np.random.default_rng(7).integers(0, 128, size=20)  # longer than the windows below (8)
LONGROPE = RopeScaling("longrope", factor=2.0, original_max_position_embeddings=32,
                       short_factor=[1.0, 1.0, 1.25, 1.5, 1.5, 2.0, 2.0, 2.5],
                       long_factor=[1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 8.0], attention_factor=1.125)


def case(name: str) -> tuple[str, ModelConfig, dict]:
    """(general.architecture, the config, the family's own metadata as llama.cpp's converter writes it)."""
    moe = dict(n_experts=4, n_experts_used=2)
    granite = dict(embedding_multiplier=12.0, residual_multiplier=0.25, attention_scale=0.0625, logit_multiplier=0.125)
    granite_keys = {"embedding_scale": 12.0, "residual_scale": 0.25, "attention.scale": 0.0625, "logit_scale": 8.0}
    cases = {
        "gemma2": ("gemma2", dict(ffn_activation="gelu_tanh", block_norms="sandwich", embedding_multiplier=8.0,
                                  attn_logit_softcap=20.0, final_logit_softcap=15.0, sliding_window=8,
                                  sliding_layers=[l % 2 == 0 for l in range(6)], tied_embeddings=True),
                   {"attn_logit_softcapping": 20.0, "final_logit_softcapping": 15.0, "attention.sliding_window": 8}),
        "gemma3": ("gemma3", dict(ffn_activation="gelu_tanh", block_norms="sandwich", embedding_multiplier=8.0,
                                  qk_norm="head", sliding_window=8, sliding_layers=[l % 6 < 5 for l in range(6)],
                                  rope_theta=1e6, rope_local_theta=10000.0, rope_scaling=RopeScaling("linear", 2.0),
                                  tied_embeddings=True),
                   {"attention.sliding_window": 8, "rope.freq_base_swa": 10000.0, "rope.scaling.type": "linear",
                    "rope.scaling.factor": 2.0}),
        "phi3": ("phi3", dict(rope_scaling=LONGROPE),
                 {"rope.scaling.original_context_length": 32, "rope.scaling.attn_factor": 1.125,
                  "attention.sliding_window": 0}),
        "qwen3": ("qwen3", dict(qk_norm="head", rope_theta=1e6, tied_embeddings=True), {}),
        "qwen3moe": ("qwen3moe", dict(qk_norm="head", expert_hidden_dim=32, **moe),
                     {"expert_count": 4, "expert_used_count": 2, "expert_feed_forward_length": 32}),
        "mixtral": ("llama", dict(rope_layout="interleaved", **moe), {"expert_count": 4, "expert_used_count": 2}),
        "olmo2": ("olmo2", dict(block_norms="post", qk_norm="projection"), {}),
        "granite": ("granite", dict(rope_layout="interleaved", **granite), granite_keys),
        "granitemoe": ("granitemoe", dict(rope_layout="interleaved", **granite, **moe),
                       granite_keys | {"expert_count": 4, "expert_used_count": 2}),
    }
    arch, options, keys = cases[name]
    npllm_arch = {"qwen3moe": "qwen3_moe"}.get(name, name)
    return arch, ModelConfig(**(BASE | {"arch": npllm_arch} | options)), keys


def metadata(arch: str, config: ModelConfig, keys: dict) -> dict:
    """The keys every llama.cpp architecture has, then the family's."""
    p = arch + "."
    meta = {"general.architecture": arch, p + "context_length": config.max_seq_len, p + "embedding_length": config.dim,
            p + "block_count": config.n_layers, p + "feed_forward_length": config.hidden_dim,
            p + "attention.head_count": config.n_heads, p + "attention.head_count_kv": config.n_kv_heads,
            p + "attention.layer_norm_rms_epsilon": config.norm_eps, p + "rope.freq_base": config.rope_theta,
            p + "attention.key_length": config.head_dim, p + "attention.value_length": config.head_dim,
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}
    return meta | {p + key: value for key, value in keys.items()}


def gguf_tensors(arch: str, config: ModelConfig, weights: dict, types: dict) -> list[TensorData]:
    """llama.cpp's tensors for canonical weights: Phi-3's q/k/v fused into attn_qkv and gate/up into ffn_up, its
    longrope factors as tensors; `types` (canonical short name -> ggml type) for the rest F32."""
    named = {}
    for name, w in weights.items():
        parts = name.split(".")
        named[GLOBAL[name] if len(parts) == 1 else f"blk.{parts[1]}.{LAYER[parts[2]]}"] = (parts[-1], w)
    if arch == "phi3":
        for l in range(config.n_layers):
            q, k, v, gate, up = (named.pop(f"blk.{l}.{LAYER[n]}")[1] for n in ("wq", "wk", "wv", "w1", "w3"))
            named[f"blk.{l}.attn_qkv.weight"] = ("wqkv", np.concatenate([q, k, v]))
            named[f"blk.{l}.ffn_up.weight"] = ("w13", np.concatenate([gate, up]))
        named["rope_factors_long.weight"] = ("", np.array(config.rope_scaling.long_factor, np.float32))
        named["rope_factors_short.weight"] = ("", np.array(config.rope_scaling.short_factor, np.float32))
    out = []
    for gguf_name, (short, w) in named.items():
        kind = types.get(short, "F32")
        out.append(TensorData(gguf_name, w.shape, kind, quantize(np.asarray(w, np.float32), kind)))
    return out


def write_family(path, name: str, types: dict | None = None, seed: int = 0):
    """A GGUF file of family `name` with random weights: (the config, the canonical weights written)."""
    arch, config, keys = case(name)
    weights = random_weights(config, seed)
    write_gguf_file(path, metadata(arch, config, keys), gguf_tensors(arch, config, weights, types or {}))
    return config, weights


FAMILY_NAMES = ["gemma2", "gemma3", "phi3", "qwen3", "qwen3moe", "mixtral", "olmo2", "granite", "granitemoe"]


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_a_family_file_gives_its_config_and_the_canonical_models_logits(tmp_path, name):
    config, weights = write_family(tmp_path / f"{name}.gguf", name)
    read_config, read_weights = read_checkpoint(tmp_path / f"{name}.gguf")
    assert read_config == config
    assert sorted(read_weights) == sorted(weights)
    got = make_model(read_config, read_weights, backend="numpy").logits(TOKENS)
    want = make_model(config, weights, backend="numpy").logits(TOKENS)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name, types", [
    ("qwen3moe", {"w1_exps": "Q8_0", "w2_exps": "Q4_1", "w3_exps": "Q5_0"}),
    ("mixtral", {"w1_exps": "Q4_0", "w2_exps": "Q8_0", "w3_exps": "Q4_0"}),
    ("phi3", {"wqkv": "Q8_0", "w13": "Q8_0", "w2": "Q4_0"}),
])
def test_quantized_experts_and_fused_projections_read_as_their_dequantized_values(tmp_path, name, types):
    """3-D expert tensors in block types stay QuantizedMatrix stacks over the file; fused ones split into views of
    their rows; the NumPy backend computes with exactly the values the blocks hold."""
    config, weights = write_family(tmp_path / "m.gguf", name, types)
    read_config, read_weights = read_checkpoint(tmp_path / "m.gguf")
    blocks = {n: w for n, w in read_weights.items() if isinstance(w, QuantizedMatrix) and w.qtype != "F32"}
    assert blocks and all(w.qtype in types.values() for w in blocks.values())
    dense = {n: np.asarray(w, np.float32) for n, w in read_weights.items()}
    for n, w in blocks.items():  # each within its type's rounding of what was written
        np.testing.assert_allclose(dense[n], weights[n], rtol=0, atol=0.2 * np.abs(weights[n]).max())
    got = make_model(read_config, read_weights, backend="numpy").logits(TOKENS)
    want = make_model(config, dense, backend="numpy").logits(TOKENS)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_projections_fused_by_the_converter_are_split(tmp_path):
    """convert_hf_to_gguf.py --fuse-qkv writes attn_qkv (weight and bias: q, k, v rows in turn) and
    --fuse-gate-up-exps writes ffn_gate_up_exps ([E, 2 Fe, D], gate first), for any family."""
    arch, config, keys = case("qwen3moe")
    config = dataclasses.replace(config, attention_bias=True)
    weights = random_weights(config, seed=3)
    tensors = {t.name: t for t in gguf_tensors(arch, config, weights, {})}
    for l in range(config.n_layers):
        w = {n: weights[f"layers.{l}.{n}"] for n in ("wq", "wk", "wv", "bq", "bk", "bv", "w1_exps", "w3_exps")}
        for name in ("wq", "wk", "wv", "bq", "bk", "bv", "w1_exps", "w3_exps"):
            del tensors[f"blk.{l}.{LAYER[name]}"]
        fused = {"attn_qkv.weight": np.concatenate([w["wq"], w["wk"], w["wv"]]),
                 "attn_qkv.bias": np.concatenate([w["bq"], w["bk"], w["bv"]]),
                 "ffn_gate_up_exps.weight": np.concatenate([w["w1_exps"], w["w3_exps"]], axis=1)}
        for name, array in fused.items():
            tensors[f"blk.{l}.{name}"] = TensorData(f"blk.{l}.{name}", array.shape, "F32", quantize(array, "F32"))
    write_gguf_file(tmp_path / "f.gguf", metadata(arch, config, keys), list(tensors.values()))
    read_config, read_weights = read_checkpoint(tmp_path / "f.gguf")
    assert read_config == config and sorted(read_weights) == sorted(weights)
    for name, w in weights.items():
        np.testing.assert_array_equal(np.asarray(read_weights[name]), w)


def test_a_stack_of_quantized_experts_is_indexed_by_expert_and_a_matrix_by_rows():
    values = np.random.default_rng(1).standard_normal((3, 5, 64)).astype(np.float32)
    stack = QuantizedMatrix.from_values(values, "Q8_0")
    assert stack.shape == (3, 5, 64) and stack.ndim == 3 and stack.size == values.size
    dense = np.asarray(stack)
    assert dense.shape == (3, 5, 64)
    expert = stack[1]
    assert isinstance(expert, QuantizedMatrix) and expert.shape == (5, 64)
    np.testing.assert_array_equal(np.asarray(expert), dense[1])
    x = np.ones((2, 64), np.float32)
    np.testing.assert_allclose(x @ expert.T, x @ dense[1].T, rtol=1e-6)
    rows = expert[1:4]
    assert isinstance(rows, QuantizedMatrix) and rows.shape == (3, 64)
    np.testing.assert_array_equal(np.asarray(rows), dense[1, 1:4])
    with pytest.raises(ValueError, match="one expert"):
        stack[0:2]
    with pytest.raises(ValueError, match="stack of 3"):
        x @ stack.T


def test_weight_dtype_q8_0_rounds_expert_stacks_too():
    """make_model's weight_dtype="q8_0" stores every matrix as Q8_0 blocks, a stack of experts included (one
    QuantizedMatrix [E, Fe, D]); the NumPy backend then computes with exactly those values."""
    from npllm.models import storage

    config = case("qwen3moe")[1]
    weights = random_weights(config, seed=5)
    stored = storage(weights, "q8_0", "numba").weights
    stack = stored["layers.0.w1_exps"]
    assert isinstance(stack, QuantizedMatrix) and stack.qtype == "Q8_0" and stack.shape == (4, 32, 64)
    dense = {n: np.asarray(w, np.float32) for n, w in stored.items()}
    got = make_model(config, weights, backend="numpy", weight_dtype="q8_0").logits(TOKENS)
    np.testing.assert_allclose(got, make_model(config, dense, backend="numpy").logits(TOKENS), rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# What llama.cpp assumes when a key is absent, and what npllm refuses


def header(path, arch: str, keys: dict, n_layers: int = 6, tensors: dict | None = None):
    """The config of a file holding only the header (and a token_embd, which sizes the vocabulary)."""
    config = dataclasses.replace(case("qwen3")[1], n_layers=n_layers)
    extra = [TensorData(n, w.shape, "F32", quantize(w, "F32")) for n, w in (tensors or {}).items()]
    embd = np.zeros((128, 64), np.float32)
    write_gguf_file(path, metadata(arch, config, keys),
                    [TensorData("token_embd.weight", embd.shape, "F32", quantize(embd, "F32"))] + extra)
    return config_from_gguf(read_gguf_file(path))


def test_gemma2_defaults_are_llama_cpps(tmp_path):
    """No soft-cap or window keys: 50 and 30, a window of 4096 on the even layers; 46 layers are the 27B model,
    whose queries llama.cpp scales by 1/sqrt(D / H) instead of 1/sqrt(Dh)."""
    c = header(tmp_path / "g.gguf", "gemma2", {})
    assert (c.attn_logit_softcap, c.final_logit_softcap, c.sliding_window) == (50.0, 30.0, 4096)
    assert c.sliding_layers == (True, False) * 3 and c.attention_scale == 0.0
    big = header(tmp_path / "g27.gguf", "gemma2", {}, n_layers=46)
    assert big.attention_scale == 1 / math.sqrt(64 // 4)


def test_gemma3_slides_only_with_a_window_five_layers_in_six_with_a_local_base(tmp_path):
    assert header(tmp_path / "a.gguf", "gemma3", {}).sliding_window is None
    c = header(tmp_path / "b.gguf", "gemma3", {"attention.sliding_window": 16}, n_layers=12)
    assert c.sliding_layers == ((True,) * 5 + (False,)) * 2 and c.rope_local_theta == 10000.0
    assert c.final_logit_softcap == 0.0 and c.attn_logit_softcap == 0.0 and c.qk_norm == "head"


@pytest.mark.parametrize("pattern, expected", [
    (np.array([True, False, True, True, False, False]), (True, False, True, True, False, False)),
    (3, (True, True, False, True, True, False)),
    (0, ()),
])
def test_a_sliding_window_pattern_key_is_a_flag_per_layer_or_a_period(tmp_path, pattern, expected):
    keys = {"attention.sliding_window": 8, "attention.sliding_window_pattern": pattern}
    assert header(tmp_path / "p.gguf", "olmo2", keys).sliding_layers == expected


def test_phi3_window_applies_to_every_layer_and_zero_means_none(tmp_path):
    assert header(tmp_path / "a.gguf", "phi3", {"attention.sliding_window": 0}).sliding_window is None
    c = header(tmp_path / "b.gguf", "phi3", {"attention.sliding_window": 8})
    assert c.sliding_window == 8 and all(c.is_sliding(l) for l in range(c.n_layers))


def test_longrope_defaults_to_the_context_and_no_attention_factor(tmp_path):
    factors = {"rope_factors_long.weight": np.full(8, 2.0, np.float32),
               "rope_factors_short.weight": np.ones(8, np.float32)}
    c = header(tmp_path / "l.gguf", "phi3", {}, tensors=factors)
    assert c.rope_scaling.kind == "longrope" and c.rope_scaling.original_max_position_embeddings == 64
    assert c.rope_scaling.attention_factor == 1.0 and c.rope_scaling.long_factor == (2.0,) * 8


def test_qwen3moe_experts_default_to_the_ffn_over_the_experts_used(tmp_path):
    c = header(tmp_path / "q.gguf", "qwen3moe", {"expert_count": 8, "expert_used_count": 2})
    assert (c.n_experts, c.n_experts_used, c.moe_hidden_dim, c.expert_weights_norm) == (8, 2, 48, True)
    keys = {"expert_count": 8, "expert_used_count": 2, "expert_weights_norm": False}
    assert header(tmp_path / "n.gguf", "qwen3moe", keys).expert_weights_norm is False


@pytest.mark.parametrize("arch, keys, tensors, error, message", [
    ("gemma4", {}, {}, ConfigError, "not one npllm runs"),
    ("qwen3moe", {"expert_count": 4, "expert_used_count": 2, "expert_shared_feed_forward_length": 32}, {},
     ConfigError, "shared experts"),
    ("qwen3moe", {"expert_count": 4, "expert_used_count": 5}, {}, ConfigError, "expert_used_count"),
    ("granite", {}, {}, ConfigError, "logit_scale"),
    ("granite", {"logit_scale": 8.0, "rope.scaling.finetuned": False}, {}, ConfigError, "without RoPE"),
    ("phi3", {}, {"rope_factors_long.weight": np.ones(8, np.float32)}, FormatError, "without its partner"),
    ("phi3", {"rope.scaling.type": "longrope"}, {}, FormatError, "rope_factors"),
    ("phi3", {}, {"rope_factors_long.weight": np.ones(4, np.float32),
                  "rope_factors_short.weight": np.ones(4, np.float32)}, ConfigError, "rotated dims / 2"),
    ("olmo2", {"attention.sliding_window": 8, "attention.sliding_window_pattern": np.array([True, False])}, {},
     ConfigError, "flag each of the 6 layers"),
    ("qwen3", {"rope.scaling.type": "yarn"}, {}, ConfigError, "rope.scaling.factor"),
    ("qwen3", {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.yarn_log_multiplier": 0.1}, {},
     ConfigError, "yarn_log_multiplier"),
    ("qwen3", {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.yarn_ext_factor": 0.5}, {},
     ConfigError, "yarn_ext_factor"),
    ("qwen3", {"rope.scaling.type": "dynamic"}, {}, ConfigError, "'dynamic' is not supported"),
    ("qwen3", {"rope.scaling.attn_factor": 1.5}, {}, ConfigError, "attn_factor other than 1 without YaRN"),
])
def test_what_npllm_cannot_run_is_refused_by_name(tmp_path, arch, keys, tensors, error, message):
    with pytest.raises(error, match=message):
        header(tmp_path / "bad.gguf", arch, keys, tensors=tensors)


def test_a_family_tensor_npllm_does_not_know_is_refused(tmp_path):
    arch, config, keys = case("qwen3")
    weights = random_weights(config)
    tensors = gguf_tensors(arch, config, weights, {}) + [
        TensorData("blk.0.ffn_gate_shexp.weight", (96, 64), "F32", quantize(np.zeros((96, 64), np.float32), "F32"))]
    write_gguf_file(tmp_path / "x.gguf", metadata(arch, config, keys), tensors)
    with pytest.raises(FormatError, match="ffn_gate_shexp"):
        read_checkpoint(tmp_path / "x.gguf")


# ---------------------------------------------------------------------------------------------------------------
# llama.cpp's own conversions of the transformers fixtures

CONVERTED = sorted((FIXTURES / "gguf_arch").glob("*.gguf"))


@pytest.mark.skipif(not CONVERTED, reason="no tests/fixtures/gguf_arch/*.gguf (made by llama.cpp's converter)")
@pytest.mark.parametrize("path", CONVERTED, ids=[p.stem for p in CONVERTED])
def test_llama_cpps_conversion_reproduces_transformers_logits(path):
    """The fixture's tokens with a context of exactly their length (longrope picks its factors by the context the
    model runs with, as transformers does by the sequence's). The converter drops the embedding rows past the tokenizer's
    vocabulary (Gemma 3): those columns of the reference have no counterpart, the others must match.

    Where the file cannot say what the checkpoint did (Gemma's query_pre_attn_scalar, Qwen3-MoE's norm_topk_prob:
    the converter writes neither, llama.cpp assumes head_dim and renormalising), the fixture script computed
    transformers' logits once more with the values the file implies: `logits_gguf`."""
    reference = np.load(FIXTURES / "hf" / path.stem / "reference.npz")
    tokens = reference["tokens"]
    expected = reference["logits_gguf"] if "logits_gguf" in reference else reference["logits"]
    config, weights = read_checkpoint(path)
    model = make_model(config.replace(max_seq_len=len(tokens)), weights, backend="numpy")
    logits = model.logits(tokens)
    assert logits.shape[1] <= expected.shape[1]
    np.testing.assert_allclose(logits, expected[:, :logits.shape[1]], rtol=0, atol=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# The families' GGUF vocabularies: llama.cpp's pre-tokenizer names


def byte_level(pre: str | None):
    """A byte-level vocabulary (the 256 byte characters, then "12" and "123") under pre-tokenizer `pre`."""
    from npllm.tokenizer.bytelevel import bytes_to_unicode, from_gguf_vocab

    tokens = list(bytes_to_unicode().values()) + ["12", "123"]
    return from_gguf_vocab(tokens, ["1 2", "12 3"], None, pre, None, None, None, "test")


@pytest.mark.parametrize("pre, merged", [("gpt-2", True), ("dbrx", True), ("olmo", True), ("gpt-4o", True),
                                         ("refact", False), ("starcoder", False), ("smollm", False),
                                         ("qwen2", False)])
def test_the_families_pre_tokenizer_names_are_known_and_split_digits_as_llama_cpp(pre, merged):
    """Granite's "refact" (as starcoder, smollm and qwen2) pre-tokenizes every digit alone, so "123" never merges;
    the others keep a run of digits (up to three) in one piece."""
    tokenizer = byte_level(pre)
    ids = tokenizer.encode("a123", bos=False)
    assert len(ids) == (2 if merged else 4)


def test_an_unknown_pre_tokenizer_name_is_refused_naming_the_known_ones():
    from npllm.errors import TokenizerError

    with pytest.raises(TokenizerError, match="'gemma4' is not one npllm knows .*refact"):
        byte_level("gemma4")


@pytest.mark.parametrize("name", ["gemma2", "qwen3moe", "granite"])
def test_npllm_does_not_write_other_families_as_llama_files(tmp_path, name):
    """npllm's GGUF writer knows only the Llama block: a family's file written as 'llama' would drop its options."""
    from npllm.formats.gguf_write import write_gguf

    config = case(name)[1]
    with pytest.raises(ConfigError, match=f"this {config.arch} model uses"):
        write_gguf(tmp_path / "w.gguf", config, random_weights(config))
    assert not (tmp_path / "w.gguf").exists()


def test_storage_decides_the_device_type_of_every_weight_dtype():
    """models.storage is the one place a weight_dtype becomes what a backend stores: for cuda, the one type every
    matrix takes on the device (the GPU model carries it out, converting while it uploads: the weights stay as
    read); for the CPU backends, the host arrays themselves and no device type."""
    from npllm.models import WEIGHT_DTYPES, storage

    config = case("qwen3moe")[1]
    weights = random_weights(config, seed=5)
    device = {dtype: storage(weights, dtype, "cuda") for dtype in WEIGHT_DTYPES}
    assert {dtype: s.device for dtype, s in device.items()} == {"file": "float32", "float32": "float32",
                                                                "float16": "float16", "q8_0": "q8_0"}
    assert all(s.weights is weights for s in device.values())
    assert storage(weights, "q8_0", "numba").device is None and storage(weights, "file", "numpy").device is None
    with pytest.raises(ConfigError, match="weight_dtype must be one of"):
        storage(weights, "q4_0", "cuda")
