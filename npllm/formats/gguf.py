"""GGUF (versions 2 and 3), the llama.cpp ecosystem's single-file checkpoint: npllm's own reader.

File layout (little-endian; "str" is a u64 byte length followed by that many UTF-8 bytes):

    magic "GGUF" | u32 version | u64 tensor_count | u64 kv_count
    kv_count x  (str key, u32 value_type, value)       value types below; an array is u32 elem_type, u64 n, n values
    tensor_count x (str name, u32 n_dims, u64 ne[n_dims], u32 ggml_type, u64 offset)
    padding to `general.alignment` (default 32)
    tensor data: each tensor at data_start + offset (a multiple of the alignment)

ggml lists dimensions fastest-varying first, so ne = [in, out] is the NumPy shape (out, in). Quantized types pack
blocks of 32 or 256 values along ne[0]; npllm.quant draws each block and holds the dequantizers. Each tensor has its
own type (a "Q4_K_M" file mixes Q4_K, Q6_K and F32 tensors).

Every count, size and offset is checked against the file before it is believed. Tensors are read through a memory map
(`GGUFFile.raw` gives a tensor's bytes without copying) and widened or dequantized to float32 by `GGUFFile.tensor`.
formats.gguf_write writes a model back out in llama.cpp's names and layout.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass, field

import numpy as np

from ..config import MAX_LAYERS, ModelConfig, RopeScaling
from ..errors import ConfigError, FormatError
from ..quant import DEQUANTIZE, TYPES_BY_ID, QuantType
from ..tensors import check_weights
from .gguf_arch import (CONFIG_TENSORS, ROPE_FREQS, canonical_name, family_of, family_options, has_biases, longrope, yarn,
                        split_fused)
from .gguf_arch import meta as _meta

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


# ggml tensor types by id: quant's table of every type npllm lays out (to validate a file and describe it);
# npllm.quant.DEQUANTIZE says which ones it can turn into numbers.
GGML_TYPES = TYPES_BY_ID


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # NumPy order (ne reversed)
    type_id: int
    offset: int  # relative to the data section
    nbytes: int

    @property
    def type(self) -> QuantType:
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
        info = self._readable(name)
        values = DEQUANTIZE[info.type.name](self.raw(name))  # [n] float32
        values = values.reshape(info.shape)
        values.flags.writeable = False
        return values

    def quantized(self, name: str):
        """A 2-D tensor kept in its file type, over the memory map: a quant.QuantizedMatrix [rows, values per row];
        a 3-D one (experts) as a stack of them [E, rows, values per row]."""
        from ..quant import QuantizedMatrix

        info = self._readable(name)
        if len(info.shape) not in (2, 3):
            raise FormatError(f"{self.path}: no matrix named {name!r}")
        return QuantizedMatrix(self.raw(name).reshape(*info.shape[:-1], -1), info.type.name, info.shape)

    def _readable(self, name: str) -> TensorInfo:
        """The named tensor's entry, if npllm can turn its type into numbers."""
        info = self.tensors.get(name)
        if info is None:
            raise FormatError(f"{self.path}: no tensor named {name!r}")
        if info.type.name not in DEQUANTIZE:
            raise FormatError(
                f"{self.path}: tensor {name!r} has type {info.type.name}, which npllm cannot read yet "
                f"(it reads {', '.join(DEQUANTIZE)})"
            )
        return info

    def raw(self, name: str) -> np.ndarray:
        """The named tensor's bytes as stored, a read-only view of the memory map (no copy).  # [nbytes] uint8"""
        info = self.tensors.get(name)
        if info is None:
            raise FormatError(f"{self.path}: no tensor named {name!r}")
        return np.frombuffer(self.buffer, dtype=np.uint8, count=info.nbytes, offset=self.data_start + info.offset)


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

    metadata = _read_metadata(cur, n_kv, path)
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 or alignment & (alignment - 1):
        raise FormatError(f"{path}: general.alignment must be a positive power of two, got {alignment!r}")
    infos = _read_tensor_table(cur, n_tensors, path)
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


def _read_metadata(cur: "_Cursor", n_kv: int, path: str) -> dict:
    """The n_kv (key, typed value) pairs after the header; a key may appear once."""
    metadata = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key #{i}")
        if key in metadata:
            raise FormatError(f"{path}: metadata key {key!r} appears twice")
        metadata[key] = cur.value(cur.u32(f"type of {key!r}"), f"metadata {key!r}")
    return metadata


def _read_tensor_table(cur: "_Cursor", n_tensors: int, path: str) -> list[tuple]:
    """The tensor infos as (name, ne, type id, offset), checked only for their dimension count here."""
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
    return infos


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


def _rope_scaling(g: GGUFFile, p: str, theta: float, head_dim: int, context: int) -> RopeScaling | None:
    """Linear scaling or YaRN (gguf_arch.yarn) from the metadata, Llama 3's recovered from the rope_freqs tensor, or
    Phi-3's longrope from its rope_factors tensors (gguf_arch.longrope); None without any. llama.cpp scales cos and
    sin by rope.scaling.attn_factor whatever the scaling: a value other than 1 is refused where npllm has no place
    for it (neither YaRN nor longrope)."""
    found = []
    kind = _meta(g, p + "rope.scaling.type", str, default="none")
    if kind == "linear":
        found.append(RopeScaling("linear", _meta(g, p + "rope.scaling.factor", float)))
    elif kind == "yarn":
        found.append(yarn(g, p, context))
    elif kind not in ("none", "longrope"):
        raise ConfigError(f"{g.path}: RoPE scaling type {kind!r} is not supported (npllm knows linear, yarn, llama3 "
                          "and longrope)")
    if ROPE_FREQS in g.tensors:
        found.append(llama3_scaling_from_freq_factors(g.tensor(ROPE_FREQS), theta, head_dim, g.path))
    long = longrope(g, p, context)
    if long is not None:
        found.append(long)
    elif kind == "longrope":
        raise FormatError(f"{g.path}: longrope RoPE scaling without its rope_factors_long/short tensors")
    if len(found) > 1:
        raise ConfigError(f"{g.path}: more than one RoPE scaling is given ({', '.join(s.kind for s in found)})")
    if not (found and found[0].kind in ("yarn", "longrope")) and \
            _meta(g, p + "rope.scaling.attn_factor", float, default=1.0) != 1.0:
        raise ConfigError(f"{g.path}: {p}rope.scaling.attn_factor other than 1 without YaRN or longrope scaling is "
                          "not supported")
    return found[0] if found else None


def _end_tokens(g: GGUFFile, bos_id: int | None) -> tuple[list[int], bool]:
    """(end ids, stop_at_bos): the end-of-sequence id, then end-of-turn and end-of-message ids where given (chat
    turn ends stop too). An end-of-turn or end-of-message id equal to BOS is llama2.c's rule that a generated BOS
    ends the text (gguf_write.model_metadata writes ModelConfig.stop_at_bos that way): it comes back as stop_at_bos."""
    eos_ids, stop_at_bos = [_meta(g, "tokenizer.ggml.eos_token_id", default=2)], False
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        extra = _meta(g, key, required=False)
        if extra is not None and extra == bos_id:
            stop_at_bos = True
        elif extra is not None and extra not in eos_ids:
            eos_ids.append(extra)
    return eos_ids, stop_at_bos


def config_from_gguf(g: GGUFFile) -> ModelConfig:
    """The ModelConfig of a GGUF file: the fields every architecture shares here, the family's own in
    gguf_arch.family_options."""
    family = family_of(g)
    p = g.metadata["general.architecture"] + "."
    base = _dimensions(g, p)
    theta = _meta(g, p + "rope.freq_base", float, default=10000.0)
    scaling = _rope_scaling(g, p, theta, base["head_dim"], base["max_seq_len"])
    bos_id = _meta(g, "tokenizer.ggml.bos_token_id", default=1)
    eos_ids, stop_at_bos = _end_tokens(g, bos_id)
    return ModelConfig(
        **base,
        rope_theta=theta,
        rope_layout=family.rope_layout,
        rope_scaling=scaling,
        tied_embeddings="output.weight" not in g.tensors,
        attention_bias=has_biases(g),
        bos_id=bos_id,
        eos_ids=tuple(eos_ids),
        stop_at_bos=stop_at_bos,
        **_pooling(g, p),
        **family_options(g, p, family, base),
    )


# llama.cpp's pooling_type ids -> npllm.embed's poolings (0: none given; 4, rank, is a reranker's head)
GGUF_POOLINGS = {0: "", 1: "mean", 2: "cls", 3: "last"}


def _pooling(g: GGUFFile, p: str) -> dict:
    """ModelConfig's pooling from `<arch>.pooling_type`, which llama.cpp's converter writes for embedding models;
    their vectors are then unit length, as llama.cpp's embeddings are by default."""
    kind = _meta(g, p + "pooling_type", int, default=0)
    if kind not in GGUF_POOLINGS:
        raise ConfigError(f"{g.path}: pooling_type {kind} is not one npllm computes (0 none, 1 mean, 2 cls, 3 last; "
                          "4 is a reranker's)")
    pooling = GGUF_POOLINGS[kind]
    return {"pooling": pooling, "normalize_embeddings": bool(pooling)}


def _dimensions(g: GGUFFile, p: str) -> dict:
    """The ModelConfig fields of sizes: dim, hidden_dim, n_layers, heads, head_dim, vocab_size, context, eps, and
    the fraction of each head RoPE rotates."""
    dim = _meta(g, p + "embedding_length")
    n_heads = _meta(g, p + "attention.head_count")
    head_dim = _meta(g, p + "attention.key_length", default=dim // n_heads if n_heads else 0)
    if _meta(g, p + "attention.value_length", default=head_dim) != head_dim:
        raise ConfigError(f"{g.path}: key and value head sizes differ; npllm needs them equal")
    rotated = _meta(g, p + "rope.dimension_count", default=head_dim)  # ModelConfig checks it as a fraction
    if "token_embd.weight" not in g.tensors:
        raise FormatError(f"{g.path}: no token_embd.weight tensor")
    vocab_size = g.tensors["token_embd.weight"].shape[0]
    if _meta(g, p + "vocab_size", default=vocab_size) != vocab_size:
        raise ConfigError(f"{g.path}: {p}vocab_size disagrees with token_embd.weight's {vocab_size} rows")
    n_layers = _meta(g, p + "block_count")
    if not 0 < n_layers <= MAX_LAYERS:  # before anything is sized by it
        raise ConfigError(f"{g.path}: {p}block_count {n_layers} is not a plausible layer count (1..{MAX_LAYERS})")
    return dict(dim=dim, hidden_dim=_meta(g, p + "feed_forward_length"), n_layers=n_layers,
                n_heads=n_heads, n_kv_heads=_meta(g, p + "attention.head_count_kv", default=n_heads),
                vocab_size=vocab_size, max_seq_len=_meta(g, p + "context_length"), head_dim=head_dim,
                norm_eps=_meta(g, p + "attention.layer_norm_rms_epsilon", float),
                partial_rotary_factor=rotated / head_dim if head_dim > 0 else 1.0)


def read_gguf(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Read a GGUF checkpoint into (config, canonical float32 weights)."""
    return _read_weights(path, lambda g, name, info: g.tensor(name))


def read_gguf_quantized(path: str | os.PathLike) -> tuple[ModelConfig, dict]:
    """Read a GGUF checkpoint keeping every matrix (and stack of experts' matrices) in its file type (F32, F16 and
    BF16 included), over the memory map (quant.QuantizedMatrix: no copy); vectors (norms, biases) are read as
    read_gguf reads them."""
    def read(g, name, info):
        return g.quantized(name) if len(info.shape) in (2, 3) else g.tensor(name)

    return _read_weights(path, read)


def _read_weights(path, read) -> tuple[ModelConfig, dict]:
    """(config, weights under canonical names), each tensor read by read(g, gguf name, TensorInfo); fused
    projections split (gguf_arch.split_fused)."""
    g = read_gguf_file(path)
    config = config_from_gguf(g)
    names = family_of(g).names
    weights = {}
    for name, info in g.tensors.items():
        if name in CONFIG_TENSORS:
            continue
        try:
            canonical = canonical_name(name, names)
        except FormatError as e:
            raise FormatError(f"{g.path}: {e}") from None
        weights[canonical] = read(g, name, info)
    return config, check_weights(config, split_fused(config, weights, g.path), g.path)


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
    if scores is not None and not np.isfinite(scores).all():
        bad = int(np.flatnonzero(~np.isfinite(scores))[0])
        raise FormatError(f"{g.path}: tokenizer.ggml.scores holds NaN or infinite values (token {bad}: "
                          f"{scores[bad]}); a score orders merges and must be a finite number")
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
    for key, kind in (("pre", str), ("add_bos_token", bool), ("add_space_prefix", bool), ("unknown_token_id", int)):
        _vocab_field(g, f"tokenizer.ggml.{key}", kind)  # (BPETokenizer checks the unknown id's range)
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
        merges=merges, pre=g.metadata.get("tokenizer.ggml.pre"),  # a str or None (checked above)
        bos_id=ids["bos"], eos_id=ids["eos"],
        add_bos=add_bos if isinstance(add_bos, bool) else None,
        chat_template=template if isinstance(template, str) else None,
    )


def _vocab_field(g: GGUFFile, key: str, kind: type):
    """A scalar tokenizer key of the type `kind` (str, bool or int), or None when absent; any other type is a
    FormatError naming the key."""
    value = g.metadata.get(key)
    if value is not None and (isinstance(value, bool) != (kind is bool) or not isinstance(value, kind)):
        raise FormatError(f"{g.path}: {key} must be {'an integer' if kind is int else kind.__name__}, got "
                          f"{value!r:.80}")
    return value
