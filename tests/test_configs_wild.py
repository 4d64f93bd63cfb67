"""Checkpoints as they are found in the wild: a null end token, a vocabulary padded past the tokenizer, token ids
outside the vocabulary."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import npllm
from npllm.config import ModelConfig
from npllm.errors import ConfigError, TokenizerError
from npllm.formats import read_checkpoint
from npllm.formats.llama2c import write_llama2c
from npllm.formats.random import random_weights
from npllm.models import make_model
from tests_support import COMPILE_TIMEOUT, REPO, assert_padding_never_drawn, pad_vocabulary

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
PROMPT = "Once upon a time"


def qwen2_copy(tmp_path, config_changes=None, generation=None) -> Path:
    """The qwen2_bias fixture (transformers' reference logits beside it) with config.json changed and
    generation_config.json replaced (None: removed). The weights are the fixture's, so the reference logits hold."""
    folder = tmp_path / "qwen2"
    shutil.copytree(FIXTURES / "qwen2_bias", folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(config_changes or {})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "generation_config.json").unlink()
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


def test_qwen2_with_null_eos_loads_and_matches_transformers_logits(tmp_path):
    """transformers writes "eos_token_id": null for a Qwen2 config without one; with no generation_config.json
    either, the model runs without an end token."""
    folder = qwen2_copy(tmp_path, {"eos_token_id": None, "bos_token_id": None})
    llm = npllm.load(folder, backend="numpy")
    assert llm.config.eos_ids == () and llm.config.bos_id is None
    ref = np.load(folder / "reference.npz")
    assert np.abs(llm.logits(ref["tokens"]) - ref["logits"]).max() < 1e-4
    # nothing ends it but the limit
    assert len(list(llm.generate_ids(ref["tokens"][:4], 20, temperature=1.0, seed=3))) == 20


def test_null_eos_falls_back_to_generation_config(tmp_path):
    folder = qwen2_copy(tmp_path, {"eos_token_id": None}, generation={"eos_token_id": [1, 4]})
    config, _ = read_checkpoint(folder)
    assert config.eos_ids == (1, 4)
    missing = qwen2_copy(tmp_path / "b", None, generation={"eos_token_id": 4})
    config = json.loads((missing / "config.json").read_text())
    del config["eos_token_id"]
    (missing / "config.json").write_text(json.dumps(config))
    assert read_checkpoint(missing)[0].eos_ids == (4,)


def test_info_says_when_there_is_no_end_token(tmp_path):
    folder = qwen2_copy(tmp_path, {"eos_token_id": None})
    result = subprocess.run([sys.executable, "-m", "npllm", "info", str(folder)], capture_output=True, text=True,
                            cwd=REPO, timeout=COMPILE_TIMEOUT)
    assert result.returncode == 0, result.stderr
    assert "end tokens:   none" in result.stdout
    with_eos = subprocess.run([sys.executable, "-m", "npllm", "info", str(FIXTURES / "qwen2_bias")],
                              capture_output=True, text=True, cwd=REPO, timeout=COMPILE_TIMEOUT)
    assert "end tokens:   1" in with_eos.stdout


@pytest.mark.parametrize("change", [{"eos_token_id": 320}, {"eos_token_id": [1, -1]}, {"bos_token_id": 999}])
def test_token_ids_outside_the_vocabulary_are_refused(tmp_path, change):
    folder = qwen2_copy(tmp_path, change)
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        read_checkpoint(folder)


@pytest.fixture(scope="module")
def padded_stories(tmp_path_factory, stories260k):
    """stories260K with 8 padding rows (tied embedding and LM head) that would win the greedy pick at every
    position of PROMPT if sampled: each is 50 times the row of the token the model picks at one position."""
    config, weights = read_checkpoint(stories260k)
    plain = npllm.load(stories260k, tokenizer=stories260k.parent / "tok512.model", backend="numpy")
    picks = plain.logits(plain.tokenizer.encode(PROMPT, bos=True)).argmax(axis=1)
    emb = np.asarray(weights["tok_embeddings"])
    loud = 50 * emb[np.resize(picks, 8)]
    padded = dict(weights, tok_embeddings=np.concatenate([emb, loud]))
    path = tmp_path_factory.mktemp("padded") / "padded.bin"
    write_llama2c(path, config.replace(vocab_size=config.vocab_size + 8), padded)
    return path


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_padded_vocabulary_loads_and_padding_is_never_sampled(padded_stories, stories260k, backend):
    """The model masks the padding (its config's usable_vocab, set by npllm.load from the tokenizer): every path
    out of the model, single or batched, greedy or sampled, on the host or by the compiled sampler."""
    tokenizer = stories260k.parent / "tok512.model"
    llm = npllm.load(padded_stories, tokenizer=tokenizer, backend=backend)
    plain = npllm.load(stories260k, tokenizer=tokenizer, backend=backend)
    assert llm.config.usable_vocab == 512 and llm.config.vocab_size == 520
    ids = plain.tokenizer.encode(PROMPT, bos=True)
    hidden = llm.model.forward(ids, np.arange(len(ids)), llm.model.new_cache())
    raw = llm.model.head_logits(hidden)
    assert (raw.argmax(axis=1) >= 512).all()  # unmasked, a padding id would be every greedy pick
    logits = llm.logits(ids)
    assert np.isneginf(logits[:, 512:]).all()
    np.testing.assert_array_equal(logits[:, :512], plain.logits(ids))
    new = list(llm.generate_ids(ids, 60, temperature=1.0, seed=0))
    assert new and max(new) < 512 and new == list(plain.generate_ids(ids, 60, temperature=1.0, seed=0))
    assert llm.generate("Once upon a time", 40, temperature=0) == plain.generate("Once upon a time", 40,
                                                                                 temperature=0)
    for strategy in ("static", "ragged", "continuous"):  # batched generation goes through the same mask
        tokens, _ = llm.generate_tokens([ids, ids[:2]], 40, temperature=1.0, strategy=strategy, seed=1)
        assert max(max(t) for t in tokens) < 512, strategy


# A model small enough for any backend (its compiled code is the same as any model's)
SMALL = ModelConfig(dim=32, hidden_dim=48, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=50, max_seq_len=32)


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_the_model_masks_a_padded_vocabulary_on_every_backend(backend):
    """lm_head gives the ids past config.usable_vocab -inf, and every draw (the compiled sampler's, the host's)
    is the unpadded model's; models/cuda.py's device sampler: test_cuda_model.py."""
    weights = random_weights(SMALL, seed=5)
    plain = make_model(SMALL, weights, backend)
    hidden = plain.forward([1, 7, 9, 30], [0, 1, 2, 3], plain.new_cache())
    padded = make_model(*pad_vocabulary(SMALL, weights, np.resize(plain.lm_head(hidden).argmax(axis=1), 6)), backend)
    assert_padding_never_drawn(plain, padded, hidden, exact=backend != "numpy")


def test_usable_vocab_is_an_id_count_inside_the_vocabulary():
    assert SMALL.replace(usable_vocab=50).usable_vocab == 50
    for bad in (0, 51, 2.5):
        with pytest.raises(ConfigError, match="usable_vocab"):
            SMALL.replace(usable_vocab=bad)


def test_a_tokenizer_far_smaller_than_the_embedding_is_refused(padded_stories, stories260k, tmp_path):
    config, weights = read_checkpoint(stories260k)
    big = tmp_path / "big.bin"
    emb = np.asarray(weights["tok_embeddings"])
    write_llama2c(big, config.replace(vocab_size=1024), dict(weights, tok_embeddings=np.concatenate([emb, emb])))
    with pytest.raises(TokenizerError, match="512 pieces"):
        npllm.load(big, tokenizer=stories260k.parent / "tok512.model")
    with pytest.raises(TokenizerError):  # a llama2.c .bin vocabulary is read for exactly the model's ids
        npllm.load(padded_stories, tokenizer=stories260k.parent / "tok512.bin")
