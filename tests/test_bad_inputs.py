"""Regression tests for what the bad-input campaign (scripts/bad_inputs.py) found, one fast check per class, plus a
small deterministic sample of the campaign itself through the real command line."""

import json
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

import npllm
from npllm.cli import build_parser
from npllm.errors import ConfigError, FormatError, NpllmError
from npllm.formats import read_checkpoint
from tests_support import COMPILE_TIMEOUT, REPO, load_campaign

bad_inputs = load_campaign()

FIXTURE = REPO / "tests" / "fixtures" / "hf" / "qwen2_bias"


@pytest.fixture(scope="module")
def gguf_parts(weights_dir, stories260k):
    return bad_inputs.stories_gguf(weights_dir)


def write(tmp_path, parts, meta=None, tensors=None):
    metadata, all_tensors = parts
    path = tmp_path / f"m{len(list(tmp_path.iterdir()))}.gguf"
    bad_inputs.write_gguf(path, {**metadata, **(meta or {})}, all_tensors if tensors is None else tensors)
    return path


def test_the_campaigns_gguf_writer_writes_a_model_npllm_runs(tmp_path, gguf_parts, stories260k):
    """The baseline the GGUF cases bend: the same logits as stories260K itself."""
    llm = npllm.load(write(tmp_path, gguf_parts), backend="numpy")
    ids = llm.tokenizer.encode("Once upon a time", bos=True)
    np.testing.assert_allclose(llm.logits(ids), npllm.load(stories260k, backend="numpy").logits(ids), atol=1e-5)


@pytest.mark.parametrize("key, kind, value", [
    ("llama.block_count", "u32", 1 << 24), ("llama.block_count", "u32", (1 << 31)),
    ("llama.block_count", "u32", (1 << 32) - 1), ("llama.context_length", "u64", 1 << 32),
    ("llama.context_length", "u64", (1 << 64) - 1), ("llama.rope.freq_base", "f32", 0.0),
    ("llama.rope.freq_base", "f32", math.nan), ("llama.attention.layer_norm_rms_epsilon", "f32", math.inf),
])
def test_gguf_implausible_sizes_are_refused_before_allocating(tmp_path, gguf_parts, key, kind, value):
    path = write(tmp_path, gguf_parts, meta={key: (kind, value)})
    start = time.monotonic()
    with pytest.raises(ConfigError):
        read_checkpoint(path)
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("layers", [1 << 24, 1 << 31])
def test_config_json_claiming_huge_layer_counts_is_refused_at_once(tmp_path, layers):
    folder = tmp_path / "hf"
    shutil.copytree(FIXTURE, folder)
    config = json.loads((folder / "config.json").read_text())
    for changes in ({"num_hidden_layers": layers, "layer_types": None},
                    {"num_hidden_layers": layers, "layer_types": None, "model_type": "mistral", "sliding_window": 8}):
        (folder / "config.json").write_text(json.dumps({**config, **changes}))
        start = time.monotonic()
        with pytest.raises(ConfigError, match="num_hidden_layers"):
            read_checkpoint(folder)
        assert time.monotonic() - start < 10
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1 << 32}))
    with pytest.raises(ConfigError, match="context"):
        read_checkpoint(folder)


@pytest.mark.parametrize("type_id", [1, 30, 8, 2, 14, 24, 26, 28, 12])
def test_gguf_tensor_whose_type_field_was_changed_is_refused(tmp_path, gguf_parts, type_id):
    """The data stays F32; only the type id changes, so the tensor's byte size no longer fits its place."""
    metadata, tensors = gguf_parts
    for index in (0, 5):  # the embedding, and a layer matrix
        bent = list(tensors)
        name, shape, _, blob, offset = bent[index]
        bent[index] = (name, shape, type_id, blob, offset)
        with pytest.raises(FormatError):
            read_checkpoint(write(tmp_path, gguf_parts, tensors=bent))


def test_same_size_type_swap_with_non_finite_values_is_refused(tmp_path, gguf_parts):
    """F16 bits read as BF16 keep the byte size; what they decode to is caught instead (here: infinities)."""
    metadata, tensors = gguf_parts
    bent = list(tensors)
    name, shape, _, blob, _ = bent[0]
    as_f16 = np.full(shape, 0x7F80, np.uint16).tobytes()  # +inf read as BF16
    bent[0] = (name, shape, 30, as_f16, None)
    with pytest.raises(FormatError, match="NaN or infinite"):
        read_checkpoint(write(tmp_path, gguf_parts, tensors=bent))


def test_a_non_finite_norm_gain_is_refused(tmp_path, gguf_parts):
    """A vector (a norm's gain, F32) is checked as every weight is, as a one-row matrix (quant.as_matrix)."""
    metadata, tensors = gguf_parts
    bent = list(tensors)
    i = next(i for i, t in enumerate(bent) if len(t[1]) == 1)
    name, shape, type_id, blob, offset = bent[i]
    values = np.frombuffer(blob, np.float32).copy()
    values[-1] = np.nan
    bent[i] = (name, shape, type_id, values.tobytes(), offset)
    assert type_id == 0  # F32
    with pytest.raises(FormatError, match="NaN or infinite"):
        read_checkpoint(write(tmp_path, gguf_parts, tensors=bent))


@pytest.mark.parametrize("key, value", [("tokenizer.ggml.eos_token_id", 512), ("tokenizer.ggml.bos_token_id", 600)])
def test_gguf_token_ids_outside_the_vocabulary_are_refused(tmp_path, gguf_parts, key, value):
    with pytest.raises(NpllmError, match="outside the vocabulary|not a token id"):
        npllm.load(write(tmp_path, gguf_parts, meta={key: ("u32", value)}))


def test_nan_weights_are_refused_at_load(tmp_path, stories260k):
    data = bytearray(stories260k.read_bytes())
    data[28:32] = struct.pack("<f", math.nan)
    bad = tmp_path / "nan.bin"
    bad.write_bytes(bytes(data))
    with pytest.raises(FormatError, match="NaN or infinite"):
        read_checkpoint(bad)


def test_a_fifo_or_a_device_as_model_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in (fifo, "/dev/zero"):
        with pytest.raises(FormatError, match="not a regular file"):
            npllm.load(path)
    with pytest.raises(NpllmError, match="not a regular file"):
        npllm.load(tokenizer=fifo)


@pytest.mark.parametrize("flag", ["--batch", "--prompt-len", "--gen-len", "--repeat", "--threads", "--bandwidth-mib"])
@pytest.mark.parametrize("value", ["0", "-3"])
def test_bench_counts_below_one_are_refused_at_parse_time(flag, value, capsys):
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(["bench", flag, value])
    assert stop.value.code == 2 and "below the minimum 1" in capsys.readouterr().err


def test_hf_directory_without_a_tokenizer_is_one_error_line(tmp_path):
    """Said before the model is made: on an empty Numba cache (as on a first run), making it would compile its
    code first, for a minute, and print the compile notice ahead of the error."""
    folder = tmp_path / "hf"
    shutil.copytree(FIXTURE, folder)
    (folder / "tokenizer.json").unlink()
    result = subprocess.run([sys.executable, "-m", "npllm", "generate", "hi", "--model", str(folder)],
                            capture_output=True, text=True, cwd=REPO, timeout=COMPILE_TIMEOUT,
                            env={**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba-cache")})
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("npllm: error: no tokenizer") and "Traceback" not in result.stderr


def test_a_sample_of_the_campaign_finds_no_problem(weights_dir, stories260k, capsys):
    """12 cases drawn (deterministically) from the whole campaign, each through the real CLI."""
    status = bad_inputs.main(["--weights", str(weights_dir), "--sample", "12", "--jobs", "2", "--timeout", "120"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "total" in out and "PROBLEM" not in out


def test_broken_sentencepiece_models_are_one_clear_error_each(tmp_path, weights_dir, stories260k, capsys):
    """The campaign's sentencepiece cases, in this process: each loads cleanly or raises an NpllmError, never an
    exception from inside sentencepiece (a byte piece that is not UTF-8 made sentencepiece's own message
    undecodable: UnicodeDecodeError), and a word or char model, which npllm does not read, is refused."""
    from npllm.tokenizer import load_tokenizer

    cases = bad_inputs.sentencepiece_cases(tmp_path, weights_dir)
    assert {"byte piece not UTF-8 (<0x6\\xc3>)", "word model", "char model", "empty piece"} <= {c.name for c in cases}
    for case in cases:
        try:
            load_tokenizer(case.args[case.args.index("--tokenizer") + 1], vocab_size=512)
        except NpllmError:
            continue
        assert case.expect == "any", f"{case.name}: loaded, but must be refused"
    undecodable = next(c for c in cases if c.name.startswith("byte piece not UTF-8"))
    assert npllm.cli.main(undecodable.args) == 2
    err = capsys.readouterr().err
    assert err.startswith("npllm: error: ") and err.count("\n") == 1 and "<0x6\\xc3>" in err, err


def test_the_campaigns_batch_input_and_disk_full_kinds_find_no_problem(weights_dir, stories260k, capsys):
    """npllm batch through the real CLI: a BOM, a 10 MB line, OUTPUT and --errors on /dev/full, and OUTPUT past a
    file-size limit (EFBIG half-way through a line; then a run without the limit must end with every id once)."""
    status = bad_inputs.main(["--weights", str(weights_dir), "--kinds", "batch-input", "disk-full", "--jobs", "2",
                              "--timeout", "120"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "PROBLEM" not in out and re.search(r"disk-full +3 ", out) and re.search(r"batch-input +3 ", out)


def test_the_campaigns_unserved_fields_find_no_problem(weights_dir, stories260k, capsys):
    """Fields that would change the answer and are not served: each a 400 from the server and an error line from
    npllm batch, never taken and dropped."""
    status = bad_inputs.main(["--weights", str(weights_dir), "--kinds", "unserved-fields", "--jobs", "2",
                              "--timeout", "120"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "PROBLEM" not in out and re.search(r"unserved-fields +25 ", out)
