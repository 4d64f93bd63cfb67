"""The command line: `npllm info`, and errors printed as one clear line with a non-zero exit."""

import subprocess
import sys

import pytest

from tests_support import REPO


def run_npllm(*args):
    return subprocess.run([sys.executable, "-m", "npllm", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=120)


def test_info_describes_stories260k(stories260k):
    result = run_npllm("info", str(stories260k))
    assert result.returncode == 0, result.stderr
    assert "5 layers, dim 64" in result.stdout and "260,032" in result.stdout and "tok512.bin" in result.stdout


def test_errors_are_one_line_not_a_traceback(stories260k, tmp_path):
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"\x01\x00\x00\x00" * 3)
    for args in (["info", str(bad)], ["generate", "--model", str(tmp_path / "absent.bin")],
                 ["generate", "hi", "--model", str(stories260k), "--temperature", "-1"],
                 ["generate", "hi", "--model", str(stories260k), "--top-p", "1.5"]):
        result = run_npllm(*args)
        assert result.returncode == 2, (args, result.stderr)
        assert result.stderr.startswith("npllm: error:") and "Traceback" not in result.stderr, result.stderr


def test_logprobs_go_to_stderr_and_match_the_model(stories260k):
    import numpy as np

    import npllm
    from npllm.sampling import log_softmax

    plain = npllm_cli_text(stories260k)
    result = run_npllm("generate", "Lily", "--model", str(stories260k), "--temperature", "0", "--max-new-tokens", "6",
                   "--logprobs", "2")
    assert result.returncode == 0 and result.stdout == plain
    lines = [line for line in result.stderr.splitlines() if line.startswith("[logprobs]")]
    assert len(lines) == 6
    llm = npllm.load(stories260k)
    ids = llm.tokenizer.encode("Lily", bos=True)
    new = list(llm.generate_ids(ids, 6, temperature=0))
    expected = log_softmax(llm.logits(ids + new).astype(np.float64))[len(ids) - 1:-1]
    for line, token, row in zip(lines, new, expected):
        assert float(line.split()[2]) == pytest.approx(row[token], abs=2e-4)


def npllm_cli_text(stories260k):
    return run_npllm("generate", "Lily", "--model", str(stories260k), "--temperature", "0", "--max-new-tokens", "6").stdout
