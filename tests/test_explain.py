"""`--explain`: the probabilities in the table are the ones the sampler used, and the tokens are generate's tokens."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import npllm
from npllm.explain import describe, explain_ids, format_step, step_json
from npllm.generate import generate_ids
from npllm.sampling import SamplingParams, sample_step
from tests_support import COMPILE_TIMEOUT, REPO

PARAMS = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=1.0, seed=3),
    SamplingParams(temperature=0.8, top_p=0.9, seed=5),
    SamplingParams(temperature=1.3, top_k=12, top_p=0.8, min_p=0.05, repetition_penalty=1.3, seed=7),
    SamplingParams(temperature=0.7, typical_p=0.9, presence_penalty=0.5, frequency_penalty=0.2, seed=11),
    SamplingParams(temperature=0, repetition_penalty=1.5, no_repeat_ngram=3),
]


@pytest.fixture(scope="module")
def llm(stories260k):
    return npllm.load(stories260k)


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: repr(p)[15:70])
def test_drawn_probability_is_the_samplers(llm, params):
    """The table's probability of the drawn token (explain_steps) equals exp(logprob) from the sampler."""
    prompt = llm.tokenizer.encode("Once upon a time, there was a", bos=True)
    steps = list(explain_ids(llm.model, llm.tokenizer, prompt, 40, params))
    assert steps
    for step in steps:
        assert step.drawn_probability > 0
        assert step.drawn_probability == pytest.approx(math.exp(step.logprob), rel=1e-5, abs=1e-7)
        drawn = next(c for c in step.candidates if c.token_id == step.token_id)
        assert step.fate(drawn) == "drawn"
        for c in step.candidates:  # a filtered-out candidate has probability 0 in the drawn-from column
            assert (step.fate(c) in ("drawn", "kept", "-")) == (c.probs[step.drawn_from] > 0)
        assert f"(id {step.token_id})" in format_step(step)
        assert json.loads(step_json(step))["logprob"] == step.logprob


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: repr(p)[15:70])
def test_explain_generates_the_same_tokens_as_generate(llm, params):
    prompt = llm.tokenizer.encode("Lily and Ben", bos=True)
    steps = list(explain_ids(llm.model, llm.tokenizer, prompt, 60, params))
    expected = list(generate_ids(llm.model, prompt, 60, params))
    assert [s.token_id for s in steps if not s.stop] == expected
    assert [s.position for s in steps] == list(range(len(prompt), len(prompt) + len(steps)))
    assert "".join(s.text for s in steps) == llm.tokenizer.decode(prompt + expected)[len(
        llm.tokenizer.decode(prompt)):]


def test_a_stop_token_is_shown_and_ends_the_run(llm):
    """stories260K ends a story with BOS (run.c's stop): explain shows that draw, marked stop, and nothing after."""
    params = SamplingParams(temperature=1.0, seed=0)
    steps = list(explain_ids(llm.model, llm.tokenizer, [llm.config.bos_id], 400, params))
    assert steps[-1].stop and steps[-1].token_id == llm.config.bos_id
    assert not any(s.stop for s in steps[:-1])
    assert [s.token_id for s in steps[:-1]] == list(generate_ids(llm.model, [llm.config.bos_id], 400, params))
    assert "stops the generation" in format_step(steps[-1])


class Pieces:
    """A tokenizer stand-in for describe(): piece i is 't<i>'."""

    def id_to_piece(self, i):
        return f"t{i}"


@given(logits=st.lists(st.floats(-20, 20), min_size=2, max_size=40),
       temperature=st.sampled_from([0.0, 0.3, 1.0, 2.5]), top_k=st.integers(0, 10),
       top_p=st.floats(0.05, 1.0), min_p=st.floats(0.0, 0.5), penalty=st.floats(0.5, 2.0),
       history=st.lists(st.integers(0, 1), max_size=4), seed=st.integers(0, 2**32 - 1))
def test_table_matches_sampler_on_arbitrary_logits(logits, temperature, top_k, top_p, min_p, penalty, history, seed):
    """Over arbitrary logits and parameters, the table's drawn probability is exp(sampler's logprob), the drawn
    token survives every filter, and the kept count is the number of tokens the sampler could have drawn."""
    x = np.array(logits, np.float32)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                            repetition_penalty=penalty, seed=seed, logprobs=len(logits))
    sampled = sample_step(params, x, params.generator(), history)
    step = describe(0, 0, x, params, history, sampled.token_ids, sampled.logprobs, "", False, Pieces(), top=len(x))
    assert step.drawn_probability == pytest.approx(math.exp(sampled.logprobs), rel=1e-5, abs=1e-7)
    if temperature > 0:
        assert step.kept == int(np.sum(sampled.top_ids >= 0))


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "npllm", *args], capture_output=True, text=True, cwd=REPO,
                          env=dict(os.environ), timeout=COMPILE_TIMEOUT)


@pytest.mark.parametrize("sampling", [["--temperature", "0"], ["--temperature", "0.9", "--top-p", "0.8",
                                                               "--seed", "4"]])
def test_cli_explain_json_reproduces_generate(stories260k, sampling):
    common = ["Lily and Ben", "--model", str(stories260k), "--max-new-tokens", "25", *sampling]
    plain = run_cli("generate", *common)
    explained = run_cli("generate", *common, "--explain", "--json")
    assert plain.returncode == 0 and explained.returncode == 0, explained.stderr
    steps = [json.loads(line) for line in explained.stdout.splitlines()]
    assert len(steps) >= 1
    completion = "".join(s["text"] for s in steps)
    assert plain.stdout == "Lily and Ben" + completion + "\n"
    for s in steps:
        row = next(c for c in s["candidates"] if c["token_id"] == s["token_id"])
        assert row["probs"][s["drawn_from"]] == pytest.approx(math.exp(s["logprob"]), rel=1e-5, abs=1e-7)


def test_cli_explain_prints_a_table_per_token(stories260k):
    result = run_cli("generate", "Once upon a", "--model", str(stories260k), "--max-new-tokens", "3",
                     "--temperature", "0.8", "--top-p", "0.9", "--seed", "1", "--explain")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("drew ") == 3
    assert "top_p" in result.stdout and "fate" in result.stdout and "the filters kept" in result.stdout


def test_cli_json_without_explain_is_refused(stories260k):
    result = run_cli("generate", "Once", "--model", str(stories260k), "--json")
    assert result.returncode == 2
    assert result.stderr.strip() == "npllm: error: --json needs --explain (it is --explain's machine-readable form)"
