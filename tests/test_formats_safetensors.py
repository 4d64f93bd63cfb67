"""safetensors reader: values round-trip, every header lie is a FormatError naming the file, and a fuzzer over
mutated headers gets nothing but npllm errors (no other exception, no hang, no allocation beyond the file)."""

import json
import re
import struct
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from npllm.errors import FormatError, NpllmError
from npllm.formats.safetensors import read_header, read_safetensors


def encode(tensors: dict, metadata=None, pad_to: int = 8) -> bytes:
    """A safetensors file, written straight from the format description. `tensors` maps a name to (dtype, array
    of the on-disk element type)."""
    header, blobs, offset = {}, [], 0
    for name, (dtype, array) in tensors.items():
        data = np.ascontiguousarray(array).tobytes()
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    if metadata is not None:
        header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % pad_to)
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


def raw_file(header_obj, data: bytes) -> bytes:
    text = json.dumps(header_obj).encode() if not isinstance(header_obj, bytes) else header_obj
    return struct.pack("<Q", len(text)) + text + data


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """Top 16 bits of float32 values (exact for values with zero low halves)."""
    return (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


@pytest.fixture
def sample():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 5)).astype(np.float32)
    b = rng.standard_normal((4,)).astype(np.float16)
    c = (rng.standard_normal((2, 3)).astype(np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)
    return a, b, c


def test_values_round_trip_and_f32_is_a_read_only_view(tmp_path, sample):
    a, b, c = sample
    path = tmp_path / "m.safetensors"
    path.write_bytes(encode({"a": ("F32", a), "b": ("F16", b), "c": ("BF16", bf16_bits(c))}, {"format": "pt"}))
    header, t = read_safetensors(path)
    assert header.metadata == {"format": "pt"}
    np.testing.assert_array_equal(t["a"], a)
    np.testing.assert_array_equal(t["b"], b.astype(np.float32))
    np.testing.assert_array_equal(t["c"], c)
    assert all(x.dtype == np.float32 for x in t.values())
    assert not t["a"].flags.owndata and not t["a"].flags.writeable  # a view of the memory map, not a copy
    assert not t["b"].flags.writeable and not t["c"].flags.writeable


def test_unaligned_buffer_still_reads_correct_values(tmp_path, sample):
    a, _, _ = sample
    path = tmp_path / "m.safetensors"
    path.write_bytes(encode({"a": ("F32", a)}, pad_to=1))  # header length need not keep floats 4-byte aligned
    _, t = read_safetensors(path)
    np.testing.assert_array_equal(t["a"], a)


def test_empty_and_scalar_tensors(tmp_path):
    path = tmp_path / "m.safetensors"
    path.write_bytes(encode({"e": ("F32", np.zeros((0, 4), np.float32)), "s": ("F32", np.float32(3.5).reshape(()))}))
    _, t = read_safetensors(path)
    assert t["e"].shape == (0, 4) and t["s"].shape == () and float(t["s"]) == 3.5


def lies():
    """(description, header object or raw bytes, data bytes, message fragment) for files that must be refused."""
    f32 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    return [
        ("unknown dtype", {"x": {**f32, "dtype": "Q7"}}, bytes(8), "unknown dtype"),
        ("unsupported dtype", {"x": {**f32, "dtype": "I64", "shape": [1]}}, bytes(8), "unsupported dtype"),
        ("size disagrees with shape", {"x": {**f32, "shape": [3]}}, bytes(8), "needs 12"),
        ("offsets past the end", {"x": {**f32, "data_offsets": [0, 16], "shape": [4]}}, bytes(8), "truncated"),
        ("end before begin", {"x": {**f32, "data_offsets": [8, 0]}}, bytes(8), "begin <= end"),
        ("negative offset", {"x": {**f32, "data_offsets": [-8, 0]}}, bytes(8), "begin <= end"),
        ("overlap", {"x": f32, "y": {**f32, "data_offsets": [4, 12]}}, bytes(12), "overlaps"),
        ("hole", {"x": {**f32, "data_offsets": [4, 12]}}, bytes(12), "belong to no tensor"),
        ("trailing bytes", {"x": f32}, bytes(12), "trailing bytes"),
        ("bool as a dimension", {"x": {**f32, "shape": [True, 2]}}, bytes(8), "shape"),
        ("float offsets", {"x": {**f32, "data_offsets": [0.0, 8.0]}}, bytes(8), "data_offsets"),
        ("entry not an object", {"x": [1, 2]}, bytes(8), "not a JSON object"),
        ("header not an object", [1, 2], b"", "not a JSON object"),
        ("metadata not strings", {"__metadata__": {"a": 1}}, b"", "__metadata__"),
        ("not JSON", b"{nope", b"", "not valid UTF-8 JSON"),
        ("not UTF-8", b"\xff\xfe{}", b"", "not valid UTF-8 JSON"),
        ("duplicate key", b'{"x": %s, "x": %s}' % (json.dumps(f32).encode(), json.dumps(f32).encode()),
         bytes(8), "duplicate key"),
    ]


@pytest.mark.parametrize("what, header, data, fragment", lies(), ids=[lie[0] for lie in lies()])
def test_header_lies_are_format_errors_naming_the_file(tmp_path, what, header, data, fragment):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(raw_file(header, data))
    with pytest.raises(FormatError) as err:
        read_safetensors(path)
    assert str(path) in str(err.value) and fragment in str(err.value)


def test_truncated_files(tmp_path, sample):
    a, _, _ = sample
    good = encode({"a": ("F32", a)})
    for cut in (0, 5, 8, 20, len(good) - 1):
        path = tmp_path / f"cut{cut}.safetensors"
        path.write_bytes(good[:cut])
        with pytest.raises(FormatError, match=str(path)):
            read_safetensors(path)


def test_header_length_larger_than_file(tmp_path):
    path = tmp_path / "big.safetensors"
    path.write_bytes(struct.pack("<Q", 2**63) + b"{}")
    with pytest.raises(FormatError, match="runs past the end"):
        read_header(path)


def test_missing_file():
    with pytest.raises(FormatError, match="cannot read"):
        read_header("/nonexistent/model.safetensors")


# --------------------------------------------------------------------------------------------------------------
# Fuzz: mutations of a valid file


def valid_file() -> bytes:
    rng = np.random.default_rng(1)
    return encode({
        "w": ("F32", rng.standard_normal((4, 8)).astype(np.float32)),
        "h": ("F16", rng.standard_normal((8,)).astype(np.float16)),
        "b": ("BF16", bf16_bits(rng.standard_normal((2, 4)).astype(np.float32))),
    }, {"format": "pt"})


VALID = valid_file()
HEADER_END = 8 + struct.unpack("<Q", VALID[:8])[0]
NUMBERS = [0, 1, 2, 7, 8, 255, 2**31, 2**32 + 8, 2**53, 2**63, 2**64 + 5, -1, -(2**40)]


@st.composite
def mutated(draw):
    data = bytearray(VALID)
    kind = draw(st.sampled_from(["truncate", "flip", "number", "length", "splice"]))
    if kind == "truncate":
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif kind == "flip":  # overwrite a few bytes of the header
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, HEADER_END - 1))
            data[i] = draw(st.integers(0, 255))
    elif kind == "number":  # replace one number in the JSON: shapes, offsets, sizes
        text = data[8:HEADER_END].decode()
        spans = [(m.start(), m.end()) for m in re.finditer(r"\d+", text)]
        start, end = draw(st.sampled_from(spans))
        text = text[:start] + str(draw(st.sampled_from(NUMBERS))) + text[end:]
        body = text.encode()
        data = bytearray(struct.pack("<Q", len(body)) + body + bytes(data[HEADER_END:]))
    elif kind == "length":  # the 8-byte header length itself lies
        lengths = [n for n in NUMBERS if 0 <= n < 2**64] + [HEADER_END - 9, HEADER_END - 7]
        data[:8] = struct.pack("<Q", draw(st.sampled_from(lengths)))
    else:  # append or drop bytes after the header
        extra = draw(st.binary(max_size=64))
        data = data + extra if draw(st.booleans()) else data[: HEADER_END + len(extra)]
    return bytes(data)


@settings(max_examples=300, deadline=2000)
@given(blob=mutated())
def test_fuzzed_headers_raise_only_npllm_errors(tmp_path_factory, blob):
    path = tmp_path_factory.mktemp("fuzz") / "m.safetensors"
    path.write_bytes(blob)
    tracemalloc.start()
    try:
        header, tensors = read_safetensors(path)
    except NpllmError as e:
        assert isinstance(e, FormatError) and str(path) in str(e)
    else:  # a harmless mutation: what was read must be consistent with the header
        for name, entry in header.tensors.items():
            assert tensors[name].shape == entry.shape
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    # The header is parsed into Python objects and F16/BF16 are widened; nothing may scale with a claimed size.
    assert peak < 64 * len(blob) + 256 * 1024
