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


import mmap
import os
from pathlib import Path

import numpy as np

from ..config import ModelConfig
from ..errors import ConfigError, FormatError

GGUF_MAGIC = b"GGUF"


def read_checkpoint(path: str | os.PathLike, keep_quantized: bool = False) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Pick the reader from what is on disk: a HF directory (config.json), a .safetensors file (config.json beside
    it), a GGUF file (magic b"GGUF"), else a llama2.c .bin.

    keep_quantized: a GGUF file's matrices come as quant.QuantizedMatrix over the memory map, in their file types
    (read_gguf_quantized), instead of float32 arrays; other formats are read as always."""
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
            from .gguf import read_gguf, read_gguf_quantized

            config, weights = (read_gguf_quantized if keep_quantized else read_gguf)(path)
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
    from ..quant import QuantizedMatrix

    for name, array in weights.items():
        finite = array.is_finite() if isinstance(array, QuantizedMatrix) else np.isfinite(array).all()
        if not finite:
            raise FormatError(f"{source}: weight {name!r} holds NaN or infinite values (a corrupt checkpoint?)")
        release(array)
    release_files(weights.values())


def release(*weights) -> None:
    """Drop the pages of weights read from a memory-mapped file from this process's resident memory.

    Reading a mapped weight makes its pages resident, and they stay counted in the process's memory as long as the
    map lives. A backend that copies the weights into its own layout (the numba model's panels) would then hold the
    model twice; releasing each weight once it is copied keeps one copy. Nothing is lost: a released page is read
    back from the file (usually from the OS's page cache) if the weight is ever read again. Weights that are not
    views of a read-only file mapping (arrays in memory, copies) are left alone; so is everything on a system
    without madvise.
    """
    from ..quant import QuantizedMatrix

    for w in weights:
        a = w.raw if isinstance(w, QuantizedMatrix) else w
        mapping = _file_mapping(a)
        if mapping is None or not a.flags.c_contiguous or a.nbytes == 0:
            continue
        start = a.ctypes.data - np.frombuffer(mapping, np.uint8, count=1).ctypes.data
        first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages inside the weight: neighbours keep theirs
        end = (start + a.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > first:
            mapping.madvise(mmap.MADV_DONTNEED, first, end - first)


def release_files(weights) -> None:
    """release() of every page of each read-only file mapping the weights view, one call per mapping, once the
    caller is done with all of them (a check of every weight, a copy into a backend's layout). A weight's own
    release() keeps the pages it shares with its neighbours, and reading the next weight can map some of its pages
    back in (the kernel maps cached neighbours around a fault: up to a large folio, 2 MiB): 10-14 MB of a 110M
    Q4_0 GGUF stayed resident after the pass of check_finite that way, ~18 MB after loading its F32 twin."""
    from ..quant import QuantizedMatrix

    mappings = {}
    for w in weights:
        mapping = _file_mapping(w.raw if isinstance(w, QuantizedMatrix) else w)
        if mapping is not None:
            mappings[id(mapping)] = mapping
    for mapping in mappings.values():
        mapping.madvise(mmap.MADV_DONTNEED, 0, len(mapping))


def _file_mapping(a) -> mmap.mmap | None:
    """The read-only mmap.mmap an array is a view of, or None."""
    if not isinstance(a, np.ndarray) or not hasattr(mmap, "MADV_DONTNEED"):
        return None
    base = a
    while base is not None:
        if isinstance(base, np.memmap) and isinstance(getattr(base, "_mmap", None), mmap.mmap):
            base = base._mmap
        if isinstance(base, mmap.mmap):
            # only a mapping that cannot be written is dropped: its pages always equal the file's
            return base if _read_only(base) else None
        base = base.obj if isinstance(base, memoryview) else getattr(base, "base", None)
    return None


def _read_only(mapping: mmap.mmap) -> bool:
    try:
        with memoryview(mapping) as view:
            return view.readonly
    except (TypeError, ValueError):  # a closed mapping
        return False


def check_token_ids(config: ModelConfig, source) -> None:
    """BOS and end ids must name rows of the embedding: an id past the vocabulary is a broken checkpoint."""
    named = ([("bos", config.bos_id)] if config.bos_id is not None else []) + [("eos", e) for e in config.eos_ids]
    for what, token in named:
        if not 0 <= token < config.vocab_size:
            raise ConfigError(f"{source}: {what} token id {token} is outside the vocabulary [0, {config.vocab_size})")


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every canonical weight the model needs, with its shape ([out, in] for matrices)."""
    D, F, V, Dh = config.dim, config.hidden_dim, config.vocab_size, config.head_dim
    HD, KD = config.n_heads * Dh, config.n_kv_heads * Dh
    shapes = {"tok_embeddings": (V, D), "norm": (D,)}
    if not config.tied_embeddings:
        shapes["output"] = (V, D)
    for l in range(config.n_layers):
        p = f"layers.{l}."
        shapes |= {p + "attention_norm": (D,), p + "wq": (HD, D), p + "wk": (KD, D), p + "wv": (KD, D),
                   p + "wo": (D, HD), p + "ffn_norm": (D,), p + "w1": (F, D), p + "w2": (D, F), p + "w3": (F, D)}
        if config.attention_bias:
            shapes |= {p + "bq": (HD,), p + "bk": (KD,), p + "bv": (KD,)}
    return shapes


def check_weights(config: ModelConfig, weights: dict[str, np.ndarray], source: str) -> dict[str, np.ndarray]:
    """Every needed weight present with the shape the config implies, nothing left over (no silent garbage model);
    returns the needed set.

    A stored lm_head equal in role to the tied embedding is dropped for tied models (some exports save both).
    """
    shapes = expected_shapes(config)
    missing = [n for n in shapes if n not in weights]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise FormatError(f"{source}: missing weight {missing[0]!r}{more}")
    extra = [n for n in weights if n not in shapes and not (n == "output" and config.tied_embeddings)]
    if extra:
        raise FormatError(f"{source}: weight {extra[0]!r} does not belong to a model with this config")
    for name, shape in shapes.items():
        if tuple(weights[name].shape) != shape:
            what = "vocabulary size" if name in ("tok_embeddings", "output") else "shape"
            raise FormatError(
                f"{source}: weight {name!r} has shape {tuple(weights[name].shape)}, but the config implies {shape} "
                f"(wrong {what}?)"
            )
    return {name: weights[name] for name in shapes}
