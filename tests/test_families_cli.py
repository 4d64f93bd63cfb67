"""Every family's GGUF (llama.cpp's own conversion of the transformers fixtures, tests/fixtures/gguf_arch) through
the command line: `npllm generate` prints the model's greedy continuation, `npllm perplexity` scores the text as the
model's own logits do, `npllm chat` answers with the family's built-in template."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import npllm
from npllm import cli
from npllm.chat.templates import ARCH_TEMPLATES
from tests_support import REPO

FILES = sorted((Path(__file__).parent / "fixtures" / "gguf_arch").glob("*.gguf"))
TEXT = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day she saw "
        "a big red ball under a tree, and she ran to get it.")
ids = pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])


@ids
def test_generate_prints_the_greedy_continuation(path, capsys):
    llm = npllm.load(path, backend="numpy")
    prompt = "Once upon a time"
    expected = llm.tokenizer.decode(list(llm.generate_ids(llm.tokenizer.encode(prompt), max_new_tokens=8,
                                                          temperature=0)))
    assert cli.main(["generate", prompt, "--model", str(path), "--backend", "numpy", "--max-new-tokens", "8",
                     "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert expected.strip() and expected in out


@ids
def test_perplexity_is_the_models_own_second_half_nll(path, tmp_path, capsys):
    """One chunk of ctx tokens (BOS first): llama.cpp's method scores positions ctx/2 .. ctx-2; recomputed here from
    the model's logits of the whole chunk."""
    (tmp_path / "text.txt").write_text(TEXT)
    llm = npllm.load(path, backend="numpy")
    tokens = llm.tokenizer.encode(TEXT)  # BOS first
    ctx = 32
    assert cli.main(["perplexity", "--model", str(path), "--text", str(tmp_path / "text.txt"), "--ctx", str(ctx),
                     "--json", "--backend", "numpy"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    n_chunks = len(tokens) // ctx
    nll = []
    for c in range(n_chunks):
        chunk = np.array(tokens[c * ctx:(c + 1) * ctx])
        chunk[0] = llm.model.config.bos_id
        z = llm.model.logits(chunk).astype(np.float64)  # [ctx, V]
        logp = z - z.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        first = ctx // 2
        nll += [-logp[t, chunk[t + 1]] for t in range(first, ctx - 1)]
    assert got["chunks"] == n_chunks and got["tokens"] == len(nll)
    assert math.isclose(got["ppl"], math.exp(np.mean(nll)), rel_tol=1e-4)


@ids
def test_chat_answers_with_the_familys_builtin_template(path):
    arch = npllm.load(path, backend="numpy").model.config.arch
    run = subprocess.run([sys.executable, "-m", "npllm", "chat", "--model", str(path), "--backend", "numpy",
                          "--max-new-tokens", "4", "--temperature", "0", "--chat-template", ARCH_TEMPLATES[arch]],
                         input="Hi\n", capture_output=True, text=True, timeout=120, cwd=REPO,
                         env={**os.environ})
    assert run.returncode == 0, run.stderr
    assert run.stdout.endswith("\n") and run.stdout.strip(), run.stderr
