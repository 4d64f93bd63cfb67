"""Golden outputs: npllm prints exactly what llama2.c's run.c prints for Karpathy's stories260K."""

import os
import subprocess
import sys

from pathlib import Path

import pytest

import npllm
from tests_support import COMPILE_TIMEOUT, REPO, require, weights_root


def run_cli(*args, env_weights=None):
    env = dict(os.environ)
    return subprocess.run([sys.executable, "-m", "npllm", *args], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=COMPILE_TIMEOUT)


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


GOLDENS = "stories260K/goldens"


def golden_cases():
    """One case per line of goldens/prompts.tsv (prompt, run.c steps, output file); a placeholder case when the
    table is absent, so the test skips (fails under CI) naming it."""
    table = weights_root() / GOLDENS / "prompts.tsv"
    if not table.exists():
        return [pytest.param(None, id="prompts.tsv")]
    rows = [line.split("\t") for line in table.read_text(encoding="utf-8").splitlines()[1:] if line.strip()]
    return [pytest.param((prompt, int(steps), file), id=file.removesuffix(".txt")) for prompt, steps, file in rows]


def golden(case) -> tuple[str, int, str]:
    """(prompt, new tokens to ask npllm for, run.c's output). run.c counts STEPS positions from BOS with the prompt
    included, so npllm generates STEPS - k tokens, k the prompt's token count without BOS (sentencepiece's count,
    independent of npllm's encoder)."""
    import sentencepiece as spm

    if case is None:
        require(f"{GOLDENS}/prompts.tsv")
    prompt, steps, file = case
    expected = require(f"{GOLDENS}/{file}").read_text(encoding="utf-8")
    sp = spm.SentencePieceProcessor(model_file=str(require("stories260K/tok512.model")))
    return prompt, steps - len(sp.encode(prompt)), expected


@pytest.mark.parametrize("case", golden_cases())
def test_cli_default_model_continues_a_prompt_as_run_c_does(case):
    """`npllm generate PROMPT` with no --model: the embedded stories260K on the default backend."""
    prompt, new_tokens, expected = golden(case)
    result = run_cli("generate", prompt, "--temperature", "0", "--max-new-tokens", str(new_tokens))
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected + "\n"


def test_numpy_backend_continues_a_prompt_as_run_c_does(stories260k):
    prompt, new_tokens, expected = golden(golden_cases()[0].values[0])
    llm = npllm.load(stories260k, backend="numpy")
    assert prompt + llm.generate(prompt, max_new_tokens=new_tokens, temperature=0) == expected


def test_embedded_default_model_is_the_reference_checkpoint(stories260k):
    """The package data is byte for byte the reference stories260K and its tokenizers, and load() uses it."""
    data = Path(npllm.__file__).parent / "data" / "stories260K"
    for name in ("stories260K.bin", "tok512.bin", "tok512.model"):
        assert (data / name).read_bytes() == (stories260k.parent / name).read_bytes(), name
    assert (data / "NOTICE").read_text(encoding="utf-8").count("MIT") >= 1
    assert Path(npllm.load().source) == data / "stories260K.bin"
