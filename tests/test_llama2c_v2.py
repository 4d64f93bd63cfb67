"""llama2.c version-2 checkpoints (export.py --version 2, what runq.c runs): int8 groups with float32 scales.

The file is written by formats.llama2c.write_llama2c(version=2), which quantizes as export.py does (per group of
group_size values of the row-by-row flattened tensor: scale = max|w| / 127, q = round(w / scale)); the tests check
those bytes against the rule computed here, and the weights read back against the bound it implies.

Tolerances:
- weights: |read - w| <= scale / 2 per value (plus float32 rounding of q * scale), scale = its group's max|w| / 127.
- logits: each weight moves by at most 1/254 of its group's largest; through stories260K's 5 layers the logits
  moved by 1.7% of max|logits| (0.32 of 19.3); the test allows 8/254 (3.1%), and top-1 agreement on every position.
"""

import struct

import numpy as np
import pytest

import npllm
from npllm.errors import FormatError
from npllm.formats import read_checkpoint
from npllm.formats.llama2c import read_llama2c, write_llama2c
from npllm.models import make_model

from test_kv_dtype import PROMPT


@pytest.fixture(scope="module")
def float_model(stories260k):
    return read_llama2c(stories260k)


@pytest.fixture(scope="module")
def v2_file(float_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("v2") / "stories260K-q80.bin"
    write_llama2c(path, *float_model, version=2)
    return path


def expected_groups(w: np.ndarray, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """export.py's rule, written out again: int8 values and float32 scales of each group."""
    groups = w.astype(np.float32).reshape(-1, group_size)
    scale = np.max(np.abs(groups), axis=1) / np.float32(127)
    return np.round(groups / scale[:, None]).astype(np.int8), scale


def test_header_and_first_tensor_bytes_follow_export_py(float_model, v2_file):
    config, weights = float_model
    data = v2_file.read_bytes()
    magic, version, *ints = struct.unpack("<Ii7i", data[:36])
    assert (magic, version) == (0x616B3432, 2)  # "ak42"
    assert ints == [64, 172, 5, 8, 4, 512, 512]
    assert data[36] == 1  # shared classifier
    group_size = struct.unpack("<i", data[37:41])[0]
    assert group_size == 64  # export.py's default divides dim 64
    assert set(data[41:256]) == {0}
    norms = 4 * (2 * config.n_layers * config.dim + config.dim)
    q, scale = expected_groups(weights["tok_embeddings"], group_size)
    start = 256 + norms
    assert data[start:start + q.size] == q.tobytes()
    assert data[start + q.size:start + q.size + 4 * scale.size] == scale.astype("<f4").tobytes()
    layers = config.n_layers * sum(weights[f"layers.0.{n}"].size for n in ("wq", "wk", "wv", "wo", "w1", "w2", "w3"))
    assert len(data) == start + (weights["tok_embeddings"].size + layers) * (1 + 4 / group_size)


def test_weights_read_back_within_half_a_step(float_model, v2_file):
    config, weights = float_model
    config2, read = read_checkpoint(v2_file)
    assert config2 == config and read.keys() == weights.keys()
    for name, w in weights.items():
        got = read[name]
        assert got.dtype == np.float32 and got.shape == w.shape
        if w.ndim == 1:  # norms stay float32
            np.testing.assert_array_equal(got, w)
            continue
        _, scale = expected_groups(w, 64)
        step = np.repeat(scale, 64).reshape(w.shape)
        assert np.all(np.abs(got - w) <= step / 2 * (1 + 1e-6) + 1e-12), name


def test_logits_close_to_the_float_model_and_greedy_follows_golden(float_model, v2_file, golden_200, stories260k):
    float_logits = make_model(*float_model, "numba").logits(PROMPT)
    llm = npllm.load(v2_file, tokenizer=stories260k.parent / "tok512.bin")
    logits = llm.model.logits(PROMPT)
    assert np.abs(logits - float_logits).max() <= 8 / 254 * np.abs(float_logits).max()
    assert np.array_equal(logits.argmax(-1), float_logits.argmax(-1))
    text = llm.generate("", max_new_tokens=200, temperature=0)
    golden = llm.tokenizer.encode(golden_200)
    ids = llm.tokenizer.encode(text)
    agree = next((i for i, (a, b) in enumerate(zip(ids, golden)) if a != b), min(len(ids), len(golden)))
    print(f"stories260K llama2.c v2 (int8, groups of 64): {agree} greedy tokens match greedy_200.txt")
    assert agree >= 50  # measured: 61 tokens (of the text's 200), "Once upon a time, ... Lily. ..."


def test_untied_classifier_and_small_groups(float_model, tmp_path):
    config, weights = float_model
    untied = config.replace(tied_embeddings=False)
    out = dict(weights, output=weights["tok_embeddings"][::-1].copy())
    write_llama2c(tmp_path / "u.bin", untied, out, version=2, group_size=4)
    config2, read = read_llama2c(tmp_path / "u.bin")
    assert config2 == untied
    assert struct.unpack("<i", (tmp_path / "u.bin").read_bytes()[37:41])[0] == 4
    np.testing.assert_allclose(read["output"], out["output"], atol=np.abs(out["output"]).max() / 254)


def test_bad_v2_files_are_format_errors(v2_file, tmp_path):
    data = bytearray(v2_file.read_bytes())

    def check(name, content, match):
        path = tmp_path / name
        path.write_bytes(bytes(content))
        with pytest.raises(FormatError, match=match):
            read_checkpoint(path)

    check("truncated.bin", data[:-5], "truncated")
    check("long.bin", data + b"\0" * 4, "longer than its header says")
    check("header.bin", data[:100], "truncated inside its 256-byte header")
    check("v3.bin", data[:4] + struct.pack("<i", 3) + data[8:], "version 3")
    check("group0.bin", data[:37] + struct.pack("<i", 0) + data[41:], "group size 0")
    check("group7.bin", data[:37] + struct.pack("<i", 7) + data[41:], "group size 7")
    check("magic.bin", b"ak43" + data[4:], "not a plausible size")  # read as a legacy header: nonsense sizes
    nan_scale = data[:]
    start = 256 + 4 * (2 * 5 * 64 + 64) + 512 * 64  # the embedding's first scale
    nan_scale[start:start + 4] = struct.pack("<f", float("nan"))
    check("nan.bin", nan_scale, "NaN or infinite")


def test_info_names_the_int8_groups(v2_file, capsys):
    from npllm.cli import main

    assert main(["info", str(v2_file)]) == 0
    assert "int8 groups (llama2.c v2), F32 norms" in capsys.readouterr().out
