"""Generation: stop conditions, the context limit, seeds, and clear errors for bad requests."""

import numpy as np
import pytest

import npllm
from npllm.config import ModelConfig
from npllm.errors import GenerationError, NpllmError, TokenizerError
from npllm.formats.random import random_weights
from npllm.generate import generate_ids
from npllm.models.reference import Transformer
from npllm.sampling import SamplingParams

TINY = ModelConfig(dim=16, hidden_dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=8, max_seq_len=6,
                   eos_ids=(2,))


def biased_model(favourite: int, config=TINY):
    """A model whose next token is always `favourite`: the layers add nothing (zero output projections), every
    embedding is all ones, and only the favourite's output row is non-zero."""
    config = config.replace(tied_embeddings=False)
    weights = {name: np.zeros_like(w) for name, w in random_weights(config).items()}
    for name in weights:
        if name.endswith("norm"):
            weights[name][:] = 1.0
    weights["tok_embeddings"][:] = 1.0
    weights["output"][favourite] = 1.0
    return Transformer(config, weights)


def greedy():
    return SamplingParams(temperature=0)


def test_stops_at_eos_without_yielding_it():
    assert list(generate_ids(biased_model(2), [1], 10, greedy())) == []


def test_stops_at_bos_only_for_llama2c_checkpoints():
    assert list(generate_ids(biased_model(1, TINY.replace(stop_at_bos=True)), [1], 10, greedy())) == []
    assert list(generate_ids(biased_model(1), [1], 3, greedy())) == [1, 1, 1]


def test_stops_at_token_limit_and_at_end_of_context():
    model = biased_model(5)
    assert list(generate_ids(model, [1], 2, greedy())) == [5, 5]
    # 6 positions: the prompt fills 2, so 4 more can be fed back and a 5th sampled from the last position.
    assert list(generate_ids(model, [1, 3], 100, greedy())) == [5] * 5


def test_prompt_longer_than_context_is_an_error():
    with pytest.raises(GenerationError, match="context is 6"):
        list(generate_ids(biased_model(5), [1] * 7, 1, greedy()))


@pytest.mark.parametrize("bad", [dict(temperature=-0.1), dict(top_p=0), dict(top_p=1.5)])
def test_bad_sampling_parameters(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_bad_token_ids():
    with pytest.raises(GenerationError, match="outside the vocabulary"):
        list(generate_ids(biased_model(5), [1, 99], 1, greedy()))


def test_same_seed_same_story(stories260k):
    llm = npllm.load(stories260k)
    a = llm.generate("Once", max_new_tokens=40, temperature=1.0, top_p=0.9, seed=7)
    b = llm.generate("Once", max_new_tokens=40, temperature=1.0, top_p=0.9, seed=7)
    c = llm.generate("Once", max_new_tokens=40, temperature=1.0, top_p=0.9, seed=8)
    assert a == b and a != c


def test_api_errors_are_npllm_errors(stories260k, weights_dir):
    llm = npllm.load(stories260k)
    with pytest.raises(GenerationError, match="context"):
        llm.generate("one two " * 400, max_new_tokens=1)
    with pytest.raises(ValueError, match="temperature"):
        llm.generate("hi", temperature=-1)
    with pytest.raises(NpllmError):
        npllm.load("no-such-model")
    llama_tok = weights_dir / "llama2-tokenizer" / "tokenizer.model"
    if llama_tok.exists():
        with pytest.raises(TokenizerError, match="512"):
            npllm.load(stories260k, tokenizer=llama_tok)


def test_logits_api(stories260k):
    llm = npllm.load(stories260k)
    ids = llm.tokenizer.encode("Lily and Ben", bos=True)
    logits = llm.logits(ids)
    assert logits.shape == (len(ids), 512) and logits.dtype == np.float32
    assert int(np.argmax(logits[-1])) == next(llm.generate_ids(ids, 1, temperature=0))


@pytest.mark.parametrize("params", [SamplingParams(temperature=0), SamplingParams(temperature=0.9, top_p=0.9, seed=4),
                                    SamplingParams(temperature=0.8, top_k=20, repetition_penalty=1.2, seed=9)],
                         ids=["greedy", "top_p", "top_k+penalty"])
def test_asking_for_logprobs_changes_no_token(stories260k, params):
    """Without logprobs a step draws the id alone (log-probability NaN); with logprobs=N the same ids come with the
    sampler's log-probability of each and N alternatives, the drawn token among them when it is the most likely."""
    from dataclasses import replace

    from npllm.generate import generate_steps
    from npllm.sampling import sample_step

    model = npllm.load(stories260k).model
    prompt = [1, 365, 108]
    plain = list(generate_steps(model, prompt, 40, params))
    reported = list(generate_steps(model, prompt, 40, replace(params, logprobs=3)))
    assert [s.token_ids for s in plain] == [s.token_ids for s in reported]
    assert all(np.isnan(s.logprobs) and s.top_ids.size == 0 for s in plain)
    history, rng = list(prompt), params.generator()
    for s in reported:  # the reported figures are sample_step's for the same logits, history and generator
        expected = sample_step(replace(params, logprobs=3), model.logits(history)[-1], rng, history)
        assert s.token_ids == expected.token_ids and s.logprobs == pytest.approx(expected.logprobs, rel=1e-6)
        np.testing.assert_array_equal(s.top_ids, expected.top_ids)
        history.append(s.token_ids)
