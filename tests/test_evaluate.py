"""Perplexity and KL divergence: llama.cpp's chunking, checked against a plain per-chunk computation."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import npllm
from npllm.errors import GenerationError
from npllm.evaluate import (DECISIVE_LEAD, _mean_and_stderr, kl_divergence, llama_cpp_chunks, perplexity,
                            scored_logits, strided_perplexity, strided_windows)
from tests_support import COMPILE_TIMEOUT


@pytest.fixture(scope="module")
def story_text(weights_dir, golden_200) -> str:
    goldens = sorted((weights_dir / "stories260K" / "goldens").glob("*.txt"))
    return "\n".join([golden_200] + [p.read_text(encoding="utf-8") for p in goldens])


@pytest.fixture(scope="module")
def models(stories260k, weights_dir):
    tok = weights_dir / "stories260K" / "tok512.bin"
    return {b: npllm.load(str(stories260k), str(tok), backend=b) for b in ("numpy", "numba")}


def plain_perplexity(llm, ids, ctx):
    """llama.cpp's perplexity written out one chunk at a time with full logits: the reference for the batched one."""
    nll = []
    for c in range(len(ids) // ctx):
        chunk = [llm.config.bos_id] + list(ids[c * ctx + 1: (c + 1) * ctx])
        logits = llm.logits(chunk).astype(np.float64)  # [ctx, V]
        for i in range(ctx // 2, ctx - 1):
            row = logits[i] - logits[i].max()
            nll.append(math.log(np.exp(row).sum()) - row[chunk[i + 1]])
    nll = np.array(nll)
    return math.exp(nll.mean()), math.exp(nll.mean()) * nll.std(ddof=1) / math.sqrt(len(nll)), len(nll)


@pytest.mark.parametrize("backend,batch", [("numpy", 1), ("numba", 3)])
def test_perplexity_equals_the_chunk_by_chunk_computation(models, story_text, backend, batch):
    llm = models[backend]
    ids = llm.tokenizer.encode(story_text, bos=True)
    expected, expected_stderr, count = plain_perplexity(models["numpy"], ids, 64)
    result = perplexity(llm.model, ids, 64, batch=batch)
    assert result.chunks == len(ids) // 64 and result.tokens == count == result.chunks * (64 - 1 - 32)
    assert result.ppl == pytest.approx(expected, rel=1e-4)
    assert result.ppl_stderr == pytest.approx(expected_stderr, rel=1e-3)


def test_a_model_predicts_its_own_stories_better_than_shuffled_ones(models, story_text):
    llm = models["numba"]
    ids = llm.tokenizer.encode(story_text, bos=True)
    shuffled = np.random.default_rng(0).permutation(ids)
    real, scrambled = perplexity(llm.model, ids, 64), perplexity(llm.model, shuffled, 64)
    assert real.ppl < 5 < 4 * real.ppl < scrambled.ppl


def test_chunks_are_cut_as_llama_cpp_cuts_them():
    ids = list(range(100, 237))  # 137 tokens
    chunks = llama_cpp_chunks(ids, 32, bos_id=1)
    assert chunks.shape == (4, 32)  # the 9-token tail is dropped
    assert (chunks[:, 0] == 1).all()
    assert chunks[:, 1:].tolist() == [ids[c * 32 + 1: c * 32 + 32] for c in range(4)]
    for ctx in (3, 69):  # too small to score half; fewer than two chunks
        with pytest.raises(GenerationError):
            llama_cpp_chunks(ids, ctx, 1)


@given(st.lists(st.floats(0, 20), min_size=2, max_size=50))
def test_stderr_is_the_standard_error_of_the_mean(values):
    values = np.array(values)
    mean, stderr = _mean_and_stderr(values)
    assert mean == pytest.approx(values.mean())
    assert stderr == pytest.approx(values.std(ddof=1) / math.sqrt(len(values)), rel=1e-6, abs=1e-9)


@given(st.integers(2, 300), st.integers(2, 64), st.integers(1, 64))
def test_strided_windows_score_every_token_once(n, max_length, stride):
    stride = min(stride, max_length)
    windows = strided_windows(n, max_length, stride)
    scored = [t for begin, end, first in windows for t in range(first, end)]
    starts = {begin for begin, _, _ in windows}
    # each token after the first once, in order; windows that do not overlap leave their first token unscored
    expected = [t for t in range(1, n) if stride < max_length or t not in starts]
    assert scored == expected
    for begin, end, first in windows:
        assert end - begin <= max_length and begin < first <= end
    with pytest.raises(GenerationError):
        strided_windows(n, 1, 1)


def test_strided_perplexity_equals_a_token_by_token_computation(models, story_text):
    llm = models["numpy"]
    ids = llm.tokenizer.encode(story_text, bos=True)[:150]
    result = strided_perplexity(llm.model, ids, 48, 16)
    nll = []
    for begin, end, first in strided_windows(len(ids), 48, 16):
        logits = llm.logits(ids[begin:end]).astype(np.float64)
        for t in range(first, end):
            row = logits[t - 1 - begin]
            nll.append(np.log(np.exp(row - row.max()).sum()) + row.max() - row[ids[t]])
    assert result.tokens == len(ids) - 1
    assert result.ppl == pytest.approx(math.exp(np.mean(nll)), rel=1e-5)


def test_kl_divergence_of_a_model_from_itself_and_across_backends(models, story_text):
    ids = models["numpy"].tokenizer.encode(story_text, bos=True)
    same = kl_divergence(models["numba"].model, models["numba"].model, ids, 64, batch=2)
    assert same.mean_kl == pytest.approx(0, abs=1e-12) and same.top1_agreement == 1.0
    assert same.decisive_agreement == 1.0 and 0 < same.decisive <= same.tokens
    model = models["numba"].model
    chunks = llama_cpp_chunks(ids, 64, model.config.bos_id)
    logits = np.concatenate([scored for scored, _ in scored_logits(model, chunks)])
    lead = np.diff(np.sort(logits, axis=-1)[:, -2:], axis=-1)[:, 0]  # the top logit minus the second
    assert same.decisive == (lead >= DECISIVE_LEAD).sum()
    across = kl_divergence(models["numba"].model, models["numpy"].model, ids, 64, batch=2)
    assert 0 <= across.mean_kl < 1e-8 and across.top1_agreement >= 0.99
    assert across.base_ppl == pytest.approx(perplexity(models["numpy"].model, ids, 64).ppl, rel=1e-6)


def test_kl_divergence_grows_with_a_perturbed_model(models, story_text, stories260k):
    from npllm.formats import read_checkpoint

    config, weights = read_checkpoint(stories260k)
    rng = np.random.default_rng(1)
    noisy = {k: (v + rng.normal(0, 0.02, v.shape).astype(v.dtype)) if v.ndim == 2 else v for k, v in weights.items()}
    from npllm.models import make_model

    ids = models["numpy"].tokenizer.encode(story_text, bos=True)
    result = kl_divergence(make_model(config, noisy, "numba"), models["numba"].model, ids, 64)
    assert result.mean_kl > 1e-3 and result.ppl > result.base_ppl


def test_cli_json(stories260k, weights_dir, story_text, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(story_text, encoding="utf-8")
    out = subprocess.run([sys.executable, "-m", "npllm", "perplexity", "--model", str(stories260k), "--tokenizer",
                          str(weights_dir / "stories260K" / "tok512.bin"), "--text", str(text), "--ctx", "64",
                          "--batch", "4", "--json"], capture_output=True, text=True, timeout=COMPILE_TIMEOUT)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert set(result) >= {"ppl", "ppl_stderr", "tokens", "chunks", "seconds"}
    llm = npllm.load(str(stories260k), str(weights_dir / "stories260K" / "tok512.bin"), backend="numpy")
    assert result["ppl"] == pytest.approx(plain_perplexity(llm, llm.tokenizer.encode(story_text, bos=True), 64)[0],
                                          rel=1e-4)
    short = tmp_path / "short.txt"
    short.write_text("Once upon a time", encoding="utf-8")
    out = subprocess.run([sys.executable, "-m", "npllm", "perplexity", "--model", str(stories260k), "--text",
                          str(short), "--ctx", "64"], capture_output=True, text=True, timeout=COMPILE_TIMEOUT)
    assert out.returncode == 2 and "needs at least 128" in out.stderr and "Traceback" not in out.stderr
