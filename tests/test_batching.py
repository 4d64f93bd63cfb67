"""Batched generation on stories260K: every strategy gives each prompt exactly what it gets alone.

The reference for tokens is npllm.generate.generate_ids run on one prompt at a time; the reference for
log-probabilities is an independent full causal forward of prompt + output (LLM.logits) and its log-softmax.
"""

import numpy as np
import pytest

import npllm
from npllm import cli
from npllm.batching import STRATEGIES, Request, continuous_generate, ragged_generate
from npllm.errors import GenerationError
from npllm.generate import generate_ids
from npllm.sampling import SamplingParams, log_softmax

GEN = 48  # new tokens per prompt: enough to cross the prompts of every length, short enough for CI


@pytest.fixture(scope="module")
def llm(stories260k):
    return npllm.load(stories260k)


@pytest.fixture(scope="module")
def story_ids(llm, golden_200):
    return llm.tokenizer.encode(golden_200 * 2, bos=True)


@pytest.fixture(scope="module")
def prompts16(story_ids):
    """16 prompts of lengths 1 .. 200 (prefixes of a story, the BOS-only prompt first)."""
    return [story_ids[:n] for n in np.linspace(1, 200, 16).astype(int)]


@pytest.fixture(scope="module")
def solo16(llm, prompts16):
    return [list(generate_ids(llm.model, p, GEN, SamplingParams(temperature=0))) for p in prompts16]


def reference_logprobs(llm, prompt, tokens) -> np.ndarray:
    """log p(token_t | tokens before it) for every token after the first of prompt + tokens.   # -> [T - 1]"""
    seq = list(prompt) + list(tokens)
    logp = log_softmax(llm.logits(seq).astype(np.float64))  # [T, V]
    return logp[np.arange(len(seq) - 1), seq[1:]]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_greedy_batch_of_16_gives_every_prompt_its_solo_tokens(llm, prompts16, solo16, strategy):
    tokens, logprobs = llm.generate_tokens(prompts16, GEN, temperature=0, logprobs=True, strategy=strategy)
    assert tokens == solo16
    for prompt, toks, lps in zip(prompts16, tokens, logprobs):
        assert len(lps) == len(toks)
        expected = reference_logprobs(llm, prompt, toks)[len(prompt) - 1:]
        np.testing.assert_allclose(lps, expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_echo_returns_the_prompt_and_its_logprobs(llm, prompts16, solo16, strategy):
    picked = [0, 5, 15]  # lengths 1, 67, 200
    prompts = [prompts16[i] for i in picked]
    tokens, logprobs = llm.generate_tokens(prompts, 12, temperature=0, logprobs=True, echo=True, strategy=strategy)
    for i, prompt, toks, lps in zip(picked, prompts, tokens, logprobs):
        assert toks == prompt + solo16[i][:12]
        assert lps[0] == 0.0  # nothing predicts the first token (Meta reports 0 there)
        np.testing.assert_allclose(lps[1:], reference_logprobs(llm, prompt, toks[len(prompt):]), rtol=0, atol=1e-4)


def test_generation_cut_at_the_stop_token_per_sequence(llm, story_ids):
    """Near the end of a sampled story, the greedy continuation ends it by drawing BOS (llama2.c's separator), at a
    different step for each prompt (or not within 40 tokens); every strategy cuts each row there and leaves the
    others running."""
    story = list(generate_ids(llm.model, [1], 400, SamplingParams(temperature=1.0, seed=0)))
    prompts = [[1] + story[:len(story) - cut] for cut in (5, 8, 12)]
    solo = [list(generate_ids(llm.model, p, 40, SamplingParams(temperature=0))) for p in prompts]
    assert sum(len(s) < 40 for s in solo) >= 1, "no prompt stopped: the test needs one that ends its story"
    for strategy in STRATEGIES:
        assert llm.generate_tokens(prompts, 40, temperature=0, strategy=strategy)[0] == solo


def seeded_requests(story_ids, lengths, seed0) -> list[Request]:
    """Sampled requests, each with its own seed and its own sampling settings."""
    settings = [dict(temperature=1.0, top_p=0.9), dict(temperature=0.8, top_k=20), dict(temperature=1.2, min_p=0.05,
                repetition_penalty=1.3), dict(temperature=0)]
    return [Request(story_ids[:n], 24 + i % 3 * 8, SamplingParams(seed=seed0 + i, **settings[i % len(settings)]))
            for i, n in enumerate(lengths)]


def solo_of(model, request: Request) -> list[int]:
    return list(generate_ids(model, list(request.prompt), request.max_new_tokens, request.params))


@pytest.mark.parametrize("run", [ragged_generate, continuous_generate], ids=["ragged", "continuous"])
def test_sampled_tokens_do_not_depend_on_the_batch(llm, story_ids, run):
    mine = seeded_requests(story_ids, [3, 40, 120], seed0=100)
    others_a = seeded_requests(story_ids, [1, 77, 9, 150, 20], seed0=7)
    others_b = seeded_requests(story_ids, [60], seed0=900)
    alone = [solo_of(llm.model, r) for r in mine]
    in_a = [c.tokens for c in run(llm.model, others_a[:2] + mine + others_a[2:])][2:5]
    in_b = [c.tokens for c in run(llm.model, mine[::-1] + others_b)][:3][::-1]
    assert in_a == alone and in_b == alone
    assert len({tuple(t) for t in alone}) == 3


def test_static_batching_follows_meta_limits(llm, prompts16, solo16):
    """max_gen_len is per sequence even though the static buffer is as long as the longest prompt + max_gen_len;
    a sequence never generates past the context."""
    prompts = [prompts16[0], prompts16[15]]
    tokens, _ = llm.generate_tokens(prompts, 5, temperature=0, strategy="static")
    assert tokens == [solo16[0][:5], solo16[15][:5]]
    story = prompts16[15] * 3
    near_the_end, room_for_50 = story[:llm.config.max_seq_len - 3], story[:llm.config.max_seq_len - 60]
    for strategy in STRATEGIES:
        tokens, _ = llm.generate_tokens([near_the_end, room_for_50], 50, temperature=0, strategy=strategy)
        assert len(tokens[0]) <= 3 and len(tokens[1]) == 50


def test_generate_tokens_errors(llm, prompts16):
    with pytest.raises(GenerationError, match="strategy"):
        llm.generate_tokens(prompts16[:2], 4, strategy="padded")
    with pytest.raises(GenerationError, match="max_gen_len"):
        llm.generate_tokens(prompts16[:2], -1)
    with pytest.raises(GenerationError, match="context"):
        llm.generate_tokens([prompts16[0], [1] * (llm.config.max_seq_len + 1)], 4)
    with pytest.raises(GenerationError, match="no tokens"):
        llm.generate_tokens([prompts16[0], []], 4, strategy="static")
    with pytest.raises(ValueError, match="top_p"):
        llm.generate_tokens(prompts16[:2], 4, top_p=0)


def test_generate_takes_a_list_of_prompts(llm):
    prompts = ["Once upon a time", "Lily and Ben", "", "The dog ran"]
    for sampling in (dict(temperature=0), dict(temperature=1.0, top_p=0.9, seed=5)):
        together = llm.generate(prompts, max_new_tokens=30, **sampling)
        assert together == [llm.generate(p, max_new_tokens=30, **sampling) for p in prompts]


def test_cli_prompt_file_prints_every_completion(llm, stories260k, tmp_path, capsys):
    prompts = ["Once upon a time", "Lily and Ben", "The dog ran"]
    path = tmp_path / "prompts.txt"
    path.write_text(prompts[0] + "\n\n" + "\n".join(prompts[1:]) + "\n", encoding="utf-8")
    assert cli.main(["generate", "--prompt-file", str(path), "-m", str(stories260k), "--temperature", "0",
                     "--max-new-tokens", "20"]) == 0
    expected = [p + llm.generate(p, max_new_tokens=20, temperature=0) for p in prompts]
    assert capsys.readouterr().out == "\n\n".join(expected) + "\n"
    assert cli.main(["generate", "--prompt-file", str(tmp_path / "absent.txt"), "-m", str(stories260k)]) == 2
    assert "absent.txt" in capsys.readouterr().err
