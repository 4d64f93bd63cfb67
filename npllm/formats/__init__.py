"""Checkpoint readers. Each returns (ModelConfig, weights) with weights a dict of float32 arrays named as below.

Canonical weight names (Meta's, as in llama2.c), all matrices stored [out, in] so a projection is x @ W.T:

    tok_embeddings             [V, D]
    layers.{l}.attention_norm  [D]
    layers.{l}.wq              [H*Dh, D]     layers.{l}.bq [H*Dh]   (only with attention_bias)
    layers.{l}.wk              [K*Dh, D]     layers.{l}.bk [K*Dh]
    layers.{l}.wv              [K*Dh, D]     layers.{l}.bv [K*Dh]
    layers.{l}.wo              [D, H*Dh]
    layers.{l}.ffn_norm        [D]
    layers.{l}.w1              [F, D]        gate projection
    layers.{l}.w2              [D, F]        down projection
    layers.{l}.w3              [F, D]        up projection
    norm                       [D]
    output                     [V, D]        absent when config.tied_embeddings

Arrays may be read-only memory maps of the checkpoint file: nothing in npllm writes to a weight.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..config import ModelConfig
from ..errors import ConfigError, FormatError
from ..tensors import release, release_files

GGUF_MAGIC = b"GGUF"


def read_checkpoint(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Pick the reader from what is on disk: a HF directory (config.json), a .safetensors file (config.json beside
    it), a GGUF file (magic b"GGUF"), else a llama2.c .bin.

    The weights come in their file types, whatever will run them: a GGUF file's matrices as quant.QuantizedMatrix
    over the memory map (read_gguf_quantized), other formats' as arrays; models.make_model decides the storage."""
    path = Path(path)
    if not path.exists():
        raise FormatError(f"checkpoint {path} does not exist")
    if not (path.is_file() or path.is_dir()):  # a FIFO or a device would block or never end
        raise FormatError(f"checkpoint {path} is not a regular file or a directory")
    if path.is_dir() or path.suffix == ".safetensors" or path.name.endswith(".safetensors.index.json"):
        from .hf import read_hf

        config, weights = read_hf(path)
    else:
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic == GGUF_MAGIC:
            from .gguf import read_gguf_quantized

            config, weights = read_gguf_quantized(path)
        else:
            from .llama2c import read_llama2c

            config, weights = read_llama2c(path)
    check_token_ids(config, path)
    check_finite(weights, path)
    return config, weights


def read_config(path: str | os.PathLike) -> ModelConfig:
    """The ModelConfig of a checkpoint from its headers alone (config.json, GGUF metadata, llama2.c header), no
    weight read: enough to tell a checkpoint that lacks a tokenizer from a file that is no checkpoint at all."""
    path = Path(path)
    if not path.exists():
        raise FormatError(f"checkpoint {path} does not exist")
    if not (path.is_file() or path.is_dir()):
        raise FormatError(f"checkpoint {path} is not a regular file or a directory")
    if path.is_dir() or path.suffix == ".safetensors" or path.name.endswith(".safetensors.index.json"):
        from .hf import CONFIG_FILE, read_config_json

        return read_config_json((path if path.is_dir() else path.parent) / CONFIG_FILE)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == GGUF_MAGIC:
        from .gguf import config_from_gguf, read_gguf_file

        return config_from_gguf(read_gguf_file(path))
    from .llama2c import read_llama2c

    return read_llama2c(path)[0]  # its tensors are memory-mapped, not read (a v2 file's are dequantized)


def check_finite(weights: dict[str, np.ndarray], source) -> None:
    """Every weight a finite number. NaN or infinity in a checkpoint (a corrupt file, F16 bits read as BF16) would
    only show up later as NaN logits, after the prompt was echoed; one pass over the weights catches it at load.
    Each weight's pages of the file are released once checked (see release): the pass leaves no copy resident."""
    from ..quant import as_matrix

    for name, array in weights.items():
        if not as_matrix(array).is_finite():
            raise FormatError(f"{source}: weight {name!r} holds NaN or infinite values (a corrupt checkpoint?)")
        release(array)
    release_files(weights.values())


def check_token_ids(config: ModelConfig, source) -> None:
    """BOS and end ids must name rows of the embedding: an id past the vocabulary is a broken checkpoint."""
    named = ([("bos", config.bos_id)] if config.bos_id is not None else []) + [("eos", e) for e in config.eos_ids]
    for what, token in named:
        if not 0 <= token < config.vocab_size:
            raise ConfigError(f"{source}: {what} token id {token} is outside the vocabulary [0, {config.vocab_size})")
