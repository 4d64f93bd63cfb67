"""Issue 41's file-level bad inputs: output paths of `npllm quantize`, non-finite metadata and token scores, a cache
folder that cannot be made, tokenizer files whose fields have the wrong types or encodings."""

import json
import math
import os
import shutil
import stat
import subprocess
import sys

import numpy as np
import pytest

from npllm.cli import main
from npllm.config import ModelConfig, RopeScaling
from npllm.errors import ConfigError, FormatError, NpllmError
from npllm.formats import read_checkpoint
from npllm.formats.gguf import TensorData, write_gguf_file
from tests_support import REPO

FIXTURE = REPO / "tests" / "fixtures" / "hf" / "qwen2_bias"


def load_campaign():
    """scripts/bad_inputs.py as a module (its GGUF writer bends any field)."""
    import importlib.util

    if "bad_inputs" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bad_inputs", REPO / "scripts" / "bad_inputs.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["bad_inputs"] = module  # dataclasses look their module up by name
        spec.loader.exec_module(module)
    return sys.modules["bad_inputs"]


def one_tensor():
    return [TensorData("w", (2, 4), "F32", np.zeros(8, np.float32).view(np.uint8))]


# ---- 3: what `npllm quantize IN OUT` may write over ---------------------------------------------------------------


def assert_nothing_left_beside(folder, before):
    assert sorted(os.listdir(folder)) == before, "a partial file was left behind"


def test_quantize_refuses_to_replace_a_fifo_or_a_device(tmp_path, capsys):
    fifo = tmp_path / "out.gguf"
    os.mkfifo(fifo)
    for out in (fifo, "/dev/null"):
        assert main(["quantize", "stories260K", str(out), "--type", "f32"]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.startswith("npllm: error: cannot write")
        assert "not a regular file" in captured.err and captured.err.count("\n") == 1
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and stat.S_ISCHR(os.stat("/dev/null").st_mode)
    assert_nothing_left_beside(tmp_path, ["out.gguf"])


def test_quantize_into_a_folder_or_a_missing_folder_is_one_error_line(tmp_path, capsys):
    (tmp_path / "existing").mkdir()
    for out, said in ((tmp_path / "existing", "is a folder"), (tmp_path / "missing" / "m.gguf", "does not exist"),
                      (tmp_path / "existing" / "sub" / "m.gguf", "does not exist")):
        assert main(["quantize", "stories260K", str(out), "--type", "f32"]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.startswith("npllm: error: cannot write") and said in captured.err
    assert_nothing_left_beside(tmp_path, ["existing"])
    assert os.listdir(tmp_path / "existing") == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into any folder")
def test_quantize_into_an_unwritable_folder_is_one_error_line(tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        assert main(["quantize", "stories260K", str(locked / "m.gguf"), "--type", "f32"]) == 2
        assert "not writable" in capsys.readouterr().err
    finally:
        locked.chmod(0o700)
    assert os.listdir(locked) == []


def test_a_failed_write_leaves_no_partial_file(tmp_path, monkeypatch):
    """A write error part-way (a full disk) is one FormatError, and the half-written file is removed."""
    import npllm.formats.gguf as gguf

    def fail(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf.os, "replace", fail)
    with pytest.raises(FormatError, match="No space left"):
        write_gguf_file(tmp_path / "m.gguf", {}, one_tensor())
    assert os.listdir(tmp_path) == []


def test_a_written_file_replaces_a_regular_one_with_the_usual_permissions(tmp_path):
    out = tmp_path / "m.gguf"
    out.write_bytes(b"old")
    write_gguf_file(out, {}, one_tensor())
    assert out.read_bytes()[:4] == b"GGUF" and os.listdir(tmp_path) == ["m.gguf"]
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o666 & ~umask


# ---- 4: non-finite token scores and metadata floats ---------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_parts(weights_dir, stories260k):
    return load_campaign().stories_gguf(weights_dir)


def bent_gguf(tmp_path, parts, **meta):
    metadata, tensors = parts
    path = tmp_path / f"m{len(list(tmp_path.iterdir()))}.gguf"
    load_campaign().write_gguf(path, {**metadata, **meta}, tensors)
    return path


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_gguf_token_scores_that_are_not_finite_are_refused(tmp_path, gguf_parts, value):
    import npllm

    scores = list(gguf_parts[0]["tokenizer.ggml.scores"][1][1])
    scores[300] = value
    path = bent_gguf(tmp_path, gguf_parts, **{"tokenizer.ggml.scores": ("arr", ("f32", scores))})
    with pytest.raises(FormatError, match="tokenizer.ggml.scores .*token 300"):
        npllm.load(path, backend="numpy")


@pytest.mark.parametrize("key, value", [("llama.rope.scaling.factor", math.inf),
                                        ("llama.rope.scaling.factor", math.nan),
                                        ("llama.rope.freq_base", math.inf),
                                        ("llama.attention.layer_norm_rms_epsilon", math.nan)])
def test_gguf_float_metadata_that_is_not_finite_is_refused_naming_the_key(tmp_path, gguf_parts, key, value):
    meta = {key: ("f32", value)}
    if key.startswith("llama.rope.scaling"):
        meta["llama.rope.scaling.type"] = ("str", "linear")
    with pytest.raises(ConfigError, match=f"{key}.*finite"):
        read_checkpoint(bent_gguf(tmp_path, gguf_parts, **meta))


@pytest.mark.parametrize("changes", [
    {"rope_theta": math.inf}, {"norm_eps": -math.inf},
    {"norm_eps": math.nan}, {"rope_theta": np.float32(np.inf)},
])
def test_model_config_refuses_every_non_finite_float(changes):
    """The one check every format passes through, whichever reader built the config."""
    base = dict(dim=64, hidden_dim=128, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=32, max_seq_len=16)
    with pytest.raises(ConfigError, match="finite"):
        ModelConfig(**base, **changes)


@pytest.mark.parametrize("fields", [
    {"factor": math.inf}, {"factor": 8.0, "low_freq_factor": math.nan}, {"factor": 8.0, "high_freq_factor": math.inf},
    {"factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0},  # hi - lo divides: must be > 0
])
def test_rope_scaling_refuses_non_finite_or_degenerate_factors(fields):
    with pytest.raises(ConfigError):
        RopeScaling("llama3", **fields)


@pytest.mark.parametrize("field, text", [("rms_norm_eps", "Infinity"), ("rope_theta", "NaN"),
                                         ("rope_parameters", '{"rope_type": "linear", "factor": Infinity}'),
                                         ("rope_theta", '"abc"')])
def test_config_json_non_finite_or_mistyped_floats_are_refused(tmp_path, field, text):
    """Python's json reads NaN and Infinity literals; they name the field in the error."""
    folder = tmp_path / "hf"
    shutil.copytree(FIXTURE, folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("rope_scaling", None)
    config.pop("rope_parameters", None)
    body = json.dumps({**config, field: "@@"}).replace('"@@"', text)
    (folder / "config.json").write_text(body)
    with pytest.raises(ConfigError, match=field if field != "rope_parameters" else "factor"):
        read_checkpoint(folder)
