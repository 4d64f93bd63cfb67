"""Bad-input campaign: malformed checkpoints of every format, broken tokenizer files, awkward prompts and every CLI
flag out of range, each run through the real command line in its own process.

    python scripts/bad_inputs.py [--weights DIR] [--jobs 2] [--timeout 60] [--sample N] [--kinds K ...] [--json]

For every case it records: a Python traceback on stderr, a hang (no exit within --timeout), an exit status other than
0, 2 (npllm's and argparse's errors), 130 or 141, text on stdout from a run that failed, a run that succeeded on
input that must be refused, and (kind "output") a file the run replaced that was no regular file, or a partial file
it left behind ("damaged"). The summary gives, per kind, how many cases were tried and how many of each problem
were seen; the exit status is 1 when any problem was seen. Children run with a 6 GiB address-space limit, so a
runaway allocation fails fast instead of swapping the machine.

Kinds: llama2c, config.json, safetensors, gguf, tokenizer, prompt, flag; output (npllm quantize's OUT: a FIFO, a
link to one, a folder, a missing folder, a cache folder that is a file), tokenizer-fields (tokenizer.json fields and
GGUF tokenizer keys of every wrong type, SentencePiece pieces not UTF-8, scores not finite), non-finite (NaN and
infinite metadata floats in GGUF and config.json), sentencepiece (.model files cut, bit-flipped, or valid
protobufs with empty, duplicate or non-UTF-8 pieces, no BOS, a word or char model type), http (one `npllm serve`
child over loopback: bodies that break the JSON parser, half-sent heads and bodies held past their deadlines, 20
held connections while /health is asked, a disconnect mid-body, empty and wrong keys, bytes that are not HTTP, a
runaway chat template), non-finite factors (longrope factor lists with NaN, infinities, 0 or negatives in
config.json and GGUF; partial_rotary_factor in both config.json layouts), env limits (NPLLM_TEMPLATE_* variables
out of range for chat and serve), killed template worker (the same server's idle template worker SIGKILLed: the
next chat must answer 200), deep-fields (batch lines and served bodies with unknown fields nested 500 to 5,000
deep), lenient-fields (logit_bias keys int() would take, "yes" for a boolean, 10**400 for a number: batch lines and
served bodies), batch-input (a byte order mark, a 10 MB line), batch-output (npllm batch's OUTPUT a FIFO, a link to
/dev/zero, a folder, a file with an id twice; two runs on one output at once), disk-full (OUTPUT or --errors on
/dev/full, OUTPUT past a file-size limit), load (another such child: a 3-token completion timed beside 8 concurrent
1 MiB prompts, 10 streams dropped mid-way and the server's log lines counted). A batch line must become an error
line while the job goes on: a result for it counts as "accepted". --kinds K ... runs only those; --sample leaves out the probes of a served model
(http, killed template worker, the served deep and lenient fields, load) and the two runs at once.

Inputs are derived from stories260K (llama2.c .bin, and written here as GGUF) and the qwen2_bias HF fixture in
tests/fixtures/hf; --sample N runs a deterministic sample of N cases (tests/test_bad_inputs.py runs a small one).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import random
import re
import resource
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, TimeoutError
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "fixtures" / "hf" / "qwen2_bias"
MEMORY_LIMIT = 6 << 30
GEN = ["--max-new-tokens", "4", "--temperature", "0"]  # a short greedy run after any model loads


@dataclass
class Case:
    kind: str
    name: str
    args: list  # str or bytes items (bytes: raw argv, e.g. invalid UTF-8)
    stdin: bytes | None = None
    expect: str = "error"  # "error": must be refused (exit 2, nothing on stdout); "ok": must run; "any": either
    env: dict | None = None  # environment variables set for this case only
    check: object = None  # called after the run: a str saying what the run damaged (a FIFO replaced), or None
    verdict: object = None  # called after the run: "accepted" or "refused" for what the run's files show, or None
    file_limit: int | None = None  # RLIMIT_FSIZE of the child: its writes past it fail (EFBIG), as on a full disk


@dataclass
class Result:
    case: Case
    status: int | None
    traceback: bool
    hang: bool
    stdout_on_error: bool
    bad_status: bool
    accepted: bool  # "error" expected, but it ran
    refused: bool  # "ok" expected, but it failed
    stderr_tail: str
    damaged: str | None = None  # what case.check found after the run

    @property
    def problems(self) -> list[str]:
        return [p for p in ("traceback", "hang", "stdout_on_error", "bad_status", "accepted", "refused", "damaged")
                if getattr(self, p)]


# ----------------------------------------------------------------------------------------------------------------
# Running


def limit_memory(file_limit: int | None = None):
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    if file_limit is not None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit, file_limit))


def run_case(case: Case, timeout: float, cwd: Path) -> Result:
    result = run_process(case, timeout, cwd)
    result.damaged = case.check() if case.check is not None else None
    found = case.verdict() if case.verdict is not None and not result.hang else None
    if found:
        setattr(result, found, True)
    return result


def run_process(case: Case, timeout: float, cwd: Path) -> Result:
    argv = [sys.executable, "-m", "npllm", *case.args]
    env = dict(os.environ, PYTHONPATH=str(REPO), NPLLM_HUB_URL="http://127.0.0.1:9", HOME=str(cwd),
               XDG_CACHE_HOME=str(cwd / "cache"))
    env.update(case.env or {})
    env.pop("NPLLM_WEIGHTS", None)
    try:
        done = subprocess.run(argv, input=case.stdin if case.stdin is not None else b"", capture_output=True,
                              cwd=cwd, env=env, timeout=timeout, preexec_fn=lambda: limit_memory(case.file_limit))
    except subprocess.TimeoutExpired as e:
        return Result(case, None, b"Traceback" in (e.stderr or b""), True, False, False, False, False,
                      (e.stderr or b"")[-300:].decode(errors="replace"))
    status, out, err = done.returncode, done.stdout, done.stderr
    failed = status != 0
    return Result(
        case, status,
        traceback=b"Traceback" in err,
        hang=False,
        stdout_on_error=failed and bool(out),
        bad_status=status not in (0, 2, 130, 141),
        accepted=case.expect == "error" and not failed,
        refused=case.expect == "ok" and failed,
        stderr_tail=err[-300:].decode(errors="replace"),
    )


# ----------------------------------------------------------------------------------------------------------------
# llama2.c checkpoints


def llama2c_cases(out: Path, weights: Path) -> list[Case]:
    src = (weights / "stories260K" / "stories260K.bin").read_bytes()
    tok = str(weights / "stories260K" / "tok512.bin")
    cases = []

    def case(name, data, expect="error"):
        path = out / f"l2c_{name}.bin"
        path.write_bytes(data)
        cases.append(Case("llama2c", name, ["generate", "Once", "--model", str(path), "--tokenizer", tok, *GEN],
                          expect=expect))

    fields = ["dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len"]
    for i, field in enumerate(fields):
        for value in (0, -1, 3, 1 << 24, (1 << 31) - 1, -(1 << 31)):
            case(f"{field}={value}", src[:4 * i] + struct.pack("<i", value) + src[4 * i + 4:])
    for size in (0, 1, 27, 28, 29, 256, len(src) // 2, len(src) - 1):
        case(f"truncated@{size}", src[:size])
    case("one_extra_byte", src + b"\0")
    case("four_extra_bytes", src + b"\0" * 4)
    v1 = struct.pack("<Ii", 0x616B3432, 1) + src[:28] + b"\1"
    for version in (0, 2, -1):
        case(f"v1_version={version}", struct.pack("<Ii", 0x616B3432, version) + v1[8:].ljust(248, b"\0") + src[28:])
    case("v1_header_truncated", v1[:100])
    case("v1_header_only", v1.ljust(256, b"\0"))
    rng = np.random.default_rng(0)
    case("random_bytes", rng.integers(0, 256, 4096, dtype=np.uint8).tobytes())
    floats = np.frombuffer(src[28:], "<f4").copy()
    for label, value in (("nan", np.nan), ("inf", np.inf)):
        bad = floats.copy()
        bad[::97] = value
        case(f"{label}_weights", src[:28] + bad.tobytes())
    return cases


# ----------------------------------------------------------------------------------------------------------------
# Hugging Face directories: config.json, safetensors, tokenizer.json


def hf_copy(out: Path, name: str) -> Path:
    folder = out / f"hf_{name}"
    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(FIXTURE, folder)
    return folder


def safetensors_parts(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def safetensors_bytes(header, body: bytes, length: int | None = None) -> bytes:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(text) if length is None else length) + text + body


def hf_cases(out: Path) -> list[Case]:
    cases = []

    def case(kind, name, folder, expect="error", extra=()):
        cases.append(Case(kind, name, ["generate", "Once", "--model", str(folder), *GEN, *extra], expect=expect))

    config = json.loads((FIXTURE / "config.json").read_text())
    fields = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "vocab_size", "max_position_embeddings", "rms_norm_eps", "bos_token_id", "eos_token_id", "head_dim",
              "sliding_window", "tie_word_embeddings"]
    values = [0, -1, 1 << 24, 1 << 31, 1 << 32, 1 << 63, "7", None, True, 1.5, [], {}]
    for field in fields:
        for value in values:
            folder = hf_copy(out, f"cfg_{field}_{values.index(value)}")
            changed = dict(config, **{field: value})
            (folder / "config.json").write_text(json.dumps(changed))
            case("config.json", f"{field}={value!r}", folder, expect="any")
    for name, text in (("not_json", "{"), ("empty", ""), ("array", "[]"), ("deep", "[" * 100_000),
                       ("model_type", json.dumps(dict(config, model_type="gpt2"))),
                       ("layer_types", json.dumps(dict(config, layer_types=[1, {}]))),
                       ("rope_params", json.dumps(dict(config, rope_parameters=[1]))),
                       ("rope_theta_nan", json.dumps(dict(config, rope_parameters={"rope_theta": "nan"}))),
                       ("invalid_utf8", b"\xff\xfe")):
        folder = hf_copy(out, f"cfg_{name}")
        (folder / "config.json").write_bytes(text if isinstance(text, bytes) else text.encode())
        case("config.json", name, folder)
    folder = hf_copy(out, "gen_config_garbage")
    (folder / "config.json").write_text(json.dumps(dict(config, eos_token_id=None)))
    (folder / "generation_config.json").write_text("{{{")
    case("config.json", "generation_config_garbage", folder)

    header, body = safetensors_parts(FIXTURE / "model.safetensors")
    first = next(k for k in header if k != "__metadata__")

    def st_case(name, data, expect="error"):
        folder = hf_copy(out, f"st_{name}")
        (folder / "model.safetensors").write_bytes(data)
        case("safetensors", name, folder, expect)

    for dtype in ("F16", "BF16", "I8", "Q4", 7):
        st_case(f"dtype={dtype}", safetensors_bytes({**header, first: {**header[first], "dtype": dtype}}, body))
    for shape in ([], [1], [0, 64], [-1, 64], [1 << 62, 1 << 62], ["a"]):
        st_case(f"shape={shape}", safetensors_bytes({**header, first: {**header[first], "shape": shape}}, body))
    begin, end = header[first]["data_offsets"]
    for offsets in ([end, begin], [0, 1 << 62], [begin, end + 4], [-4, end], [begin]):
        st_case(f"offsets={offsets}",
                safetensors_bytes({**header, first: {**header[first], "data_offsets": offsets}}, body))
    for length in (0, 1 << 40, len(json.dumps(header)) + 1):
        st_case(f"header_length={length}", safetensors_bytes(header, body, length))
    st_case("header_garbage", safetensors_bytes(b"not json at all", body))
    st_case("header_array", safetensors_bytes(b"[1, 2, 3]", body))
    st_case("header_deep", safetensors_bytes(b"[" * 50_000, body))
    st_case("metadata_not_strings", safetensors_bytes({**header, "__metadata__": {"a": 1}}, body))
    st_case("duplicate_key", safetensors_bytes(json.dumps(header).replace("{", '{"x": 1, "x": 2, ', 1).encode(),
                                               body))
    st_case("truncated", safetensors_bytes(header, body[: len(body) // 2]))
    st_case("trailing_bytes", safetensors_bytes(header, body + b"\0" * 8))
    st_case("empty_file", b"")
    st_case("seven_bytes", b"\0" * 7)
    missing = {k: v for k, v in header.items() if k != first}
    st_case("missing_tensor", safetensors_bytes(missing, body))
    st_case("unknown_tensor", safetensors_bytes({("model.extra" if k == first else k): v for k, v in header.items()},
                                                body))
    entry = header[first]
    nan_body = bytearray(body)
    nan_body[entry["data_offsets"][0]:entry["data_offsets"][0] + 4] = struct.pack("<f", math.nan)
    st_case("nan_weight", safetensors_bytes(header, bytes(nan_body)))

    for name, text in (("absent", None), ("not_json", b"{"), ("empty_object", b"{}"), ("invalid_utf8", b"\xff"),
                       ("vocab_list", json.dumps({"model": {"type": "BPE", "vocab": [1], "merges": []}}).encode()),
                       ("truncated", (FIXTURE / "tokenizer.json").read_bytes()[:5000])):
        folder = hf_copy(out, f"tok_{name}")
        if text is None:
            (folder / "tokenizer.json").unlink()
        else:
            (folder / "tokenizer.json").write_bytes(text)
        case("tokenizer", f"tokenizer.json {name}", folder)
    index = {"weight_map": {k: "../../etc/passwd" for k in header if k != "__metadata__"}}
    folder = hf_copy(out, "index_escape")
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    case("safetensors", "index_path_escape", folder)
    return cases


# ----------------------------------------------------------------------------------------------------------------
# GGUF, written here field by field so every field can be bent


GGUF_TYPES = {"u32": 4, "i32": 5, "f32": 6, "bool": 7, "str": 8, "arr": 9, "u64": 10}


def gguf_string(text: str | bytes) -> bytes:
    data = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(data)) + data


def gguf_value(kind: str, value) -> bytes:
    if kind == "str":
        return struct.pack("<I", 8) + gguf_string(value)
    if kind == "arr":
        etype, items = value
        if etype == "str":
            body = b"".join(gguf_string(v) for v in items)
        else:
            body = np.asarray(items, {"f32": "<f4", "i32": "<i4"}[etype]).tobytes()
        return struct.pack("<IIQ", 9, GGUF_TYPES[etype], len(items)) + body
    fmt = {"u32": "<I", "i32": "<i", "f32": "<f", "bool": "<?", "u64": "<Q"}[kind]
    return struct.pack("<I", GGUF_TYPES[kind]) + struct.pack(fmt, value)


def write_gguf(path: Path, metadata: dict, tensors: list, version=3, alignment=32, n_tensors=None, n_kv=None):
    """metadata: key -> (kind, value); tensors: (name, numpy shape, type id, data bytes, offset or None)."""
    head = b"GGUF" + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors,
                                 len(metadata) if n_kv is None else n_kv)
    head += b"".join(gguf_string(k) + gguf_value(*v) for k, v in metadata.items())
    data, offsets = b"", []
    for _, _, _, blob, offset in tensors:
        offsets.append(len(data) if offset is None else offset)
        data += blob + b"\0" * (-len(blob) % alignment)
    for (name, shape, type_id, _, _), offset in zip(tensors, offsets):
        ne = list(reversed(shape))
        head += gguf_string(name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne)
        head += struct.pack("<IQ", type_id, offset)
    head += b"\0" * (-len(head) % alignment)
    path.write_bytes(head + data)


def stories_gguf(weights: Path):
    """(metadata, tensors) of stories260K as an F32 GGUF with its vocabulary embedded."""
    import sentencepiece as spm

    sys.path.insert(0, str(REPO))
    from npllm.formats import read_checkpoint

    config, w = read_checkpoint(weights / "stories260K" / "stories260K.bin")
    sp = spm.SentencePieceProcessor(model_file=str(weights / "stories260K" / "tok512.model"))
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1
             for i in range(sp.get_piece_size())]
    metadata = {
        "general.architecture": ("str", "llama"),
        "llama.context_length": ("u32", config.max_seq_len),
        "llama.embedding_length": ("u32", config.dim),
        "llama.block_count": ("u32", config.n_layers),
        "llama.feed_forward_length": ("u32", config.hidden_dim),
        "llama.attention.head_count": ("u32", config.n_heads),
        "llama.attention.head_count_kv": ("u32", config.n_kv_heads),
        "llama.attention.layer_norm_rms_epsilon": ("f32", 1e-5),
        "llama.rope.freq_base": ("f32", 10000.0),
        "tokenizer.ggml.model": ("str", "llama"),
        "tokenizer.ggml.tokens": ("arr", ("str", [sp.id_to_piece(i) for i in range(sp.get_piece_size())])),
        "tokenizer.ggml.scores": ("arr", ("f32", [sp.get_score(i) for i in range(sp.get_piece_size())])),
        "tokenizer.ggml.token_type": ("arr", ("i32", types)),
        "tokenizer.ggml.bos_token_id": ("u32", 1),
        "tokenizer.ggml.eos_token_id": ("u32", 2),
    }
    names = {"tok_embeddings": "token_embd.weight", "norm": "output_norm.weight", "attention_norm": "attn_norm.weight",
             "wq": "attn_q.weight", "wk": "attn_k.weight", "wv": "attn_v.weight", "wo": "attn_output.weight",
             "ffn_norm": "ffn_norm.weight", "w1": "ffn_gate.weight", "w2": "ffn_down.weight", "w3": "ffn_up.weight"}
    tensors = []
    for name, array in w.items():
        parts = name.split(".")
        gguf_name = names[parts[-1]] if len(parts) == 1 else f"blk.{parts[1]}.{names[parts[2]]}"
        array = np.ascontiguousarray(array, np.float32)
        tensors.append((gguf_name, array.shape, 0, array.tobytes(), None))
    return metadata, tensors


def gguf_cases(out: Path, weights: Path) -> list[Case]:
    metadata, tensors = stories_gguf(weights)
    cases = []

    def case(name, expect="error", meta=None, tens=None, **kwargs):
        path = out / f"gguf_{len(cases)}.gguf"
        write_gguf(path, metadata if meta is None else meta, tensors if tens is None else tens, **kwargs)
        cases.append(Case("gguf", name, ["generate", "Once", "--model", str(path), *GEN], expect=expect))

    case("valid", expect="ok")
    for key, kind, bad in (("llama.block_count", "u32", (0, 6, 1 << 24, 1 << 31, (1 << 32) - 1)),
                           ("llama.context_length", "u64", (0, 1 << 32, 1 << 40, (1 << 64) - 1)),
                           ("llama.embedding_length", "u32", (0, 1, 63, 1 << 31)),
                           ("llama.attention.head_count", "u32", (0, 3, 1 << 31)),
                           ("llama.attention.head_count_kv", "u32", (0, 3, 1 << 31)),
                           ("llama.feed_forward_length", "u32", (0, 1 << 31)),
                           ("llama.attention.layer_norm_rms_epsilon", "f32", (0.0, -1.0, math.nan, math.inf)),
                           ("llama.rope.freq_base", "f32", (0.0, -1.0, math.nan, math.inf)),
                           ("tokenizer.ggml.bos_token_id", "u32", (512, 1 << 31)),
                           ("tokenizer.ggml.eos_token_id", "u32", (512, (1 << 32) - 1)),
                           ("general.alignment", "u32", (0, 3, 1 << 31)),
                           ("general.architecture", "str", ("gpt2", "")),
                           ("llama.context_length", "str", ("512",))):
        for value in bad:
            case(f"{key}={value}", meta={**metadata, key: (kind, value)})
    tokens = metadata["tokenizer.ggml.tokens"][1][1]
    case("tokens_shortened", meta={**metadata, "tokenizer.ggml.tokens": ("arr", ("str", tokens[:100]))})
    case("scores_shortened", meta={**metadata, "tokenizer.ggml.scores": ("arr", ("f32", [0.0] * 10))})
    case("token_invalid_utf8", meta={**metadata, "tokenizer.ggml.tokens": ("arr", ("str", [b"\xff"] + tokens[1:]))})
    case("tokenizer_model_unknown", meta={**metadata, "tokenizer.ggml.model": ("str", "t5")})
    # A changed type field: 6 tensors x 10 type ids (the data stays F32).
    chosen = [0, 1, 2, 5, 9, len(tensors) - 1]
    for t in chosen:
        for type_id in (1, 30, 8, 2, 14, 24, 26, 28, 12, 99):
            bent = list(tensors)
            name, shape, _, blob, offset = bent[t]
            bent[t] = (name, shape, type_id, blob, offset)
            case(f"{name} type={type_id}", tens=bent)
    q = next(i for i, t in enumerate(tensors) if t[0].endswith("attn_q.weight"))
    name, shape, type_id, blob, _ = tensors[q]
    for label, new_shape in (("wider", (shape[0], shape[1] * 2)), ("narrower", (shape[0], shape[1] // 2)),
                             ("huge", (1 << 31, 1 << 31)), ("zero", (0, shape[1]))):
        bent = list(tensors)
        bent[q] = (name, new_shape, type_id, blob, None)
        case(f"{name} shape {label}", tens=bent)
    bent = list(tensors)
    bent[q] = (name, shape, type_id, blob, 4)
    case("misaligned_offset", tens=bent)
    bent[q] = (name, shape, type_id, blob, 0)
    case("overlapping_offset", tens=bent)
    bent[q] = (name, shape, type_id, blob, 1 << 40)
    case("offset_past_end", tens=bent)
    case("duplicate_tensor", tens=tensors + [tensors[0]])
    case("missing_tensor", tens=tensors[:-1])
    for version in (1, 4, 1 << 24):
        case(f"version={version}", version=version)
    case("n_tensors_huge", n_tensors=1 << 60)
    case("n_kv_huge", n_kv=1 << 60)
    case("n_kv_short", n_kv=3)
    nan_tensors = list(tensors)
    blob = bytearray(nan_tensors[0][3])
    blob[:4] = struct.pack("<f", math.nan)
    nan_tensors[0] = (*nan_tensors[0][:3], bytes(blob), None)
    case("nan_weight", tens=nan_tensors)
    full = (out / f"gguf_0.gguf").read_bytes()
    for size in (0, 3, 8, 24, 100, 5000, len(full) // 2, len(full) - 1):
        path = out / f"gguf_trunc_{size}.gguf"
        path.write_bytes(full[:size])
        cases.append(Case("gguf", f"truncated@{size}", ["generate", "Once", "--model", str(path), *GEN]))
    info = [Case("gguf", f"info {c.name}", ["info", c.args[3]], expect=c.expect) for c in cases[::3]]
    return cases + info


# ----------------------------------------------------------------------------------------------------------------
# Tokenizer files given with --tokenizer


def tokenizer_cases(out: Path, weights: Path) -> list[Case]:
    model = str(weights / "stories260K" / "stories260K.bin")
    tok_bin = (weights / "stories260K" / "tok512.bin").read_bytes()
    tok_model = (weights / "stories260K" / "tok512.model").read_bytes()
    cases = []

    def case(name, filename, data):
        path = out / filename
        path.write_bytes(data)
        cases.append(Case("tokenizer", name, ["generate", "Once", "--model", model, "--tokenizer", str(path), *GEN]))

    for size in (0, 3, 4, 100, len(tok_bin) // 2, len(tok_bin) - 1):
        case(f"tok512.bin truncated@{size}", f"t{size}.bin", tok_bin[:size])
    case("tok512.bin extra record", "extra.bin", tok_bin + struct.pack("<fi", 0.0, 3) + b"abc")
    case("tok512.bin negative length", "neg.bin", tok_bin[:4] + struct.pack("<fi", 0.0, -5) + tok_bin[12:])
    case("tok512.bin huge length", "huge.bin", tok_bin[:4] + struct.pack("<fi", 0.0, 1 << 30) + tok_bin[12:])
    case("tok512.bin nan score", "nan.bin", tok_bin[:4] + struct.pack("<f", math.nan) + tok_bin[8:])
    for size in (0, 10, len(tok_model) // 2):
        case(f"tok512.model truncated@{size}", f"m{size}.model", tok_model[:size])
    case("tok512.model garbage", "garbage.model", b"\xff" * 1000)
    case("unknown suffix", "tok.txt", b"hello")
    case("tokenizer.json garbage", "tokenizer.json", b"{]")
    case("gguf no vocab", "novocab.gguf", b"GGUF" + struct.pack("<IQQ", 3, 0, 0))
    llama_tok = weights / "llama2-tokenizer" / "tokenizer.model"
    if llama_tok.exists():  # a real tokenizer of another size
        cases.append(Case("tokenizer", "llama2 tokenizer (32000) for a 512 model",
                          ["generate", "Once", "--model", model, "--tokenizer", str(llama_tok), *GEN]))
    cases.append(Case("tokenizer", "directory", ["generate", "Once", "--model", model, "--tokenizer", str(out), *GEN]))
    return cases


# ----------------------------------------------------------------------------------------------------------------
# Prompts


def prompt_cases(out: Path) -> list[Case]:
    cases = []
    for name, arg, expect in (("invalid_utf8 \\xff", b"\xff", "error"), ("lone lead byte", b"Once \xc3", "error"),
                              ("encoded surrogate", b"a\xed\xa0\x80b", "error"), ("overlong", b"\xc0\xaf", "error"),
                              ("escape sequence", "\x1b[31mred\x1b[0m", "ok"), ("bell", "\x07", "ok"),
                              ("crlf", "a\r\nb", "ok"), ("tab", "\t", "ok"), ("space", " ", "ok"), ("empty", "", "ok"),
                              ("rtl override", "\u202eabc", "ok"), ("emoji", "😀" * 10, "ok"),
                              ("bom", "\ufeffOnce", "ok"),
                              ("combining", "e\u0301" * 50, "ok"), ("100 kB", "a " * 50_000, "error"),
                              ("nul escape", "\\x00", "ok"), ("dash x", "-x", "error")):
        cases.append(Case("prompt", f"argv {name}", ["generate", arg, *GEN], expect=expect))
    # "--" ends the options (argparse), so a prompt "--" comes after one
    cases.append(Case("prompt", "argv '--' after '--'", ["generate", *GEN, "--", "--"], expect="ok"))
    for name, data, expect in (("nul and controls", b"\x00\x01\x02\x7f", "ok"), ("1 MB", b"a " * 500_000, "error"),
                               ("invalid utf8", b"\xff\xfe", "error"), ("empty", b"", "ok"), ("newline", b"\n", "ok"),
                               ("crlf", b"Once\r\n", "ok"), ("utf16", "Once".encode("utf-16"), "error")):
        cases.append(Case("prompt", f"stdin {name}", ["generate", "-", *GEN], stdin=data, expect=expect))
    files = {"invalid_utf8": b"\xff\n", "empty": b"", "blank": b"\n \n\n", "1 MB line": b"a " * 500_000 + b"\n",
             "nul": b"a\x00b\n"}
    for name, data in files.items():
        path = out / f"prompts_{name.replace(' ', '_')}.txt"
        path.write_bytes(data)
        cases.append(Case("prompt", f"--prompt-file {name}", ["generate", "--prompt-file", str(path), *GEN],
                          expect="ok" if name == "nul" else "error"))
    cases.append(Case("prompt", "--prompt-file directory", ["generate", "--prompt-file", str(out), *GEN]))
    cases.append(Case("prompt", "--prompt-file missing", ["generate", "--prompt-file", str(out / "absent"), *GEN]))
    return cases


# ----------------------------------------------------------------------------------------------------------------
# Flags


def flag_cases(out: Path) -> list[Case]:
    cases = []
    numbers = ["-1", "0", "1000000000", "nan", "inf", "-inf", "abc", "", "99999999999999999999", "1e-300"]
    ranges = {  # value -> allowed?  (None: either is fine, e.g. a huge token limit ends at the context)
        "--max-new-tokens": {"0": True, "1000000000": None, "99999999999999999999": None},
        "--temperature": {"0": True, "1000000000": True, "99999999999999999999": True},
        "--top-p": {"1e-300": True},
        "--seed": {"0": True, "1000000000": True, "-1": None, "99999999999999999999": None},
        "--top-k": {"0": True, "1000000000": True, "99999999999999999999": None},
        "--min-p": {"0": True, "1e-300": True},
        "--typical-p": {"1e-300": True},
        "--repetition-penalty": {"1000000000": True, "99999999999999999999": True, "1e-300": None},
        "--presence-penalty": {"-1": True, "0": True, "1000000000": True, "99999999999999999999": True,
                               "1e-300": True},
        "--frequency-penalty": {"-1": True, "0": True, "1000000000": True, "99999999999999999999": True,
                                "1e-300": True},
        "--no-repeat-ngram": {"0": True, "1000000000": True, "99999999999999999999": None},
        "--logprobs": {"0": True, "1000000000": None, "99999999999999999999": None},
        "--threads": {"1000000000": None, "99999999999999999999": None},
    }
    for flag, allowed in ranges.items():
        for value in numbers:
            ok = allowed.get(value, False)
            expect = "any" if ok is None else "ok" if ok else "error"
            cases.append(Case("flag", f"generate {flag} {value!r}", ["generate", "Once", *GEN, flag, value],
                              expect=expect))
    for name, args, expect in (("--backend bad", ["--backend", "gpu"], "error"),
                               ("--backend bad", ["--backend", "tpu"], "error"),
                               ("--backend cuda", ["--backend", "cuda"], "any"),
                               ("--stop empty", ["--stop", ""], "any"),
                               ("--json alone", ["--json"], "error"),
                               ("--model fifo", ["--model", str(out / "fifo")], "error"),
                               ("--model /dev/zero", ["--model", "/dev/zero"], "error"),
                               ("--model directory", ["--model", str(out / "fifo_dir")], "error"),
                               ("--tokenizer fifo", ["--tokenizer", str(out / "fifo")], "error"),
                               ("--model unknown name", ["--model", "stories1B"], "error")):
        cases.append(Case("flag", f"generate {name}", ["generate", *GEN, *args],
                          expect=expect))
    base = ["bench", "--model", "stories260K", "--batch", "1", "--prompt-len", "8", "--gen-len", "4", "--repeat",
            "1", "--bandwidth-mib", "8"]
    for flag in ("--batch", "--prompt-len", "--gen-len", "--threads", "--repeat", "--bandwidth-mib"):
        for value in ("-1", "0", "abc", "1000000000", "99999999999999999999"):
            expect = "any" if value in ("1000000000", "99999999999999999999") else "error"
            cases.append(Case("flag", f"bench {flag} {value}", [*base, flag, value], expect=expect))
    cases.append(Case("flag", "bench --backend bad", [*base, "--backend", "gpu"]))
    cases.append(Case("flag", "bench --model fifo", [*base, "--model", str(out / "fifo")]))
    cases.append(Case("flag", "info fifo", ["info", str(out / "fifo")]))
    cases.append(Case("flag", "info missing", ["info", str(out / "absent.bin")]))
    return cases


# ----------------------------------------------------------------------------------------------------------------
# Options given together


def combination_cases(out: Path) -> list[Case]:
    """Options that go together or do not (npllm.cli.parser's GENERATE_MODES and friends): each combination runs, or is
    refused before anything loads; none is silently ignored. The files they name exist, so a refusal can only come
    from the combination."""
    prompts, text = out / "combo_prompts.txt", out / "combo_text.txt"
    prompts.write_text("Once upon a time\nLily and Ben\n", encoding="utf-8")
    text.write_text("Once upon a time, there was a little girl named Lily. " * 30, encoding="utf-8")
    short = ["--max-new-tokens", "4"]
    batch, one = ["generate", "--prompt-file", str(prompts), *short], ["generate", "Once", *short]
    chat, hi = ["chat", "--chat-template", "chatml", *short], b"Hi\n"
    ppl = ["perplexity", "--text", str(text), "--ctx", "64"]
    refused = {
        "--prompt-file --num-beams": [*batch, "--num-beams", "2"],
        "--prompt-file --draft": [*batch, "--draft", "stories260K"],
        "--prompt-file --draft-layers": [*batch, "--draft-layers", "2"],
        "--prompt-file --ignore-eos": [*batch, "--ignore-eos"],
        "--prompt-file --context-policy": [*batch, "--context-policy", "sinks"],
        "--prompt-file PROMPT": [*batch, "Once"],
        "--num-beams --draft-layers": [*one, "--num-beams", "2", "--draft-layers", "2"],
        "--num-beams --logprobs": [*one, "--num-beams", "2", "--logprobs", "2"],
        "--num-beams --temperature": [*one, "--num-beams", "2", "--temperature", "0.7"],
        "--num-beams --seed": [*one, "--num-beams", "2", "--seed", "1"],
        "--num-beams --top-k": [*one, "--num-beams", "2", "--top-k", "5"],
        "--num-beams --ignore-eos": [*one, "--num-beams", "2", "--ignore-eos"],
        "--explain --num-beams": [*one, "--explain", "--num-beams", "2"],
        "--explain --stop": [*one, "--explain", "--stop", "."],
        "--explain --logprobs": [*one, "--explain", "--logprobs", "2"],
        "--explain --draft-layers": [*one, "--explain", "--draft-layers", "2"],
        "--draft --draft-layers": [*one, "--draft", "stories260K", "--draft-layers", "2"],
        "--draft-layers --logprobs": [*one, "--draft-layers", "2", "--logprobs", "2"],
        "--draft-layers --context-policy": [*one, "--draft-layers", "2", "--context-policy", "truncate"],
        "--draft-layers --ignore-eos": [*one, "--draft-layers", "2", "--ignore-eos"],
        "--num-draft alone": [*one, "--num-draft", "3"],
        "--sinks alone": [*one, "--sinks", "8"],
        "--sinks --context-policy truncate": [*one, "--context-policy", "truncate", "--sinks", "8"],
        "chat --sinks alone": [*chat, "--sinks", "8"],
        "perplexity --stride --kl-divergence": [*ppl, "--stride", "32", "--kl-divergence", "stories260K"],
        "perplexity --stride --batch": [*ppl, "--stride", "32", "--batch", "2"],
    }
    works = {
        "--prompt-file --logprobs --stop": [*batch, "--logprobs", "2", "--stop", "."],
        "--num-beams --stop": [*one, "--num-beams", "2", "--stop", "."],
        "--draft-layers --stop --top-k": [*one, "--draft-layers", "2", "--stop", ".", "--top-k", "4", "--seed", "1"],
        "--explain --json --temperature": [*one, "--explain", "--json", "--temperature", "0.5", "--seed", "1"],
        "chat --logprobs --kv-dtype": [*chat, "--logprobs", "2", "--kv-dtype", "float16"],
        "perplexity --stride": [*ppl, "--stride", "32"],
        "perplexity --kl-divergence --batch": [*ppl, "--kl-divergence", "stories260K", "--batch", "2"],
    }
    return ([Case("combo", name, args, stdin=hi if args[0] == "chat" else None) for name, args in refused.items()]
            + [Case("combo", name, args, stdin=hi if args[0] == "chat" else None, expect="ok")
               for name, args in works.items()])


# ----------------------------------------------------------------------------------------------------------------
# Chat templates (code from a model file): each must end in one error line, within its deadline


TEMPLATES = {  # name -> (template, expect)
    "nested range loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                           "error"),
    "nested loops writing": ("{% for i in range(100000) %}{% for j in range(100000) %}xxxx{% endfor %}{% endfor %}",
                             "error"),
    "string * 10**9": ("{{ 'a' * 10**9 }}", "error"),
    "list * 10**9": ("{{ ['a'] * 10**9 }}", "error"),
    "indent(10**9)": ("{{ 'x' | indent(10**9) }}", "error"),
    "center(10**9)": ("{{ 'x' | center(10**9) }}", "error"),
    "str.ljust(10**9)": ("{{ 'x'.ljust(10**9) }}", "error"),
    "tojson(indent=10**9)": ("{{ messages | tojson(indent=10**9) }}", "error"),
    "replace('', big)": ("{{ ('a' * 100000).replace('', 'b' * 100000) }}", "error"),
    "join of a repeated list": ("{{ (['b' * 100000] * 100000) | join }}", "error"),
    "%-format width": ("{{ '%1000000000d' % 1 }}", "error"),
    "str.format width": ("{{ '{:>1000000000}'.format(1) }}", "error"),
    "doubling list": ("{% set ns = namespace(x=['a']) %}{% for i in range(64) %}{% set ns.x = ns.x + ns.x %}"
                      "{% endfor %}", "error"),
    "10**100000": ("{{ 10 ** 100000 }}", "error"),
    "1/0": ("{{ 1/0 }}", "error"),
    "tojson of undefined": ("{{ nothing | tojson }}", "error"),
    "recursive macro": ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "error"),
    "include": ("{% include 'x.jinja' %}", "error"),
    "import": ("{% import 'x.jinja' as x %}", "error"),
    "extends": ("{% extends 'x.jinja' %}", "error"),
    "range(10**10)|length": ("{{ range(10**10) | length }}", "error"),
    "str + int": ("{{ 'a' + 1 }}", "error"),
    "100,000-digit literal": ("{{ " + "7" * 100_000 + " }}", "error"),
    "strftime_now(5)": ("{{ strftime_now(5) }}", "error"),
    "wordwrap(0)": ("{{ 'a b' | wordwrap(0) }}", "error"),
    "syntax error": ("{% for %}", "error"),
    "raise_exception": ("{{ raise_exception('no') }}", "error"),
    "python internals": ("{{ messages.__class__.__mro__ }}", "error"),
    "plain": ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}", "ok"),
}


def template_cases(out: Path) -> list[Case]:
    """`npllm chat --chat-template FILE` with one user line, for each template above (stories260K, greedy)."""
    cases = []
    for i, (name, (template, expect)) in enumerate(TEMPLATES.items()):
        path = out / f"template_{i}.jinja"
        path.write_text(template, encoding="utf-8")
        cases.append(Case("template", name, ["chat", "--chat-template", str(path), *GEN], stdin=b"Hi\n",
                          expect=expect))
    return cases


# ----------------------------------------------------------------------------------------------------------------
# Output paths (npllm quantize IN OUT) and cache folders: nothing but a regular file is ever replaced, no partial file
# is left behind, and a folder that cannot be made or written is one error line


def file_kind(path: Path) -> str:
    """'fifo', 'folder', 'file', 'link' or 'absent': what a case must leave as it found."""
    if path.is_symlink():
        return "link"
    if not path.exists():
        return "absent"
    return "fifo" if path.is_fifo() else "folder" if path.is_dir() else "file" if path.is_file() else "other"


def unchanged(folder: Path, *kept: Path):
    """A Case.check: every path in `kept` is still what it was, and `folder` holds no partial file afterwards."""
    before = {p: file_kind(p) for p in kept}

    def check() -> str | None:
        changed = [f"{p.name} was a {k}, is a {file_kind(p)}" for p, k in before.items() if file_kind(p) != k]
        partial = [p.name for p in folder.iterdir() if "partial" in p.name and p not in before]
        return "; ".join(changed + [f"left {name}" for name in partial]) or None

    return check


def output_cases(out: Path, weights: Path) -> list[Case]:
    model = str(weights / "stories260K" / "stories260K.bin")
    place = out / "outputs"
    place.mkdir()
    fifo, folder, a_file = place / "fifo.gguf", place / "folder.gguf", place / "a_file"
    os.mkfifo(fifo)
    folder.mkdir()
    a_file.write_bytes(b"not a folder")
    os.mkfifo(place / "next.gguf.partial")  # the name the writer used to use: must be neither opened nor replaced
    (place / "fifo_link.gguf").symlink_to(fifo)
    locked = place / "locked"
    locked.mkdir(mode=0o500)
    cases = []

    def case(name, target, expect="error", kept=()):
        cases.append(Case("output", name, ["quantize", model, str(target), "--type", "f32"], expect=expect,
                          check=unchanged(place, fifo, folder, a_file, place / "next.gguf.partial", *kept)))

    case("OUT is a FIFO", fifo)
    case("OUT is a link to a FIFO", place / "fifo_link.gguf", kept=[place / "fifo_link.gguf"])
    case("OUT is a folder", folder)
    case("OUT in a missing folder", place / "missing" / "m.gguf")
    case("OUT below a file", a_file / "m.gguf")
    case("OUT with a trailing slash", str(place / "new_dir") + "/")
    case("OUT empty", "")
    case("OUT in an unwritable folder", locked / "m.gguf", expect="any" if os.geteuid() == 0 else "error")
    case("OUT beside a FIFO named OUT.partial", place / "next.gguf", expect="ok")
    old = place / "old.gguf"
    old.write_bytes(b"an older file")
    case("OUT replaces a regular file", old, expect="ok", kept=[old])
    cache_file = out / "cache_is_a_file"
    cache_file.write_bytes(b"")
    for name, env in (("XDG_CACHE_HOME is a file", {"XDG_CACHE_HOME": str(cache_file)}),
                      ("XDG_CACHE_HOME below a file", {"XDG_CACHE_HOME": str(cache_file / "sub")})):
        cases.append(Case("output", f"download: {name}", ["generate", "Once", "--model", "stories15M", *GEN],
                          env=env))
    return cases


# ----------------------------------------------------------------------------------------------------------------
# Tokenizer fields of the wrong type or encoding: tokenizer.json, GGUF tokenizer keys, SentencePiece pieces

WRONG_JSON = [5, -1, 1.5, "x", "", [], {}, True, None, [1], {"a": 1}]


def json_variants(spec, wrong=WRONG_JSON, skip=("vocab", "merges"), prefix=()):
    """(path, value) for every field of a parsed JSON document at every depth (the first 3 items of a list; not
    inside the `skip` keys' values), each with every value in `wrong`: what json_with puts there."""
    items = spec.items() if isinstance(spec, dict) else enumerate(spec[:3]) if isinstance(spec, list) else ()
    for key, value in items:
        path = (*prefix, key)
        for bad in wrong:
            yield path, bad
        if key not in skip:
            yield from json_variants(value, wrong, skip, path)


def json_with(spec, path: tuple, value):
    """A deep copy of spec with the field at `path` replaced by `value`."""
    import copy

    bent = copy.deepcopy(spec)
    node = bent
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return bent


GGUF_TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.scores",
                       "tokenizer.ggml.token_type", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                       "tokenizer.ggml.eot_token_id", "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.pre",
                       "tokenizer.ggml.merges", "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_space_prefix")
GGUF_WRONG = (("u32", 5), ("i32", -1), ("str", "x"), ("f32", math.nan), ("bool", True), ("arr", ("str", ["a", "b"])),
              ("arr", ("i32", [1, 2])), ("arr", ("f32", [0.5])))


def sentencepiece_bent(model: bytes, piece: bytes, byte_at: int | None = None, score: float | None = None) -> bytes:
    """tok512.model with one piece's text byte replaced by 0xFF (byte_at) or its score set (score). A piece is a
    protobuf message: field 1 the text (tag 0x0A, length, bytes), field 2 the score (tag 0x15, float32)."""
    data = bytearray(model)
    start = data.find(b"\x0a" + bytes([len(piece)]) + piece)
    assert start >= 0, piece
    text = start + 2
    if byte_at is not None:
        data[text + byte_at] = 0xFF
    if score is not None:
        assert data[text + len(piece)] == 0x15
        data[text + len(piece) + 1 : text + len(piece) + 5] = struct.pack("<f", score)
    return bytes(data)


def tokenizer_field_cases(out: Path, weights: Path) -> list[Case]:
    numpy = ["--backend", "numpy", *GEN]  # no kernels to compile: the tokenizer is what is tried
    cases = []
    spec = json.loads((FIXTURE / "tokenizer.json").read_text())
    variants = list(json_variants(spec))
    for i, (path, value) in enumerate(random.Random(1).sample(variants, min(120, len(variants)))):
        target = out / f"tokjson_{i}.json"
        target.write_text(json.dumps(json_with(spec, path, value)))
        where = ".".join(map(str, path))
        cases.append(Case("tokenizer-fields", f"tokenizer.json {where}={value!r}",
                          ["generate", "Once", "--model", str(FIXTURE), "--tokenizer", str(target), *numpy],
                          expect="any"))
    metadata, tensors = stories_gguf(weights)
    for key in GGUF_TOKENIZER_KEYS:
        for kind, value in GGUF_WRONG:
            for model in ("llama", "gpt2") if key in ("tokenizer.ggml.pre", "tokenizer.ggml.merges") else ("llama",):
                meta = {**metadata, key: (kind, value)}
                if model == "gpt2":
                    meta = {"tokenizer.ggml.merges": ("arr", ("str", ["a b"])), **meta,
                            "tokenizer.ggml.model": ("str", "gpt2")}
                path = out / f"tokgguf_{len(cases)}.gguf"
                write_gguf(path, meta, tensors)
                cases.append(Case("tokenizer-fields", f"gguf {model} {key}={value!r}",
                                  ["generate", "Once", "--model", str(path), *numpy], expect="any"))
    model, tok = weights / "stories260K" / "stories260K.bin", weights / "stories260K" / "tok512.model"
    piece = "\u2581the".encode()
    for name, kwargs in (("piece not UTF-8", {"byte_at": 3}), ("piece lead byte 0xFF", {"byte_at": 0}),
                         ("score NaN", {"score": math.nan}), ("score inf", {"score": math.inf})):
        path = out / f"sp_{name.replace(' ', '_')}.model"
        path.write_bytes(sentencepiece_bent(tok.read_bytes(), piece, **kwargs))
        cases.append(Case("tokenizer-fields", f"tok512.model {name}",
                          ["generate", "the cat", "--model", str(model), "--tokenizer", str(path), *numpy]))
    return cases


# ----------------------------------------------------------------------------------------------------------------
# SentencePiece .model files: cut, bit-flipped, and valid protobufs holding what sentencepiece refuses (or npllm does)


def proto_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        out.append((value & 0x7F) | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


def proto_fields(data: bytes) -> list[tuple[int, int, bytes | int]]:
    """(number, wire type, value) of each field of a protobuf message (values: int for varints, else bytes)."""
    fields, i = [], 0

    def varint():
        nonlocal i
        value = shift = 0
        while True:
            value |= (data[i] & 0x7F) << shift
            shift, i = shift + 7, i + 1
            if data[i - 1] < 0x80:
                return value

    while i < len(data):
        key = varint()
        wire = key & 7
        if wire == 0:
            value = varint()
        else:
            size = varint() if wire == 2 else {1: 8, 5: 4}[wire]
            value, i = data[i:i + size], i + size
        fields.append((key >> 3, wire, value))
    return fields


def proto_message(fields) -> bytes:
    out = bytearray()
    for number, wire, value in fields:
        out += proto_varint(number << 3 | wire)
        out += proto_varint(value) if wire == 0 else (proto_varint(len(value)) if wire == 2 else b"") + value
    return bytes(out)


def sentencepiece_with(model: bytes, pieces=None, trainer: dict | None = None) -> bytes:
    """tok512.model rebuilt: pieces {index: {field: value}} changes those pieces' fields (1 text, 2 score as
    float32 bytes, 3 type), pieces {index: None} drops one; trainer {field: varint} sets TrainerSpec fields (3 is
    model_type: 1 unigram, 2 BPE, 3 word, 4 char)."""
    fields, index = [], -1
    for number, wire, value in proto_fields(model):
        if number == 1:
            index += 1
            change = (pieces or {}).get(index, {})
            if change is None:
                continue
            kept = [(n, w, change.get(n, v)) for n, w, v in proto_fields(value)]
            kept += [(n, 0 if n == 3 else 2, v) for n, v in change.items() if n not in {k for k, _, _ in kept}]
            value = proto_message(kept)
        elif number == 2 and trainer:
            value = proto_message([f for f in proto_fields(value) if f[0] not in trainer]
                                  + [(n, 0, v) for n, v in trainer.items()])
        fields.append((number, wire, value))
    return proto_message(fields)


def sentencepiece_cases(out: Path, weights: Path) -> list[Case]:
    """`npllm generate --tokenizer FILE.model` on stories260K for broken SentencePiece models: each must be one
    error line (or, "any", a clean run), never a traceback from inside sentencepiece."""
    model, tok = weights / "stories260K" / "stories260K.bin", (weights / "stories260K" / "tok512.model").read_bytes()
    cases = []

    def case(name, data, expect="error"):
        path = out / f"spm_{len(cases)}.model"
        path.write_bytes(data)
        cases.append(Case("sentencepiece", name, ["generate", "Once", "--model", str(model), "--tokenizer",
                                                  str(path), "--backend", "numpy", *GEN], expect=expect))

    for size in (1, 2, 7, 64, 1000, len(tok) - 3):
        case(f"truncated@{size}", tok[:size])
    rng = random.Random(2)
    for _ in range(24):  # flips anywhere: most leave a model that still loads, others break it
        data, at = bytearray(tok), rng.randrange(len(tok))
        data[at] ^= 1 << rng.randrange(8)
        case(f"bit flipped @{at}", bytes(data), expect="any")
    byte_piece = tok.find(b"<0x6C>")  # sentencepiece's error quotes the piece: a non-UTF-8 one broke its message
    case("byte piece not UTF-8 (<0x6\\xc3>)", tok[:byte_piece + 4] + b"\xc3" + tok[byte_piece + 5:])
    for name, pieces in (("empty piece", {300: {1: b""}}), ("duplicate piece", {300: {1: b"\xe2\x96\x81the"}}),
                         ("piece with NUL", {300: {1: b"a\x00b"}}), ("100 kB piece", {300: {1: b"x" * 100_000}}),
                         ("byte piece renamed", {3: {1: b"abc"}}), ("normal piece of byte type", {300: {3: 6}}),
                         ("two unknown pieces", {300: {3: 2}}), ("no BOS piece", {1: {3: 1}}),
                         ("no pieces past BOS", {i: None for i in range(2, 512)})):
        case(name, sentencepiece_with(tok, pieces))
    for name, kind, expect in (("word model", 3, "error"), ("char model", 4, "error"), ("unigram model", 1, "any"),
                               ("model type 9", 9, "error"), ("model type 0", 0, "error")):
        case(name, sentencepiece_with(tok, trainer={3: kind}), expect)
    case("byte fallback off", sentencepiece_with(tok, trainer={35: 0}))
    case("tok512.bin as .model", (weights / "stories260K" / "tok512.bin").read_bytes())
    case("JSON as .model", b'{"model": {"type": "BPE"}}')
    return cases


# ----------------------------------------------------------------------------------------------------------------
# NaN and infinite metadata values: refused at load, whichever format carries them


def non_finite_cases(out: Path, weights: Path) -> list[Case]:
    numpy = ["--backend", "numpy", *GEN]
    cases = []
    metadata, tensors = stories_gguf(weights)
    linear = {"llama.rope.scaling.type": ("str", "linear")}
    scores = metadata["tokenizer.ggml.scores"][1][1]
    for value in (math.nan, math.inf, -math.inf):
        for key, extra in (("llama.rope.scaling.factor", linear), ("llama.rope.freq_base", {}),
                           ("llama.attention.layer_norm_rms_epsilon", {}), ("tokenizer.ggml.scores", {})):
            bent = ("arr", ("f32", [value] + scores[1:])) if key == "tokenizer.ggml.scores" else ("f32", value)
            path = out / f"nonfinite_{len(cases)}.gguf"
            write_gguf(path, {**metadata, **extra, key: bent}, tensors)
            cases.append(Case("non-finite", f"gguf {key}={value}", ["generate", "Once", "--model", str(path),
                                                                     *numpy]))
    config = json.loads((FIXTURE / "config.json").read_text())
    config.pop("rope_scaling", None)
    config.pop("rope_parameters", None)
    llama3 = '{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": %s, "high_freq_factor": 4.0, ' \
             '"original_max_position_embeddings": 64}'
    for literal in ("NaN", "Infinity", "-Infinity"):
        for field, text in (("rms_norm_eps", literal), ("rope_theta", literal),
                            ("rope_parameters", '{"rope_type": "linear", "factor": %s}' % literal),
                            ("rope_parameters", llama3 % literal)):
            folder = out / f"nonfinite_hf_{len(cases)}"
            folder.mkdir()
            for f in FIXTURE.iterdir():
                (folder / f.name).symlink_to(f)
            (folder / "config.json").unlink()
            (folder / "config.json").write_text(json.dumps({**config, field: "@@"}).replace('"@@"', text))
            cases.append(Case("non-finite", f"config.json {field}={text}", ["generate", "Once", "--model",
                                                                             str(folder), *numpy]))
    return cases


# ----------------------------------------------------------------------------------------------------------------
# RoPE factors: longrope's lists with NaN, infinities, 0 or negatives; partial_rotary_factor in both config.json
# layouts (a fraction in (0, 1] rotating an even number of each head's dims runs: 1.0 and 0.5; the rest is refused)


def rope_factor_cases(out: Path) -> list[Case]:
    numpy = ["--backend", "numpy", *GEN]
    hf = REPO / "tests" / "fixtures" / "hf"
    cases = []

    def case(name, source: Path, config: dict, literal: str = "", expect="error"):
        folder = out / f"rope_factors_{len(cases)}"
        folder.mkdir()
        for f in source.iterdir():
            (folder / f.name).symlink_to(f)
        (folder / "config.json").unlink()
        (folder / "config.json").write_text(json.dumps(config).replace('"@@"', literal))
        cases.append(Case("non-finite factors", name, ["generate", "Once", "--model", str(folder), *numpy],
                          expect=expect))

    phi3 = json.loads((hf / "phi3" / "config.json").read_text())
    for which in ("short_factor", "long_factor"):
        for literal in ("NaN", "Infinity", "-Infinity", "0", "-1.0"):
            bent = json.loads(json.dumps(phi3))
            bent["rope_parameters"][which][3] = "@@"
            case(f"config.json {which}[3]={literal}", hf / "phi3", bent, literal)
    qwen2 = json.loads((FIXTURE / "config.json").read_text())
    for literal in ("0", "NaN", "2.0", "0.5", "-1", "1.0"):
        expect = "ok" if literal in ("1.0", "0.5") else "error"
        case(f"config.json partial_rotary_factor={literal}", FIXTURE, {**qwen2, "partial_rotary_factor": "@@"},
             literal, expect)
        inner = {**qwen2, "rope_parameters": {**qwen2.get("rope_parameters", {}), "partial_rotary_factor": "@@"}}
        case(f"config.json rope_parameters.partial_rotary_factor={literal}", FIXTURE, inner, literal, expect)
    return cases + gguf_rope_factor_cases(out)


def gguf_rope_factor_cases(out: Path) -> list[Case]:
    """llama.cpp's conversion of the phi3 fixture with one longrope factor bent in place (an F32 tensor)."""
    sys.path.insert(0, str(REPO))
    from npllm.formats.gguf import read_gguf_file

    source = REPO / "tests" / "fixtures" / "gguf_arch" / "phi3.gguf"
    g, cases = read_gguf_file(source), []
    for tensor in ("rope_factors_long.weight", "rope_factors_short.weight"):
        for value in (math.nan, math.inf, 0.0, -1.0):
            data = bytearray(source.read_bytes())
            at = g.data_start + g.tensors[tensor].offset + 4 * 2
            data[at:at + 4] = struct.pack("<f", value)
            path = out / f"rope_factors_{tensor.split('.')[0]}_{value}.gguf"
            path.write_bytes(bytes(data))
            cases.append(Case("non-finite factors", f"gguf {tensor}[2]={value}",
                              ["generate", "Once", "--model", str(path), "--backend", "numpy", *GEN]))
    return cases


# ----------------------------------------------------------------------------------------------------------------
# NPLLM_TEMPLATE_* limits out of range: refused when read, before a model loads (chat, serve), naming the variable


def env_limit_cases(out: Path) -> list[Case]:
    chat = ["chat", "--chat-template", "chatml", "--max-new-tokens", "4", "--backend", "numpy"]
    serve = ["serve", "--port", "0", "--backend", "numpy"]
    cases = []
    for variable in ("NPLLM_TEMPLATE_TIMEOUT", "NPLLM_TEMPLATE_MAX_CHARS", "NPLLM_TEMPLATE_MEMORY_MIB"):
        for value in ("1e300", "1e20", "nan", "-1", "0", "abc"):
            cases.append(Case("env limits", f"chat {variable}={value}", chat, stdin=b"Hi\n", env={variable: value}))
        cases.append(Case("env limits", f"serve {variable}=1e300", serve, env={variable: "1e300"}))
    good = {"NPLLM_TEMPLATE_TIMEOUT": "30", "NPLLM_TEMPLATE_MAX_CHARS": "100000", "NPLLM_TEMPLATE_MEMORY_MIB": "512"}
    cases.append(Case("env limits", "chat with limits in range", chat, stdin=b"Hi\n", env=good, expect="ok"))
    return cases


# ----------------------------------------------------------------------------------------------------------------
# HTTP: one `npllm serve` child under abuse over loopback (bounded: a few dozen connections, each with a deadline).
# A probe's outcome is the HTTP status it got (None: the server closed the connection without one); after each,
# /health must still answer (else "hang": the server stalled its other clients) and the server's stderr must hold no
# traceback. An outcome outside the probe's `expect` counts as "accepted" when it is a 2xx, else as "bad_status".

HTTP_KEY = "sk-bad-inputs"
HTTP_TIMEOUTS = ["--header-timeout", "2", "--body-timeout", "2"]
RUNAWAY_TEMPLATE = ("{% if messages[0]['content'] == 'hang' %}{% for i in range(100000) %}{% for j in range(100000) %}"
                    "{% endfor %}{% endfor %}{% endif %}"
                    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")


@dataclass
class Probe:
    name: str
    send: object  # port -> the HTTP status seen, or None
    expect: tuple = (400,)
    kind: str = "http"  # the summary's row


class Server:
    """`npllm serve` on the stories260K checkpoint in a child process; its stderr collected line by line."""

    def __init__(self, out: Path, weights: Path, options: tuple = ()):
        template = out / "runaway.jinja"
        template.write_text(RUNAWAY_TEMPLATE, encoding="utf-8")
        argv = [sys.executable, "-m", "npllm", "serve", "--model", str(weights / "stories260K" / "stories260K.bin"),
                "--backend", "numpy", "--port", "0", "--api-key", HTTP_KEY, "--chat-template", str(template),
                "--max-body-bytes", "65536", "--grace", "1", *HTTP_TIMEOUTS, *options]  # options: the last word
        env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", NPLLM_TEMPLATE_TIMEOUT="2")
        self.proc = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
        self.lines: list[str] = []
        self.port = self._wait_for_port()
        threading.Thread(target=self._collect, daemon=True).start()

    def _wait_for_port(self) -> int:
        for line in self.proc.stderr:
            self.lines.append(line)
            found = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
            if found:
                return int(found.group(1))
        raise RuntimeError(f"npllm serve ended before it listened: {''.join(self.lines)[-500:]}")

    def _collect(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def http_status(sock: socket.socket) -> int | None:
    """The status code of the response on `sock` (None: closed, or nothing within the socket's timeout)."""
    data = b""
    try:
        while b"\r\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
    except OSError:
        pass
    found = re.match(rb"HTTP/1\.[01] (\d{3})", data)
    return int(found.group(1)) if found else None


def send_raw(port: int, data: bytes, hold: float = 0.0, timeout: float = 15.0) -> int | None:
    """Send `data` on a new connection, wait `hold` seconds, then read the response's status."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        time.sleep(hold)
        return http_status(sock)


def post(path: str, body: bytes, key: str | None = HTTP_KEY, length: int | None = None) -> bytes:
    """A whole POST request's bytes (Content-Length `length` when given, to send less than it announces)."""
    auth = b"" if key is None else f"Authorization: Bearer {key}\r\n".encode()
    size = len(body) if length is None else length
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {size}\r\nConnection: close\r\n").encode() + auth + b"\r\n" + body


def completion(**fields) -> bytes:
    return json.dumps({"model": "stories260K", "prompt": "Once", "max_tokens": 2, **fields}).encode()


def health(port: int) -> int | None:
    return send_raw(port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n", timeout=5.0)


def held_heads(port: int, n: int = 20) -> int | None:
    """n connections send half a request head and hold it: /health must answer meanwhile (its status is the
    outcome), and the server must drop every one by its head deadline (else the outcome is None)."""
    socks = [socket.create_connection(("127.0.0.1", port), timeout=10.0) for _ in range(n)]
    try:
        for sock in socks:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        answer = health(port)
        dropped = all(http_status(sock) in (None, 408) for sock in socks)  # closed by the server, not timed out
        return answer if dropped else None
    finally:
        for sock in socks:
            sock.close()


def disconnect_mid_body(port: int) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=5.0) as sock:
        sock.sendall(post("/v1/completions", b'{"model": "m", "pro', length=500))
    return 0  # the outcome is what the server logs (a traceback is counted after the probe)


def http_probes() -> list[Probe]:
    chat = b'{"model": "stories260K", "messages": [{"role": "user", "content": "hang"}], "max_tokens": 2}'
    return [
        Probe("60,000 nested [", lambda port: send_raw(port, post("/v1/completions", b"[" * 60_000))),
        Probe("a 5,000-digit integer", lambda port: send_raw(
            port, post("/v1/completions", completion()[:-1] + b', "seed": ' + b"9" * 5000 + b"}"))),
        Probe("invalid JSON", lambda port: send_raw(port, post("/v1/completions", b'{"model": '))),
        Probe("NaN temperature", lambda port: send_raw(
            port, post("/v1/completions", completion()[:-1] + b', "temperature": NaN}'))),
        Probe("max_tokens -1", lambda port: send_raw(port, post("/v1/completions", completion(max_tokens=-1)))),
        Probe("a body past --max-body-bytes", lambda port: send_raw(
            port, post("/v1/completions", b" " * 70_000)), (413,)),
        Probe("half a body, held", lambda port: send_raw(
            port, post("/v1/completions", b'{"model"', length=1000), hold=3.0), (408, None)),
        Probe("half a head, held", lambda port: send_raw(
            port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", hold=3.0), (408, None)),
        Probe("20 half heads held while /health is asked", held_heads, (200,)),
        Probe("a disconnect mid-body", disconnect_mid_body, (0,)),
        Probe("an empty bearer token", lambda port: send_raw(port, post("/v1/completions", completion(), key="")),
              (401,)),
        Probe("a wrong key", lambda port: send_raw(port, post("/v1/completions", completion(), key="sk-no")), (401,)),
        Probe("no key", lambda port: send_raw(port, post("/v1/completions", completion(), key=None)), (401,)),
        Probe("not HTTP", lambda port: send_raw(port, b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" * 8),
              (400, None)),
        Probe("a runaway chat template", lambda port: send_raw(port, post("/v1/chat/completions", chat))),
        Probe("an unknown path", lambda port: send_raw(port, post("/v1/nothing", completion())), (404,)),
        Probe("a completion that must work", lambda port: send_raw(port, post("/v1/completions", completion())),
              (200,)),
    ]


# The server's template worker killed while idle, as the OOM killer would (SIGKILL): the next chat must still work.

def template_workers(parent: int) -> list[int]:
    """The pids of process `parent`'s live chat template workers (npllm/chat/sandbox.py)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read()
        except (OSError, IndexError):
            continue
        if fields[1:2] == [str(parent)] and fields[0] != "Z" and b"sandbox.py" in command:  # state, ppid, ...
            found.append(int(entry))
    return found


def kill_idle_worker_then_chat(server: Server, port: int, wait: bool) -> int | None:
    """A chat (its worker is then idle), every worker of the server killed (and, where `wait`, seen dead), then
    another chat: that one's status (None where the first failed or no worker was found)."""
    body = json.dumps({"model": "stories260K", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 2}).encode()
    if send_raw(port, post("/v1/chat/completions", body)) != 200:
        return None
    workers = template_workers(server.proc.pid)
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while wait and template_workers(server.proc.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    return send_raw(port, post("/v1/chat/completions", body)) if workers else None


def killed_worker_probes(server: Server) -> list[Probe]:
    return [Probe(f"a chat after the idle worker was killed{' (seen dead)' if wait else ''}",
                  lambda port, wait=wait: kill_idle_worker_then_chat(server, port, wait), (200,),
                  kind="killed template worker") for wait in (True, False)]


def http_results(out: Path, weights: Path, timeout: float, kinds: list | None = None) -> list[Result]:
    def wanted(probe: Probe) -> bool:
        return not kinds or probe.kind in kinds

    probes = [p for p in http_probes() + deep_field_probes() + lenient_field_probes() + unserved_field_probes()
              if wanted(p)]
    if not probes and kinds and "killed template worker" not in kinds:
        return []
    server = Server(out, weights)
    try:
        probes += [p for p in killed_worker_probes(server) if wanted(p)]
        return [run_probe(server, probe, timeout) for probe in probes]
    finally:
        server.stop()


def run_probe(server: Server, probe: Probe, timeout: float) -> Result:
    case = Case(probe.kind, probe.name, [], expect="ok" if 200 in probe.expect else "error")
    seen = len(server.lines)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(probe.send, server.port)
        try:
            outcome, hang = future.result(timeout), False
        except TimeoutError:
            outcome, hang = None, True
    hang = hang or health(server.port) != 200  # the server still answers its other clients
    time.sleep(0.2)  # what the probe made the server log
    logged = "".join(server.lines[seen:])
    unexpected = outcome not in probe.expect
    ok = outcome is not None and 200 <= outcome < 300
    return Result(case, outcome, traceback="Traceback" in logged, hang=hang, stdout_on_error=False,
                  bad_status=unexpected and not ok, accepted=unexpected and ok, refused=False,
                  stderr_tail=logged[-300:])


# ----------------------------------------------------------------------------------------------------------------
# npllm batch: a bad line is an error line and the job goes on (exit 0, the good line's result written, the bad one
# in the errors file and not in the output: else "accepted", or "refused" for a good line without its result); a
# bad output file or a failed write is one error line. Kinds: deep-fields, lenient-fields (also as HTTP probes on
# the served bodies), batch-input, batch-output (also two runs at once: batch_race_results), disk-full.

DEPTHS = (500, 700, 980, 5000)
GOOD_LINE = json.dumps({"id": "good", "prompt": "Once", "max_tokens": 2, "temperature": 0})
LENIENT = {  # name -> fields a request must be refused for (OpenAI's types, strictly)
    **{f"logit_bias key {key!r}": {"logit_bias": {key: 5}} for key in (" 1", "1_0", "\u0661", "00001", "+1")},
    "logit_bias keys '00001' and '1'": {"logit_bias": {"00001": 5, "1": -5}},
    "include_usage 'yes'": {"stream": True, "stream_options": {"include_usage": "yes"}},
    "echo 0": {"echo": 0},
    "temperature 10**400": {"temperature": 10 ** 400},
}


def nested_json(depth: int) -> str:
    """An object nested `depth` deep, as text (json.dumps would recurse as deep)."""
    return '{"a": ' * depth + "1" + "}" * depth


def read_records(path: Path) -> list[dict]:
    """The JSON objects of a JSONL file's lines (none when it cannot be read)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return []
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            pass
    return [r for r in records if isinstance(r, dict)]


class BatchFiles:
    """The input, output and errors files of one batch case in `folder`, and the command line that runs them."""

    def __init__(self, folder: Path, weights: Path, number: int):
        self.input, self.output = folder / f"b{number}.jsonl", folder / f"b{number}.out.jsonl"
        self.errors = folder / f"b{number}.out.errors.jsonl"
        self.model = str(weights / "stories260K" / "stories260K.bin")

    def argv(self, *extra, output=None) -> list:
        return ["batch", "--model", self.model, "--backend", "numpy", "-i", str(self.input), "-o",
                str(self.output if output is None else output), *extra]

    def verdict(self, bad_line: int | None, good: tuple = ("good",)):
        """A Case.verdict: "accepted" when the bad line has a result or is not reported, "refused" when a good id
        has no result."""
        def verdict() -> str | None:
            ids = [r.get("id") for r in read_records(self.output)]
            reported = {e.get("line") for e in read_records(self.errors)}
            if "bad" in ids or (bad_line is not None and bad_line not in reported):
                return "accepted"
            return "refused" if any(g not in ids for g in good) else None

        return verdict


def batch_line_cases(out: Path, weights: Path, kind: str, lines: dict, extra=()) -> list[Case]:
    """One case per (name -> bad line): the good line, then the bad one (line 2), with the bad line's id "bad"."""
    cases = []
    for name, bad in lines.items():
        files = BatchFiles(out, weights, len(list(out.iterdir())))
        files.input.write_bytes(GOOD_LINE.encode() + b"\n" + (bad if isinstance(bad, bytes) else bad.encode())
                                + b"\n")
        cases.append(Case(kind, f"batch: {name}", files.argv(*extra), expect="ok", verdict=files.verdict(2)))
    return cases


def deep_field_cases(out: Path, weights: Path) -> list[Case]:
    lines = {}
    for depth in DEPTHS:
        lines[f"an unknown field nested {depth} deep"] = ('{"id": "bad", "prompt": "Once", "extra": '
                                                          + nested_json(depth) + "}")
        lines[f"a message's unknown field nested {depth} deep"] = (
            '{"id": "bad", "messages": [{"role": "user", "content": "Hi", "extra": ' + nested_json(depth) + "}]}")
        lines[f"a prompt of {depth} nested lists"] = '{"id": "bad", "prompt": ' + "[" * depth + "]" * depth + "}"
    return batch_line_cases(out, weights, "deep-fields", lines, ("--chat-template", "chatml"))


def deep_field_probes() -> list[Probe]:
    def chat(extra: str) -> bytes:
        return ('{"model": "stories260K", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi", "extra": '
                + extra + "}]}").encode()

    probes = []
    for depth in DEPTHS:
        deep = nested_json(depth)
        probes.append(Probe(f"chat: a message's unknown field nested {depth} deep", lambda port, deep=deep: send_raw(
            port, post("/v1/chat/completions", chat(deep))), kind="deep-fields"))
        probes.append(Probe(f"completion: an unknown field nested {depth} deep", lambda port, deep=deep: send_raw(
            port, post("/v1/completions", completion()[:-1] + b', "extra": ' + deep.encode() + b"}")),
            kind="deep-fields"))
    return probes


def lenient_field_cases(out: Path, weights: Path) -> list[Case]:
    lines = {name: json.dumps({"id": "bad", "prompt": "Once", **fields}) for name, fields in LENIENT.items()}
    return batch_line_cases(out, weights, "lenient-fields", lines)


def lenient_field_probes() -> list[Probe]:
    return [Probe(f"completion: {name}", lambda port, fields=fields: send_raw(
        port, post("/v1/completions", completion(**fields))), kind="lenient-fields")
            for name, fields in LENIENT.items()]


UNSERVED_ASKS = {  # name -> fields that would change the answer and are not served, or bad values of served ones
    "repeat_penalty 1.3 (llama.cpp's name)": {"repeat_penalty": 1.3},
    "functions": {"functions": [{"name": "f", "parameters": {}}]},
    "function_call auto": {"function_call": "auto"}, "n_predict 5": {"n_predict": 5},
    "guided_json": {"guided_json": {"type": "object"}}, "mirostat 2": {"mirostat": 2}, "min_tokens 5": {"min_tokens": 5},
    "n 17": {"n": 17}, "top_k -5": {"top_k": -5}, "stop_token_ids outside the vocabulary": {"stop_token_ids": [10 ** 6]},
    "ignore_eos 'yes'": {"ignore_eos": "yes"}, "repetition_penalty 0": {"repetition_penalty": 0},
}


def unserved_field_cases(out: Path, weights: Path) -> list[Case]:
    lines = {name: json.dumps({"id": "bad", "prompt": "Once", **fields})
             for name, fields in {**UNSERVED_ASKS, "n 2 (a line holds one choice)": {"n": 2}}.items()}
    return batch_line_cases(out, weights, "unserved-fields", lines)


def unserved_field_probes() -> list[Probe]:
    return [Probe(f"completion: {name}", lambda port, fields=fields: send_raw(
        port, post("/v1/completions", completion(**fields))), kind="unserved-fields")
            for name, fields in UNSERVED_ASKS.items()]


def batch_input_cases(out: Path, weights: Path) -> list[Case]:
    huge = json.dumps({"id": "bad", "prompt": "x" * (10 << 20)})
    cases = batch_line_cases(out, weights, "batch-input", {
        "a 10 MB line": huge, "a byte order mark before line 2": "\ufeff" + json.dumps({"id": "bad", "prompt": "x"})})
    files = BatchFiles(out, weights, len(list(out.iterdir())))
    files.input.write_bytes(b"\xef\xbb\xbf" + GOOD_LINE.encode() + b"\n")
    cases.append(Case("batch-input", "batch: a byte order mark before line 1", files.argv(), expect="ok",
                      verdict=files.verdict(None)))
    return cases


def batch_output_cases(out: Path, weights: Path) -> list[Case]:
    """Outputs that are no regular file (refused before anything is read: a FIFO blocked the reading forever, a link
    to /dev/zero read until memory ran out), and an output holding an id twice (refused, not resumed)."""
    files = BatchFiles(out, weights, len(list(out.iterdir())))
    files.input.write_text(GOOD_LINE + "\n")
    fifo, zero, folder = out / "batch_fifo.jsonl", out / "batch_zero.jsonl", out / "batch_folder.jsonl"
    os.mkfifo(fifo)
    zero.symlink_to("/dev/zero")
    folder.mkdir()
    twice = out / "batch_twice.jsonl"
    result = {"text": "", "tokens": [], "finish_reason": "stop", "usage": {}}
    twice.write_text("".join(json.dumps({"id": i, **result}) + "\n" for i in ("x", "y", "x")))
    return [Case("batch-output", f"batch: OUTPUT is {name}", files.argv(output=target),
                 check=unchanged(out, fifo, zero, folder))
            for name, target in (("a FIFO", fifo), ("a link to /dev/zero", zero), ("/dev/null", "/dev/null"),
                                 ("a folder", folder), ("a file with an id twice", twice), ("an empty name", ""),
                                 ("'.'", "."))]


def disk_full_cases(out: Path, weights: Path) -> list[Case]:
    """The output on /dev/full (refused: a device), the errors file on /dev/full (ENOSPC), and an output whose
    writes fail past a file-size limit (EFBIG, half-way through a line): one error line each; after the last, a
    run without the limit must end with every id once (nothing half-written misread)."""
    cases = []
    files = BatchFiles(out, weights, len(list(out.iterdir())))
    files.input.write_text(GOOD_LINE + "\nnot json\n")
    cases.append(Case("disk-full", "batch: OUTPUT on /dev/full", files.argv(output="/dev/full")))
    cases.append(Case("disk-full", "batch: --errors /dev/full", files.argv("--errors", "/dev/full")))
    files = BatchFiles(out, weights, len(list(out.iterdir())))
    rows = [{"id": f"r{i}", "prompt": "Once", "max_tokens": 4, "temperature": 0} for i in range(6)]
    files.input.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def resumed() -> str | None:
        done = subprocess.run([sys.executable, "-m", "npllm", *files.argv()], capture_output=True, cwd=out,
                              env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=300)
        ids = [r.get("id") for r in read_records(files.output)]
        if done.returncode != 0 or ids != [r["id"] for r in rows]:
            return f"the run without the limit: exit {done.returncode}, ids {ids}"
        return None

    cases.append(Case("disk-full", "batch: OUTPUT past a 400-byte file-size limit", files.argv(), file_limit=400,
                      check=resumed))
    return cases


def batch_cases(out: Path, weights: Path) -> list[Case]:
    folder = out / "batch"
    folder.mkdir()
    return (deep_field_cases(folder, weights) + lenient_field_cases(folder, weights) + unserved_field_cases(folder, weights)
            + batch_input_cases(folder, weights) + batch_output_cases(folder, weights)
            + disk_full_cases(folder, weights))


def batch_race_results(out: Path, weights: Path, timeout: float, kinds: list | None = None) -> list[Result]:
    """Two runs on one output at once: the second must be refused (else "accepted"), the first must end with every
    id once (else "damaged")."""
    if kinds and "batch-output" not in kinds:
        return []
    folder = out / "batch_race"
    folder.mkdir()
    files = BatchFiles(folder, weights, 0)
    rows = [{"id": i, "prompt": "Once upon a time", "max_tokens": 200, "temperature": 0} for i in range(30)]
    files.input.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = [sys.executable, "-m", "npllm", *files.argv("--batch-size", "1")]
    first = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=folder,
                             env=dict(os.environ, PYTHONPATH=str(REPO)), preexec_fn=limit_memory)
    try:
        deadline = time.monotonic() + timeout
        while not read_records(files.output) and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        started = first.poll() is None
        result = run_process(Case("batch-output", "batch: a second run on the output of a running one",
                                  files.argv()), timeout, folder)
        first.wait(timeout)
    except subprocess.TimeoutExpired:
        result.hang = True
    finally:
        first.kill()
        first.wait()
    ids = [r.get("id") for r in read_records(files.output)]
    if not started:
        result.damaged = f"the first run ended (exit {first.returncode}) before the second began: nothing was tried"
    elif ids != list(range(len(rows))):
        result.damaged = f"the first run: exit {first.returncode}, {len(ids)} results for {len(set(ids))} ids"
    return [result]


# Kind "load": one more server, taking 2 MiB bodies. 8 clients send 1 MiB prompts at once (each must be refused,
# 400) while a 3-token completion is timed (it must answer 200 within LOAD_WAIT seconds); 10 streams are dropped
# mid-way by a reset while other prompts are tokenized (the server may write at most a line each). Each prints what
# it measured on stderr.

LOAD_WAIT = 5.0  # generous on a loaded machine: unloaded, the completion answers in well under a second
LOAD_CLIENTS = 8


def timed_post(port: int, body: bytes) -> tuple[int | None, float]:
    """(status, seconds) of one completion request."""
    started = time.monotonic()
    status = send_raw(port, post("/v1/completions", body), timeout=120.0)
    return status, time.monotonic() - started


STORY = "Once upon a time, there was a little girl named Lily. " * 20_000
LONG_PROMPT = completion(prompt=STORY[:1 << 20], max_tokens=3)
# past stories260K's context of 512 tokens, but not by so much that it is refused before it is tokenized (4 KB of
# this text is about 1,100 tokens; each token is at most 9 bytes): tokenizing it keeps the server's threads busy
BUSY_PROMPT = completion(prompt=STORY[:4000], max_tokens=3)


def flooding(port: int, until: threading.Event, seen: list, body: bytes = LONG_PROMPT,
             rounds: int = 50) -> ThreadPoolExecutor:
    """LOAD_CLIENTS clients each sending `body` again and again, at most `rounds` times, until `until`; (status,
    seconds) of each in `seen`. Leaving the returned pool waits for them."""
    def flood():
        for _ in range(rounds):
            if until.is_set():
                return
            seen.append(timed_post(port, body))

    pool = ThreadPoolExecutor(LOAD_CLIENTS)
    for _ in range(LOAD_CLIENTS):
        pool.submit(flood)
    time.sleep(0.2)  # the long bodies are on their way
    return pool


def long_prompts_beside(port: int) -> int | None:
    """A 3-token completion sent while LOAD_CLIENTS clients send 1 MiB prompts: its status when it answered within
    LOAD_WAIT and every long prompt was refused (400, or 429 when the server was busy), else None."""
    answered, refused = threading.Event(), []
    with flooding(port, answered, refused):
        status, wait = timed_post(port, completion(max_tokens=3))
        answered.set()
    times = [t for _, t in refused] or [0.0]
    print(f"[load] a 3-token completion beside {LOAD_CLIENTS} clients sending 1 MiB prompts: {status} after "
          f"{wait:.2f} s; the prompts: {dict(collections.Counter(s for s, _ in refused))} after {min(times):.2f}-"
          f"{max(times):.2f} s", file=sys.stderr)
    return status if wait <= LOAD_WAIT and all(s in (400, 429) for s, _ in refused) else None


def dropped_streams(server: Server, port: int, n: int = 10) -> int:
    """n streams started together while prompts being tokenized keep the server busy, each reset by its client
    after its first bytes: the lines the server wrote on stderr meanwhile (asyncio logs one per write to a lost
    connection past the fifth, and a busy server's streams have many tokens queued when their client goes)."""
    seen, done = len(server.lines), threading.Event()
    body = completion(max_tokens=400, stream=True, logit_bias={"1": -100, "2": -100})
    with flooding(port, done, [], BUSY_PROMPT):
        socks = [socket.create_connection(("127.0.0.1", port), timeout=30.0) for _ in range(n)]
        for sock in socks:
            sock.sendall(post("/v1/completions", body))
        for sock in socks:
            sock.recv(4096)  # the head, and perhaps the first chunks
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
        done.set()
    time.sleep(1.0)  # what the server writes about them
    lines = len(server.lines) - seen
    print(f"[load] {n} dropped streams: {lines} lines in the server's log", file=sys.stderr)
    return lines


def load_results(out: Path, weights: Path, timeout: float) -> list[Result]:
    server = Server(out, weights, ("--max-body-bytes", str(2 << 20)))
    probes = [Probe("a completion beside 8 concurrent 1 MiB prompts", long_prompts_beside, (200,), kind="load"),
              Probe("10 dropped streams (outcome: log lines)", lambda port: dropped_streams(server, port),
                    tuple(range(11)), kind="load")]
    try:
        return [run_probe(server, probe, timeout) for probe in probes]
    finally:
        server.stop()


def constraint_cases(out: Path) -> list[Case]:
    """Structured outputs on the command line (--json-schema FILE, --grammar FILE, --regex RE): malformed, unenforced,
    huge and deeply nested constraints are one error line each; good ones run."""
    files = {"not JSON": (b"{nope", "error"), "a JSON list": (b"[1, 2]", "error"),
             "invalid utf8": (b"\xff\xfe", "error"),
             "100,000 nested lists": (b"[" * 100_000 + b"]" * 100_000, "error"),
             "300 nested items": (b'{"items":' * 300 + b"{}" + b"}" * 300, "error"),
             "unenforced keyword": (b'{"type": "array", "uniqueItems": true}', "error"),
             "misspelt keyword": (b'{"type": "string", "maxLenght": 3}', "error"),
             "unknown format": (b'{"type": "string", "format": "uri"}', "error"),
             "remote $ref": (b'{"$ref": "https://example.com/s.json"}', "error"),
             "bad pattern": (b'{"type": "string", "pattern": "(a"}', "error"),
             "200,000-value enum": (b'{"enum": [' + b",".join(b"%d" % i for i in range(200_000)) + b"]}", "error"),
             "unsatisfiable": (b'{"type": "object", "required": ["a"], "additionalProperties": false}', "error"),
             "empty": (b"", "error"), "an object": (b'{"type": "object"}', "ok")}
    cases = []
    for name, (data, expect) in files.items():
        path = out / f"schema_{name.replace(' ', '_').replace(',', '')}.json"
        path.write_bytes(data)
        cases.append(Case("constraint", f"--json-schema {name}", ["generate", "x", *GEN, "--json-schema", str(path)],
                          expect=expect))
    grammars = {"lark syntax error": (b"start: (((", "error"), "undefined rule": (b"root ::= nothing", "error"),
                "gbnf": (b'root ::= "yes" | "no"', "ok"), "lark": (b'start: "yes" | "no"', "ok")}
    for name, (data, expect) in grammars.items():
        path = out / f"grammar_{name.replace(' ', '_')}.txt"
        path.write_bytes(data)
        cases.append(Case("constraint", f"--grammar {name}", ["generate", "x", *GEN, "--grammar", str(path)],
                          expect=expect))
    cases.append(Case("constraint", "--grammar a directory", ["generate", "x", *GEN, "--grammar", str(out)]))
    for name, regex, expect in (("look-ahead", "(?=a)b", "error"), ("unclosed", "(a", "error"),
                                ("back-reference", r"(a)\1", "error"), ("nul escape", r"\x00", "ok"),
                                ("plain", "[a-z]{3}", "ok")):
        cases.append(Case("constraint", f"--regex {name}", ["generate", "x", *GEN, "--regex", regex], expect=expect))
    cases.append(Case("constraint", "two constraints", ["generate", "x", *GEN, "--regex", "a", "--json-object"]))
    return cases


def all_cases(out: Path, weights: Path) -> list[Case]:
    os.mkfifo(out / "fifo")
    (out / "fifo_dir").mkdir()
    return (llama2c_cases(out, weights) + hf_cases(out) + gguf_cases(out, weights) + tokenizer_cases(out, weights)
            + prompt_cases(out) + flag_cases(out) + combination_cases(out) + template_cases(out)
            + output_cases(out, weights) + tokenizer_field_cases(out, weights) + non_finite_cases(out, weights)
            + rope_factor_cases(out) + env_limit_cases(out) + sentencepiece_cases(out, weights)
            + batch_cases(out, weights) + constraint_cases(out))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_weights = Path(os.environ.get("NPLLM_WEIGHTS") or REPO / "weights")
    parser.add_argument("--weights", type=Path, default=default_weights, help="reference weights folder")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds before a case counts as a hang")
    parser.add_argument("--sample", type=int, default=0, help="run a deterministic sample of this many cases")
    parser.add_argument("--kinds", nargs="+", default=None, help="only these kinds")
    parser.add_argument("--json", action="store_true", help="one JSON object per problem case, then the summary")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="npllm-bad-") as tmp:
        out = Path(tmp)
        (out / "files").mkdir()
        cases = all_cases(out / "files", args.weights)
        if args.kinds:
            cases = [c for c in cases if c.kind in args.kinds]
        if args.sample:
            cases = random.Random(0).sample(cases, min(args.sample, len(cases)))
        with ThreadPoolExecutor(args.jobs) as pool:
            results = list(pool.map(lambda c: run_case(c, args.timeout, out), cases))
        if not args.sample:
            results += http_results(out / "files", args.weights, args.timeout, args.kinds)
            results += batch_race_results(out / "files", args.weights, args.timeout, args.kinds)
        if not args.sample and (args.kinds is None or "load" in args.kinds):
            results += load_results(out / "files", args.weights, args.timeout)
    return report(results, args.json)


def report(results: list[Result], as_json: bool) -> int:
    per_kind = collections.defaultdict(collections.Counter)
    for r in results:
        counts = per_kind[r.case.kind]
        counts["tried"] += 1
        counts["refused (exit 2)"] += r.status == 2
        counts["ran (exit 0)"] += r.status == 0
        for p in r.problems:
            counts[p] += 1
        if r.problems:
            line = {"kind": r.case.kind, "case": r.case.name, "status": r.status, "problems": r.problems,
                    "stderr": r.stderr_tail.strip().splitlines()[-1:] }
            print(json.dumps(line) if as_json else f"PROBLEM {line}")
    columns = ["tried", "refused (exit 2)", "ran (exit 0)", "traceback", "hang", "stdout_on_error", "bad_status",
               "accepted", "refused", "damaged"]
    width = max([18] + [len(kind) + 2 for kind in per_kind])  # the kinds' names, each followed by a space or two
    print(f"{'kind':{width}}" + "".join(f"{c:>18}" for c in columns))
    total = collections.Counter()
    for kind, counts in sorted(per_kind.items()):
        total.update(counts)
        print(f"{kind:{width}}" + "".join(f"{counts[c]:>18}" for c in columns))
    print(f"{'total':{width}}" + "".join(f"{total[c]:>18}" for c in columns))
    return 1 if any(r.problems for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
