"""npllm.sampling by example: the seed tables, the documented edge cases, errors, and chi-square tests of the draw.

The Hypothesis laws live in test_sampling_laws.py.
"""

import dataclasses
import doctest
import math

import numpy as np
import pytest

from npllm import sampling as S
from npllm.errors import GenerationError

# ---------------------------------------------------------------------------------------------------------------
# Seed tables
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "logits, temperature, table",
    [
        ([11.0, 12.0, 13.0], 1.0, [0.0900, 0.2447, 0.6652]),
        ([0.01, 0.02, 0.03], 1.0, [0.3300, 0.3333, 0.3367]),
        ([2.0, 1.0, 0.5, 0.1], 0.5, [0.828, 0.112, 0.041, 0.019]),
        ([2.0, 1.0, 0.5, 0.1], 1.0, [0.575, 0.211, 0.128, 0.086]),
        ([2.0, 1.0, 0.5, 0.1], 2.0, [0.406, 0.246, 0.192, 0.157]),
    ],
)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_seed_tables(logits, temperature, table, dtype):
    half_unit = 0.5 * 10.0 ** -(len(str(table[0]).split(".")[1]))  # the tables are rounded to 3 or 4 places
    p = S.softmax(np.array(logits, dtype), temperature)
    assert p.dtype == dtype
    np.testing.assert_allclose(p, table, rtol=0, atol=half_unit + 1e-7)


def test_docstring_examples_run():
    result = doctest.testmod(S)
    assert result.attempted >= 3 and result.failed == 0


# ---------------------------------------------------------------------------------------------------------------
# Filters: the documented boundaries
# ---------------------------------------------------------------------------------------------------------------


def kept_ids(filtered):
    return np.flatnonzero(filtered > -np.inf).tolist()


def test_top_k_keeps_the_whole_tie_at_the_boundary():
    x = np.array([3.0, 1.0, 2.0, 2.0, 0.0])
    assert kept_ids(S.top_k(x, 1)) == [0]
    assert kept_ids(S.top_k(x, 2)) == [0, 2, 3]  # the 2nd largest value is shared: both copies survive
    assert kept_ids(S.top_k(x, 3)) == [0, 2, 3]
    assert kept_ids(S.top_k(x, 4)) == [0, 1, 2, 3]
    assert kept_ids(S.top_k(x, 0)) == [0, 1, 2, 3, 4]


def test_top_p_boundary():
    x = np.log([0.5, 0.3, 0.2])
    assert kept_ids(S.top_p(x, 0.45)) == [0]
    assert kept_ids(S.top_p(x, 0.75)) == [0, 1]  # 0.5 < 0.75 <= 0.8: the token that crosses p is kept
    assert kept_ids(S.top_p(x, 0.85)) == [0, 1, 2]
    assert kept_ids(S.top_p(np.zeros(4), 0.3)) == [0, 1, 2, 3]  # one tie group: kept whole


def test_top_p_is_not_idempotent():
    """The second pass sees the renormalised survivors [2/3, 1/3], whose first token alone reaches 0.65."""
    x = np.log([0.6, 0.3, 0.1])
    once = S.top_p(x, 0.65)
    assert kept_ids(once) == [0, 1]
    assert kept_ids(S.top_p(once, 0.65)) == [0]


def test_min_p_and_typical_p_examples():
    x = np.log([0.5, 0.3, 0.15, 0.05])
    assert kept_ids(S.min_p(x, 0.5)) == [0, 1]  # 0.3 >= 0.25 > 0.15
    assert kept_ids(S.min_p(x, 1.0)) == [0]
    # entropy 1.1568 nats; |−log p − H| = 0.464, 0.047, 0.740, 1.839: typical order 1, 0, 2, 3
    assert kept_ids(S.typical_p(x, 0.2)) == [1]  # the argmax is not the most typical token
    assert kept_ids(S.typical_p(x, 0.7)) == [0, 1]
    assert kept_ids(S.typical_p(x, 0.9)) == [0, 1, 2]


def test_pipeline_applies_top_k_before_top_p():
    """π = [0.4, 0.3, 0.2, 0.1], k = 2, p = 0.5: top-k first renormalises to [4/7, 3/7] and top-p keeps one token;
    top-p first would keep two (0.4 < 0.5 <= 0.7)."""
    x = np.log([0.4, 0.3, 0.2, 0.1])
    assert kept_ids(S.top_k(S.top_p(x, 0.5), 2)) == [0, 1]
    assert kept_ids(S.top_p(S.top_k(x, 2), 0.5)) == [0]
    final = S.explain_steps(x, S.SamplingParams(top_k=2, top_p=0.5))[-1][1]
    assert np.flatnonzero(final).tolist() == [0]
    draws = {S.sample(x, np.random.default_rng(s), top_k=2, top_p=0.5).token_ids for s in range(50)}
    assert draws == {0}


# ---------------------------------------------------------------------------------------------------------------
# Penalties
# ---------------------------------------------------------------------------------------------------------------


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    x = np.array([2.0, -2.0, 0.0, 5.0])
    out = S.repetition_penalty(x, [0, 1, 2, 2, 2], 2.0)
    np.testing.assert_array_equal(out, [1.0, -4.0, 0.0, 5.0])
    np.testing.assert_array_equal(S.repetition_penalty(x, [0, 1], 0.5), [4.0, -1.0, 0.0, 5.0])


def test_presence_and_frequency_penalties():
    x = np.zeros(4)
    out = S.presence_frequency_penalty(x, [1, 1, 2], presence=0.5, frequency=0.25)
    np.testing.assert_array_equal(out, [0.0, -1.0, -0.75, 0.0])


def test_no_repeat_ngram_examples():
    x = np.zeros(9)
    history = [5, 6, 7, 5, 6]
    assert np.flatnonzero(S.no_repeat_ngram(x, history, 3) == -np.inf).tolist() == [7]  # 5 6 7 again
    assert np.flatnonzero(S.no_repeat_ngram(x, history, 2) == -np.inf).tolist() == [7]  # 6 7 again
    assert np.flatnonzero(S.no_repeat_ngram(x, history, 1) == -np.inf).tolist() == [5, 6, 7]
    assert np.flatnonzero(S.no_repeat_ngram(x, history, 6) == -np.inf).tolist() == []
    np.testing.assert_array_equal(S.no_repeat_ngram(x, history, 0), x)


def test_logit_bias_bans_even_an_infinite_logit():
    x = np.array([np.inf, 1.0, 2.0])
    np.testing.assert_array_equal(S.logit_bias(x, {0: -np.inf, 1: 3.0}), [-np.inf, 4.0, 2.0])


def test_batched_histories_are_per_row():
    x = np.zeros((2, 4))
    out = S.repetition_penalty(x + 1.0, [[0], [3, 3]], 2.0)
    np.testing.assert_array_equal(out, [[0.5, 1, 1, 1], [1, 1, 1, 0.5]])


# ---------------------------------------------------------------------------------------------------------------
# Greedy, +inf, and what a step consumes
# ---------------------------------------------------------------------------------------------------------------


def test_greedy_breaks_ties_toward_the_lowest_id():
    x = np.array([1.0, 3.0, 0.0, 3.0])
    assert S.greedy(x) == 1
    assert S.sample(x, None, temperature=0.0).token_ids == 1
    got = S.sample(x, None, temperature=0.0, logprobs=3)
    assert got.top_ids.tolist() == [1, 3, 0]
    assert got.logprobs == pytest.approx(S.log_softmax(x)[1])


def test_greedy_reports_the_log_softmax_of_the_penalised_logits():
    x = np.array([2.0, 1.0, 0.5])
    got = S.sample(x, None, temperature=0.0, repetition_penalty=4.0, token_ids=[0])
    penalised = np.array([0.5, 1.0, 0.5])
    assert got.token_ids == 1
    assert got.logprobs == pytest.approx(S.log_softmax(penalised)[1], rel=1e-12)


def test_positive_infinity_shares_the_mass():
    x = np.array([1.0, np.inf, 0.0, np.inf])
    np.testing.assert_array_equal(S.softmax(x), [0.0, 0.5, 0.0, 0.5])
    np.testing.assert_array_equal(S.log_softmax(x), [-np.inf, -math.log(2), -np.inf, -math.log(2)])
    for filtered in (S.top_p(x, 0.3), S.min_p(x, 0.9), S.typical_p(x, 0.3), S.top_k(x, 1)):
        assert kept_ids(filtered) == [1, 3]
    assert S.greedy(x) == 1
    draws = {S.sample(x, np.random.default_rng(s), top_p=0.5).token_ids for s in range(40)}
    assert draws == {1, 3}
    assert S.sample(x, np.random.default_rng(0)).logprobs == pytest.approx(-math.log(2))


def test_a_sampled_step_consumes_one_uniform_and_a_greedy_step_none():
    x = np.linspace(-1, 1, 7)
    rng, twin = np.random.default_rng(3), np.random.default_rng(3)
    S.sample(x, rng, temperature=0.0)
    assert rng.random() == twin.random()
    S.sample(x, rng, top_k=3, top_p=0.9, min_p=0.1, typical_p=0.9)
    twin.random()
    assert rng.random() == twin.random()
    S.sample(np.tile(x, (4, 1)), rng)
    twin.random(4)
    assert rng.random() == twin.random()


def test_sample_with_returns_ids_and_sample_step_everything():
    x = np.linspace(-2, 2, 9)
    params = S.SamplingParams(temperature=0.7, top_k=5, logprobs=2, seed=11)
    token = S.sample_with(params, x, params.generator())
    step = S.sample_step(params, x, params.generator())
    assert isinstance(token, int) and token == step.token_ids
    assert isinstance(step.logprobs, float) and step.top_ids.shape == (2,) and step.top_logprobs.shape == (2,)
    batch = S.sample_step(params, np.tile(x, (3, 1)), params.generator())
    assert batch.token_ids.shape == (3,) and batch.token_ids.dtype == np.int64 and batch.top_ids.shape == (3, 2)


def test_top_alternatives_are_padded_past_the_survivors():
    x = np.log([0.5, 0.3, 0.2])
    got = S.sample(x, np.random.default_rng(0), top_k=2, logprobs=4)
    assert got.top_ids.tolist() == [0, 1, -1, -1]
    np.testing.assert_allclose(np.exp(got.top_logprobs[:2]), [0.625, 0.375])
    assert (got.top_logprobs[2:] == -np.inf).all()


def test_float32_logits_keep_their_dtype_through_the_filters():
    x = np.linspace(-3, 3, 50, dtype=np.float32)
    for f in (lambda v: S.top_k(v, 5), lambda v: S.top_p(v, 0.5), lambda v: S.min_p(v, 0.1),
              lambda v: S.typical_p(v, 0.5), lambda v: S.repetition_penalty(v, [1, 2], 1.2), S.log_softmax):
        assert f(x).dtype == np.float32
    assert 0 <= S.sample(x, np.random.default_rng(0), top_p=0.9).token_ids < 50


def test_explain_steps_names_every_active_stage_in_order():
    x = np.linspace(-2, 2, 12)
    params = S.SamplingParams(temperature=0.8, top_k=6, top_p=0.9, min_p=0.05, typical_p=0.95,
                              repetition_penalty=1.2, presence_penalty=0.1, frequency_penalty=0.1,
                              no_repeat_ngram=2, logit_bias={3: -1.0})
    steps = S.explain_steps(x, params, [1, 2, 1])
    assert [name for name, _ in steps] == [
        "logits", "repetition_penalty", "presence_frequency_penalty", "logit_bias", "no_repeat_ngram",
        "temperature", "top_k", "top_p", "min_p", "typical_p",
    ]
    for _, p in steps:
        assert p.shape == (12,) and p.sum() == pytest.approx(1.0)
    assert [name for name, _ in S.explain_steps(x, S.SamplingParams())] == ["logits"]
    assert [name for name, _ in S.explain_steps(x, S.SamplingParams(temperature=0))] == ["logits", "greedy"]


# ---------------------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------------------

FUNCTIONS = {
    "softmax": lambda x: S.softmax(x),
    "log_softmax": lambda x: S.log_softmax(x),
    "top_k": lambda x: S.top_k(x, 2),
    "top_p": lambda x: S.top_p(x, 0.5),
    "min_p": lambda x: S.min_p(x, 0.1),
    "typical_p": lambda x: S.typical_p(x, 0.5),
    "repetition_penalty": lambda x: S.repetition_penalty(x, [0], 1.1),
    "presence_frequency_penalty": lambda x: S.presence_frequency_penalty(x, [0], 0.1, 0.1),
    "no_repeat_ngram": lambda x: S.no_repeat_ngram(x, [0], 1),
    "logit_bias": lambda x: S.logit_bias(x, {0: 1.0}),
    "greedy": S.greedy,
    "sample": lambda x: S.sample(x, np.random.default_rng(0)),
    "explain_steps": lambda x: S.explain_steps(x, S.SamplingParams()),
}


@pytest.mark.parametrize("name", FUNCTIONS)
def test_nan_logits_raise(name):
    with pytest.raises(GenerationError, match="NaN"):
        FUNCTIONS[name](np.array([0.0, np.nan, 1.0]))


@pytest.mark.parametrize("bad", [np.zeros((2, 2, 2)), np.zeros(0), np.zeros((0, 3)), np.array(["a", "b"]), 1.0])
def test_bad_logit_shapes_and_types_raise(bad):
    with pytest.raises(GenerationError, match="logits"):
        S.softmax(bad)


def test_a_row_with_every_token_masked_raises():
    with pytest.raises(GenerationError, match="every token is -inf"):
        S.softmax(np.array([[0.0, 1.0], [-np.inf, -np.inf]]))
    with pytest.raises(GenerationError, match="row 1"):
        S.sample(np.array([[0.0, 1.0], [-np.inf, -np.inf]]), np.random.default_rng(0))
    with pytest.raises(GenerationError, match="masked every token"):
        S.sample(np.zeros(2), np.random.default_rng(0), no_repeat_ngram=1, token_ids=[0, 1])
    with pytest.raises(GenerationError, match="masked every token"):
        S.sample(np.zeros(2), None, temperature=0, logit_bias={0: -np.inf, 1: -np.inf})


@pytest.mark.parametrize(
    "token_ids, message",
    [([0, 9], "outside the vocabulary"), ([-1], "outside the vocabulary"), ([0.5], "integer"), ([[0, 1]], "flat")],
)
def test_bad_token_ids_raise(token_ids, message):
    with pytest.raises(GenerationError, match=message):
        S.repetition_penalty(np.zeros(4), token_ids, 1.2)


def test_batched_token_ids_need_one_sequence_per_row():
    with pytest.raises(GenerationError, match="one sequence per logits row"):
        S.sample(np.zeros((3, 4)), np.random.default_rng(0), repetition_penalty=1.2, token_ids=[[0], [1]])


@pytest.mark.parametrize("bias, message", [({7: 1.0}, "outside the vocabulary"), ({0: np.inf}, r"\+inf"),
                                           ({0: np.nan}, "real number"), ({-1: 1.0}, "token id"), ([1.0], "mapping")])
def test_bad_logit_bias_raises(bias, message):
    with pytest.raises(GenerationError, match=message):
        S.logit_bias(np.zeros(4), bias)


@pytest.mark.parametrize("rng", [None, 42, [np.random.default_rng(0)] * 2, np.random.RandomState(0)])
def test_bad_generators_raise(rng):
    with pytest.raises(GenerationError, match="rng"):
        S.sample(np.zeros((3, 4)), rng)


def test_one_generator_per_row_only_for_batches():
    with pytest.raises(GenerationError, match="rng"):
        S.sample(np.zeros(4), [np.random.default_rng(0)])


# ---------------------------------------------------------------------------------------------------------------
# SamplingParams
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1), ("temperature", math.inf), ("temperature", math.nan), ("temperature", "hot"),
        ("top_k", -1), ("top_k", 2.5), ("top_k", True),
        ("top_p", 0.0), ("top_p", 1.5), ("top_p", math.nan),
        ("min_p", -0.1), ("min_p", 1.01),
        ("typical_p", 0.0), ("typical_p", 2.0),
        ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", math.inf),
        ("presence_penalty", math.inf), ("frequency_penalty", math.nan),
        ("no_repeat_ngram", -2), ("logprobs", -1), ("seed", -5), ("seed", 1.5),
        ("logit_bias", {1: math.inf}), ("logit_bias", [(1, 2.0)]), ("stop", ("",)), ("stop", (3,)),
    ],
)
def test_sampling_params_reject_bad_values_naming_the_field(field, value):
    with pytest.raises(GenerationError, match=field) as err:
        S.SamplingParams(**{field: value})
    assert isinstance(err.value, ValueError)


def test_sampling_params_are_frozen_normalised_and_hashable():
    params = S.SamplingParams(temperature=1, top_k=np.int64(5), logit_bias={3: 1}, stop="\n\n", seed=0)
    assert params.temperature == 1.0 and isinstance(params.temperature, float) and params.top_k == 5
    assert params.stop == ("\n\n",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.top_k = 3
    with pytest.raises(TypeError):
        params.logit_bias[4] = 1.0
    assert hash(params) == hash(S.SamplingParams(temperature=1, top_k=5, logit_bias={3: 1.0}, stop="\n\n", seed=0))
    assert params == S.SamplingParams(temperature=1.0, top_k=5, logit_bias={3: 1.0}, stop=("\n\n",), seed=0)
    assert S.SamplingParams(logit_bias={}).logit_bias is None
    assert S.SamplingParams(temperature=0).is_greedy and not params.is_greedy
    assert params.generator().random() == np.random.default_rng(0).random()


def test_sample_validates_its_keywords_like_sampling_params():
    with pytest.raises(GenerationError, match="top_p"):
        S.sample(np.zeros(3), np.random.default_rng(0), top_p=0.0)
    with pytest.raises(GenerationError, match="top_k"):
        S.top_k(np.zeros(3), -1)
    with pytest.raises(GenerationError, match="min_p"):
        S.min_p(np.zeros(3), 2.0)
    with pytest.raises(GenerationError, match="temperature"):
        S.softmax(np.zeros(3), -1.0)


# ---------------------------------------------------------------------------------------------------------------
# Chi-square goodness of fit of the draw
# ---------------------------------------------------------------------------------------------------------------

ALPHA = 0.001  # significance level of every goodness-of-fit test below
Z_ALPHA = 3.090232  # the standard normal quantile 1 - ALPHA


def chi_square_critical(df: int) -> float:
    """Upper ALPHA quantile of χ²(df) by the Wilson–Hilferty cube approximation.

    It errs high, so the test is a little more lenient than ALPHA states: by 1.8% at df = 3 (16.55 where the table
    has 16.27), 0.7% at df = 9 and under 0.2% from df = 30.
    """
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + Z_ALPHA * math.sqrt(h)) ** 3


def chi_square(counts: np.ndarray, q: np.ndarray) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom of observed counts against probabilities q.

    Tokens whose expected count is below 5 are pooled into one bin (with the smallest others until it reaches 5).
    """
    n = counts.sum()
    expected = n * q
    order = np.argsort(expected)
    bins_o, bins_e, pool_o, pool_e = [], [], 0.0, 0.0
    for t in order:
        if expected[t] == 0:
            continue
        if pool_e < 5.0:
            pool_o, pool_e = pool_o + counts[t], pool_e + expected[t]
        else:
            bins_o.append(counts[t])
            bins_e.append(expected[t])
    bins_o.append(pool_o)
    bins_e.append(pool_e)
    o, e = np.array(bins_o), np.array(bins_e)
    return float(((o - e) ** 2 / e).sum()), len(o) - 1


def draw_counts(x, params, n, token_ids=None, chunk=4000, seed=20240601):
    """Counts of n draws, each from the same logits row; drawn as [chunk, V] batches from one generator."""
    rng = np.random.default_rng(seed)
    counts = np.zeros(x.shape[-1], np.int64)
    for start in range(0, n, chunk):
        rows = min(chunk, n - start)
        ids = None if token_ids is None else [token_ids] * rows
        counts += np.bincount(S.sample_with(params, np.tile(x, (rows, 1)), rng, ids), minlength=x.shape[-1])
    return counts


LOGITS = np.array([2.0, 1.5, 1.4, 0.3, 0.2, -0.5, -1.0, -3.0, 0.9, 1.1])
CASES = {
    "filters": (LOGITS, S.SamplingParams(temperature=0.8, top_k=7, top_p=0.9, min_p=0.05), None),
    "penalties+typical": (
        LOGITS,
        S.SamplingParams(temperature=1.2, repetition_penalty=1.5, presence_penalty=0.2, frequency_penalty=0.1,
                         typical_p=0.8, logit_bias={7: 2.5}),
        [0, 0, 2, 8],
    ),
    "float32": (LOGITS.astype(np.float32), S.SamplingParams(top_p=0.95, min_p=0.1), None),
    "vocabulary 700, no filter": (np.random.default_rng(5).standard_normal(700) * 1.5,
                                  S.SamplingParams(temperature=1.3), None),
    "vocabulary 3000, flat top-p": (np.random.default_rng(6).standard_normal(3000) * 0.5,
                                    S.SamplingParams(top_p=0.95), None),
}


@pytest.mark.parametrize("case", CASES)
def test_draw_frequencies_match_the_filtered_distribution(case):
    x, params, history = CASES[case]
    q = S.explain_steps(x, params, history)[-1][1]
    counts = draw_counts(x, params, 20000, history)
    assert counts[q == 0].sum() == 0  # nothing outside the support, ever
    stat, df = chi_square(counts, q)
    assert stat < chi_square_critical(df), (stat, df)


def test_chi_square_rejects_the_unfiltered_distribution():
    """The same draws against the distribution before the filters: the test must be able to fail."""
    x, params, _ = CASES["filters"]
    counts = draw_counts(x, params, 20000)
    stat, df = chi_square(counts, S.softmax(x, params.temperature))
    assert stat > chi_square_critical(df)


def test_chi_square_critical_values_against_the_table():
    # χ²(df) upper 0.001 quantiles from standard tables
    for df, table, rel in [(3, 16.266, 0.02), (9, 27.877, 0.007), (30, 59.703, 0.002), (100, 149.449, 0.001)]:
        assert table <= chi_square_critical(df) <= table * (1 + rel)
