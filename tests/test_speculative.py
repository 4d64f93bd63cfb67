"""Speculative decoding: greedy output equals plain greedy; sampled tokens follow the model's distribution."""

import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import npllm
from npllm.config import ModelConfig
from npllm.errors import GenerationError
from npllm.formats.random import random_weights
from npllm.generate import Request
from npllm.models import make_model
from npllm.sampling import SamplingParams, softmax
from npllm.speculative import SpeculationStats, _accept_or_resample, first_layers, speculative_decode
from tests_support import COMPILE_TIMEOUT

# Wilson-Hilferty: the chi-square critical value for alpha = 1e-3 (z = 3.0902)
def chi2_critical(df, z=3.0902):
    return df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3


@pytest.fixture(scope="module")
def llm(stories260k, weights_dir):
    return npllm.load(str(stories260k), str(weights_dir / "stories260K" / "tok512.bin"))


@pytest.mark.parametrize("layers", [1, 3, 5])
def test_greedy_speculation_is_plain_greedy(llm, layers):
    plain = llm.generate("Lily and Ben", 120, temperature=0)
    stats = SpeculationStats()
    assert llm.generate("Lily and Ben", 120, temperature=0, draft_layers=layers, num_draft=4,
                        speculation=stats) == plain
    assert stats.drafted > 0 and stats.rounds <= 120
    if layers == 5:  # the whole model as its own draft: every proposal passes, 5 tokens per call of the model
        assert stats.acceptance_rate == 1.0 and stats.rounds <= 1 + 120 // 5


def test_cli_draft_layers_prints_the_golden(stories260k, weights_dir, golden_200):
    out = subprocess.run([sys.executable, "-m", "npllm", "generate", "--model", str(stories260k), "--tokenizer",
                          str(weights_dir / "stories260K" / "tok512.bin"), "--temperature", "0", "--max-new-tokens",
                          "200", "--draft-layers", "2", "--num-draft", "4"], capture_output=True, text=True,
                         timeout=COMPILE_TIMEOUT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.rstrip("\n") == golden_200
    assert "acceptance" in out.stderr


@given(st.lists(st.floats(0.01, 1), min_size=2, max_size=6), st.data())
def test_accept_rule_keeps_the_models_support(weights, data):
    """A proposal the model cannot produce is never returned; with q = p the proposal always passes."""
    p = np.array(weights) / sum(weights)
    proposal = data.draw(st.integers(0, len(p) - 1))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    assert _accept_or_resample(p, p, proposal, rng) == proposal
    p_without = p.copy()
    p_without[proposal] = 0
    p_without /= p_without.sum()
    for _ in range(20):
        assert _accept_or_resample(p_without, p, proposal, rng) != proposal


def test_accept_rule_is_distributed_as_the_model():
    """Chi-square goodness of fit: draft from q, accept or resample, and the result follows p."""
    rng = np.random.default_rng(7)
    p = np.array([0.05, 0.4, 0.1, 0.3, 0.15])
    q = np.array([0.4, 0.1, 0.3, 0.1, 0.1])  # a bad draft: most mass where p has little
    n = 20000
    counts = np.bincount([_accept_or_resample(p, q, int(rng.choice(5, p=q)), rng) for _ in range(n)], minlength=5)
    chi2 = (((counts - n * p) ** 2) / (n * p)).sum()
    assert chi2 < chi2_critical(4)
    wrong = (((counts - n * q) ** 2) / (n * q)).sum()  # the same draws are far from the draft's distribution
    assert wrong > 100 * chi2_critical(4)


def tiny_model():
    config = ModelConfig(dim=16, hidden_dim=32, n_layers=3, n_heads=2, n_kv_heads=1, vocab_size=6, max_seq_len=16,
                         tied_embeddings=False, bos_id=0, eos_ids=())  # no end token: always 3 tokens
    weights = {k: 3 * v if v.ndim == 2 else v for k, v in random_weights(config, seed=3).items()}  # peaked logits
    return config, weights


def test_sampled_speculation_follows_the_models_distribution():
    """The third token's marginal under speculation (drafted by the first layer, 2 proposals a round) against the
    exact marginal computed from the model: sum over the first two tokens of p(t1) p(t2 | t1) p(t3 | t1, t2)."""
    config, weights = tiny_model()
    model = make_model(config, weights, "numpy")
    draft = make_model(*first_layers(config, weights, 1), "numpy")
    params = SamplingParams(temperature=0.9, top_p=1.0)
    prompt = [0, 3]
    exact = np.zeros(config.vocab_size)
    p1 = softmax(model.logits(prompt)[-1].astype(np.float64), 0.9)
    for t1 in range(config.vocab_size):
        p2 = softmax(model.logits(prompt + [t1])[-1].astype(np.float64), 0.9)
        for t2 in range(config.vocab_size):
            exact += p1[t1] * p2[t2] * softmax(model.logits(prompt + [t1, t2])[-1].astype(np.float64), 0.9)
    n = 1500
    thirds = []
    for seed in range(n):
        request = Request(prompt, 3, replace(params, seed=seed), stop_ids=frozenset())
        tokens = list(speculative_decode(model, draft, request, num_draft=2))
        assert len(tokens) == 3
        thirds.append(tokens[2])
    counts = np.bincount(thirds, minlength=config.vocab_size)
    expected = n * exact
    assert (((counts - expected) ** 2) / expected).sum() < chi2_critical(config.vocab_size - 1)


def test_bad_arguments(llm):
    with pytest.raises(GenerationError):
        llm.generate("Once", 10, temperature=0, draft_layers=0)
    with pytest.raises(GenerationError):
        llm.generate("Once", 10, temperature=0, draft_layers=6)
    with pytest.raises(GenerationError):
        llm.generate("Once", 10, temperature=0, draft_layers=2, num_draft=0)
    with pytest.raises(GenerationError):
        llm.generate("Once", 10, temperature=0, draft_layers=2, logprobs=3)


def test_a_draft_model_given_by_path_or_llm(llm, stories260k):
    """--draft MODEL: the same checkpoint as its own draft accepts every proposal, by path or as an LLM."""
    plain = llm.generate("Once upon a time", 40, temperature=0)
    for draft in (str(stories260k), llm):
        stats = SpeculationStats()
        assert llm.generate("Once upon a time", 40, temperature=0, draft=draft, num_draft=3,
                            speculation=stats) == plain
        assert stats.acceptance_rate == 1.0
    with pytest.raises(GenerationError):
        llm.generate("Once", 5, temperature=0, draft=llm, draft_layers=2)
