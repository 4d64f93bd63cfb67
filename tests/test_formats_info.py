"""`npllm info`'s summary: every line computed from the checkpoint, checked against what the fixtures are."""

from pathlib import Path

import numpy as np
import pytest

from npllm.formats import read_checkpoint
from npllm.info import describe, kv_cache_bytes

FIXTURES = Path(__file__).parent / "fixtures" / "hf"


def info(path):
    config, weights = read_checkpoint(path)
    return config, weights, describe(config, weights, path)


def field(text, name):
    return next(line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith(name + ":"))


def test_hf_llama3_fixture():
    config, weights, text = info(FIXTURES / "llama3_tied")
    assert "llama, 2 layers, dim 64, FFN 96, 4 heads / 2 KV heads of 16, vocab 320" in field(text, "architecture")
    assert "llama3 RoPE scaling x8" in text and "tied embeddings" in text and "RoPE theta 500000" in text
    n = sum(w.size for w in weights.values())
    assert n == config.n_params and f"({n:,})" in field(text, "parameters")
    assert field(text, "on disk") == "F32 x20"
    assert field(text, "context") == "256 tokens"
    assert field(text, "tokenizer").startswith("byte-level BPE tokenizer.json: 320 tokens, 5 of them")


def test_memory_line_adds_weights_and_full_context_cache():
    config, weights, text = info(FIXTURES / "mistral_window")
    weight_kib = sum(w.nbytes for w in weights.values()) / 1024
    cache_kib = kv_cache_bytes(config, 128) / 1024
    assert cache_kib == 2 * 2 * 128 * 2 * 16 * 4 / 1024
    assert f"{weight_kib / 1024:.1f} MiB weights" in field(text, "memory")
    assert f"{cache_kib:.1f} KiB KV cache" in field(text, "memory")
    assert "sliding window 16" in text


def test_bf16_sharded_and_bias():
    assert field(info(FIXTURES / "llama_bf16")[2], "on disk") == "BF16 x21"
    assert field(info(FIXTURES / "llama_sharded")[2], "on disk") == "F32 x21"
    assert "q/k/v bias" in info(FIXTURES / "qwen2_bias")[2]


def test_gguf_counts_tensor_types_and_embedded_vocab(tmp_path):
    gguf = pytest.importorskip("gguf")
    from test_formats_gguf import write_gguf
    from npllm.formats.hf import read_hf

    config, weights = read_hf(FIXTURES / "llama_gqa")

    def vocab(w):
        w.add_tokenizer_model("llama")
        w.add_token_list([f"t{i}" for i in range(320)])
        w.add_token_scores([0.0] * 320)

    path = write_gguf(tmp_path / "m.gguf", config, weights, gguf.GGMLQuantizationType.Q8_0, vocab=vocab)
    text = info(path)[2]
    sizes = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        sizes[t.tensor_type.name] = sizes.get(t.tensor_type.name, 0) + int(t.n_bytes)
    assert field(text, "on disk") == (f"Q8_0 x16 ({sizes['Q8_0'] / 2**20:.1f} MiB), "
                                      f"F32 x5 ({sizes['F32'] / 1024:.1f} KiB)")
    assert field(text, "tokenizer") == "SentencePiece-style BPE, 320 tokens, embedded in the GGUF metadata"


def test_llama2c(stories260k):
    text = info(stories260k)[2]
    assert field(text, "on disk") == "F32" and field(text, "context") == "512 tokens"
    assert "(260,032)" in field(text, "parameters") and field(text, "tokenizer").endswith(".bin")
