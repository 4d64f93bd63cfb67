"""The laws of npllm.sampling, stated and checked with Hypothesis.

References here are written independently of the module: probabilities from math.fsum, sorted-order loops for
the mass filters, plain Python loops for the penalties. Mass comparisons allow EPS for the different summation
order; everything that involves no arithmetic (which tokens survive top-k, penalties on unlisted tokens, rows of a
batch) is compared exactly. The profile (tests/conftest.py) runs each law on 200 derandomised examples in CI.
"""

import math

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from npllm import sampling as S
from npllm.errors import GenerationError

EPS = 1e-9  # slack for mass comparisons between differently ordered float64 sums


# ---------------------------------------------------------------------------------------------------------------
# Strategies and references
# ---------------------------------------------------------------------------------------------------------------


@st.composite
def logit_rows(draw, max_v=24, bound=50.0, dtype=np.float64, masked=True, unique=False):
    """A [V] logit vector with bounded finite values, some entries possibly -inf (never all)."""
    V = draw(st.integers(1, max_v))
    width = 64 if dtype == np.float64 else 32
    x = draw(hnp.arrays(dtype, V, elements=st.floats(-bound, bound, width=width), unique=unique))
    if masked and V > 1:
        mask = draw(hnp.arrays(np.bool_, V))
        if not mask.all():
            x[mask] = -np.inf
    return x


@st.composite
def logit_batches(draw, max_b=4, max_v=16, bound=50.0, dtype=np.float64):
    B = draw(st.integers(1, max_b))
    V = draw(st.integers(1, max_v))
    width = 64 if dtype == np.float64 else 32
    x = draw(hnp.arrays(dtype, (B, V), elements=st.floats(-bound, bound, width=width)))
    if V > 1:
        mask = draw(hnp.arrays(np.bool_, (B, V)))
        mask[:, 0] = False  # every row keeps one finite logit
        x[mask] = -np.inf
    return x


def histories(V, max_len=12):
    return st.lists(st.integers(0, V - 1), max_size=max_len)


def ref_softmax(x):
    """Probabilities of one row with math.fsum; -inf entries get 0."""
    m = max(x)
    e = [math.exp(v - m) if v != -math.inf else 0.0 for v in x]
    total = math.fsum(e)
    return np.array([v / total for v in e])


def mass(p, keep):
    return math.fsum(p[keep])


def kept(filtered):
    return np.isfinite(filtered) | (filtered == np.inf)


probs_p = st.floats(0.01, 1.0)
temperatures = st.floats(0.05, 20.0)


# ---------------------------------------------------------------------------------------------------------------
# softmax and temperature
# ---------------------------------------------------------------------------------------------------------------


@given(logit_batches())
def test_softmax_sums_to_one_and_matches_reference(x):
    p = S.softmax(x)
    assert p.shape == x.shape and (p >= 0).all()
    np.testing.assert_allclose(p.sum(axis=1), 1.0, rtol=0, atol=1e-12)
    for row, prow in zip(x, p):
        np.testing.assert_allclose(prow, ref_softmax(row), rtol=1e-12, atol=1e-300)


@given(logit_rows(dtype=np.float32))
def test_softmax_float32_sums_to_one(x):
    p = S.softmax(x)
    assert p.dtype == np.float32
    assert abs(float(p.sum(dtype=np.float64)) - 1.0) < 1e-5
    np.testing.assert_allclose(p, ref_softmax(x.astype(np.float64)), rtol=1e-5, atol=1e-7)


@given(logit_rows(), st.floats(-100.0, 100.0))
def test_softmax_invariant_to_adding_a_constant(x, c):
    np.testing.assert_allclose(S.softmax(x + c), S.softmax(x), rtol=1e-10, atol=1e-14)


@given(logit_rows(masked=False), st.floats(1e-3, 1.0))
def test_temperature_to_zero_concentrates_on_the_argmax(x, t):
    assume(len(x) > 1)
    order = np.sort(x)[::-1]
    gap = order[0] - order[1]
    assume(gap > 0)
    top = np.argmax(x)
    bound = 1.0 - (len(x) - 1) * math.exp(-gap / t)  # every other token has mass <= exp(-gap / T) · top
    assert S.softmax(x, t)[top] >= bound - 1e-12
    point = np.zeros(len(x))
    point[top] = 1.0
    np.testing.assert_array_equal(S.softmax(x, 0.0), point)
    np.testing.assert_array_equal(S.softmax(x, gap / 800.0), point)  # exp(-800) underflows: already the limit


@given(logit_rows(masked=False))
def test_temperature_zero_shares_the_mass_among_tied_maxima(x):
    top = x == x.max()
    np.testing.assert_allclose(S.softmax(x, 0.0), top / top.sum(), rtol=1e-15)


@given(logit_rows())
def test_temperature_to_infinity_tends_to_uniform(x):
    finite = np.isfinite(x)
    p = S.softmax(x, 1e9)
    np.testing.assert_allclose(p[finite], 1.0 / finite.sum(), rtol=1e-6)
    assert (p[~finite] == 0).all()


@given(logit_rows(), temperatures, temperatures)
def test_lower_temperature_never_lowers_the_top_probability(x, t1, t2):
    low, high = sorted((t1, t2))
    assert S.softmax(x, low).max() >= S.softmax(x, high).max() - 1e-12


@given(logit_batches(), temperatures)
def test_log_softmax_is_the_log_of_softmax(x, t):
    lp = S.log_softmax(x, t)
    p = S.softmax(x, t)
    np.testing.assert_allclose(np.exp(lp), p, rtol=1e-12, atol=1e-300)
    np.testing.assert_array_equal(lp == -np.inf, x == -np.inf)  # finite where softmax merely underflows
    for row in lp:
        assert math.fsum(np.exp(row)) == pytest.approx(1.0, abs=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# top_k
# ---------------------------------------------------------------------------------------------------------------


@given(logit_rows(masked=False, unique=True), st.data())
def test_top_k_keeps_exactly_k_without_ties(x, data):
    k = data.draw(st.integers(1, len(x)))
    out = S.top_k(x, k)
    assert kept(out).sum() == k
    assert set(np.flatnonzero(kept(out))) == set(np.argsort(-x)[:k])


@given(logit_rows(bound=3.0), st.data())
def test_top_k_keeps_every_tie_with_the_kth_value(x, data):
    k = data.draw(st.integers(1, len(x)))
    kth = np.sort(x)[::-1][k - 1]
    out = S.top_k(x, k)
    np.testing.assert_array_equal(kept(out), (x >= kth) & (x > -np.inf))  # -inf entries stay -inf
    assert kept(out).sum() >= min(k, np.isfinite(x).sum())
    assert kept(out)[np.argmax(x)]
    np.testing.assert_array_equal(out[kept(out)], x[kept(out)])  # survivors unchanged


@given(logit_rows(bound=3.0), st.data())
def test_top_k_is_monotone_and_idempotent(x, data):
    k1 = data.draw(st.integers(0, len(x) + 2))
    k2 = data.draw(st.integers(0, len(x) + 2))
    small, large = sorted((k1, k2))
    if small == 0:  # 0 disables the filter: it is the largest set
        small, large = large, small
    a, b = kept(S.top_k(x, small)), kept(S.top_k(x, large))
    assert (a <= b).all()
    np.testing.assert_array_equal(S.top_k(S.top_k(x, k1), k1), S.top_k(x, k1))
    if k1 == 0 or k1 >= len(x):
        np.testing.assert_array_equal(S.top_k(x, k1), x)


# ---------------------------------------------------------------------------------------------------------------
# top_p
# ---------------------------------------------------------------------------------------------------------------


def check_nucleus(x, p, out):
    """The top-p law: kept = {π >= τ}, mass{π >= τ} >= p > mass{π > τ}, most probable kept."""
    prob = ref_softmax(x)
    keep = kept(out)
    assert keep[np.argmax(x)]
    if (~keep & np.isfinite(x)).any():
        assert x[keep].min() > x[~keep & np.isfinite(x)].max()  # a prefix of the sorted order, ties whole
    tau = prob[keep].min()
    assert mass(prob, keep) >= p - EPS
    assert mass(prob, prob > tau) < p + EPS  # dropping the least probable kept token(s) falls below p
    np.testing.assert_array_equal(out[keep], x[keep])


@given(logit_rows(), probs_p)
def test_top_p_keeps_the_minimal_prefix_reaching_p(x, p):
    check_nucleus(x, p, S.top_p(x, p))


@given(logit_rows(masked=False, unique=True), probs_p)
def test_top_p_without_ties_dropping_the_last_kept_token_falls_below_p(x, p):
    assume(len(x) == 1 or np.diff(np.sort(x)).min() > 1e-6)  # distinct probabilities, not just distinct logits
    prob = ref_softmax(x)
    keep = kept(S.top_p(x, p))
    last = np.flatnonzero(keep)[np.argmin(prob[keep])]
    assert mass(prob, keep) >= p - EPS
    assert mass(prob, keep) - prob[last] < p + EPS


@given(st.integers(0, 2**32 - 1), st.sampled_from([0.3, 1.0, 2.0, 6.0]), probs_p)
def test_top_p_on_a_large_vocabulary_both_routes(seed, scale, p):
    """V = 2500 > the 1024 candidates sorted first: peaked rows take the partition route, flat ones the full
    sort; both must obey the same law."""
    x = np.random.default_rng(seed).standard_normal(2500) * scale
    check_nucleus(x, p, S.top_p(x, p))


@given(logit_rows(), probs_p, probs_p)
def test_top_p_is_monotone_in_p(x, p1, p2):
    low, high = sorted((p1, p2))
    assert (kept(S.top_p(x, low)) <= kept(S.top_p(x, high))).all()
    np.testing.assert_array_equal(S.top_p(x, 1.0), x)


@given(logit_rows(), probs_p)
def test_top_p_applied_twice_keeps_a_subset(x, p):
    """Not idempotent: the second pass renormalises over the survivors (see test_sampling.py for an example)."""
    once = S.top_p(x, p)
    twice = S.top_p(once, p)
    assert (kept(twice) <= kept(once)).all()
    assert kept(twice)[np.argmax(x)]


# ---------------------------------------------------------------------------------------------------------------
# min_p and typical_p
# ---------------------------------------------------------------------------------------------------------------


@given(logit_rows(), st.floats(0.0, 1.0))
def test_min_p_keeps_tokens_above_p_times_the_top_probability(x, p):
    out = S.min_p(x, p)
    keep = kept(out)
    prob = ref_softmax(x)
    assert keep[np.argmax(x)]
    assert (prob[keep] >= p * prob.max() * (1 - 1e-12)).all()
    assert (prob[~keep] <= p * prob.max() * (1 + 1e-12)).all()
    np.testing.assert_array_equal(S.min_p(out, p), out)  # idempotent: the maximum and the ratios survive


@given(logit_rows(), st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_min_p_is_monotone(x, p1, p2):
    low, high = sorted((p1, p2))
    assert (kept(S.min_p(x, high)) <= kept(S.min_p(x, low))).all()
    np.testing.assert_array_equal(S.min_p(x, 0.0), x)


def typical_scores(x):
    prob = ref_softmax(x)
    with np.errstate(divide="ignore"):
        surprise = -np.log(prob)
    entropy = math.fsum(q * s for q, s in zip(prob, surprise) if q > 0)
    return prob, np.abs(surprise - entropy)


@given(logit_rows(), probs_p)
def test_typical_p_keeps_the_most_typical_tokens_until_p(x, p):
    out = S.typical_p(x, p)
    keep = kept(out)
    prob, gap = typical_scores(x)
    assert keep.any()
    delta = gap[keep].max()
    live = prob > 0
    assert mass(prob, keep) >= p - EPS
    assert mass(prob, gap < delta - 1e-9) < p + EPS  # without the least typical kept tokens: below p
    if (~keep & live).any():
        assert delta <= gap[~keep & live].min() + 1e-9  # closed under "more typical"
    np.testing.assert_array_equal(out[keep], x[keep])


@given(logit_rows(), probs_p, probs_p)
def test_typical_p_is_monotone_in_p(x, p1, p2):
    low, high = sorted((p1, p2))
    assert (kept(S.typical_p(x, low)) <= kept(S.typical_p(x, high))).all()
    np.testing.assert_array_equal(S.typical_p(x, 1.0), x)


# ---------------------------------------------------------------------------------------------------------------
# Penalties
# ---------------------------------------------------------------------------------------------------------------


@st.composite
def row_and_history(draw, max_v=20):
    x = draw(logit_rows(max_v=max_v, masked=False))
    return x, draw(histories(len(x)))


@given(row_and_history(), st.floats(0.05, 20.0))
def test_repetition_penalty_is_the_ctrl_rule_once_per_token(case, penalty):
    x, ids = case
    out = S.repetition_penalty(x, ids, penalty)
    expected = x.copy()
    for t in set(ids):
        expected[t] = x[t] / penalty if x[t] > 0 else x[t] * penalty
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(S.repetition_penalty(x, sorted(set(ids)), penalty), out)  # counts don't matter
    np.testing.assert_array_equal(S.repetition_penalty(x, ids, 1.0), x)


@given(row_and_history(), st.floats(1.0, 20.0))
def test_repetition_penalty_never_favours_repeats(case, penalty):
    x, ids = case
    listed = np.zeros(len(x), bool)
    listed[ids] = True
    out = S.repetition_penalty(x, ids, penalty)
    before, after = ref_softmax(x), ref_softmax(out)
    assert (out[listed] <= x[listed]).all()
    assert (after[~listed] >= before[~listed] * (1 - 1e-12)).all()  # unlisted tokens only gain
    assert mass(after, listed) <= mass(before, listed) + EPS  # the penalised tokens together only lose
    if len(set(ids)) == 1:
        assert after[ids[0]] <= before[ids[0]] * (1 + 1e-12)


@given(row_and_history(), st.floats(-3, 3), st.floats(-3, 3))
def test_presence_frequency_penalty_subtracts_presence_and_counts(case, presence, frequency):
    x, ids = case
    out = S.presence_frequency_penalty(x, ids, presence, frequency)
    expected = x.copy()
    for t in set(ids):
        expected[t] = x[t] - (presence + frequency * ids.count(t))
    np.testing.assert_allclose(out, expected, rtol=1e-14, atol=1e-12)
    untouched = np.ones(len(x), bool)
    untouched[ids] = False
    np.testing.assert_array_equal(out[untouched], x[untouched])
    np.testing.assert_array_equal(S.presence_frequency_penalty(x, ids, 0.0, 0.0), x)
    if presence >= 0 and frequency >= 0:
        assert (out <= x).all()


@st.composite
def ngram_case(draw):
    V = draw(st.integers(1, 5))  # a small vocabulary makes repeats likely
    x = draw(hnp.arrays(np.float64, V, elements=st.floats(-5, 5)))
    ids = draw(st.lists(st.integers(0, V - 1), max_size=14))
    return x, ids, draw(st.integers(0, 4))


@given(ngram_case())
def test_no_repeat_ngram_bans_exactly_the_repeating_continuations(case):
    x, ids, n = case
    out = S.no_repeat_ngram(x, ids, n)
    seen = {tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)} if n else set()
    for t in range(len(x)):
        repeats = n > 0 and tuple((ids + [t])[-n:]) in seen  # the n-gram that appending t would end with
        assert (out[t] == -np.inf) == repeats, (t, ids, n)
        if not repeats:
            assert out[t] == x[t]


@given(logit_rows(max_v=10, masked=False), st.data())
def test_logit_bias_adds_to_listed_tokens_only(x, data):
    V = len(x)
    bias = data.draw(st.dictionaries(st.integers(0, V - 1), st.floats(-10, 10) | st.just(-np.inf), max_size=V))
    out = S.logit_bias(x, bias)
    for t in range(V):
        assert out[t] == (x[t] + bias[t] if t in bias else x[t])


# ---------------------------------------------------------------------------------------------------------------
# Laws of every function: no mutation, batch rows are independent calls
# ---------------------------------------------------------------------------------------------------------------


def apply_all(x, ids):
    """Every public array function, on logits x with histories ids (one per row for [B, V])."""
    return {
        "softmax": S.softmax(x, 0.7),
        "log_softmax": S.log_softmax(x, 1.3),
        "top_k": S.top_k(x, 3),
        "top_p": S.top_p(x, 0.6),
        "min_p": S.min_p(x, 0.2),
        "typical_p": S.typical_p(x, 0.5),
        "repetition_penalty": S.repetition_penalty(x, ids, 1.5),
        "presence_frequency_penalty": S.presence_frequency_penalty(x, ids, 0.5, 0.25),
        "no_repeat_ngram": S.no_repeat_ngram(x, ids, 2),
        "logit_bias": S.logit_bias(x, {0: 1.5, x.shape[-1] - 1: -np.inf}),
        "greedy": S.greedy(x),
    }


@st.composite
def batch_and_histories(draw):
    x = draw(logit_batches())
    B, V = x.shape
    return x, [draw(histories(V, 8)) for _ in range(B)]


@given(batch_and_histories())
def test_no_function_mutates_its_inputs(case):
    x, ids = case
    x_before, ids_before = x.copy(), [list(r) for r in ids]
    x.setflags(write=False)  # any in-place write would raise
    apply_all(x, ids)
    S.sample(x, [np.random.default_rng(0) for _ in x], top_k=3, top_p=0.8, repetition_penalty=1.3, token_ids=ids)
    np.testing.assert_array_equal(x, x_before)
    assert ids == ids_before


@given(batch_and_histories())
def test_a_batch_gives_the_rows_of_separate_calls(case):
    x, ids = case
    batched = apply_all(x, ids)
    for b in range(x.shape[0]):
        single = apply_all(x[b], ids[b])
        for name, value in batched.items():
            np.testing.assert_array_equal(np.asarray(value)[b], single[name], err_msg=name)


# ---------------------------------------------------------------------------------------------------------------
# The pipeline and the draw
# ---------------------------------------------------------------------------------------------------------------


@st.composite
def params(draw):
    return S.SamplingParams(
        temperature=draw(st.sampled_from([0.0, 0.3, 1.0, 2.5])),
        top_k=draw(st.integers(0, 6)),
        top_p=draw(st.sampled_from([1.0, 0.95, 0.6, 0.2])),
        min_p=draw(st.sampled_from([0.0, 0.05, 0.5])),
        typical_p=draw(st.sampled_from([1.0, 1.0, 0.7])),
        repetition_penalty=draw(st.sampled_from([1.0, 1.3, 0.8])),
        presence_penalty=draw(st.sampled_from([0.0, 0.5])),
        frequency_penalty=draw(st.sampled_from([0.0, 0.3])),
        no_repeat_ngram=draw(st.sampled_from([0, 0, 2])),
        logprobs=draw(st.integers(0, 4)),
    )


@st.composite
def pipeline_case(draw):
    x = draw(logit_rows(max_v=20, bound=10.0))
    return x, draw(histories(len(x), 10)), draw(params()), draw(st.integers(0, 2**32 - 1))


def final_distribution(x, p, ids):
    """The distribution sample_step draws from, composed from the public functions in the documented order."""
    z = S.repetition_penalty(x, ids, p.repetition_penalty)
    z = S.presence_frequency_penalty(z, ids, p.presence_penalty, p.frequency_penalty)
    z = S.no_repeat_ngram(z, ids, p.no_repeat_ngram)
    if p.temperature == 0 or np.isneginf(z).all():
        return z, None
    s = (z - z.max()) / p.temperature  # the documented temperature stage
    s = S.top_k(s, p.top_k)
    s = S.top_p(s, p.top_p)
    s = S.min_p(s, p.min_p)
    s = S.typical_p(s, p.typical_p)
    return z, S.softmax(s)


@given(pipeline_case())
def test_sample_draws_from_the_documented_pipeline(case):
    x, ids, p, seed = case
    z, q = final_distribution(x, p, ids)
    if np.isneginf(z).all():  # no_repeat_ngram banned everything: an error, never a silent draw
        with pytest.raises(GenerationError, match="masked every token"):
            S.sample_step(p, x, np.random.default_rng(seed), ids)
        return
    got = S.sample_step(p, x, np.random.default_rng(seed), ids)
    steps = S.explain_steps(x, p, ids)
    if q is None:  # greedy: argmax of the penalised logits, lowest id on ties, log-softmax at T = 1
        assert got.token_ids == int(np.flatnonzero(z == z.max())[0])
        assert got.logprobs == pytest.approx(math.log(ref_softmax(z)[got.token_ids]), rel=1e-9, abs=1e-12)
        assert steps[-1][0] == "greedy" and steps[-1][1][got.token_ids] == 1.0
        return
    assert q[got.token_ids] > 0
    assert got.logprobs == pytest.approx(math.log(q[got.token_ids]), rel=1e-9, abs=1e-9)
    np.testing.assert_allclose(steps[-1][1], q, rtol=1e-9, atol=1e-15)
    if p.typical_p == 1.0:  # every other filter keeps the argmax of the penalised logits
        assert q[np.argmax(z)] > 0
    # top-N: the N most probable of q, most probable first, ties to the lower id, -1 / -inf past the support
    order = sorted(np.flatnonzero(q > 0), key=lambda t: (-q[t], t))[: p.logprobs]
    assert got.top_ids[: len(order)].tolist() == order
    assert (got.top_ids[len(order) :] == -1).all() and (got.top_logprobs[len(order) :] == -np.inf).all()
    np.testing.assert_allclose(np.exp(got.top_logprobs[: len(order)]), q[order], rtol=1e-9)


@given(logit_rows(max_v=30, bound=10.0), st.integers(0, 2**32 - 1), st.sampled_from([0.5, 1.0, 3.0]))
def test_the_draw_is_the_inverse_cdf_over_ascending_ids(x, seed, t):
    """With u the generator's next uniform, the chosen token t has cdf(t - 1) <= u < cdf(t)."""
    q = S.softmax(x, t)
    u = np.random.default_rng(seed).random()
    token = S.sample(x, np.random.default_rng(seed), temperature=t).token_ids
    cdf = np.cumsum(q)
    below = cdf[token - 1] if token else 0.0
    assert below - 1e-9 <= u < cdf[token] + 1e-9
    assert q[token] > 0


@given(logit_batches(max_b=5), st.integers(0, 2**32 - 1), params())
def test_one_generator_serves_the_rows_in_order(x, seed, p):
    batched = S.sample_step(p, x, np.random.default_rng(seed))
    rng = np.random.default_rng(seed)
    for b in range(x.shape[0]):
        single = S.sample_step(p, x[b], rng)
        assert batched.token_ids[b] == single.token_ids
        assert batched.logprobs[b] == pytest.approx(single.logprobs, rel=1e-12, abs=1e-12)
        np.testing.assert_array_equal(batched.top_ids[b], single.top_ids)


@given(logit_batches(max_b=5), st.lists(st.integers(0, 2**32 - 1), min_size=5, max_size=5), params(), st.data())
def test_per_row_generators_make_rows_independent_of_their_neighbours(x, seeds, p, data):
    B, V = x.shape
    rngs = lambda: [np.random.default_rng(s) for s in seeds[:B]]  # noqa: E731
    batched = S.sample_with(p, x, rngs())
    for b in range(B):
        assert batched[b] == S.sample_with(p, x[b], np.random.default_rng(seeds[b]))
    other = x.copy()
    other[0] = data.draw(hnp.arrays(np.float64, V, elements=st.floats(-50, 50)))
    changed = S.sample_with(p, other, rngs())
    np.testing.assert_array_equal(changed[1:], batched[1:])


@given(logit_rows(), st.integers(0, 2**32 - 1), params())
def test_the_same_seed_gives_the_same_draws(x, seed, p):
    a = [S.sample_with(p, x, rng) for rng in [np.random.default_rng(seed)] for _ in range(5)]
    b = [S.sample_with(p, x, rng) for rng in [np.random.default_rng(seed)] for _ in range(5)]
    assert a == b


@given(logit_rows(max_v=12, bound=8.0), st.integers(1, 5), st.sampled_from([0.3, 0.7, 0.95]))
def test_top_k_then_top_p_keeps_no_more_than_the_reverse_order(x, k, p):
    """The pipeline's order renormalises over the top-k set before the nucleus, so it cuts no later than top-p
    followed by top-k (which is the intersection of the two prefixes)."""
    k_then_p = kept(S.top_p(S.top_k(x, k), p))
    p_then_k = kept(S.top_k(S.top_p(x, p), k))
    assert (k_then_p <= p_then_k).all()
    q = S.explain_steps(x, S.SamplingParams(top_k=k, top_p=p))[-1][1]
    s = x - x.max()  # the temperature stage at T = 1 (subtracting may merge nearly equal logits into a tie)
    np.testing.assert_array_equal(q > 0, kept(S.top_p(S.top_k(s, k), p)) & (ref_softmax(s) > 0))


@given(st.integers(0, 2**32 - 1), st.integers(1, 120), st.sampled_from([None, 1, 0]))
def test_top_k_first_cut_on_a_large_vocabulary(seed, k, decimals):
    """V = 2000 >= 4k: the pipeline gathers top-k's survivors above a floor read off block maxima. Its candidates
    must be exactly top_k's survivors, ties included (rounding the logits makes ties common)."""
    x = np.random.default_rng(seed).standard_normal(2000) * 3
    if decimals is not None:
        x = np.round(x, decimals)
    survivors = np.flatnonzero(kept(S.top_k(x, k)))
    got = S.sample_step(S.SamplingParams(top_k=k, logprobs=len(survivors) + 1), x, np.random.default_rng(seed))
    assert sorted(got.top_ids[:-1].tolist()) == survivors.tolist()
    assert got.top_ids[-1] == -1
    assert got.token_ids in survivors
