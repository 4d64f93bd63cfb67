"""safetensors: npllm's own reader, over a read-only memory map.

File layout (little-endian throughout):

    [8 bytes]  N, the header length, unsigned 64-bit
    [N bytes]  header: a UTF-8 JSON object
                 {"<tensor name>": {"dtype": "F32", "shape": [d0, d1, ...], "data_offsets": [begin, end]}, ...,
                  "__metadata__": {"<str>": "<str>", ...}}          (the metadata entry is optional)
    [rest]     the byte buffer: each tensor's raw row-major bytes at [begin, end) relative to the buffer's start

The header is checked before any tensor is touched: every entry has a known dtype, a shape of non-negative integers,
`end - begin == prod(shape) * itemsize`, and the entries tile the buffer exactly (no overlap, no hole, nothing past the
end of the file), as the format requires. Nothing in the file is executed or unpickled.

F32 tensors come back as zero-copy views of the memory map; F16 and BF16 are widened to float32 on load.
"""

from __future__ import annotations

import json
import math
import mmap
import os
from dataclasses import dataclass

import numpy as np

from ..errors import FormatError

HEADER_LENGTH_BYTES = 8
# A header is a table of contents; 100 MB is far beyond any real one and stops a lying length from being believed.
MAX_HEADER_BYTES = 100 * 1024 * 1024

# The dtypes npllm reads, with their on-disk element type. BF16 is read as raw 16-bit words and widened by hand.
DTYPES = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
}
# Dtypes the format defines but npllm does not read, named so the error can say "unsupported" rather than "unknown".
OTHER_DTYPES = {"F64", "F8_E4M3", "F8_E5M2", "I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8", "BOOL", "C64"}


@dataclass(frozen=True)
class TensorEntry:
    """One header entry: where a tensor's bytes lie in the byte buffer and what they mean."""

    name: str
    dtype: str  # a key of DTYPES
    shape: tuple[int, ...]
    begin: int  # byte offset into the buffer (after the header)
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class SafetensorsHeader:
    path: str
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]
    data_start: int  # absolute file offset of the byte buffer
    file_size: int


def _reject_duplicates(pairs):
    """object_pairs_hook for json: a repeated key would silently shadow a tensor, so it is an error."""
    result = {}
    for key, value in pairs:
        if key in result:
            raise FormatError(f"duplicate key {key!r} in the JSON header")
        result[key] = value
    return result


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_entry(path: str, name: str, entry) -> TensorEntry:
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise FormatError(f"{where}: header entry is not a JSON object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str):
        raise FormatError(f"{where}: missing or non-string 'dtype'")
    if dtype not in DTYPES:
        kind = "unsupported" if dtype in OTHER_DTYPES else "unknown"
        raise FormatError(f"{where}: {kind} dtype {dtype!r} (npllm reads {', '.join(DTYPES)})")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise FormatError(f"{where}: 'shape' must be a list of non-negative integers, got {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
        raise FormatError(f"{where}: 'data_offsets' must be [begin, end] integers, got {offsets!r}")
    begin, end = offsets
    if not 0 <= begin <= end:
        raise FormatError(f"{where}: data_offsets {offsets} are not 0 <= begin <= end")
    expected = math.prod(shape) * DTYPES[dtype].itemsize
    if end - begin != expected:
        raise FormatError(
            f"{where}: data_offsets span {end - begin} bytes but shape {shape} of {dtype} needs {expected}"
        )
    return TensorEntry(name, dtype, tuple(shape), begin, end)


def read_header(path: str | os.PathLike) -> SafetensorsHeader:
    """Read and validate the header of a .safetensors file; the tensor bytes are not read."""
    path = os.fspath(path)
    try:
        file_size = os.path.getsize(path)
        with open(path, "rb") as f:
            prefix = f.read(HEADER_LENGTH_BYTES)
            if len(prefix) < HEADER_LENGTH_BYTES:
                raise FormatError(f"{path}: file is {file_size} bytes, too short for a safetensors header")
            n = int.from_bytes(prefix, "little")
            if n > file_size - HEADER_LENGTH_BYTES:
                raise FormatError(
                    f"{path}: header length {n} runs past the end of the file ({file_size} bytes): truncated or not "
                    "a safetensors file"
                )
            if n > MAX_HEADER_BYTES:
                raise FormatError(f"{path}: header length {n} is implausibly large (limit {MAX_HEADER_BYTES})")
            raw = f.read(n)
    except OSError as e:
        raise FormatError(f"{path}: cannot read safetensors file: {e}") from e
    if len(raw) != n:
        raise FormatError(f"{path}: file shrank while reading the header")
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_reject_duplicates)
    except FormatError as e:
        raise FormatError(f"{path}: {e}") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise FormatError(f"{path}: header is not valid UTF-8 JSON ({type(e).__name__}: {e})") from None
    if not isinstance(header, dict):
        raise FormatError(f"{path}: header is not a JSON object")

    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise FormatError(f"{path}: '__metadata__' must map strings to strings")
    tensors = {name: _parse_entry(path, name, entry) for name, entry in header.items()}

    data_start = HEADER_LENGTH_BYTES + n
    _check_tiling(path, tensors, file_size - data_start)
    return SafetensorsHeader(path, tensors, metadata, data_start, file_size)


def _check_tiling(path: str, tensors: dict[str, TensorEntry], buffer_size: int) -> None:
    """The entries must cover [0, buffer_size) exactly once, in some order: no overlap, no hole, nothing outside."""
    position = 0
    for entry in sorted(tensors.values(), key=lambda e: (e.begin, e.end)):
        if entry.begin < position:
            raise FormatError(f"{path}: tensor {entry.name!r} at bytes [{entry.begin}, {entry.end}) overlaps another")
        if entry.begin > position:
            raise FormatError(f"{path}: bytes [{position}, {entry.begin}) of the buffer belong to no tensor")
        position = entry.end
    if position > buffer_size:
        raise FormatError(
            f"{path}: tensors need {position} bytes after the header but the file holds {buffer_size}: truncated?"
        )
    if position < buffer_size:
        raise FormatError(f"{path}: {buffer_size - position} trailing bytes after the last tensor")


def widen_to_float32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Return a float32 array equal to `raw` read as `dtype`; F32 input is returned as is (no copy).

    BF16 is the top half of an IEEE float32: widening shifts the 16-bit word into the high half, exactly.
    """
    if dtype == "F32":
        return raw
    if dtype == "F16":
        wide = raw.astype(np.float32)
    elif dtype == "BF16":
        wide = (raw.astype(np.uint32) << 16).view(np.float32)
    else:
        raise FormatError(f"cannot widen dtype {dtype!r}")
    wide.flags.writeable = False  # like the mapped F32 weights: nothing in npllm writes to a weight
    return wide


def _map_file(path: str):
    try:
        with open(path, "rb") as f:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as e:
        raise FormatError(f"{path}: cannot memory-map: {e}") from e


def raw_tensor(buffer, header: SafetensorsHeader, entry: TensorEntry) -> np.ndarray:
    """The tensor's bytes as a read-only array of its on-disk element type (BF16 as uint16), without copying."""
    dtype = DTYPES[entry.dtype]
    count = math.prod(entry.shape)
    array = np.frombuffer(buffer, dtype=dtype, count=count, offset=header.data_start + entry.begin)
    array = array.reshape(entry.shape)
    if not array.flags.aligned:  # the header length need not be a multiple of the itemsize
        array = array.copy()
        array.flags.writeable = False
    return array


def read_safetensors(path: str | os.PathLike, names=None) -> tuple[SafetensorsHeader, dict[str, np.ndarray]]:
    """Validate the header, map the file, and return float32 arrays keyed by the file's own tensor names.

    `names` restricts reading to those tensors (each must exist). F32 arrays are read-only views of the map.
    """
    header = read_header(path)
    if names is None:
        names = list(header.tensors)
    missing = [n for n in names if n not in header.tensors]
    if missing:
        raise FormatError(f"{header.path}: no tensor named {missing[0]!r}")
    if not header.tensors:
        return header, {}
    buffer = _map_file(header.path)
    tensors = {}
    for name in names:
        entry = header.tensors[name]
        tensors[name] = widen_to_float32(raw_tensor(buffer, header, entry), entry.dtype)
    return header, tensors
