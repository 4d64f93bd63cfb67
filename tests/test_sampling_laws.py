"""The laws of npllm.sampling, stated and checked with Hypothesis.

The laws of each filter kind (temperature, top-k, top-p, min-p, typical-p, the penalties, no-repeat-n-gram) live
in npllm.testing, the kit anyone can point at their own sampler; test_the_kit_laws_hold runs them on npllm's
functions with npllm's own tie rule and tighter slack. This file keeps what is specific to npllm: softmax itself,
T = 0 and T -> infinity, the exact identities of the neutral values, exact idempotence of min-p, logit_bias,
batches, mutation, and the pipeline.

References here are written independently of the module: probabilities from math.fsum, plain Python loops for the
penalties. Mass comparisons allow EPS for the different summation order; everything that involves no arithmetic
(which tokens survive top-k, penalties on unlisted tokens, rows of a batch) is compared exactly. The profile
(tests/conftest.py) runs each law on 200 derandomised examples in CI, and the kit's searches take the same count.
"""

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from npllm import sampling as S
from npllm.errors import GenerationError
from npllm.testing import check_case, check_filter

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
    if gap / 800.0 >= np.finfo(np.float32).tiny:  # smaller temperatures are refused (float32 logits would divide by 0)
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


@given(logit_batches(), temperatures)
def test_log_softmax_is_the_log_of_softmax(x, t):
    lp = S.log_softmax(x, t)
    p = S.softmax(x, t)
    np.testing.assert_allclose(np.exp(lp), p, rtol=1e-12, atol=1e-300)
    np.testing.assert_array_equal(lp == -np.inf, x == -np.inf)  # finite where softmax merely underflows
    for row in lp:
        assert math.fsum(np.exp(row)) == pytest.approx(1.0, abs=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# The kit's laws on npllm's filters (npllm.testing; docs/testing.md lists them)
# ---------------------------------------------------------------------------------------------------------------


def log_of_softmax(x, t):
    with np.errstate(divide="ignore"):  # log 0 = -inf where a probability underflows: the kit allows it
        return np.log(S.softmax(x, t))


F64, F32 = (np.float64,), (np.float32,)
KIT = [  # (kind, function under test, options): npllm keeps boundary ties whole (ties="keep")
    ("temperature", S.log_softmax, {}),
    ("temperature", log_of_softmax, {}),
    ("top_k", S.top_k, {"rtol": 0.0}),
    ("top_p", S.top_p, {"dtypes": F64, "rtol": EPS}),
    ("top_p", S.top_p, {"dtypes": F32}),
    ("min_p", S.min_p, {"dtypes": F64, "rtol": 1e-12}),
    ("min_p", S.min_p, {"dtypes": F32}),
    ("typical_p", S.typical_p, {"rtol": 1e-9}),
    ("repetition_penalty", S.repetition_penalty, {"dtypes": F64, "rtol": 0.0}),
    ("repetition_penalty", S.repetition_penalty, {"dtypes": F32, "rtol": 1e-7}),
    ("presence_frequency_penalty", S.presence_frequency_penalty, {"dtypes": F64, "rtol": 1e-14}),
    ("presence_frequency_penalty", S.presence_frequency_penalty, {"dtypes": F32, "rtol": 1e-7}),
    ("presence_penalty", lambda x, h, presence: S.presence_frequency_penalty(x, h, presence, 0.0), {}),
    ("frequency_penalty", lambda x, h, frequency: S.presence_frequency_penalty(x, h, 0.0, frequency), {}),
    ("no_repeat_ngram", S.no_repeat_ngram, {}),
]


@pytest.mark.parametrize("kind, fn, options", KIT, ids=[
    f"{kind}-{getattr(fn, '__name__', 'lambda')}-{'-'.join(np.dtype(d).name for d in o.get('dtypes', ()))}"
    for kind, fn, o in KIT])
def test_the_kit_laws_hold(kind, fn, options):
    """Every law of npllm.testing for the kind, ties kept whole; as many examples per search as the profile's."""
    check_filter(fn, kind, ties="keep", max_examples=settings.default.max_examples, **options)


# ---------------------------------------------------------------------------------------------------------------
# What npllm adds to the kit's laws: the neutral values are exact identities, 0 disables top-k and n-gram bans,
# min-p is exactly idempotent (decided in logit space), and top-p's two routes on a large vocabulary
# ---------------------------------------------------------------------------------------------------------------


@given(logit_rows(bound=3.0), st.data())
def test_top_k_zero_or_at_least_v_is_the_identity(x, data):
    k = data.draw(st.sampled_from([0, len(x), len(x) + 3]))
    np.testing.assert_array_equal(S.top_k(x, k), x)
    if k == 0:  # 0 disables the filter: it keeps at least what any k keeps
        assert (kept(S.top_k(x, data.draw(st.integers(1, len(x))))) <= kept(S.top_k(x, 0))).all()


@given(logit_rows())
def test_neutral_mass_filters_are_exact_identities(x):
    np.testing.assert_array_equal(S.top_p(x, 1.0), x)
    np.testing.assert_array_equal(S.typical_p(x, 1.0), x)
    np.testing.assert_array_equal(S.min_p(x, 0.0), x)


@given(logit_rows(), st.floats(0.0, 1.0))
def test_min_p_is_exactly_idempotent(x, p):
    out = S.min_p(x, p)
    np.testing.assert_array_equal(S.min_p(out, p), out)  # the maximum and the logit differences survive


@given(st.integers(0, 2**32 - 1), st.sampled_from([0.3, 1.0, 2.0, 6.0]), probs_p)
def test_top_p_on_a_large_vocabulary_both_routes(seed, scale, p):
    """V = 2500 > the 1024 candidates sorted first: peaked rows take the partition route, flat ones the full
    sort; both must obey the kit's pointwise laws of top-p."""
    x = np.random.default_rng(seed).standard_normal(2500) * scale
    check_case(S.top_p, "top_p", x, p, rtol=EPS)


@given(logit_rows(max_v=10, masked=False), st.integers(0, 12))
def test_no_repeat_ngram_zero_bans_nothing(x, length):
    ids = [i % len(x) for i in range(length)]
    np.testing.assert_array_equal(S.no_repeat_ngram(x, ids, 0), x)


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
