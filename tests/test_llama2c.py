"""llama2.c checkpoints: both layouts read to the same weights, and every kind of bad file is a clear FormatError."""

import struct

import numpy as np
import pytest

from npllm.errors import FormatError
from npllm.formats import read_checkpoint
from npllm.formats.llama2c import read_llama2c, write_llama2c


def test_stories260k_header(stories260k):
    config, weights = read_llama2c(stories260k)
    assert (config.dim, config.hidden_dim, config.n_layers, config.n_heads, config.n_kv_heads) == (64, 172, 5, 8, 4)
    assert (config.vocab_size, config.max_seq_len, config.tied_embeddings) == (512, 512, True)
    assert isinstance(weights["layers.0.wq"].base, np.memmap) or isinstance(weights["layers.0.wq"], np.memmap)
    assert "output" not in weights


@pytest.mark.parametrize("version", [0, 1])
def test_write_then_read_round_trips(stories260k, tmp_path, version):
    config, weights = read_llama2c(stories260k)
    path = tmp_path / f"v{version}.bin"
    write_llama2c(path, config, weights, version=version)
    config2, weights2 = read_checkpoint(path)
    assert config2 == config
    assert weights2.keys() == weights.keys()
    for name in weights:
        np.testing.assert_array_equal(weights2[name], weights[name])
    if version == 1:
        assert path.read_bytes()[:4] == struct.pack("<I", 0x616B3432)


def test_untied_classifier_round_trips(stories260k, tmp_path):
    config, weights = read_llama2c(stories260k)
    untied = config.replace(tied_embeddings=False)
    weights = dict(weights, output=np.asarray(weights["tok_embeddings"]) * 2)
    for version in (0, 1):
        write_llama2c(tmp_path / "m.bin", untied, weights, version=version)
        config2, weights2 = read_llama2c(tmp_path / "m.bin")
        assert not config2.tied_embeddings
        np.testing.assert_array_equal(weights2["output"], weights["output"])


def test_missing_file(tmp_path):
    with pytest.raises(FormatError, match="does not exist"):
        read_checkpoint(tmp_path / "nope.bin")


@pytest.mark.parametrize("cut", [0, 10, 28, 1000, -4])
def test_truncated_file(stories260k, tmp_path, cut):
    data = stories260k.read_bytes()
    path = tmp_path / "cut.bin"
    path.write_bytes(data[:cut] if cut >= 0 else data[:cut])
    with pytest.raises(FormatError, match="cut.bin"):
        read_checkpoint(path)


def test_header_sizes_disagree_with_file_length(stories260k, tmp_path):
    data = bytearray(stories260k.read_bytes())
    data[0:4] = struct.pack("<i", 96)  # dim 96: the tensors would need more bytes than the file holds
    (tmp_path / "lie.bin").write_bytes(bytes(data))
    with pytest.raises(FormatError, match="truncated"):
        read_checkpoint(tmp_path / "lie.bin")
    (tmp_path / "long.bin").write_bytes(stories260k.read_bytes() + b"\0" * 8)
    with pytest.raises(FormatError, match="longer"):
        read_checkpoint(tmp_path / "long.bin")


@pytest.mark.parametrize("header", [(0, 172, 5, 8, 4, 512, 512), (64, 172, 5, 7, 4, 512, 512),
                                    (64, 172, 5, 8, 3, 512, 512), (-64, 172, 5, 8, 4, 512, 512),
                                    (64, 172, 5, 8, 4, 512, 1 << 30)])
def test_implausible_header(tmp_path, header):
    path = tmp_path / "bad.bin"
    path.write_bytes(struct.pack("<7i", *header) + b"\0" * 4096)
    with pytest.raises(FormatError, match="bad.bin"):
        read_checkpoint(path)


def test_wrong_format_and_unsupported_version(tmp_path):
    (tmp_path / "text.bin").write_bytes(b"this is not a checkpoint at all, just some text" * 10)
    with pytest.raises(FormatError):
        read_checkpoint(tmp_path / "text.bin")
    (tmp_path / "v3.bin").write_bytes(struct.pack("<Ii", 0x616B3432, 3) + b"\0" * 300)
    with pytest.raises(FormatError, match="version 3"):
        read_checkpoint(tmp_path / "v3.bin")
