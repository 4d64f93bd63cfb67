"""The shortcuts of npllm._sampling_fast against the readable definitions in npllm.sampling.

sample_step and sample_with run the pipeline through these shortcuts; each must give what the readable rule gives:
the same kept tokens, the same chosen slot, the same draws.
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from npllm import _sampling_fast as fast
from npllm import sampling as S
from npllm.errors import GenerationError


@st.composite
def logit_batch(draw, max_b=4, min_v=1, max_v=40):
    """[B, V] float32 or float64 logits, sometimes rounded so that ties are common, sometimes with -inf entries."""
    B = draw(st.integers(1, max_b))
    V = draw(st.integers(min_v, max_v))
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    x = draw(hnp.arrays(dtype, (B, V), elements=st.floats(-20, 20, width=32)))
    if draw(st.booleans()):
        x = np.round(x, draw(st.integers(0, 1))).astype(dtype)
    x[np.arange(B), draw(st.integers(0, V - 1))] = 5.0  # a finite maximum, so no row is all -inf
    if V > 1 and draw(st.booleans()):
        x[:, draw(st.integers(0, V - 1))] = -np.inf
    return x


def large_batch(seed: int, V: int, scale: float) -> np.ndarray:
    """[3, V] normal logits: flat (small scale) rows reach beyond the nucleus candidates, peaked ones do not."""
    return (np.random.default_rng(seed).standard_normal((3, V)) * scale).astype(np.float32)


def tempered(x: np.ndarray) -> np.ndarray:
    return S._shifted(x, 1.0)


@given(logit_batch(), st.floats(0.01, 1.0))
def test_top_p_shortcut_keeps_what_the_definition_keeps(x, p):
    s = tempered(x)
    np.testing.assert_array_equal(fast.top_p_keep(s, p), S._top_p_keep(s, p))


@given(st.integers(0, 2**32 - 1), st.sampled_from([300, 1500, 5000]), st.sampled_from([0.3, 1.0, 4.0]),
       st.sampled_from([0.1, 0.5, 0.9, 0.99]))
def test_top_p_shortcut_on_large_vocabularies(seed, V, scale, p):
    """Past _NUCLEUS_CANDIDATES entries and across several running-sum blocks."""
    s = tempered(large_batch(seed, V, scale))
    np.testing.assert_array_equal(fast.top_p_keep(s, p), S._top_p_keep(s, p))


@st.composite
def filter_params(draw):
    return S.SamplingParams(
        top_k=draw(st.sampled_from([0, 1, 3, 10, 50])),
        top_p=draw(st.sampled_from([1.0, 0.95, 0.6, 0.2])),
        min_p=draw(st.sampled_from([0.0, 0.05, 0.5])),
        typical_p=draw(st.sampled_from([1.0, 0.7])),
    )


def readable_survivors(s: np.ndarray, params: S.SamplingParams) -> np.ndarray:
    """The filter stages applied one after the other through their public functions: [B, V] -> [B, V]."""
    s = S.top_k(s, params.top_k)
    s = S.top_p(s, params.top_p)
    s = S.min_p(s, params.min_p)
    return S.typical_p(s, params.typical_p)


def fast_survivors(s: np.ndarray, params: S.SamplingParams) -> np.ndarray:
    """fast.candidates' compact [B, C] result spread back over the vocabulary: [B, V] -> [B, V]."""
    filters = [(stage.name, stage.rule, *stage.values(params)) for stage in S._active(params, "filter")]
    ids, vals = fast.candidates(s, filters)
    out = np.full(s.shape, -np.inf, s.dtype)
    for b in range(len(s)):
        live = ids[b] >= 0
        out[b, ids[b, live]] = vals[b, live]
    return out


@given(logit_batch(max_v=60), filter_params())
def test_candidates_are_the_survivors_of_the_filter_stages(x, params):
    s = tempered(x)
    np.testing.assert_array_equal(fast_survivors(s, params), readable_survivors(s, params))


@given(st.integers(0, 2**32 - 1), st.sampled_from([2000, 6000]), filter_params())
def test_candidates_on_large_vocabularies(seed, V, params):
    """Large enough for top_k's block-maxima floor and for the compact gather after the first filter."""
    s = tempered(large_batch(seed, V, 3.0))
    np.testing.assert_array_equal(fast_survivors(s, params), readable_survivors(s, params))


def readable_draw(vals: np.ndarray, u: float) -> int:
    """Inverse CDF by the definition: the first slot whose cumulative probability exceeds u."""
    q = S.softmax(vals.astype(np.float64))
    return int(np.searchsorted(np.cumsum(q), u, side="right"))


@given(logit_batch(max_v=700), st.lists(st.floats(0, 1, exclude_max=True), min_size=4, max_size=4))
def test_the_draw_is_the_inverse_cdf(x, us):
    u = np.array(us[: len(x)])
    slot, log_total = fast.draw(x, u)
    for b in range(len(x)):
        assert x[b, slot[b]] > -np.inf
        expected = readable_draw(x[b], u[b])
        if expected != slot[b]:  # only a rounding tie at the boundary may differ: u sits on a cumulative sum
            cdf = np.cumsum(S.softmax(x[b].astype(np.float64)))
            assert abs(cdf[min(expected, len(cdf) - 1)] - u[b]) < 1e-6 or abs(cdf[slot[b] - 1] - u[b]) < 1e-6
    e = np.exp(x.astype(np.float64) - x.max(axis=1, keepdims=True))
    np.testing.assert_allclose(np.exp(log_total), e.sum(axis=1), rtol=1e-6)  # Z, from float32 exponentials


@st.composite
def step_params(draw):
    return S.SamplingParams(
        temperature=draw(st.sampled_from([0.0, 0.5, 1.0, 1.7])),
        top_k=draw(st.sampled_from([0, 1, 5])),
        top_p=draw(st.sampled_from([1.0, 0.9, 0.3])),
        min_p=draw(st.sampled_from([0.0, 0.1])),
        typical_p=draw(st.sampled_from([1.0, 0.8])),
        repetition_penalty=draw(st.sampled_from([1.0, 1.3])),
        presence_penalty=draw(st.sampled_from([0.0, 0.4])),
        logprobs=draw(st.integers(0, 3)),
    )


@given(logit_batch(max_v=50), step_params(), st.integers(0, 2**32 - 1), st.data())
def test_sample_with_draws_what_sample_step_draws(x, params, seed, data):
    """The ids-only path (no log-probabilities) and the full step choose the same tokens from the same uniforms."""
    V = x.shape[1]
    history = [data.draw(st.lists(st.integers(0, V - 1), max_size=6)) for _ in x]
    rngs = lambda: [np.random.default_rng(seed + b) for b in range(len(x))]  # noqa: E731
    try:
        expected = S.sample_step(params, x, rngs(), history).token_ids
    except GenerationError as e:  # the penalties masked a whole row: both refuse
        with pytest.raises(GenerationError, match="masked every token"):
            S.sample_with(params, x, rngs(), history)
        assert "masked every token" in str(e)
        return
    np.testing.assert_array_equal(S.sample_with(params, x, rngs(), history), expected)
