"""Issue 41's file-level bad inputs: output paths of `npllm quantize`, non-finite metadata and token scores, a cache
folder that cannot be made, tokenizer files whose fields have the wrong types or encodings."""

import json
import math
import os
import shutil
import stat

import numpy as np
import pytest

from npllm.cli import main
from npllm.config import ModelConfig, RopeScaling
from npllm.errors import ConfigError, FormatError
from npllm.formats import read_checkpoint
from npllm.formats.gguf_write import TensorData, write_gguf_file
from tests_support import REPO, load_campaign

FIXTURE = REPO / "tests" / "fixtures" / "hf" / "qwen2_bias"


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


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_quantize_into_a_folder_no_file_can_be_made_in_is_one_error_line(capsys):
    """/proc takes no new file, even from root (where a read-only folder would not stop the write)."""
    assert main(["quantize", "stories260K", "/proc/npllm-test.gguf", "--type", "f32"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith("npllm: error: cannot write /proc/npllm-test.gguf")


def test_a_failed_write_leaves_no_partial_file(tmp_path, monkeypatch):
    """A write error part-way (a full disk) is one FormatError, and the half-written file is removed."""
    import npllm.formats.gguf_write as gguf_write

    def fail(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf_write.os, "replace", fail)
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


# ---- 10: a cache folder that cannot be made; tokenizer fields of the wrong type or encoding --------------------


@pytest.mark.parametrize("below", ["", "sub"])
def test_a_cache_folder_that_cannot_be_made_is_one_error_line(tmp_path, monkeypatch, capsys, below):
    a_file = tmp_path / "a_file"
    a_file.write_bytes(b"")
    monkeypatch.setenv("XDG_CACHE_HOME", str(a_file / below))
    monkeypatch.delenv("NPLLM_WEIGHTS", raising=False)
    monkeypatch.setenv("NPLLM_HUB_URL", "http://127.0.0.1:9")
    assert main(["generate", "Once", "--model", "stories15M"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith("npllm: error: cannot make the folder") and "XDG_CACHE_HOME" in captured.err


def test_every_tokenizer_json_field_of_a_wrong_type_is_a_tokenizer_error():
    """Each field of a real tokenizer.json, at every depth, replaced by values of every other JSON type: the file
    is refused with a TokenizerError or still makes a working tokenizer; nothing else escapes."""
    from npllm.errors import TokenizerError
    from npllm.tokenizer.bytelevel import ByteLevelBPE

    campaign = load_campaign()
    spec = json.loads((FIXTURE / "tokenizer.json").read_text())
    refused = 0
    for path, value in campaign.json_variants(spec):
        try:
            tokenizer = ByteLevelBPE.from_spec(campaign.json_with(spec, path, value), "t.json")
            tokenizer.decode(tokenizer.encode("Hello world 123 <|im_start|>", bos=True))
        except TokenizerError:
            refused += 1
    assert refused > 100  # the variants do reach the checks


def deeply_nested_normalizer(depth: int) -> dict:
    spec = {"type": "NFC"}
    for _ in range(depth):
        spec = {"type": "Sequence", "normalizers": [spec]}
    return spec


@pytest.mark.parametrize("path, value, said", [
    (("normalizer",), [1], "normalizer must be an object"),
    (("added_tokens",), 5, "added_tokens must be an array"),
    (("model", "ignore_merges"), "false", "ignore_merges must be true or false"),
    (("added_tokens", 0, "content"), 7, "malformed added token"),
    (("added_tokens", 0, "special"), "yes", "special must be true or false"),
    (("pre_tokenizer", "pretokenizers", 0, "pattern", "Regex"), None, "Regex must be a string"),
    (("model", "vocab", "a"), -1, "integer ids >= 0"),
    (("post_processor",), {"type": "TemplateProcessing", "single": [{"SpecialToken": "x"}]}, "SpecialToken"),
    (("normalizer",), deeply_nested_normalizer(2000), "nested too deeply"),
])
def test_tokenizer_json_shapes_that_were_tracebacks_or_misread_name_the_field(tmp_path, path, value, said):
    from npllm.errors import TokenizerError
    from npllm.tokenizer.bytelevel import ByteLevelBPE

    spec = json.loads((FIXTURE / "tokenizer.json").read_text())
    with pytest.raises(TokenizerError, match=said):
        ByteLevelBPE.from_spec(load_campaign().json_with(spec, path, value), "t.json")


@pytest.mark.parametrize("key", ["tokenizer.ggml.pre", "tokenizer.ggml.add_space_prefix",
                                 "tokenizer.ggml.add_bos_token", "tokenizer.ggml.unknown_token_id"])
def test_gguf_tokenizer_keys_of_a_wrong_type_are_refused_naming_the_key(tmp_path, gguf_parts, key):
    import npllm

    metadata = {key: ("arr", ("i32", [1, 2]))}
    if key == "tokenizer.ggml.pre":
        metadata.update({"tokenizer.ggml.model": ("str", "gpt2"), "tokenizer.ggml.merges": ("arr", ("str", ["a b"]))})
    with pytest.raises(FormatError, match=key):
        npllm.load(bent_gguf(tmp_path, gguf_parts, **metadata), backend="numpy")


@pytest.mark.parametrize("bend, said", [({"byte_at": 3}, "not valid UTF-8"), ({"byte_at": 0}, "not valid UTF-8"),
                                        ({"score": math.nan}, "score nan"), ({"score": -math.inf}, "score -inf")])
def test_sentencepiece_pieces_not_utf8_or_scores_not_finite_are_refused_at_load(tmp_path, weights_dir, bend, said):
    from npllm.errors import TokenizerError
    from npllm.tokenizer import load_tokenizer

    model = (weights_dir / "stories260K" / "tok512.model").read_bytes()
    path = tmp_path / "bent.model"
    path.write_bytes(load_campaign().sentencepiece_bent(model, "\u2581the".encode(), **bend))
    with pytest.raises(TokenizerError, match=f"piece \\d+ .*{said}"):
        load_tokenizer(path)
