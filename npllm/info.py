"""`npllm info MODEL`: what a checkpoint is, in a few lines a person can read.

    describe(config, weights, path) -> str

Architecture and shape come from the config, the parameter count and in-memory size from the loaded weights, and the
on-disk dtypes and the tokenizer from the files themselves (headers only; no tensor is read again).
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import numpy as np

from .config import ModelConfig
from .errors import NpllmError
from .quant import in_block_type

MiB = 1024 * 1024


def _count(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _size(nbytes: int) -> str:
    return f"{nbytes / MiB:.1f} MiB" if nbytes >= MiB / 10 else f"{nbytes / 1024:.1f} KiB"


def disk_dtypes(path: Path) -> Counter:
    """Tensor count per on-disk element type, read from the file headers."""
    if path.suffix == ".gguf":
        from .formats.gguf import read_gguf_file

        return Counter(info.type.name for info in read_gguf_file(path).tensors.values())
    if path.is_dir() or path.suffix == ".safetensors" or path.name.endswith(".index.json"):
        from .formats.safetensors import read_header

        folder = path if path.is_dir() else path.parent
        files = [path] if path.suffix == ".safetensors" else sorted(folder.glob("*.safetensors"))
        return Counter(e.dtype for f in files for e in read_header(f).tensors.values())
    with open(path, "rb") as f:
        head = f.read(8)
    if head[:4] == (0x616B3432).to_bytes(4, "little") and int.from_bytes(head[4:8], "little") == 2:
        return Counter({"int8 groups (llama2.c v2), F32 norms": -1})
    return Counter({"F32": -1})  # legacy and v1 llama2.c checkpoints are float32 throughout


def gguf_type_bytes(path: Path) -> Counter:
    """Bytes per tensor type of a GGUF file (each tensor keeps its own type)."""
    from .formats.gguf import read_gguf_file

    sizes = Counter()
    for info in read_gguf_file(path).tensors.values():
        sizes[info.type.name] += info.nbytes
    return sizes


def kv_cache_bytes(config: ModelConfig, positions: int, itemsize: int = 4) -> int:
    """Keys and values for `positions` positions in every layer: 2 * L * S * K * Dh elements."""
    return 2 * config.n_layers * positions * config.n_kv_heads * config.head_dim * itemsize


def describe_tokenizer(path: Path) -> str:
    from .hub import find_tokenizer

    found = find_tokenizer(path)
    if found is None:
        return "none found beside the checkpoint (pass --tokenizer)"
    if found.suffix == ".gguf":
        from .formats.gguf import read_gguf_file, read_vocab

        vocab = read_vocab(read_gguf_file(found))
        if vocab is None:
            return "none embedded in the GGUF file (pass --tokenizer)"
        kind = {"llama": "SentencePiece-style BPE", "gpt2": "byte-level BPE"}.get(vocab.model, vocab.model)
        return f"{kind}, {len(vocab.tokens)} tokens, embedded in the GGUF metadata"
    if found.suffix == ".json":  # read by the tokenizer's own reader, which checks every field
        from .tokenizer.bytelevel import ByteLevelBPE

        tokenizer = ByteLevelBPE.from_file(found)
        return (f"byte-level BPE {found.name}: {len(tokenizer.id_to_token)} tokens, {len(tokenizer.added_ids)} of "
                "them added/special")
    if found.suffix == ".model":
        return f"SentencePiece {found.name}"
    return f"llama2.c BPE {found.name}"


def end_tokens(c: ModelConfig) -> str:
    """The line naming what ends a generation: the end ids, and BOS too where the model stops on it (llama2.c)."""
    ids = ", ".join(map(str, c.eos_ids))
    bos = c.stop_at_bos and c.bos_id is not None and c.bos_id not in c.eos_ids
    if bos:
        also = f"BOS {c.bos_id} too (a generated BOS ends the text, llama2.c's rule)"
        return f"end tokens:   {ids}; {also}" if ids else f"end tokens:   {also}"
    if ids:
        return f"end tokens:   {ids}"
    return "end tokens:   none: generation stops only at its length limit (--max-new-tokens or the context)"


def describe(config: ModelConfig, weights: dict[str, np.ndarray], path: str | os.PathLike) -> str:
    """A multi-line summary: architecture, parameters, dtypes on disk, context, memory needed, tokenizer."""
    path = Path(path)
    c = config
    n_params = sum(int(w.size) for w in weights.values())
    weight_bytes = sum(int(w.nbytes) for w in weights.values())
    cache_bytes = kv_cache_bytes(c, c.max_seq_len)
    kept = any(in_block_type(w) for w in weights.values())
    stored = "in their file types (the numba backend reads them in place)" if kept else "as float32"
    features = [f"RoPE theta {c.rope_theta:g} ({c.rope_layout})"]
    if c.rope_scaling is not None:
        features.append(f"{c.rope_scaling.kind} RoPE scaling x{c.rope_scaling.factor:g}")
    if c.rotary_dims != c.head_dim:
        features.append(f"RoPE on {c.rotary_dims} of {c.head_dim} head dims")
    nope = sum(not c.has_rope(l) for l in range(c.n_layers))
    if nope:
        features.append(f"{nope} layer{'s' if nope > 1 else ''} without RoPE")
    if c.sliding_window:
        features.append(f"sliding window {c.sliding_window}")
    if c.attention_bias:
        features.append("q/k/v bias")
    features.append("tied embeddings" if c.tied_embeddings else "separate LM head")
    try:
        dtypes = disk_dtypes(path)
        sizes = gguf_type_bytes(path) if path.suffix == ".gguf" else {}
        on_disk = ", ".join((f"{name} x{n}" if n > 0 else name) + (f" ({_size(sizes[name])})" if name in sizes else "")
                            for name, n in dtypes.most_common())
    except NpllmError as e:
        on_disk = f"unknown ({e})"
    try:
        tokenizer = describe_tokenizer(path)
    except (NpllmError, OSError, ValueError) as e:
        tokenizer = f"unreadable ({e})"
    lines = [
        f"model:        {path}",
        f"architecture: {c.arch}, {c.n_layers} layers, dim {c.dim}, FFN {c.hidden_dim}, "
        f"{c.n_heads} heads / {c.n_kv_heads} KV heads of {c.head_dim}, vocab {c.vocab_size}",
        f"              {', '.join(features)}",
        f"parameters:   {_count(n_params)} ({n_params:,})",
        f"on disk:      {on_disk}",
        f"context:      {c.max_seq_len} tokens",
        f"memory:       {_size(weight_bytes)} weights {stored} + {_size(cache_bytes)} KV cache at full context "
        f"= {_size(weight_bytes + cache_bytes)}",
        f"tokenizer:    {tokenizer}",
        end_tokens(c),
    ]
    return "\n".join(lines)
