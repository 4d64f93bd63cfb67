"""RoPE settings as every format gives them: read from both config.json layouts in one place, and checked in one
place (ModelConfig / RopeScaling), NaN included: partial_rotary_factor (an even whole number of each head's dims),
longrope's factor lists, and the comparisons a NaN slips past. What partial rotary computes: test_long_rope.py."""

import json
import math
import shutil

import numpy as np
import pytest

from npllm.config import ModelConfig, RopeScaling
from npllm.errors import ConfigError
from npllm.formats import read_checkpoint
from npllm.formats.gguf import read_gguf_file
from npllm.formats.hf import config_from_hf
from tests_support import REPO, load_campaign

HF = REPO / "tests" / "fixtures" / "hf"
LLAMA = json.loads((HF / "llama_gqa" / "config.json").read_text())  # head_dim 16, rope_parameters layout
PHI3 = HF / "phi3"
SMALL = dict(dim=64, hidden_dim=128, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=32, max_seq_len=16)


def with_rotary(layout: str, value) -> dict:
    """LLAMA's config with partial_rotary_factor at the top level or inside rope_parameters."""
    if layout == "top":
        return {**LLAMA, "partial_rotary_factor": value}
    return {**LLAMA, "rope_parameters": {**LLAMA["rope_parameters"], "partial_rotary_factor": value}}


@pytest.mark.parametrize("layout", ["top", "rope_parameters"])
@pytest.mark.parametrize("value, said", [
    (0, r"partial_rotary_factor must be a number in \(0, 1\].*got 0"), (2.0, r"in \(0, 1\].*got 2.0"),
    (-0.5, r"in \(0, 1\]"), (math.nan, "partial_rotary_factor.*finite"), (math.inf, "partial_rotary_factor.*finite"),
    (0.3, "even whole number"), ("0.5", "partial_rotary_factor.*must be a number"),
    (True, "partial_rotary_factor.*must be a number"),
])
def test_partial_rotary_factor_is_read_from_both_layouts_and_checked(layout, value, said):
    """transformers 5 writes it inside rope_parameters, where it used to be silently ignored (whole-head RoPE)."""
    with pytest.raises(ConfigError, match=said):
        config_from_hf(with_rotary(layout, value))


@pytest.mark.parametrize("layout", ["top", "rope_parameters"])
@pytest.mark.parametrize("value, rotated", [(0.5, 8), (0.25, 4), (0.75, 12)])
def test_partial_rotary_factor_is_used_from_both_layouts(layout, value, rotated):
    config = config_from_hf(with_rotary(layout, value))
    assert (config.partial_rotary_factor, config.rotary_dims) == (value, rotated)
    assert "partial_rotary_factor" in config.features


def test_partial_rotary_factor_one_loads_and_the_layouts_must_agree():
    for layout in ("top", "rope_parameters"):
        assert config_from_hf(with_rotary(layout, 1.0)).partial_rotary_factor == 1.0
    both = {**with_rotary("top", 1.0), "rope_parameters": with_rotary("rope_parameters", 0.5)["rope_parameters"]}
    with pytest.raises(ConfigError, match="partial_rotary_factor 1.0 disagrees with rope_parameters' 0.5"):
        config_from_hf(both)
    assert read_checkpoint(PHI3)[0].partial_rotary_factor == 1.0  # its rope_parameters says 1.0


def test_a_sliding_layer_rotary_factor_of_its_own_is_refused():
    gemma3 = json.loads((HF / "gemma3" / "config.json").read_text())
    params = gemma3["rope_parameters"]
    bent = {**gemma3, "rope_parameters": {**params, "sliding_attention": {**params["sliding_attention"],
                                                                          "partial_rotary_factor": 0.5}}}
    with pytest.raises(ConfigError, match="sliding_attention.*partial_rotary_factor 0.5 differs"):
        config_from_hf(bent)


@pytest.mark.parametrize("factor, said", [(1 / 16, "even whole number"), (3 / 16, "even whole number"),
                                          (1e-9, "even whole number"), (0.0, r"\(0, 1\]")])
def test_model_config_checks_the_rotated_fraction_for_every_format(factor, said):
    with pytest.raises(ConfigError, match=said):
        ModelConfig(**SMALL, partial_rotary_factor=factor)


@pytest.mark.parametrize("rotated, said", [(0, r"\(0, 1\]"), (3, "even whole number"), (16, r"\(0, 1\]")])
def test_gguf_rope_dimension_count_goes_through_the_same_check(tmp_path, weights_dir, stories260k, rotated, said):
    bad_inputs = load_campaign()
    metadata, tensors = bad_inputs.stories_gguf(weights_dir)
    path = tmp_path / "m.gguf"
    bad_inputs.write_gguf(path, {**metadata, "llama.rope.dimension_count": ("u32", rotated)}, tensors)
    with pytest.raises(ConfigError, match=said):
        read_checkpoint(path)


# ---- longrope factors: finite and > 0, every one of them --------------------------------------------------------


@pytest.mark.parametrize("which", ["short_factor", "long_factor"])
@pytest.mark.parametrize("value, said", [("NaN", "finite"), ("Infinity", "finite"), ("-Infinity", "finite"),
                                         ("0", "> 0"), ("-1.5", "> 0")])
@pytest.mark.parametrize("at", [0, 5])
def test_config_json_longrope_factors_must_be_finite_and_positive(tmp_path, which, value, said, at):
    """NaN used to pass `min(...) <= 0` (a comparison with NaN is False) wherever it sat in the list."""
    folder = tmp_path / "phi3"
    shutil.copytree(PHI3, folder)
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"][which][at] = "@@"
    (folder / "config.json").write_text(json.dumps(config).replace('"@@"', value))
    with pytest.raises(ConfigError, match=f"{which}.*{said}"):
        read_checkpoint(folder)


@pytest.mark.parametrize("tensor", ["rope_factors_long.weight", "rope_factors_short.weight"])
@pytest.mark.parametrize("value", [math.nan, math.inf, 0.0, -2.0])
def test_gguf_longrope_factor_tensors_must_be_finite_and_positive(tmp_path, tensor, value):
    source = REPO / "tests" / "fixtures" / "gguf_arch" / "phi3.gguf"
    g = read_gguf_file(source)
    info = g.tensors[tensor]
    assert info.type_id == 0  # F32: bent in place below
    data = bytearray(source.read_bytes())
    at = g.data_start + info.offset + 4 * 3
    data[at:at + 4] = np.float32(value).tobytes()
    path = tmp_path / "phi3.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match="finite|> 0"):
        read_checkpoint(path)


@pytest.mark.parametrize("fields, said", [
    ({"short_factor": (1.0, math.nan), "long_factor": (1.0, 1.0)}, "short_factor.*finite"),
    ({"short_factor": (1.0, 1.0), "long_factor": (math.nan, 1.0)}, "long_factor.*finite"),
    ({"short_factor": (1.0, 1.0), "long_factor": (1.0, 0.0)}, "long_factor.*> 0"),
    ({"short_factor": (1.0, 1.0), "long_factor": (1.0, 1.0), "attention_factor": math.nan}, "attention_factor"),
    ({"short_factor": (1.0, 1.0), "long_factor": (1.0, 1.0), "original_max_position_embeddings": -4},
     "original_max_position_embeddings"),
])
def test_rope_scaling_checks_every_longrope_field(fields, said):
    with pytest.raises(ConfigError, match=said):
        RopeScaling("longrope", 2.0, **fields)


@pytest.mark.parametrize("changes, said", [
    ({"attention_scale": math.nan}, "finite"), ({"rope_local_theta": -1.0}, ">= 0"),
    ({"sliding_window": 2.5}, "sliding_window must be a positive integer"),
    ({"sliding_window": math.nan}, "finite"), ({"partial_rotary_factor": math.nan}, "finite"),
])
def test_model_config_float_fields_refuse_nan_and_out_of_range_values(changes, said):
    with pytest.raises(ConfigError, match=said):
        ModelConfig(**SMALL, **changes)


@pytest.mark.parametrize("change, said", [
    ({"original_max_position_embeddings": 1}, "attention_factor undefined"),  # was a ZeroDivisionError
    ({"short_factor": [10 ** 400] * 8}, "too large"),  # an integer no float holds: was an OverflowError
])
def test_config_json_longrope_values_that_were_tracebacks(change, said):
    config = json.loads((PHI3 / "config.json").read_text())
    config["rope_parameters"] = {**config["rope_parameters"], **change}
    config.pop("original_max_position_embeddings", None)
    with pytest.raises(ConfigError, match=said):
        config_from_hf(config)
