"""GGUF (versions 2 and 3), the llama.cpp ecosystem's single-file checkpoint: npllm's own reader.

File layout (little-endian; "str" is a u64 byte length followed by that many UTF-8 bytes):

    magic "GGUF" | u32 version | u64 tensor_count | u64 kv_count
    kv_count x  (str key, u32 value_type, value)       value types below; an array is u32 elem_type, u64 n, n values
    tensor_count x (str name, u32 n_dims, u64 ne[n_dims], u32 ggml_type, u64 offset)
    padding to `general.alignment` (default 32)
    tensor data: each tensor at data_start + offset (a multiple of the alignment)

ggml lists dimensions fastest-varying first, so ne = [in, out] is the NumPy shape (out, in). Quantized types pack
blocks of 32 values along ne[0]:

    Q8_0  34 bytes: f16 d, 32 x int8 q                 x[j] = d * q[j]
    Q4_0  18 bytes: f16 d, 16 bytes of nibbles         x[j] = d * ((b[j] & 15) - 8),  x[j+16] = d * ((b[j] >> 4) - 8)

Every count, size and offset is checked against the file before it is believed. Tensors are read through a memory map
and widened or dequantized to float32 on load.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass, field

import numpy as np

from ..config import ModelConfig, RopeScaling
from ..errors import ConfigError, FormatError
from .hf import check_weights

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # ggml tensors have at most 4 dimensions
MAX_ARRAY_NESTING = 4

# Metadata value types: id -> (name, little-endian NumPy dtype) for the fixed-size ones.
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
SCALAR_TYPES = {
    UINT8: np.dtype("<u1"), INT8: np.dtype("<i1"), UINT16: np.dtype("<u2"), INT16: np.dtype("<i2"),
    UINT32: np.dtype("<u4"), INT32: np.dtype("<i4"), FLOAT32: np.dtype("<f4"), BOOL: np.dtype("<u1"),
    UINT64: np.dtype("<u8"), INT64: np.dtype("<i8"), FLOAT64: np.dtype("<f8"),
}


@dataclass(frozen=True)
class GGMLType:
    name: str
    block_size: int  # values per block
    block_bytes: int  # bytes per block


# ggml tensor types by id. Sizes are listed for every type npllm can lay out (to validate a file and describe it);
# DEQUANTIZE below says which ones it can turn into numbers.
GGML_TYPES = {
    0: GGMLType("F32", 1, 4), 1: GGMLType("F16", 1, 2), 2: GGMLType("Q4_0", 32, 18), 3: GGMLType("Q4_1", 32, 20),
    6: GGMLType("Q5_0", 32, 22), 7: GGMLType("Q5_1", 32, 24), 8: GGMLType("Q8_0", 32, 34),
    9: GGMLType("Q8_1", 32, 36), 10: GGMLType("Q2_K", 256, 84), 11: GGMLType("Q3_K", 256, 110),
    12: GGMLType("Q4_K", 256, 144), 13: GGMLType("Q5_K", 256, 176), 14: GGMLType("Q6_K", 256, 210),
    15: GGMLType("Q8_K", 256, 292), 24: GGMLType("I8", 1, 1), 25: GGMLType("I16", 1, 2),
    26: GGMLType("I32", 1, 4), 27: GGMLType("I64", 1, 8), 28: GGMLType("F64", 1, 8), 30: GGMLType("BF16", 1, 2),
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # NumPy order (ne reversed)
    type_id: int
    offset: int  # relative to the data section
    nbytes: int

    @property
    def type(self) -> GGMLType:
        return GGML_TYPES[self.type_id]


@dataclass
class GGUFFile:
    """A parsed GGUF header plus the memory map its tensors are read from."""

    path: str
    version: int
    metadata: dict
    tensors: dict[str, TensorInfo]
    alignment: int
    data_start: int
    buffer: object = field(repr=False, default=None)

    def tensor(self, name: str) -> np.ndarray:
        """The named tensor as float32 in NumPy shape (F32 without copying; others converted)."""
        info = self.tensors.get(name)
        if info is None:
            raise FormatError(f"{self.path}: no tensor named {name!r}")
        if info.type.name not in DEQUANTIZE:
            raise FormatError(
                f"{self.path}: tensor {name!r} has type {info.type.name}, which npllm cannot read yet "
                f"(it reads {', '.join(DEQUANTIZE)})"
            )
        raw = np.frombuffer(self.buffer, dtype=np.uint8, count=info.nbytes, offset=self.data_start + info.offset)
        values = DEQUANTIZE[info.type.name](raw)  # [n] float32
        values = values.reshape(info.shape)
        values.flags.writeable = False
        return values


# ----------------------------------------------------------------------------------------------------------------
# Tensor data -> float32


def _f32(raw: np.ndarray) -> np.ndarray:
    out = raw.view("<f4")
    return out if out.flags.aligned else out.copy()


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.view("<f2").astype(np.float32)


def _bf16(raw: np.ndarray) -> np.ndarray:
    """bfloat16 is the high half of a float32: shift the 16-bit word up."""
    return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)


def dequantize_q8_0(raw: np.ndarray) -> np.ndarray:
    """Q8_0 blocks [nb, 34] -> [nb * 32] float32: x = d * q with d the block's f16 scale and q int8."""
    blocks = raw.reshape(-1, 34)
    d = blocks[:, :2].copy().view("<f2").astype(np.float32)  # [nb, 1]
    q = blocks[:, 2:].view(np.int8).astype(np.float32)  # [nb, 32]
    return (d * q).reshape(-1)


def dequantize_q4_0(raw: np.ndarray) -> np.ndarray:
    """Q4_0 blocks [nb, 18] -> [nb * 32] float32.

    Byte j (0 <= j < 16) of a block's 16 data bytes holds value j in its low nibble and value j + 16 in its high
    nibble, each stored offset by 8: x = d * (nibble - 8).
    """
    blocks = raw.reshape(-1, 18)
    d = blocks[:, :2].copy().view("<f2").astype(np.float32)  # [nb, 1]
    packed = blocks[:, 2:]  # [nb, 16]
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=1).astype(np.int8) - 8  # [nb, 32]
    return (d * q.astype(np.float32)).reshape(-1)


DEQUANTIZE = {"F32": _f32, "F16": _f16, "BF16": _bf16, "Q8_0": dequantize_q8_0, "Q4_0": dequantize_q4_0}


# ----------------------------------------------------------------------------------------------------------------
# Header parsing


class _Cursor:
    """Reads little-endian values from a buffer, refusing to read past its end."""

    def __init__(self, buffer, path: str):
        self.buffer, self.path, self.pos, self.size = buffer, path, 0, len(buffer)

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or n > self.size - self.pos:
            raise FormatError(
                f"{self.path}: {what} at byte {self.pos} needs {n} bytes but only {self.size - self.pos} remain "
                "(truncated file or corrupt header)"
            )
        data = self.buffer[self.pos : self.pos + n]
        self.pos += n
        return data

    def u32(self, what: str) -> int:
        return struct.unpack("<I", self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack("<Q", self.take(8, what))[0]

    def string(self, what: str) -> str:
        n = self.u64(what + " length")
        data = self.take(n, what)
        try:
            return bytes(data).decode("utf-8")
        except UnicodeDecodeError as e:
            raise FormatError(f"{self.path}: {what} at byte {self.pos - n} is not UTF-8 ({e.reason})") from None

    def value(self, vtype: int, what: str, depth: int = 0):
        if vtype == STRING:
            return self.string(what)
        if vtype == ARRAY:
            return self.array(what, depth)
        if vtype == BOOL:
            byte = self.take(1, what)[0]
            if byte > 1:
                raise FormatError(f"{self.path}: {what} is a bool stored as {byte}")
            return bool(byte)
        dtype = SCALAR_TYPES.get(vtype)
        if dtype is None:
            raise FormatError(f"{self.path}: {what} has unknown value type {vtype}")
        value = np.frombuffer(self.take(dtype.itemsize, what), dtype=dtype)[0]
        if vtype == FLOAT32:  # the shortest decimal that rounds to this float32: 1e-5, not 9.999999747378752e-06
            return float(str(value))
        return value.item()

    def array(self, what: str, depth: int):
        if depth >= MAX_ARRAY_NESTING:
            raise FormatError(f"{self.path}: {what} nests arrays deeper than {MAX_ARRAY_NESTING}")
        etype = self.u32(what + " element type")
        n = self.u64(what + " length")
        if etype in SCALAR_TYPES:
            dtype = SCALAR_TYPES[etype]
            if n > (self.size - self.pos) // dtype.itemsize:  # checked before multiplying into a huge size
                raise FormatError(f"{self.path}: {what} claims {n} elements, more than the file holds")
            values = np.frombuffer(self.take(n * dtype.itemsize, what), dtype=dtype).copy()
            if etype == BOOL:
                if values.size and values.max() > 1:
                    raise FormatError(f"{self.path}: {what} holds a bool that is neither 0 nor 1")
                values = values.astype(bool)
            return values
        if etype not in (STRING, ARRAY):
            raise FormatError(f"{self.path}: {what} has unknown element type {etype}")
        if n > (self.size - self.pos) // 8:  # every string or array element takes at least 8 bytes
            raise FormatError(f"{self.path}: {what} claims {n} elements, more than the file holds")
        return [self.value(etype, f"{what}[{i}]", depth + 1) for i in range(n)]


def _map(path: str):
    try:
        with open(path, "rb") as f:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except FileNotFoundError:
        raise FormatError(f"{path}: file not found") from None
    except (OSError, ValueError) as e:  # ValueError: mapping an empty file
        raise FormatError(f"{path}: cannot memory-map ({e}); empty or unreadable file") from None


def read_gguf_file(path: str | os.PathLike) -> GGUFFile:
    """Parse and validate a GGUF file's header and tensor table; tensors are read on demand by .tensor(name)."""
    path = os.fspath(path)
    buffer = _map(path)
    cur = _Cursor(buffer, path)
    if bytes(cur.take(4, "magic")) != MAGIC:
        raise FormatError(f"{path}: not a GGUF file (no 'GGUF' magic)")
    version = cur.u32("version")
    if version not in VERSIONS:
        if version and not version & 0xFFFF and version >> 24 in VERSIONS:
            raise FormatError(f"{path}: big-endian GGUF is not supported")
        raise FormatError(f"{path}: GGUF version {version} is not supported (npllm reads versions 2 and 3)")
    n_tensors = cur.u64("tensor count")
    n_kv = cur.u64("metadata count")
    # Each key-value takes at least 13 bytes and each tensor info at least 24: refuse counts the file cannot hold.
    if n_kv > cur.size // 13 or n_tensors > cur.size // 24:
        raise FormatError(f"{path}: header claims {n_tensors} tensors and {n_kv} metadata entries, more than fit")

    metadata = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key #{i}")
        if key in metadata:
            raise FormatError(f"{path}: metadata key {key!r} appears twice")
        metadata[key] = cur.value(cur.u32(f"type of {key!r}"), f"metadata {key!r}")

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 or alignment & (alignment - 1):
        raise FormatError(f"{path}: general.alignment must be a positive power of two, got {alignment!r}")

    infos = []
    for i in range(n_tensors):
        name = cur.string(f"tensor #{i} name")
        n_dims = cur.u32(f"tensor {name!r} dimension count")
        if not 1 <= n_dims <= MAX_DIMS:
            raise FormatError(f"{path}: tensor {name!r} has {n_dims} dimensions (ggml allows 1 to {MAX_DIMS})")
        ne = [cur.u64(f"tensor {name!r} dimension") for _ in range(n_dims)]
        type_id = cur.u32(f"tensor {name!r} type")
        offset = cur.u64(f"tensor {name!r} offset")
        infos.append((name, ne, type_id, offset))

    data_start = -(-cur.pos // alignment) * alignment
    data_size = cur.size - data_start
    if data_size < 0:
        raise FormatError(f"{path}: file ends inside the padding before the tensor data (truncated)")
    tensors = {}
    for name, ne, type_id, offset in infos:
        if name in tensors:
            raise FormatError(f"{path}: tensor {name!r} appears twice")
        tensors[name] = _tensor_info(path, name, ne, type_id, offset, alignment, data_size)
    _check_extents(path, tensors, alignment, data_size)
    return GGUFFile(path, version, metadata, tensors, alignment, data_start, buffer)


def _tensor_info(path, name, ne, type_id, offset, alignment, data_size) -> TensorInfo:
    ggml_type = GGML_TYPES.get(type_id)
    if ggml_type is None:
        raise FormatError(f"{path}: tensor {name!r} has unknown ggml type {type_id}")
    if ne[0] % ggml_type.block_size:
        raise FormatError(
            f"{path}: tensor {name!r} rows of {ne[0]} values do not split into {ggml_type.name} blocks of "
            f"{ggml_type.block_size}"
        )
    nbytes = math.prod(ne[1:]) * (ne[0] // ggml_type.block_size) * ggml_type.block_bytes
    if offset % alignment:
        raise FormatError(f"{path}: tensor {name!r} offset {offset} is not a multiple of the alignment {alignment}")
    if offset + nbytes > data_size:
        raise FormatError(
            f"{path}: tensor {name!r} needs bytes [{offset}, {offset + nbytes}) of the data section, which holds "
            f"{data_size} (truncated file or lying header)"
        )
    return TensorInfo(name, tuple(reversed(ne)), type_id, offset, nbytes)


def _check_extents(path: str, tensors: dict[str, TensorInfo], alignment: int, data_size: int) -> None:
    """The tensors tile the data section exactly as GGUF writers lay it out: in offset order, each one starts at the
    previous one's end rounded up to the alignment, the first at 0, and the section ends within one alignment of
    the last one's end. A tensor whose type or shape field was altered changes its byte size, so it leaves a gap or
    an overlap here instead of being read as the wrong numbers."""
    end, last = 0, None
    for info in sorted(tensors.values(), key=lambda t: (t.offset, t.nbytes)):
        if info.offset < end:
            raise FormatError(f"{path}: tensors {last!r} and {info.name!r} overlap")
        if info.offset != -(-end // alignment) * alignment:
            raise FormatError(f"{path}: bytes [{end}, {info.offset}) of the data section belong to no tensor "
                              f"(after {last!r}): a tensor's type or shape does not match its data")
        end, last = info.offset + info.nbytes, info.name
    if tensors and data_size - end >= alignment:
        raise FormatError(f"{path}: {data_size - end} bytes after the last tensor ({last!r}) belong to no tensor: "
                          "a tensor's type or shape does not match its data")


# ----------------------------------------------------------------------------------------------------------------
# Model: metadata -> ModelConfig, llama.cpp tensor names -> canonical names

# GGUF architecture -> (npllm arch, RoPE layout as llama.cpp runs it, q/k/v biases)
ARCHITECTURES = {
    "llama": ("llama", "interleaved", False),  # llama.cpp's converter permutes HF q/k rows back to interleaved
    "qwen2": ("qwen2", "half", True),  # run with NeoX-style (half-split) RoPE, weights unpermuted
}

GLOBAL_NAMES = {"token_embd.weight": "tok_embeddings", "output_norm.weight": "norm", "output.weight": "output"}
LAYER_NAMES = {
    "attn_norm.weight": "attention_norm", "attn_q.weight": "wq", "attn_k.weight": "wk", "attn_v.weight": "wv",
    "attn_output.weight": "wo", "attn_q.bias": "bq", "attn_k.bias": "bk", "attn_v.bias": "bv",
    "ffn_norm.weight": "ffn_norm", "ffn_gate.weight": "w1", "ffn_down.weight": "w2", "ffn_up.weight": "w3",
}
ROPE_FREQS = "rope_freqs.weight"


def canonical_name(gguf_name: str) -> str:
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_NAMES:
        return f"layers.{int(parts[1])}.{LAYER_NAMES[parts[2]]}"
    raise FormatError(f"unexpected tensor {gguf_name!r}: not a tensor of a Llama-family model npllm knows")


def _meta(g: GGUFFile, key: str, kind=int, default=None, required=True):
    value = g.metadata.get(key, default)
    if value is None:
        if required:
            raise ConfigError(f"{g.path}: metadata {key!r} is missing")
        return None
    ok = isinstance(value, (int, float)) if kind is float else isinstance(value, kind)
    if isinstance(value, bool) and kind is not bool or not ok:
        raise ConfigError(f"{g.path}: metadata {key!r} should be {kind.__name__}, got {value!r}")
    return kind(value)


def llama3_scaling_from_freq_factors(factors: np.ndarray, theta: float, head_dim: int, path: str) -> RopeScaling:
    """Recover Llama 3's RoPE scaling from the per-frequency divisors llama.cpp stores as `rope_freqs.weight`.

    The llama3 rule divides inverse frequency i (wavelength w_i = 2 pi theta^(2i/Dh)) by f_i:
        f_i = 1 where O / w_i > hi,   f_i = factor where O / w_i < lo,
        1 / f_i = (1 - s_i) / factor + s_i  with  s_i = (O / w_i - lo) / (hi - lo)  in between,
    where O = original context, lo/hi = low/high_freq_factor. Only the ratios O/lo and O/hi matter, so O is fixed at
    8192 and lo, hi are solved for; the recovered parameters must reproduce every stored factor.
    """
    factors = np.asarray(factors, dtype=np.float64)
    half = head_dim // 2
    if factors.shape != (half,) or not np.all(np.isfinite(factors)) or factors.min() < 1 - 1e-6:
        raise ConfigError(f"{path}: rope_freqs must hold {half} factors >= 1, got shape {factors.shape}")
    factor = float(factors.max())
    O = 8192
    u = O / (2 * np.pi * theta ** (np.arange(half) * 2 / head_dim))  # O / w_i, decreasing in i
    kept = np.isclose(factors, 1.0, rtol=0, atol=1e-6)
    divided = np.isclose(factors, factor, rtol=1e-6, atol=0) & ~kept
    blended = ~kept & ~divided
    if factor <= 1 + 1e-6:
        raise ConfigError(f"{path}: rope_freqs are all 1: no scaling to apply, the tensor should be absent")
    s = (1 / factors[blended] - 1 / factor) / (1 - 1 / factor)
    u_low_band = u[divided].max() if divided.any() else 0.0  # lo must lie above these
    u_high_band = u[kept].min() if kept.any() else np.inf  # hi must lie below these
    if blended.sum() >= 2:  # s = (u - lo) / (hi - lo) is a line in u: fit it
        slope, intercept = np.polyfit(u[blended], s, 1)
        hi_minus_lo = 1 / slope
        lo = -intercept * hi_minus_lo
        hi = lo + hi_minus_lo
    elif blended.sum() == 1:  # one point on the line u_b = lo + s_b (hi - lo): pick lo mid-way in its feasible range
        ub, sb = u[blended][0], s[0]
        lowest = max(u_low_band, (ub / sb - u_high_band) / (1 / sb - 1))  # keeps hi below the kept band
        lo = (lowest + ub) / 2
        hi = lo + (ub - lo) / sb
    else:  # no blended band: any lo < hi between the two bands
        top = u_high_band if np.isfinite(u_high_band) else 2 * u.max()
        lo, hi = u_low_band + (top - u_low_band) / 3, u_low_band + 2 * (top - u_low_band) / 3
    scaling = RopeScaling("llama3", factor=factor, low_freq_factor=float(lo), high_freq_factor=float(hi),
                          original_max_position_embeddings=O) if 0 < lo < hi else None
    if scaling is None or not np.allclose(llama3_factors(scaling, theta, head_dim), factors, rtol=1e-5, atol=0):
        raise ConfigError(f"{path}: rope_freqs do not follow Llama 3's RoPE scaling rule; npllm cannot apply them")
    return scaling


def llama3_factors(scaling: RopeScaling, theta: float, head_dim: int) -> np.ndarray:
    """The per-frequency divisors f_i of the llama3 rule (see llama3_scaling_from_freq_factors)."""
    wavelen = 2 * np.pi * theta ** (np.arange(head_dim // 2) * 2 / head_dim)
    u = scaling.original_max_position_embeddings / wavelen
    lo, hi, factor = scaling.low_freq_factor, scaling.high_freq_factor, scaling.factor
    s = np.clip((u - lo) / (hi - lo), 0.0, 1.0)
    return 1 / ((1 - s) / factor + s)


def config_from_gguf(g: GGUFFile) -> ModelConfig:
    gguf_arch = g.metadata.get("general.architecture")
    if gguf_arch not in ARCHITECTURES:
        raise ConfigError(
            f"{g.path}: general.architecture {gguf_arch!r} is not one npllm runs ({', '.join(ARCHITECTURES)})"
        )
    arch, layout, bias = ARCHITECTURES[gguf_arch]
    p = gguf_arch + "."
    dim = _meta(g, p + "embedding_length")
    n_heads = _meta(g, p + "attention.head_count")
    head_dim = _meta(g, p + "attention.key_length", default=dim // n_heads if n_heads else 0)
    if _meta(g, p + "attention.value_length", default=head_dim) != head_dim:
        raise ConfigError(f"{g.path}: key and value head sizes differ; npllm needs them equal")
    if _meta(g, p + "rope.dimension_count", default=head_dim) != head_dim:
        raise ConfigError(f"{g.path}: RoPE rotates only part of each head; npllm rotates whole heads")
    theta = _meta(g, p + "rope.freq_base", float, default=10000.0)

    scaling = None
    kind = _meta(g, p + "rope.scaling.type", str, default="none")
    if kind == "linear":
        scaling = RopeScaling("linear", _meta(g, p + "rope.scaling.factor", float))
    elif kind != "none":
        raise ConfigError(f"{g.path}: RoPE scaling type {kind!r} is not supported (npllm knows linear and llama3)")
    if ROPE_FREQS in g.tensors:
        if scaling is not None:
            raise ConfigError(f"{g.path}: both rope_freqs and {kind} RoPE scaling are given")
        scaling = llama3_scaling_from_freq_factors(g.tensor(ROPE_FREQS), theta, head_dim, g.path)

    if "token_embd.weight" not in g.tensors:
        raise FormatError(f"{g.path}: no token_embd.weight tensor")
    vocab_size = g.tensors["token_embd.weight"].shape[0]
    if _meta(g, p + "vocab_size", default=vocab_size) != vocab_size:
        raise ConfigError(f"{g.path}: {p}vocab_size disagrees with token_embd.weight's {vocab_size} rows")
    eos_ids = [_meta(g, "tokenizer.ggml.eos_token_id", default=2)]
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):  # chat turn ends stop too
        extra = _meta(g, key, required=False)
        if extra is not None and extra not in eos_ids:
            eos_ids.append(extra)
    return ModelConfig(
        dim=dim,
        hidden_dim=_meta(g, p + "feed_forward_length"),
        n_layers=_meta(g, p + "block_count"),
        n_heads=n_heads,
        n_kv_heads=_meta(g, p + "attention.head_count_kv", default=n_heads),
        vocab_size=vocab_size,
        max_seq_len=_meta(g, p + "context_length"),
        head_dim=head_dim,
        norm_eps=_meta(g, p + "attention.layer_norm_rms_epsilon", float),
        rope_theta=theta,
        rope_layout=layout,
        rope_scaling=scaling,
        tied_embeddings="output.weight" not in g.tensors,
        attention_bias=bias,
        bos_id=_meta(g, "tokenizer.ggml.bos_token_id", default=1),
        eos_ids=tuple(eos_ids),
        arch=arch,
    )


def read_gguf(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Read a GGUF checkpoint into (config, canonical float32 weights)."""
    g = read_gguf_file(path)
    config = config_from_gguf(g)
    weights = {}
    for name in g.tensors:
        if name == ROPE_FREQS:
            continue
        try:
            canonical = canonical_name(name)
        except FormatError as e:
            raise FormatError(f"{g.path}: {e}") from None
        weights[canonical] = g.tensor(name)
    return config, check_weights(config, weights, g.path)


# ----------------------------------------------------------------------------------------------------------------
# Tokenizer metadata

# tokenizer.ggml.token_type values (llama.cpp's vocabulary token types)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6


@dataclass(frozen=True)
class GGUFVocab:
    """The tokenizer a GGUF file carries in its metadata."""

    model: str  # tokenizer.ggml.model: "llama" (SentencePiece-style BPE over scores) or "gpt2" (byte-level BPE)
    tokens: list[str]
    scores: np.ndarray | None  # [V] float32, "llama" vocabularies
    token_types: np.ndarray | None  # [V] int32, TOKEN_* values
    merges: list[str] | None  # "gpt2" vocabularies: "left right" in rank order
    pre: str | None  # tokenizer.ggml.pre: the pre-tokenizer's name for "gpt2" vocabularies
    bos_id: int | None
    eos_id: int | None
    add_bos: bool | None
    chat_template: str | None


def read_vocab(g: GGUFFile) -> GGUFVocab | None:
    """The embedded tokenizer, or None when the file carries none. Lengths and ids are checked against each other."""
    model = g.metadata.get("tokenizer.ggml.model")
    if model is None:
        return None
    tokens = g.metadata.get("tokenizer.ggml.tokens")
    if not isinstance(model, str) or not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise FormatError(f"{g.path}: tokenizer.ggml.model/tokens are malformed")
    n = len(tokens)

    def array(key, kind):
        value = g.metadata.get(key)
        if value is None:
            return None
        if not isinstance(value, np.ndarray) or value.shape != (n,) or value.dtype.kind not in kind:
            raise FormatError(f"{g.path}: {key} must be a numeric array of {n} entries, one per token")
        return value

    scores = array("tokenizer.ggml.scores", "f")
    types = array("tokenizer.ggml.token_type", "iu")
    merges = g.metadata.get("tokenizer.ggml.merges")
    if merges is not None and (not isinstance(merges, list) or not all(isinstance(m, str) for m in merges)):
        raise FormatError(f"{g.path}: tokenizer.ggml.merges must be a list of strings")
    ids = {}
    for key in ("bos", "eos"):
        value = g.metadata.get(f"tokenizer.ggml.{key}_token_id")
        if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and 0 <= value < n):
            raise FormatError(f"{g.path}: tokenizer.ggml.{key}_token_id {value!r} is not a token id (vocab {n})")
        ids[key] = value
    if model == "llama" and scores is None:
        raise FormatError(f"{g.path}: a 'llama' tokenizer needs tokenizer.ggml.scores")
    if model == "gpt2" and merges is None:
        raise FormatError(f"{g.path}: a 'gpt2' tokenizer needs tokenizer.ggml.merges")
    add_bos = g.metadata.get("tokenizer.ggml.add_bos_token")
    template = g.metadata.get("tokenizer.chat_template")
    return GGUFVocab(
        model=model, tokens=tokens,
        scores=None if scores is None else scores.astype(np.float32),
        token_types=None if types is None else types.astype(np.int32),
        merges=merges, pre=g.metadata.get("tokenizer.ggml.pre"),
        bos_id=ids["bos"], eos_id=ids["eos"],
        add_bos=add_bos if isinstance(add_bos, bool) else None,
        chat_template=template if isinstance(template, str) else None,
    )


def gguf_tokenizer(path: str | os.PathLike):
    """npllm's tokenizer for the vocabulary a GGUF file embeds: "llama" vocabularies (tokens, scores, token types,
    SentencePiece spelling) feed BPETokenizer; "gpt2" ones (tokens and merges) feed ByteLevelBPE."""
    from ..errors import TokenizerError
    from ..tokenizer.bpe import BPETokenizer
    from ..tokenizer.bytelevel import from_gguf_vocab

    g = read_gguf_file(path)
    vocab = read_vocab(g)
    if vocab is None:
        raise TokenizerError(f"{g.path}: carries no tokenizer (no tokenizer.ggml.model): pass a tokenizer file")
    if vocab.model == "llama":
        unk = g.metadata.get("tokenizer.ggml.unknown_token_id", 0)
        add_space = g.metadata.get("tokenizer.ggml.add_space_prefix", True)
        return BPETokenizer(vocab.tokens, vocab.scores, vocab.token_types,
                            bos_id=1 if vocab.bos_id is None else vocab.bos_id,
                            eos_id=2 if vocab.eos_id is None else vocab.eos_id,
                            unk_id=unk if isinstance(unk, int) else 0,
                            add_dummy_prefix=bool(add_space), name=g.path)
    if vocab.model == "gpt2":
        return from_gguf_vocab(vocab.tokens, vocab.merges, vocab.token_types, vocab.pre, vocab.bos_id, vocab.eos_id,
                               vocab.add_bos, g.path)
    raise TokenizerError(f"{g.path}: tokenizer model {vocab.model!r} is not supported (npllm reads llama and gpt2)")
