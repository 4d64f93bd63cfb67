"""Writing GGUF files: npllm models in llama.cpp's names and layout (the reader is formats.gguf).

`write_gguf` writes a model (its matrices in one type of npllm.quant or a mixture such as Q4_K_M, vectors in F32, and
a SentencePiece-style vocabulary when given); `write_gguf_file` writes any metadata and tensors already in their
types. A file appears under its name only once complete.
"""

from __future__ import annotations

import contextlib
import os
import struct
import tempfile
from dataclasses import dataclass

import numpy as np

from ..config import ModelConfig
from ..errors import ConfigError, FormatError
from ..quant import MIXTURES
from .gguf import (ARRAY, BOOL, DEFAULT_ALIGNMENT, FLOAT32, GGUF_POOLINGS, INT64, MAGIC, SCALAR_TYPES, STRING, UINT32,
                   llama3_factors)
from .gguf_arch import GLOBAL_NAMES, LAYER_NAMES, ROPE_FREQS


@dataclass(frozen=True)
class TensorData:
    """One tensor to write: its bytes already in `type_name` (a name in npllm.quant.TYPES)."""

    name: str
    shape: tuple[int, ...]  # NumPy order: (rows, values per row)
    type_name: str
    raw: np.ndarray  # [nbytes] uint8


_ARRAY_TYPES = {np.dtype(d): t for t, d in SCALAR_TYPES.items() if t != BOOL}


def _encode_value(key: str, value) -> bytes:
    """A metadata value with its GGUF type tag: bool, int (u32, or i64 beyond it), float (f32), str, list of str,
    or a NumPy array of a fixed-size type or of bools (a flag per layer)."""
    if isinstance(value, (bool, np.bool_)):
        return struct.pack("<IB", BOOL, bool(value))
    if isinstance(value, (int, np.integer)):
        if 0 <= value < 2**32:
            return struct.pack("<II", UINT32, int(value))
        return struct.pack("<Iq", INT64, int(value))
    if isinstance(value, (float, np.floating)):
        return struct.pack("<If", FLOAT32, float(value))
    if isinstance(value, str):
        return struct.pack("<I", STRING) + _encode_string(value)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return struct.pack("<IIQ", ARRAY, STRING, len(value)) + b"".join(_encode_string(v) for v in value)
    if isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype == bool:
        return struct.pack("<IIQ", ARRAY, BOOL, len(value)) + value.astype(np.uint8).tobytes()
    if isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype.newbyteorder("<") in _ARRAY_TYPES:
        dtype = value.dtype.newbyteorder("<")
        return struct.pack("<IIQ", ARRAY, _ARRAY_TYPES[dtype], len(value)) + value.astype(dtype).tobytes()
    raise ConfigError(f"metadata {key!r}: cannot store a {type(value).__name__} in GGUF")


def _encode_string(text: str) -> bytes:
    data = text.encode("utf-8")
    return struct.pack("<Q", len(data)) + data


def write_gguf_file(path: str | os.PathLike, metadata: dict, tensors: list[TensorData],
                    alignment: int = DEFAULT_ALIGNMENT) -> None:
    """Write a GGUF version 3 file: header, metadata, tensor table, then each tensor's bytes at an aligned offset.

    The file appears under `path` only once complete (written beside it, then renamed).
    """
    path = os.fspath(path)
    header = [MAGIC, struct.pack("<IQQ", 3, len(tensors), len(metadata))]
    header += [_encode_string(key) + _encode_value(key, value) for key, value in metadata.items()]
    offset = 0
    offsets = []
    for t in tensors:
        ggml_type = quant_type(t.type_name)
        if t.raw.size != ggml_type.nbytes(t.shape) or t.shape[-1] % ggml_type.block_size:
            raise FormatError(f"tensor {t.name!r}: {t.raw.size} bytes of {t.type_name} do not hold shape {t.shape}")
        offsets.append(offset)
        ne = tuple(reversed(t.shape))
        header.append(_encode_string(t.name) + struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, ggml_type.type_id,
                                                          offset))
        offset += -(-t.raw.size // alignment) * alignment
    head = b"".join(header)
    check_output_path(path)
    with _partial_file(path) as f:
        f.write(head + bytes(-len(head) % alignment))
        for t, start in zip(tensors, offsets):
            f.write(np.ascontiguousarray(t.raw, dtype=np.uint8).tobytes())
            f.write(bytes(-t.raw.size % alignment))


def check_output_path(path: str | os.PathLike) -> None:
    """Refuse, before any work, a file to write that would replace something other than a regular file (a device,
    a FIFO, a folder, a link to one) or that cannot be made (its folder is missing, is not a folder, or is not
    writable). The rename that puts a finished file in place would otherwise swap a device for a plain file."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if not path or path.endswith(os.sep):
        raise FormatError(f"cannot write {path!r}: name a file to write")
    if os.path.lexists(path) and not os.path.isfile(path):
        kind = "a folder" if os.path.isdir(path) else "not a regular file"
        raise FormatError(f"cannot write {path}: it exists and is {kind}; name a new file or a regular one to replace")
    if not os.path.isdir(folder):
        what = "does not exist" if not os.path.lexists(folder) else "is not a folder"
        raise FormatError(f"cannot write {path}: the folder {folder} {what}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise FormatError(f"cannot write {path}: the folder {folder} is not writable")


@contextlib.contextmanager
def _partial_file(path: str):
    """A new file beside `path`, open for writing, renamed to `path` once the block ends without an error, else
    removed. It is made with a unique name (never an existing file, FIFO or device opened for writing) and gets the
    permissions a plain open() would give it (0o666 less the umask)."""
    folder, name = os.path.split(os.path.abspath(path))
    try:
        fd, partial = tempfile.mkstemp(prefix=f".{name}.", suffix=".partial", dir=folder)
    except OSError as e:
        raise FormatError(f"cannot write {path}: no file can be made in {folder} ({e.strerror or e})") from None
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as f:
            yield f
        check_output_path(path)  # again: what it names may have changed while the file was written
        os.replace(partial, path)
    except OSError as e:
        _remove(partial)
        raise FormatError(f"cannot write {path}: {e.strerror or e}") from None
    except BaseException:
        _remove(partial)
        raise


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def quant_type(name: str):
    from ..quant import TYPES

    if name not in TYPES:
        raise FormatError(f"unknown tensor type {name!r} (npllm knows {', '.join(TYPES)})")
    return TYPES[name]


def model_metadata(config: ModelConfig, name: str) -> dict:
    """llama.cpp's metadata keys for a ModelConfig; refuses what a GGUF 'llama'/'qwen2' model cannot express."""
    gguf_arch = "qwen2" if config.arch == "qwen2" else "llama"  # llama2c, llama and mistral are all 'llama'
    if config.features:
        raise ConfigError(f"npllm writes GGUF files of Llama-block models only; this {config.arch} model uses "
                          f"{', '.join(sorted(config.features))}")
    if config.sliding_window is not None:
        raise ConfigError("GGUF 'llama' models carry no sliding window: this model cannot be written faithfully")
    if config.attention_bias != (gguf_arch == "qwen2"):
        raise ConfigError(f"q/k/v biases {'present' if config.attention_bias else 'absent'}: not a {gguf_arch} model")
    ends = list(config.eos_ids)
    if config.stop_at_bos and config.bos_id is not None and config.bos_id not in ends:
        ends.append(config.bos_id)  # a generated BOS ends the text: BOS as an end of turn (read back by _end_tokens)
    if len(ends) > 3:
        raise ConfigError(f"GGUF stores at most three end tokens (eos, eot, eom), the model has {ends}")
    p = gguf_arch + "."
    meta = {
        "general.architecture": gguf_arch, "general.name": name,
        p + "context_length": config.max_seq_len, p + "embedding_length": config.dim,
        p + "block_count": config.n_layers, p + "feed_forward_length": config.hidden_dim,
        p + "attention.head_count": config.n_heads, p + "attention.head_count_kv": config.n_kv_heads,
        p + "attention.layer_norm_rms_epsilon": np.float32(config.norm_eps),
        p + "rope.freq_base": np.float32(config.rope_theta), p + "rope.dimension_count": config.head_dim,
    }
    if config.head_dim != config.dim // config.n_heads:
        meta[p + "attention.key_length"] = meta[p + "attention.value_length"] = config.head_dim
    if config.rope_scaling is not None and config.rope_scaling.kind == "linear":
        meta[p + "rope.scaling.type"] = "linear"
        meta[p + "rope.scaling.factor"] = np.float32(config.rope_scaling.factor)
    if config.pooling:  # an embedding model's pooling (GGUF's readers make its vectors unit length)
        meta[p + "pooling_type"] = {v: k for k, v in GGUF_POOLINGS.items()}[config.pooling]
    meta["tokenizer.ggml.bos_token_id"] = config.bos_id
    for key, eos in zip(("eos", "eot", "eom"), ends):
        meta[f"tokenizer.ggml.{key}_token_id"] = eos
    return meta


def vocab_metadata(tokenizer) -> dict:
    """tokenizer.ggml.* keys for a SentencePiece-style vocabulary (pieces, scores, token types): what
    tokenizer.gguf.gguf_tokenizer reads back as a BPETokenizer. Byte-level (tokenizer.json) vocabularies are not written yet."""
    if not hasattr(tokenizer, "score"):
        raise ConfigError(f"tokenizer {tokenizer.name}: npllm writes only SentencePiece-style vocabularies to GGUF")
    ids = range(tokenizer.vocab_size)
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [tokenizer.id_to_piece(i) for i in ids],
        "tokenizer.ggml.scores": np.array([tokenizer.score(i) for i in ids], dtype=np.float32),
        "tokenizer.ggml.token_type": np.array([int(tokenizer.token_type(i)) for i in ids], dtype=np.int32),
        "tokenizer.ggml.unknown_token_id": tokenizer.unk_id,
        "tokenizer.ggml.add_space_prefix": bool(tokenizer.add_dummy_prefix),
    }


def gguf_name(canonical: str) -> str:
    """Inverse of canonical_name: 'layers.3.wq' -> 'blk.3.attn_q.weight'."""
    for gguf, ours in GLOBAL_NAMES.items():
        if ours == canonical:
            return gguf
    parts = canonical.split(".")
    if len(parts) == 3 and parts[0] == "layers":
        for gguf, ours in LAYER_NAMES.items():
            if ours == parts[2]:
                return f"blk.{parts[1]}.{gguf}"
    raise FormatError(f"weight {canonical!r} has no GGUF name")


def half_to_interleaved(w: np.ndarray, heads: int) -> np.ndarray:
    """Reorder q/k projection rows from the half-split RoPE layout to interleaved pairs (llama.cpp's 'llama').

    Within each head, output rows [a_0 .. a_{n-1}, b_0 .. b_{n-1}] become [a_0, b_0, a_1, b_1, ...].
    # [H*Dh, ...] -> [H*Dh, ...]
    """
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tensor_type_for(shape: tuple[int, ...], wanted: str) -> str:
    """The type a tensor is stored in: vectors (norms, biases) stay F32 as llama.cpp keeps them; a matrix whose rows
    do not split into `wanted`'s blocks falls back to Q8_0 (a K-quant's rows that split into 32s), else F16."""
    if len(shape) == 1:
        return "F32"
    row = shape[-1]
    if row % quant_type(wanted).block_size == 0:
        return wanted
    if quant_type(wanted).block_size == 256 and row % 32 == 0:
        return "Q8_0"
    return "F16"


# The mixtures (quant.MIXTURES): a base type for most matrices, and one with more bits where an error costs the most.


def more_bits(layer: int, n_layers: int) -> bool:
    """Whether a mixture stores layer `layer`'s wv and w2 in its type with more bits."""
    eighth = n_layers // 8
    return layer < eighth or layer >= 7 * n_layers // 8 or (layer - eighth) % 3 == 2


def mixture_type(canonical: str, config: ModelConfig, wanted: str) -> str:
    """The type `wanted` (a type, or a name in MIXTURES) gives the weight `canonical` ('layers.3.wv'), before
    tensor_type_for's fallbacks."""
    if wanted not in MIXTURES:
        return wanted
    base, more = MIXTURES[wanted]
    parts = canonical.split(".")
    head = canonical == "output" or (canonical == "tok_embeddings" and config.tied_embeddings)
    projection = len(parts) == 3 and parts[2] in ("wv", "w2") and more_bits(int(parts[1]), config.n_layers)
    return more if head or projection else base


def fallbacks(tensors: list[TensorData], wanted: str) -> dict[tuple[str, int], int]:
    """The matrices tensor_type_for stored in another type than `wanted` (a type or a mixture) asked for, because
    their rows do not split into its blocks: (type stored, values per row) -> how many."""
    asked = set(MIXTURES.get(wanted, (wanted,)))
    found: dict[tuple[str, int], int] = {}
    for t in tensors:
        if len(t.shape) > 1 and t.type_name not in asked:
            found[t.type_name, t.shape[-1]] = found.get((t.type_name, t.shape[-1]), 0) + 1
    return found


def model_tensors(config: ModelConfig, weights: dict[str, np.ndarray], wanted: str,
                  progress=None) -> list[TensorData]:
    """Canonical float32 weights as GGUF tensors of type `wanted` (a type or a mixture: mixture_type, then
    tensor_type_for), in llama.cpp's names and RoPE layout, plus rope_freqs for Llama 3 scaling.
    progress(done, total, gguf name), when given, is called after each weight (quantizing a large model takes
    minutes)."""
    from ..quant import quantize

    tensors = []
    if config.rope_scaling is not None and config.rope_scaling.kind == "llama3":
        factors = llama3_factors(config.rope_scaling, config.rope_theta, config.head_dim).astype(np.float32)
        tensors.append(TensorData(ROPE_FREQS, factors.shape, "F32", quantize(factors, "F32")))
    for done, (name, array) in enumerate(weights.items()):
        array = np.asarray(array, dtype=np.float32)
        short = name.rsplit(".", 1)[-1]
        if config.arch != "qwen2" and config.rope_layout == "half" and short in ("wq", "wk", "bq", "bk"):
            array = half_to_interleaved(array, config.n_heads if short in ("wq", "bq") else config.n_kv_heads)
        type_name = tensor_type_for(array.shape, mixture_type(name, config, wanted))
        tensors.append(TensorData(gguf_name(name), array.shape, type_name, quantize(array, type_name)))
        if progress is not None:
            progress(done + 1, len(weights), tensors[-1].name)
    return tensors


def write_gguf(path: str | os.PathLike, config: ModelConfig, weights: dict[str, np.ndarray], type_name: str = "F32",
               tokenizer=None, name: str | None = None, progress=None) -> list[TensorData]:
    """Write a model as a GGUF file that llama.cpp and npllm read: matrices in `type_name` (a type of quant.QUANTIZE,
    or a mixture in quant.MIXTURES: Q4_K_M, Q5_K_M; fallbacks in
    tensor_type_for), vectors in F32, and the tokenizer's vocabulary when one is given. Returns the tensors written
    (for a summary). progress: see model_tensors."""
    meta = model_metadata(config, name or os.path.splitext(os.path.basename(os.fspath(path)))[0])
    if tokenizer is not None:
        meta.update(vocab_metadata(tokenizer))
    tensors = model_tensors(config, weights, type_name, progress)
    write_gguf_file(path, meta, tensors)
    return tensors
