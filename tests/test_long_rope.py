"""The long-context RoPE variants (issue 56): YaRN, dynamic NTK, partial rotary embeddings and NoPE layers.

Their laws (ops.yarn_inv_freq, ops.dynamic_ntk_theta, the rotation of the first r dims only, the zero frequencies the
compiled backends pad with), how config.json spells them, what is refused, and proof that each transformers fixture
(tests/fixtures/hf/{qwen2_yarn, llama_dynamic, phi3_partial, smollm3_nope}, made by
scripts/fixtures/make_arch_fixtures.py) exercises its feature: switched off in npllm, the logits move by >= 0.05
from transformers'. The fixtures' logits on each backend: test_families.py (NumPy), test_numba_families.py,
test_cuda_families.py.
"""

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from npllm import ops
from npllm.config import ModelConfig, RopeScaling
from npllm.errors import ConfigError
from npllm.formats import read_checkpoint
from npllm.formats.gguf_write import model_metadata
from npllm.formats.hf import config_from_hf, to_interleaved
from npllm.models import make_model
from npllm.tensors import permute_qk_half_to_interleaved

HF = Path(__file__).parent / "fixtures" / "hf"
LLAMA = json.loads((HF / "llama_gqa" / "config.json").read_text())  # head_dim 16, rope_parameters layout
SMALL = dict(dim=64, hidden_dim=128, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=32, max_seq_len=16)
seeds = st.integers(0, 2**32 - 1)


def fixture_logits(name: str, **changes) -> tuple[np.ndarray, np.ndarray]:
    """(npllm's NumPy logits of the fixture's tokens with `changes` made to its config, transformers' logits); the
    context is the sequence's length, as the tests of every backend run it."""
    reference = np.load(HF / name / "reference.npz")
    config, weights = read_checkpoint(HF / name)
    config = config.replace(**{"max_seq_len": len(reference["tokens"]), **changes})
    return make_model(config, weights, backend="numpy").logits(reference["tokens"]), reference["logits"]


def scaling_of(name: str) -> RopeScaling:
    return read_checkpoint(HF / name)[0].rope_scaling


# ---- each fixture exercises its feature ------------------------------------------------------------------------


@pytest.mark.parametrize("name, changes", [
    ("qwen2_yarn", {"rope_scaling": None}),
    ("qwen2_yarn", {"rope_scaling": dataclasses.replace(scaling_of("qwen2_yarn"), attention_factor=1.0)}),
    ("qwen2_yarn", {"rope_scaling": dataclasses.replace(scaling_of("qwen2_yarn"), beta_fast=32.0, beta_slow=1.0)}),
    ("llama_dynamic", {"rope_scaling": None}),
    ("phi3_partial", {"partial_rotary_factor": 1.0}),
    ("smollm3_nope", {"rope_layers": ()}),
    ("phi3_partial_longrope", {"rope_scaling": dataclasses.replace(scaling_of("phi3_partial_longrope"),
                                                                   attention_factor=1.0)}),
    ("smollm3_yarn", {"rope_layers": ()}),
    ("smollm3_yarn", {"rope_scaling": None}),
], ids=["yarn", "yarn-attention-factor", "yarn-betas", "dynamic", "partial", "nope", "partial-longrope-factor",
        "nope-with-yarn", "yarn-with-nope"])
def test_each_fixture_exercises_its_feature(name, changes):
    on, expected = fixture_logits(name)
    off, _ = fixture_logits(name, **changes)
    assert np.abs(on - expected).max() < 1e-4
    assert np.abs(off - expected).max() >= 0.05


def test_dynamic_ntk_grows_its_base_by_the_context_past_the_original():
    """llama_dynamic at a context of 32 (its max_position_embeddings) is plain RoPE; at 80 it is transformers' one
    forward over the 80 tokens."""
    config = read_checkpoint(HF / "llama_dynamic")[0]
    plain = ops.rope_inv_freq(config.head_dim, config.rope_theta)
    for context in (8, 32):
        np.testing.assert_allclose(ops.rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling,
                                                     context), plain)
    grown = ops.rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling, 80)
    np.testing.assert_allclose(grown, (10000.0 * (2 * 80 / 32 - 1) ** (16 / 14)) ** (-np.arange(0, 16, 2) / 16))
    at_32, expected = fixture_logits("llama_dynamic", max_seq_len=32)
    assert np.abs(at_32 - expected).max() >= 0.05


def test_a_cached_decode_under_dynamic_ntk_keeps_one_base():
    """npllm's base comes from the context, so decode steps after a prefill give one forward's logits exactly
    where transformers' generate() would re-base each step (see make_arch_fixtures.py)."""
    reference = np.load(HF / "llama_dynamic" / "reference.npz")
    tokens = reference["tokens"]
    config, weights = read_checkpoint(HF / "llama_dynamic")
    model = make_model(config.replace(max_seq_len=len(tokens)), weights, backend="numpy")
    cache = model.new_cache()
    n = 40
    steps = [model.lm_head(model.forward(tokens[:n], np.arange(n), cache))]
    steps += [model.lm_head(model.forward(tokens[p:p + 1], [p], cache)) for p in range(n, len(tokens))]
    assert np.abs(np.concatenate(steps) - reference["logits"]).max() < 1e-4


# ---- laws --------------------------------------------------------------------------------------------------------


def test_yarn_keeps_fast_pairs_and_divides_slow_ones_by_the_factor():
    s = RopeScaling("yarn", 4.0, original_max_position_embeddings=32, beta_fast=8.0, beta_slow=0.5)
    w = ops.rope_inv_freq(16, 10000.0)
    scaled = ops.yarn_inv_freq(w, 10000.0, s)
    # d(b) = 16 ln(32 / (2 pi b)) / (2 ln 10000): d(8) = -0.39 -> lo 0, d(0.5) = 2.02 -> hi 3
    ramp = np.clip(np.arange(8) / 3, 0, 1)
    np.testing.assert_allclose(scaled, w / 4 * ramp + w * (1 - ramp))
    assert scaled[0] == w[0] and np.allclose(scaled[3:], w[3:] / 4)
    untruncated = ops.yarn_inv_freq(w, 10000.0, dataclasses.replace(s, truncate=False))
    lo, hi = 0.0, 16 * math.log(32 / (2 * math.pi * 0.5)) / (2 * math.log(10000.0))
    np.testing.assert_allclose(untruncated, w / 4 * np.clip((np.arange(8) - lo) / (hi - lo), 0, 1)
                               + w * (1 - np.clip((np.arange(8) - lo) / (hi - lo), 0, 1)))
    assert np.allclose(ops.yarn_inv_freq(w, 10000.0, dataclasses.replace(s, factor=1.0)), w)  # factor 1: none


@settings(deadline=None, max_examples=30)
@given(st.floats(1.0, 8.0), st.integers(4, 4096), st.integers(1, 10_000), st.sampled_from([4, 8, 64, 128]))
def test_dynamic_ntk_base_is_the_base_up_to_the_original_and_grows_past_it(factor, original, context, r):
    s = RopeScaling("dynamic", factor, original_max_position_embeddings=original)
    theta = ops.dynamic_ntk_theta(10000.0, s, context, r)
    if context <= original:
        assert theta == pytest.approx(10000.0)
    else:
        assert theta > 10000.0 and theta < ops.dynamic_ntk_theta(10000.0, s, context + 1, r)


@settings(deadline=None, max_examples=30)
@given(seeds, st.integers(1, 4), st.sampled_from([(8, 4), (16, 8), (16, 12), (12, 4), (8, 8)]))
def test_partial_rotary_turns_the_first_r_dims_in_either_layout(seed, n, dims):
    """rope_half / rope_interleaved with r/2 angles leave x[r:] as it is; the half layout's first r rows permuted
    (permute_qk_half_to_interleaved with rotary_dims) give the interleaved rotation; and zero frequencies padded
    past r/2 (what the compiled backends rotate: padded_rope_tables) are exactly the identity."""
    Dh, r = dims
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(5, n, Dh))
    inv = ops.rope_inv_freq(Dh, 100.0, rotary_dims=r)
    cos, sin = ops.rope_angles(np.arange(5) * 3, inv, np.float64)
    half, inter = ops.rope_half(x, cos, sin), ops.rope_interleaved(x, cos, sin)
    assert np.array_equal(half[..., r:], x[..., r:]) and np.array_equal(inter[..., r:], x[..., r:])
    perm = permute_qk_half_to_interleaved(np.arange(Dh), 1, Dh, r)
    np.testing.assert_allclose(ops.rope_interleaved(x[..., perm], cos, sin), half[..., perm], atol=1e-12)
    padded = np.pad(inv, (0, Dh // 2 - r // 2))
    pcos, psin = ops.rope_angles(np.arange(5) * 3, padded, np.float64)
    assert np.array_equal(ops.rope_interleaved(x, pcos, psin), inter)


def test_partial_rotary_fixture_in_the_interleaved_layout_gives_the_same_logits():
    from npllm.models.reference import Transformer

    reference = np.load(HF / "phi3_partial" / "reference.npz")
    config, weights = to_interleaved(*read_checkpoint(HF / "phi3_partial"))
    got = Transformer(config.replace(max_seq_len=48), weights).logits(reference["tokens"])
    assert np.abs(got - reference["logits"]).max() < 1e-4


# ---- config.json spellings and refusals ------------------------------------------------------------------------


def with_rope(**spec) -> dict:
    return {**LLAMA, "rope_parameters": {**LLAMA["rope_parameters"], **spec}}


def test_yarn_is_read_as_transformers_reads_it():
    base = config_from_hf(with_rope(rope_type="yarn", factor=4.0, original_max_position_embeddings=32)).rope_scaling
    assert (base.kind, base.factor, base.original_max_position_embeddings) == ("yarn", 4.0, 32)
    assert (base.beta_fast, base.beta_slow, base.truncate) == (32.0, 1.0, True)
    assert base.attention_factor == pytest.approx(0.1 * math.log(4) + 1)
    old = {**LLAMA, "rope_theta": LLAMA["rope_parameters"]["rope_theta"],  # the hub's rope_scaling spelling
           "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}}
    old.pop("rope_parameters")
    assert config_from_hf(old).rope_scaling == base
    deepseek = config_from_hf(with_rope(rope_type="yarn", factor=40.0, original_max_position_embeddings=32,
                                        mscale=1.0, mscale_all_dim=0.707)).rope_scaling
    assert deepseek.attention_factor == pytest.approx((0.1 * math.log(40) + 1) / (0.0707 * math.log(40) + 1))
    assert config_from_hf(with_rope(rope_type="yarn", factor=4.0, attention_factor=1.5)).rope_scaling \
        .attention_factor == 1.5
    implied = config_from_hf({**with_rope(rope_type="yarn", original_max_position_embeddings=32),
                              "max_position_embeddings": 96}).rope_scaling
    assert implied.factor == 3.0  # no factor: max_position_embeddings / original


@pytest.mark.parametrize("spec, said", [
    ({"rope_type": "yarn", "factor": 4.0, "mscale": 0.8}, "mscale 0.8 with mscale_all_dim None"),
    ({"rope_type": "yarn", "factor": 4.0, "beta_fast": 1.0, "beta_slow": 2.0}, "beta_slow < beta_fast"),
    ({"rope_type": "yarn", "factor": 4.0, "truncate": "yes"}, "truncate"),
    ({"rope_type": "yarn", "factor": -1.0}, "factor must be > 0"),
    ({"rope_type": "dynamic"}, "factor"),
])
def test_what_cannot_be_computed_faithfully_is_refused(spec, said):
    with pytest.raises(ConfigError, match=said):
        config_from_hf(with_rope(**spec))


def test_no_rope_layers_are_read_and_checked():
    smol = {**LLAMA, "model_type": "smollm3", "num_hidden_layers": 4}
    assert config_from_hf(smol).rope_layers == (True, True, True, False)  # every 4th, transformers' default
    assert config_from_hf({**smol, "no_rope_layers": [0, 1, 1, 0]}).rope_layers == (False, True, True, False)
    assert config_from_hf({**smol, "no_rope_layer_interval": 2}).rope_layers == (True, False, True, False)
    assert config_from_hf(smol).sliding_window is None  # use_sliding_window false: no layer slides
    sliding = config_from_hf({**smol, "use_sliding_window": True, "sliding_window": 8, "layer_types": None})
    assert sliding.sliding_layers == (False, False, False, True)  # its NoPE layers
    for bad in ([1, 1, 0], [1, 1, 2, 1], "1101"):
        with pytest.raises(ConfigError, match="no_rope_layers"):
            config_from_hf({**smol, "no_rope_layers": bad})
    with pytest.raises(ConfigError, match="rope_layers must flag each of the 2 layers"):
        ModelConfig(**SMALL, rope_layers=(True,))


@pytest.mark.parametrize("change", [{"partial_rotary_factor": 0.5}, {"rope_layers": (True, False)},
                                    {"rope_scaling": RopeScaling("yarn", 2.0, original_max_position_embeddings=8)},
                                    {"rope_scaling": RopeScaling("dynamic", 2.0, original_max_position_embeddings=8)}])
def test_the_gguf_writer_refuses_what_its_llama_files_cannot_say(change):
    with pytest.raises(ConfigError, match="Llama-block models only"):
        model_metadata(ModelConfig(**SMALL, **change), "m")


def test_dynamic_ntk_needs_more_than_two_rotated_dims():
    """Its base grows as a power r / (r - 2): r = 2 was a ZeroDivisionError deep in ops."""
    with pytest.raises(ConfigError, match="more than 2 rotated dims"):
        ModelConfig(**{**SMALL, "dim": 8}, rope_scaling=RopeScaling("dynamic", 2.0, original_max_position_embeddings=8))
    with pytest.raises(ConfigError, match="more than 2 rotated dims"):
        ModelConfig(**SMALL, partial_rotary_factor=0.125,
                    rope_scaling=RopeScaling("dynamic", 2.0, original_max_position_embeddings=8))


# ---- GGUF: the keys llama.cpp's converter writes ---------------------------------------------------------------


def test_gguf_yarn_keys_are_read_with_llama_cpps_defaults(tmp_path):
    """type yarn, factor, original_context_length (default context_length), yarn_beta_fast / yarn_beta_slow
    (32 / 1), yarn_attn_factor (default 0.1 ln factor + 1) times attn_factor; qwen2_yarn.gguf (llama.cpp's
    conversion) gives the HF checkpoint's scaling."""
    from test_formats_gguf_families import header

    keys = {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0}
    plain = header(tmp_path / "a.gguf", "qwen3", keys)
    assert plain.rope_scaling == RopeScaling("yarn", 4.0, original_max_position_embeddings=plain.max_seq_len,
                                             attention_factor=0.1 * math.log(4) + 1)
    given = {**keys, "rope.scaling.original_context_length": 16, "rope.scaling.yarn_beta_fast": 8.0,
             "rope.scaling.yarn_beta_slow": 0.5, "rope.scaling.yarn_attn_factor": 1.25, "rope.scaling.attn_factor": 2.0}
    scaling = header(tmp_path / "b.gguf", "qwen3", given).rope_scaling
    assert (scaling.original_max_position_embeddings, scaling.beta_fast, scaling.beta_slow,
            scaling.attention_factor) == (16, 8.0, 0.5, 2.5)
    assert read_checkpoint(HF.parent / "gguf_arch" / "qwen2_yarn.gguf")[0].rope_scaling == scaling_of("qwen2_yarn")


@pytest.mark.parametrize("name", ["qwen2_yarn", "phi3_partial", "smollm3_nope", "phi3_partial_longrope",
                                  "smollm3_yarn"])
def test_llama_cpps_conversions_carry_the_feature(name):
    """The GGUF files say what the HF checkpoints say: the same ModelConfig RoPE fields (SmolLM3's NoPE layers by
    llama.cpp's built-in rule, every 4th layer; Phi-3's partial rotary as rope.dimension_count 8 of 16)."""
    hf = read_checkpoint(HF / name)[0]
    gguf = read_checkpoint(HF.parent / "gguf_arch" / f"{name}.gguf")[0]
    for field in ("partial_rotary_factor", "rope_layers", "rope_theta"):
        assert getattr(gguf, field) == getattr(hf, field), field
    if hf.rope_scaling is None:
        assert gguf.rope_scaling is None
    else:  # GGUF stores the factors and the attention factor as float32
        for field in dataclasses.fields(RopeScaling):
            a, b = getattr(gguf.rope_scaling, field.name), getattr(hf.rope_scaling, field.name)
            assert np.allclose(a, b, rtol=1e-6) if field.name != "kind" else a == b, field.name


@pytest.mark.parametrize("name", ["phi3_partial_longrope", "smollm3_yarn"])
def test_the_attention_factor_scales_only_what_turns(name):
    """longrope's and yarn's attention factor scales cos and sin (Model.rope_amplitudes), so only the rotated dims
    of RoPE layers: one score scale of a^2 over whole heads and every layer (npllm's earlier rule, still right for
    whole heads with RoPE everywhere) misses transformers by far more than 1e-4 on these two."""
    from npllm.models.reference import Transformer

    reference = np.load(HF / name / "reference.npz")
    config, weights = read_checkpoint(HF / name)
    config = config.replace(max_seq_len=len(reference["tokens"]))
    a = config.rope_scaling.attention_factor
    whole = Transformer(config.replace(attention_scale=a * a / math.sqrt(config.head_dim),
                                       rope_scaling=dataclasses.replace(config.rope_scaling, attention_factor=1.0)),
                        weights)
    assert np.abs(whole.logits(reference["tokens"]) - reference["logits"]).max() >= 0.05
    model = Transformer(config, weights)
    assert model.rope_amplitudes()[model.rope_rows()].tolist() == [a if config.has_rope(l) else 1.0
                                                                   for l in range(config.n_layers)]


def test_npllm_info_names_the_variants():
    from npllm.info import describe

    config, weights = read_checkpoint(HF / "phi3_partial_longrope")
    assert "RoPE on 12 of 16 head dims" in describe(config, weights, HF / "phi3_partial_longrope")
    config, weights = read_checkpoint(HF / "smollm3_yarn")
    text = describe(config, weights, HF / "smollm3_yarn")
    assert "yarn RoPE scaling x4" in text and "1 layer without RoPE" in text
