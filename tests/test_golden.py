"""Golden outputs: npllm prints exactly what llama2.c's run.c prints for Karpathy's stories260K."""

import os
import subprocess
import sys

import pytest

import npllm
from tests_support import REPO


def run_cli(*args, env_weights=None):
    env = dict(os.environ)
    return subprocess.run([sys.executable, "-m", "npllm", *args], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=300)


@pytest.mark.parametrize("tokenizer", ["tok512.bin", "tok512.model"])
def test_cli_greedy_from_bos_prints_run_c_output(stories260k, golden_200, tokenizer):
    """run.c -n 200 forwards 200 positions from BOS and prints the 200 tokens it samples."""
    result = run_cli("generate", "--model", str(stories260k), "--tokenizer", str(stories260k.parent / tokenizer),
                     "--temperature", "0", "--max-new-tokens", "200")
    assert result.returncode == 0, result.stderr
    assert result.stdout == golden_200 + "\n"
    assert "tok/s" in result.stderr


def test_api_greedy_matches_golden(stories260k, golden_200):
    llm = npllm.load(stories260k)
    assert llm.generate("", max_new_tokens=200, temperature=0) == golden_200
    assert llm.generate("", max_new_tokens=50, temperature=0) == llm.tokenizer.decode(
        llm.tokenizer.encode(golden_200)[:51])


def test_prompt_continuation_matches_run_c(stories260k):
    result = run_cli("generate", "Lily and Ben", "--model", str(stories260k), "--temperature", "0",
                     "--max-new-tokens", "40")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Lily and Ben were playing in the park. They liked to play with their toys and "
                                    "run around the park.")
    completion = npllm.load(stories260k).generate("Lily and Ben", max_new_tokens=40, temperature=0)
    assert result.stdout == "Lily and Ben" + completion + "\n"
