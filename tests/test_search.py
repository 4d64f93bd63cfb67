"""Beam search equals transformers' on the tiny random Llama fixture (tests/fixtures/hf/beam_search.json, made by
scripts/fixtures/make_beam_fixtures.py): same sequences in the same order, scores within 1e-3."""

import json
from pathlib import Path

import numpy as np
import pytest

from npllm.models import make_model
from npllm.errors import GenerationError
from npllm.formats import read_checkpoint
from npllm.search import beam_search

HF = Path(__file__).parent / "fixtures" / "hf"
CASES = json.loads((HF / "beam_search.json").read_text())["cases"]


@pytest.fixture(scope="module")
def models():
    config, weights = read_checkpoint(HF / "llama_gqa")
    return {b: make_model(config, weights, b) for b in ("numpy", "numba")}


def case_id(c):
    return (f"p{len(c['prompt'])}-{c['eos_kind']}-B{c['num_beams']}-lp{c['length_penalty']:g}-"
            f"early-{c['early_stopping']}")


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_beam_search_equals_transformers(models, case):
    found = beam_search(models["numpy"], case["prompt"], case["num_beams"], case["max_new_tokens"],
                        length_penalty=case["length_penalty"], early_stopping=case["early_stopping"],
                        eos_token_id=case["eos"])
    assert [list(h.tokens) for h in found] == case["sequences"]
    assert [h.score for h in found] == pytest.approx(case["scores"], abs=1e-3)
    for h in found:  # logprob: the model's own log-probabilities of the tokens, each read off one full forward pass
        assert h.logprob == pytest.approx(scored(models["numpy"], case["prompt"], h.tokens), abs=1e-4)


def scored(model, prompt, tokens) -> float:
    """Sum of log p(token | the tokens before it) over `tokens` after `prompt`, from the logits of the whole
    sequence in one call (not the search's incremental cache steps), softmax in float64."""
    logits = model.logits(list(prompt) + list(tokens)).astype(np.float64)[len(prompt) - 1:-1]
    logprobs = logits - logits.max(axis=1, keepdims=True)
    logprobs -= np.log(np.exp(logprobs).sum(axis=1, keepdims=True))
    return float(logprobs[np.arange(len(tokens)), list(tokens)].sum())


def test_fixture_has_finished_and_unfinished_hypotheses():
    finished = [c for c in CASES if any(c["eos"] in s for s in c["sequences"])]
    assert 10 <= len(finished) < len(CASES)
    assert any(len({len(s) for s in c["sequences"]}) > 1 for c in finished)  # hypotheses of different lengths


@pytest.mark.parametrize("case", CASES[::7], ids=case_id)
def test_numba_backend_finds_the_same_beams(models, case):
    kwargs = dict(length_penalty=case["length_penalty"], early_stopping=case["early_stopping"],
                  eos_token_id=case["eos"])
    found = beam_search(models["numba"], case["prompt"], case["num_beams"], case["max_new_tokens"], **kwargs)
    assert [list(h.tokens) for h in found] == case["sequences"]


@pytest.mark.parametrize("case", [c for c in CASES if c["eos_kind"] == "likely"][::3], ids=case_id)
def test_an_ends_rule_ends_a_hypothesis_as_eos_does(models, case):
    """ends(tokens) firing on the EOS id, with no EOS id given, finds transformers' beams for that EOS (LLM.beam_search
    ends hypotheses at stop strings this way)."""
    found = beam_search(models["numpy"], case["prompt"], case["num_beams"], case["max_new_tokens"],
                        length_penalty=case["length_penalty"], early_stopping=case["early_stopping"],
                        eos_token_id=[], ends=lambda tokens: tokens[-1] == case["eos"])
    assert [list(h.tokens) for h in found] == case["sequences"]


def test_one_beam_is_greedy(models):
    model = models["numpy"]
    prompt = [0, 45, 112]
    (best,) = beam_search(model, prompt, 1, 8, eos_token_id=model.config.vocab_size - 1)
    ids = list(prompt)
    for _ in range(8):
        ids.append(int(np.argmax(model.logits(ids)[-1])))
    assert list(best.tokens) == ids[len(prompt):]


def test_num_return_sequences_and_bad_arguments(models):
    model = models["numpy"]
    assert len(beam_search(model, [0, 5], 4, 5, num_return_sequences=2)) == 2
    for kwargs in (dict(num_beams=0), dict(max_new_tokens=0), dict(early_stopping="sometimes"),
                   dict(num_return_sequences=5), dict(eos_token_id=10_000), dict(max_new_tokens=1000)):
        args = dict(num_beams=4, max_new_tokens=5) | kwargs
        with pytest.raises(GenerationError):
            beam_search(model, [0, 5], **args)


def test_cache_reorder_moves_whole_slots(models):
    cache = models["numpy"].new_cache(capacity=8, slots=3)
    cache.k[:, 0], cache.k[:, 1], cache.k[:, 2] = 1, 2, 3
    cache.positions[:, :2], cache.lengths[:] = [[0, 1], [0, -1], [-1, -1]], [2, 1, 0]
    k = cache.k
    cache.reorder([1, 1, 0])
    assert cache.k is k and (cache.k[:, 0] == 2).all() and (cache.k[:, 1] == 2).all() and (cache.k[:, 2] == 1).all()
    assert cache.positions[:, :2].tolist() == [[0, -1], [0, -1], [0, 1]] and cache.lengths.tolist() == [1, 1, 2]
    with pytest.raises(GenerationError):
        cache.reorder([0, 1])


def test_early_stopping_heuristic_is_transformers():
    """Can the best running beam still beat the worst finished one, its score judged at the current length (at
    max_new_tokens for early_stopping="never" with a positive penalty)? Only once every place is finished."""
    from npllm.search import NEG, _Beams, _improvable

    beams = _Beams(np.zeros((2, 4), np.int64), np.array([-6.0, -7.0]), [(1,), (2,)], np.array([-1.0, -2.5]),
                   np.array([-4.0, -5.0]))
    assert _improvable(beams, 4, 10, 1.0, False)  # -6 / 4 = -1.5 beats the worst finished, -2.5
    assert not _improvable(beams, 2, 10, 1.0, False)  # -6 / 2 = -3 does not
    assert _improvable(beams, 2, 10, 1.0, "never")  # judged at 10 tokens: -0.6
    assert not _improvable(beams, 2, 10, 0.0, "never")  # no penalty: -6 < -2.5 at any length
    beams.done_scores = np.array([-1.0, NEG])  # a place still open: always improvable
    assert _improvable(beams, 2, 10, 0.0, False)
