"""llama2.c checkpoints: the legacy fp32 format, the versioned v1 ("ak42") fp32 format and v2 (int8 groups).

Legacy layout (what run.c reads):
    int32 header [7]: dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len
                      (vocab_size < 0 means the classifier is stored separately, > 0 that it is the embedding)
    float32 tensors, each layer's matrices stacked along a leading L axis:
        tok_embeddings [V, D], attention_norm [L, D], wq [L, H*Dh, D], wk [L, K*Dh, D], wv [L, K*Dh, D],
        wo [L, D, H*Dh], ffn_norm [L, D], w1 [L, F, D], w2 [L, D, F], w3 [L, F, D], norm [D],
        freq_cis_real [seq_len, Dh/2], freq_cis_imag [seq_len, Dh/2]   (unused: RoPE is recomputed),
        output [V, D]   (only when vocab_size < 0)

v1 layout (export.py's version 1): a 256-byte header
    uint32 magic 0x616b3432 ("ak42"), int32 version = 1, int32 [7] as above (vocab_size always positive),
    uint8 shared_classifier, zero padding to 256 bytes;
then float32 tensors: attention_norm [L, D], ffn_norm [L, D], norm [D], tok_embeddings [V, D], wq, wk, wv, wo,
w1, w2, w3 (each [L, ...]), output [V, D] unless shared.

v2 layout (export.py's version 2, what runq.c runs): the v1 header with version = 2 and, right after the
shared_classifier byte (at byte 37, unaligned), int32 group_size; zero padding to 256 bytes. Then
    float32 norms: attention_norm [L, D], ffn_norm [L, D], norm [D]
    int8 tensors, one at a time (each layer's matrix on its own, not stacked): tok_embeddings, wq[0], ..., wq[L-1],
    wk[...], wv[...], wo[...], w1[...], w2[...], w3[...], output (unless shared). Each one is
        int8 q [numel]  then  float32 scale [numel / group_size]
    over the tensor flattened row by row, so a group may run across rows (w2's rows of F values when F is not a
    multiple of group_size). Value i is q[i] * scale[i // group_size]; export.py chose scale = max|w| / 127 per
    group and q = round(w / scale), symmetric in [-127, 127].

Tensors are memory-mapped: loading a legacy or v1 checkpoint reads only its header. A v2 checkpoint is dequantized
to float32 at load (its float32 per-group scales do not fit a GGUF block type, whose scales are float16), so it
takes float32 memory like a v1 file; the int8 rounding is kept, exactly.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from ..config import ModelConfig
from ..errors import FormatError

V1_MAGIC = 0x616B3432
V1_HEADER_BYTES = 256
LEGACY_HEADER_BYTES = 7 * 4
V2_GROUP_SIZE = 64  # export.py's default, halved until it divides dim
V2_QUANTIZED = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")  # after tok_embeddings, before output


def read_llama2c(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Read a llama2.c checkpoint (legacy, v1 or v2) into (config, canonical weights)."""
    path = Path(path)
    head = _read_head(path)
    if len(head) >= 8 and struct.unpack("<I", head[:4])[0] == V1_MAGIC:
        if len(head) < V1_HEADER_BYTES:
            raise FormatError(f"checkpoint {path} is truncated inside its 256-byte header")
        version = struct.unpack("<i", head[4:8])[0]
        if version == 1:
            return _read_v1(path, head)
        if version == 2:
            return _read_v2(path, head)
        raise FormatError(f"checkpoint {path} is llama2.c version {version}; npllm reads the legacy format, "
                          f"version 1 (fp32) and version 2 (int8)")
    return _read_legacy(path, head)


def _read_head(path: Path) -> bytes:
    if not path.exists():
        raise FormatError(f"checkpoint {path} does not exist")
    if not path.is_file():
        raise FormatError(f"checkpoint {path} is not a file")
    with open(path, "rb") as f:
        head = f.read(V1_HEADER_BYTES)
    if len(head) < LEGACY_HEADER_BYTES:
        raise FormatError(f"checkpoint {path} is {len(head)} bytes long: too short for a llama2.c header")
    return head


def _config_from_header(path: Path, ints: tuple[int, ...], tied: bool) -> ModelConfig:
    dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len = ints
    fields = dict(dim=dim, hidden_dim=hidden_dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                  vocab_size=vocab_size, seq_len=seq_len)
    for name, value in fields.items():
        if value <= 0 or value > 1 << 24:
            text = " (the file begins like text)" if _looks_like_text(path) else ""
            raise FormatError(f"checkpoint {path}: header field {name} = {value} is not a plausible size: not a "
                              f"llama2.c .bin file{text}; npllm reads llama2.c .bin, GGUF, and Hugging Face "
                              "folders or .safetensors files")
    if dim % n_heads or n_heads % n_kv_heads:
        raise FormatError(f"checkpoint {path}: header says dim {dim}, n_heads {n_heads}, n_kv_heads {n_kv_heads}, "
                          f"which do not divide evenly")
    return ModelConfig(dim=dim, hidden_dim=hidden_dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                       vocab_size=vocab_size, max_seq_len=seq_len, tied_embeddings=tied, norm_eps=1e-5,
                       rope_theta=10000.0, rope_layout="interleaved", bos_id=1, eos_ids=(2,), stop_at_bos=True,
                       arch="llama2c")


def _looks_like_text(path: Path) -> bool:
    """Whether a file's first bytes are printable UTF-8 text (a prompt or notes given as --model)."""
    with open(path, "rb") as f:
        head = f.read(LEGACY_HEADER_BYTES)
    try:
        return all(c.isprintable() or c.isspace() for c in head.decode("utf-8"))
    except UnicodeDecodeError:
        return False


def _layer_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of the per-layer stacks, [L, ...], in the canonical [out, in] orientation."""
    L, D, F, Dh = c.n_layers, c.dim, c.hidden_dim, c.head_dim
    return {
        "attention_norm": (L, D), "ffn_norm": (L, D),
        "wq": (L, c.n_heads * Dh, D), "wk": (L, c.n_kv_heads * Dh, D), "wv": (L, c.n_kv_heads * Dh, D),
        "wo": (L, D, c.n_heads * Dh), "w1": (L, F, D), "w2": (L, D, F), "w3": (L, F, D),
    }


def _legacy_order(c: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    s = _layer_shapes(c)
    half = c.head_dim // 2
    order = [("tok_embeddings", (c.vocab_size, c.dim)), ("attention_norm", s["attention_norm"]),
             ("wq", s["wq"]), ("wk", s["wk"]), ("wv", s["wv"]), ("wo", s["wo"]), ("ffn_norm", s["ffn_norm"]),
             ("w1", s["w1"]), ("w2", s["w2"]), ("w3", s["w3"]), ("norm", (c.dim,)),
             ("freq_cis_real", (c.max_seq_len, half)), ("freq_cis_imag", (c.max_seq_len, half))]
    if not c.tied_embeddings:
        order.append(("output", (c.vocab_size, c.dim)))
    return order


def _v1_order(c: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    s = _layer_shapes(c)
    order = [("attention_norm", s["attention_norm"]), ("ffn_norm", s["ffn_norm"]), ("norm", (c.dim,)),
             ("tok_embeddings", (c.vocab_size, c.dim))]
    order += [(name, s[name]) for name in ("wq", "wk", "wv", "wo", "w1", "w2", "w3")]
    if not c.tied_embeddings:
        order.append(("output", (c.vocab_size, c.dim)))
    return order


def _read_legacy(path: Path, head: bytes):
    ints = struct.unpack("<7i", head[:LEGACY_HEADER_BYTES])
    tied = ints[5] > 0
    config = _config_from_header(path, ints[:5] + (abs(ints[5]), ints[6]), tied)
    return config, _map_tensors(path, LEGACY_HEADER_BYTES, _legacy_order(config))


def _read_v1(path: Path, head: bytes):
    ints = struct.unpack("<7i", head[8:36])
    tied = bool(head[36])
    config = _config_from_header(path, ints, tied)
    return config, _map_tensors(path, V1_HEADER_BYTES, _v1_order(config))


def _v2_order(c: ModelConfig) -> tuple[list, list]:
    """(float32 norms, int8 tensors) of a v2 file, in file order: [(name, shape)], per-layer names for the int8."""
    s = _layer_shapes(c)
    norms = [("attention_norm", s["attention_norm"]), ("ffn_norm", s["ffn_norm"]), ("norm", (c.dim,))]
    quantized = [("tok_embeddings", (c.vocab_size, c.dim))]
    quantized += [(f"layers.{l}.{name}", s[name][1:]) for name in V2_QUANTIZED for l in range(c.n_layers)]
    if not c.tied_embeddings:
        quantized.append(("output", (c.vocab_size, c.dim)))
    return norms, quantized


def _read_v2(path: Path, head: bytes):
    ints = struct.unpack("<7i", head[8:36])
    config = _config_from_header(path, ints, bool(head[36]))
    group_size = struct.unpack("<i", head[37:41])[0]
    norms, quantized = _v2_order(config)
    sizes = [int(np.prod(shape)) for _, shape in quantized]
    if group_size <= 0 or any(n % group_size for n in sizes):
        raise FormatError(f"checkpoint {path}: v2 group size {group_size} does not divide every tensor's size "
                          f"(is this a llama2.c version-2 file?)")
    norm_bytes = 4 * sum(int(np.prod(shape)) for _, shape in norms)
    expected = V1_HEADER_BYTES + norm_bytes + sum(n + 4 * (n // group_size) for n in sizes)
    _check_size(path, expected)
    weights = _map_tensors(path, V1_HEADER_BYTES, norms, check=False)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    cursor = V1_HEADER_BYTES + norm_bytes
    for (name, shape), n in zip(quantized, sizes):
        q = data[cursor:cursor + n].view(np.int8)
        scale = np.frombuffer(data, dtype="<f4", count=n // group_size, offset=cursor + n)
        weights[name] = dequantize_groups(q, scale, group_size).reshape(shape)
        cursor += n + 4 * (n // group_size)
    return config, weights


def dequantize_groups(q: np.ndarray, scale: np.ndarray, group_size: int) -> np.ndarray:
    """Values of int8 groups: q[i] * scale[i // group_size], in float32.   # [n] int8, [n / g] -> [n]"""
    return (q.reshape(-1, group_size).astype(np.float32) * scale.astype(np.float32)[:, None]).reshape(-1)


def quantize_groups(w: np.ndarray, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """export.py's version-2 quantizer: per group of group_size values (w flattened row by row),
    scale = max|w| / 127 and q = round(w / scale) (ties to even), in float32.   # [...] -> [n] int8, [n / g] f32

    Each value is then within scale / 2 of q * scale. A group of zeros gets scale 0 and q 0."""
    groups = np.asarray(w, np.float32).reshape(-1, group_size)
    scale = np.abs(groups).max(axis=1) / np.float32(127.0)
    safe = np.where(scale > 0, scale, np.float32(1.0))[:, None]
    q = np.round(groups / safe).astype(np.int8)
    return q.reshape(-1), scale.astype(np.float32)


def _check_size(path: Path, expected: int) -> None:
    """The file holds exactly the bytes its header promises."""
    actual = path.stat().st_size
    if actual != expected:
        what = "truncated" if actual < expected else "longer than its header says"
        raise FormatError(f"checkpoint {path} is {what}: the header describes {expected:,} bytes, "
                          f"the file has {actual:,}")


def _map_tensors(path: Path, offset: int, order, check: bool = True) -> dict[str, np.ndarray]:
    """Memory-map the float32 tensors that follow the header, checking (unless check is False: more follows) that
    the file holds exactly what the header promises."""
    expected = offset + 4 * sum(int(np.prod(shape)) for _, shape in order)
    if check:
        _check_size(path, expected)
    flat = np.memmap(path, dtype="<f4", mode="r", offset=offset, shape=((expected - offset) // 4,))
    stacks, cursor = {}, 0
    for name, shape in order:
        n = int(np.prod(shape))
        stacks[name] = flat[cursor:cursor + n].reshape(shape)
        cursor += n
    return _unstack_layers(stacks)


def _unstack_layers(stacks: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    weights = {}
    for name, array in stacks.items():
        if name.startswith("freq_cis"):
            continue
        if name in ("tok_embeddings", "norm", "output"):
            weights[name] = array
        else:
            for layer, layer_array in enumerate(array):
                weights[f"layers.{layer}.{name}"] = layer_array
    return weights


def write_llama2c(path: str | os.PathLike, config: ModelConfig, weights: dict[str, np.ndarray], version: int = 0,
                  group_size: int = V2_GROUP_SIZE):
    """Write (config, weights) as a llama2.c checkpoint: version 0 is the legacy format, 1 the "ak42" v1 format,
    2 the int8 format (quantize_groups, in groups of group_size, halved until it divides dim as export.py does).

    Used by tests and fixtures (a short-context model, a v1 copy of a legacy file, a v2 file); interleaved RoPE
    layout only.
    """
    if config.rope_layout != "interleaved" or config.attention_bias or config.head_dim * config.n_heads != config.dim:
        raise FormatError("llama2.c checkpoints hold only plain Llama models with interleaved RoPE and Dh = D / H")
    if version == 2:
        return _write_v2(path, config, weights, group_size)
    stacks = {name: np.stack([weights[f"layers.{l}.{name}"] for l in range(config.n_layers)])
              for name in _layer_shapes(config)}
    stacks.update(tok_embeddings=weights["tok_embeddings"], norm=weights["norm"])
    if not config.tied_embeddings:
        stacks["output"] = weights["output"]
    half = config.head_dim // 2
    stacks["freq_cis_real"] = np.zeros((config.max_seq_len, half), np.float32)  # run.c skips these
    stacks["freq_cis_imag"] = np.zeros((config.max_seq_len, half), np.float32)
    c = config
    if version == 0:
        vocab = c.vocab_size if c.tied_embeddings else -c.vocab_size
        header = struct.pack("<7i", c.dim, c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads, vocab, c.max_seq_len)
        order = _legacy_order(c)
    elif version == 1:
        header = struct.pack("<Ii7iB", V1_MAGIC, 1, c.dim, c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads,
                             c.vocab_size, c.max_seq_len, int(c.tied_embeddings))
        header += b"\0" * (V1_HEADER_BYTES - len(header))
        order = _v1_order(c)
    else:
        raise FormatError(f"llama2.c version {version} is not written by npllm (0 = legacy, 1 = v1 fp32, 2 = int8)")
    with open(path, "wb") as f:
        f.write(header)
        for name, shape in order:
            f.write(np.ascontiguousarray(stacks[name], dtype="<f4").reshape(shape).tobytes())


def _write_v2(path, c: ModelConfig, weights: dict[str, np.ndarray], group_size: int) -> None:
    while group_size > 1 and c.dim % group_size:
        group_size //= 2
    norms, quantized = _v2_order(c)
    for name, shape in quantized:
        if int(np.prod(shape)) % group_size:
            raise FormatError(f"{name} {shape} does not split into groups of {group_size}")
    header = struct.pack("<Ii7iBi", V1_MAGIC, 2, c.dim, c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads,
                         c.vocab_size, c.max_seq_len, int(c.tied_embeddings), group_size)
    stacked = {"attention_norm": np.stack([weights[f"layers.{l}.attention_norm"] for l in range(c.n_layers)]),
               "ffn_norm": np.stack([weights[f"layers.{l}.ffn_norm"] for l in range(c.n_layers)]),
               "norm": weights["norm"]}
    with open(path, "wb") as f:
        f.write(header + b"\0" * (V1_HEADER_BYTES - len(header)))
        for name, _ in norms:
            f.write(np.ascontiguousarray(stacked[name], dtype="<f4").tobytes())
        for name, _ in quantized:
            q, scale = quantize_groups(weights[name], group_size)
            f.write(q.tobytes())
            f.write(scale.astype("<f4").tobytes())
