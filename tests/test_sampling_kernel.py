"""The compiled CPU sampler (kernels/cpu.py: kth_largest, nucleus_floor(_bucketed), sample_row, sample_rows) against the
readable definitions of npllm.sampling, and the numba model's sample / sample_next against sample_with.

The kernel uses sampling.py's arithmetic (float32 logits and exponentials, float64 sums), but its exponentials
come from a different library and its sums run in another order. A draw may therefore differ only where u * total
lies within rounding of a step of the running sum, or top-p's target within rounding of a partial mass. Those cases
are measured here and left out (hypothesis.assume); everything else must be the very same id.
"""

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from npllm import sampling as S
from npllm.config import ModelConfig
from npllm.errors import GenerationError
from npllm.formats.random import random_weights
from npllm.kernels import cpu
from npllm.models import make_model
from npllm.models.base import kernel_samples

ROUNDING = 1e-6  # relative distance to a step below which two correct implementations may disagree


@given(hnp.arrays(np.float32, st.integers(1, 200), elements=st.floats(-8, 8, width=32)), st.data())
def test_kth_largest_is_the_kth_of_the_descending_sort(a, data):
    rounded = data.draw(st.booleans())
    a = np.round(a) if rounded else a  # ties everywhere, or almost none
    k = data.draw(st.integers(1, len(a)))
    assert cpu.kth_largest(a.copy(), len(a), k) == np.sort(a)[::-1][k - 1]


def nucleus_floor_by_sorting(e: np.ndarray, target: float) -> float:
    """The definition: walk the descending values until their float64 running sum reaches target."""
    descending = np.sort(e)[::-1]
    reach = np.cumsum(descending, dtype=np.float64)
    first = min(int(np.sum(reach < target)), len(e) - 1)
    return descending[first]


@given(hnp.arrays(np.float32, st.integers(1, 200), elements=st.floats(0, 1, width=32)), st.floats(0.01, 1.0),
       st.booleans())
def test_nucleus_floor_is_where_the_descending_mass_reaches_the_target(e, p, rounded):
    e = np.round(e, 1) if rounded else e
    assume(e.sum() > 0)
    target = p * float(e.sum(dtype=np.float64))
    reach = np.cumsum(np.sort(e)[::-1], dtype=np.float64)
    assume(np.min(np.abs(reach - target)) > ROUNDING * reach[-1])  # not within rounding of a partial mass
    assert cpu.nucleus_floor(e.copy(), len(e), target) == nucleus_floor_by_sorting(e, target)
    positive = e[e > 0]  # the bucketed search skips zeros, which hold no mass
    assert cpu.nucleus_floor_bucketed(e, len(e), target, np.empty(len(e), np.float32)) == \
        nucleus_floor_by_sorting(positive, target)


def reference(x: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float):
    """sampling.py's kept tokens and their e = exp(s) (s the tempered logits): ([n] ids, [n] float32 e, whether a
    top-p decision lies within rounding)."""
    s = (x - x.max()) / np.float32(temperature) if temperature != 1.0 else x - x.max()
    kept = np.isfinite(S.min_p(S.top_p(S.top_k(s, top_k), top_p), min_p))
    ids = np.flatnonzero(kept)
    survivors = np.exp(S.top_k(s, top_k))
    survivors = survivors[survivors > 0]
    reach = np.cumsum(np.sort(survivors)[::-1], dtype=np.float64)
    edge = top_p < 1.0 and np.min(np.abs(reach - top_p * reach[-1])) <= ROUNDING * reach[-1]
    return ids, np.exp(s[ids]), edge


def reference_draw(x, temperature, top_k, top_p, min_p, u):
    """The inverse CDF at u over the kept tokens by ascending id; None when u * total lies within rounding of a
    step of the running sum (or top-p's target of a partial mass), where the kernel may rightly pick a neighbour."""
    ids, e, edge = reference(x, temperature, top_k, top_p, min_p)
    run = np.cumsum(e, dtype=np.float64)
    target = u * run[-1]
    if edge or np.min(np.abs(run - target)) <= ROUNDING * run[-1]:
        return None
    return int(ids[min(int(np.searchsorted(run, target, side="right")), len(ids) - 1)])


@st.composite
def rows(draw):
    V = draw(st.integers(1, 300))
    x = draw(hnp.arrays(np.float32, V, elements=st.floats(-12, 12, width=32)))
    if draw(st.booleans()):
        x = np.round(x * 2) / 2  # ties everywhere, at filter floors too
    if V > 1 and draw(st.booleans()):
        x[draw(st.integers(0, V - 1))] = -np.inf
    x[draw(st.integers(0, V - 1))] = 4.0  # a finite maximum
    return x.astype(np.float32)


@given(rows(), st.sampled_from([0.5, 0.8, 1.0, 1.7]), st.integers(0, 320),
       st.one_of(st.just(1.0), st.floats(0.01, 1.0)), st.sampled_from([0.0, 0.001, 0.05, 0.3]), st.floats(0, 0.999999))
@settings(max_examples=300)
def test_sample_row_draws_what_the_definition_draws(x, temperature, top_k, top_p, min_p, u):
    expected = reference_draw(x, temperature, top_k, top_p, min_p, u)
    assume(expected is not None)
    V = len(x)
    got = cpu.sample_row(x, temperature, top_k, top_p, min_p, u, np.empty(V, np.float32), np.empty(V, np.float32))
    assert got == expected


def test_sample_row_over_a_grid_of_u_on_large_vocabularies():
    """Each kept token's step of the CDF is reached: 64 values of u across [0, 1) on a 32,000-token row."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(32000) * 3).astype(np.float32)
    V = len(x)
    e, scratch = np.empty(V, np.float32), np.empty(V, np.float32)
    for temperature, top_k, top_p, min_p in [(1.0, 0, 0.9, 0.0), (0.7, 40, 0.95, 0.0), (1.0, 0, 1.0, 0.02),
                                             (1.3, 500, 0.5, 0.01)]:
        for u in np.linspace(0, 1, 64, endpoint=False) + 0.003:
            expected = reference_draw(x, temperature, top_k, top_p, min_p, u)
            if expected is not None:
                assert cpu.sample_row(x, temperature, top_k, top_p, min_p, u, e, scratch) == expected


@given(rows(), st.booleans())
def test_greedy_is_the_first_maximum(x, tie):
    if tie and len(x) > 2:
        x[len(x) // 2:] = np.where(x[len(x) // 2:] == x.max(), x.max(), x[len(x) // 2:])
    V = len(x)
    assert cpu.sample_row(x, 0.0, 5, 0.5, 0.1, 0.5, np.empty(V, np.float32), np.empty(V, np.float32)) == np.argmax(x)


def test_tie_rules():
    """Ties at a filter's floor are kept whole; the draw takes the first kept id whose running mass exceeds u times
    the total, so u landing exactly on a step moves on to the next token (as in sampling.py and the CUDA kernel)."""
    e, scratch = np.empty(20, np.float32), np.empty(20, np.float32)
    draw = lambda x, k, p, u: cpu.sample_row(np.asarray(x, np.float32), 1.0, k, p, 0.0, u, e, scratch)  # noqa: E731
    assert draw([0.0] * 20, 3, 1.0, 0.62) == 12  # top-k 3 of 20 equal logits keeps all 20
    assert draw([5, 5, 2, 2, 2, 2] + [-1] * 14, 3, 1.0, 0.99) == 5  # both 5s and all four 2s
    assert draw([3] * 4 + [0] * 16, 0, 0.5, 0.99) == 3  # the four 3s hold over half the mass: top-p 0.5 keeps them
    assert draw([3] * 4 + [0] * 16, 4, 1.0, 0.5) == 2  # u = 0.5 is exactly the second step: the third token


def test_rows_with_infinities_follow_sampling_py():
    """+inf logits share the mass equally (sampling._normalisable); -inf ones are never drawn."""
    x = np.array([1.0, np.inf, 0.0, np.inf, -np.inf], np.float32)
    e, scratch = np.empty(5, np.float32), np.empty(5, np.float32)
    assert [cpu.sample_row(x, 1.0, 0, 1.0, 0.0, u, e, scratch) for u in (0.2, 0.7)] == [1, 3]
    assert cpu.sample_row(x, 0.0, 0, 1.0, 0.0, 0.5, e, scratch) == 1
    x = np.array([-np.inf, 2.0, -np.inf], np.float32)
    assert cpu.sample_row(x, 1.0, 2, 0.3, 0.5, 0.999, e, scratch) == 1


def test_rows_without_a_distribution_are_reported():
    logits = np.zeros((3, 4), np.float32)
    logits[1, 2] = np.nan
    logits[2] = -np.inf
    ids = np.empty(3, np.int64)
    table = np.array([[1.0, 0, 1.0, 0.0, 0.5]] * 3)
    assert cpu.sample_rows(logits, table, ids) == 1
    assert ids[1] == -1 and ids[2] == -2 and ids[0] >= 0


CONFIG = ModelConfig(dim=32, hidden_dim=48, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, max_seq_len=32,
                     head_dim=8)


@pytest.fixture(scope="module")
def numba_model():
    return make_model(CONFIG, random_weights(CONFIG, 11), "numba")


PARAMS = [S.SamplingParams(temperature=0), S.SamplingParams(temperature=0.8, top_k=10, top_p=0.9, seed=1),
          S.SamplingParams(temperature=1.2, min_p=0.05, seed=2), S.SamplingParams(top_p=0.5, seed=3),
          S.SamplingParams(seed=4, stop=("the",))]


@pytest.mark.parametrize("params", PARAMS, ids=str)
def test_numba_sample_next_draws_what_sample_with_draws(numba_model, params):
    """Twenty generators in a row: the numba model's compiled draw is sample_with's, from the same uniform."""
    assert kernel_samples(params)
    hidden = numba_model.forward([4, 5, 6], [0, 1, 2], numba_model.new_cache())[-1:]
    logits = numba_model.lm_head(hidden)[0]
    for seed in range(20):
        expected = int(S.sample_with(params, logits, np.random.default_rng(seed)))
        assert numba_model.sample_next(hidden, params, np.random.default_rng(seed)) == expected


def test_options_the_kernel_lacks_go_to_sample_with(numba_model):
    """Penalties and typical-p need sample_with: sample_next sends it the logits, and its draw is sample_with's."""
    hidden = numba_model.forward([4, 5, 6], [0, 1, 2], numba_model.new_cache())[-1:]
    logits = numba_model.lm_head(hidden)[0]
    for params in (S.SamplingParams(typical_p=0.5, seed=1), S.SamplingParams(repetition_penalty=1.5, seed=2),
                   S.SamplingParams(logit_bias={int(np.argmax(logits)): -math.inf}, temperature=0)):
        assert not kernel_samples(params)
        expected = int(S.sample_with(params, logits, np.random.default_rng(0), [4, 5, 6]))
        assert numba_model.sample_next(hidden, params, np.random.default_rng(0), [4, 5, 6]) == expected


def test_numba_sample_reports_broken_logits(numba_model, monkeypatch):
    hidden = numba_model.forward([4], [0], numba_model.new_cache())
    broken = np.zeros((1, CONFIG.vocab_size), np.float32)
    broken[0, 3] = np.nan
    monkeypatch.setattr(numba_model, "lm_head", lambda h: broken)
    with pytest.raises(GenerationError, match="NaN"):
        numba_model.sample(hidden, 1.0, 0, 0.9, 0.0, 0.5)
    monkeypatch.setattr(numba_model, "lm_head", lambda h: np.full((1, CONFIG.vocab_size), -np.inf, np.float32))
    with pytest.raises(GenerationError, match="every token is -inf"):
        numba_model.sample(hidden, 0.0)
