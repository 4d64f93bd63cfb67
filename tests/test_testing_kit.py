"""npllm.testing checks other people's samplers: correct implementations pass, planted bugs are caught.

Every implementation below is written here in plain NumPy, independently of npllm.sampling: the correct ones in
the two tie conventions (whole ties kept; ties split by position, as sort-based libraries do), and for each kind at
least two classic bugs. The kit must pass the former and catch the latter with its default number of examples.
"""

import math
import subprocess
import sys
import textwrap
from collections import Counter

import numpy as np
import pytest

from npllm.testing import LawFailure, check_case, check_filter, check_sampler, laws_of
from npllm.testing.sampler import DEFAULT_ROWS, chi_square_critical, chi_square_sf, draws_needed


def probs(x):
    e = np.exp(x - np.max(x))
    return e / e.sum()


def masked(x, keep):
    return np.where(keep, x, -np.inf)


# ---------------------------------------------------------------------------------------------------------------
# Independent implementations: correct ones
# ---------------------------------------------------------------------------------------------------------------


def temperature_ok(x, t):
    return x / t


def top_k_ok(x, k):  # every tie with the k-th largest kept
    kth = np.sort(x)[::-1][min(k, len(x)) - 1]
    return masked(x, x >= kth)


def top_k_by_position(x, k):  # exactly k, ties broken by position (a stable sort)
    keep = np.zeros(len(x), bool)
    keep[np.argsort(-x, kind="stable")[:k]] = True
    return masked(x, keep & (x > -np.inf))


def top_p_ok(x, p):  # walk down the sorted probabilities to the first running sum >= p; keep its whole tie
    q = probs(x.astype(np.float64))
    order = np.argsort(-q, kind="stable")
    j = min(int(np.searchsorted(np.cumsum(q[order]), p)), len(x) - 1)
    return masked(x, q >= q[order[j]])


def top_p_ascending(x, p):  # drop the tail whose ascending cumulative mass is <= 1 - p; keep at least one
    q = probs(x.astype(np.float64))
    order = np.argsort(q, kind="stable")
    drop = np.cumsum(q[order]) <= 1 - p
    drop[-1] = False
    keep = np.ones(len(x), bool)
    keep[order[drop]] = False
    return masked(x, keep)


def min_p_ok(x, p):
    q = probs(x.astype(np.float64))
    return masked(x, q >= p * q.max())


def typical_scores(x):
    s = x.astype(np.float64) - np.max(x)
    logq = s - np.log(np.exp(s).sum())
    q = np.exp(logq)
    entropy = -np.sum(q[q > 0] * logq[q > 0])
    return q, np.abs(-logq - entropy)


def typical_ok(x, p):  # most typical first until the mass reaches p; equal scores kept together
    q, d = typical_scores(x)
    order = np.argsort(d, kind="stable")
    j = min(int(np.searchsorted(np.cumsum(q[order]), p)), len(x) - 1)
    return masked(x, d <= d[order[j]])


def typical_by_position(x, p):
    q, d = typical_scores(x)
    order = np.argsort(d, kind="stable")
    j = min(int(np.searchsorted(np.cumsum(q[order]), p)), len(x) - 1)
    keep = np.zeros(len(x), bool)
    keep[order[: j + 1]] = True
    return masked(x, keep)


def repetition_ok(x, history, penalty):
    out = x.copy()
    for t in set(history):
        out[t] = x[t] / penalty if x[t] > 0 else x[t] * penalty
    return out


def presence_frequency_ok(x, history, presence, frequency):
    out = x.copy()
    for t, n in Counter(history).items():
        out[t] = x[t] - presence - frequency * n
    return out


def ngram_ok(x, history, n):
    out = x.copy()
    prefix = history[len(history) - n + 1 :] if n > 1 else []
    for i in range(len(history) - n + 1):
        if history[i : i + n - 1] == prefix:
            out[history[i + n - 1]] = -np.inf
    return out


CORRECT = [
    ("temperature", temperature_ok, "keep"),
    ("top_k", top_k_ok, "keep"),
    ("top_k", top_k_ok, "any"),
    ("top_k", top_k_by_position, "any"),
    ("top_p", top_p_ok, "keep"),
    ("top_p", top_p_ok, "any"),
    ("top_p", top_p_ascending, "any"),
    ("min_p", min_p_ok, "keep"),
    ("typical_p", typical_ok, "keep"),
    ("typical_p", typical_by_position, "any"),
    ("repetition_penalty", repetition_ok, "keep"),
    ("presence_frequency_penalty", presence_frequency_ok, "keep"),
    ("presence_penalty", lambda x, h, pr: presence_frequency_ok(x, h, pr, 0.0), "keep"),
    ("frequency_penalty", lambda x, h, fr: presence_frequency_ok(x, h, 0.0, fr), "keep"),
    ("no_repeat_ngram", ngram_ok, "keep"),
]


# ---------------------------------------------------------------------------------------------------------------
# Planted bugs
# ---------------------------------------------------------------------------------------------------------------


def top_p_drops_the_crossing_token(x, p):
    q = probs(x.astype(np.float64))
    order = np.argsort(-q, kind="stable")
    before = np.cumsum(q[order]) - q[order]
    keep = np.zeros(len(x), bool)
    keep[order[(np.cumsum(q[order]) < p) | (before == 0)]] = True
    return masked(x, keep)


def top_p_keeps_one_more(x, p):
    q = probs(x.astype(np.float64))
    order = np.argsort(-q, kind="stable")
    j = min(int(np.searchsorted(np.cumsum(q[order]), p)) + 1, len(x) - 1)
    return masked(x, q >= q[order[j]])


def top_p_naive_softmax(x, p):  # exp without subtracting the maximum: overflows for large logits
    with np.errstate(over="ignore", invalid="ignore"):
        e = np.exp(x.astype(np.float64))
        q = e / e.sum()
    order = np.argsort(-q, kind="stable")
    j = min(int(np.searchsorted(np.cumsum(q[order]), p)), len(x) - 1)
    return masked(x, q >= q[order[j]])


def top_p_splits_ties_by_position(x, p):  # correct under ties="any", wrong under "keep"
    q = probs(x.astype(np.float64))
    order = np.argsort(-q, kind="stable")
    j = min(int(np.searchsorted(np.cumsum(q[order]), p)), len(x) - 1)
    keep = np.zeros(len(x), bool)
    keep[order[: j + 1]] = True
    return masked(x, keep)


def top_k_mutates(x, k):
    kth = np.sort(x)[::-1][min(k, len(x)) - 1]
    x[x < kth] = -np.inf
    return x


def min_p_absolute(x, p):  # pi_i >= p instead of p * max pi
    return masked(x, probs(x.astype(np.float64)) >= p)


def min_p_strict(x, p):  # > instead of >=: p = 1 removes the argmax too
    q = probs(x.astype(np.float64))
    return masked(x, q > p * q.max())


def min_p_in_logit_space(x, p):  # x_i >= p * max x: the wrong space
    return masked(x, x >= p * np.max(x))


def typical_by_probability(x, p):  # sorts by probability: that is top-p, not typical
    return top_p_ok(x, p)


def typical_signed(x, p):  # forgets the absolute value of -log pi - H
    s = x.astype(np.float64) - np.max(x)
    logq = s - np.log(np.exp(s).sum())
    q = np.exp(logq)
    d = -logq + np.sum(q[q > 0] * logq[q > 0])
    order = np.argsort(d, kind="stable")
    j = min(int(np.searchsorted(np.cumsum(q[order]), p)), len(x) - 1)
    return masked(x, d <= d[order[j]])


def typical_drops_the_crossing_token(x, p):
    q, d = typical_scores(x)
    order = np.argsort(d, kind="stable")
    j = max(min(int(np.searchsorted(np.cumsum(q[order]), p)), len(x) - 1) - 1, 0)
    return masked(x, d <= d[order[j]])


def repetition_divides_negatives(x, history, penalty):  # multiplies negative logits by 1/penalty: raises them
    out = x.copy()
    for t in set(history):
        out[t] = x[t] / penalty
    return out


def repetition_per_occurrence(x, history, penalty):
    out = x.copy()
    for t in history:
        out[t] = out[t] / penalty if out[t] > 0 else out[t] * penalty
    return out


def repetition_skips_the_last_token(x, history, penalty):
    return repetition_ok(x, history[:-1], penalty)


def frequency_once(x, history, presence, frequency):  # frequency not multiplied by the count
    out = x.copy()
    for t in set(history):
        out[t] = x[t] - presence - frequency
    return out


def presence_per_occurrence(x, history, presence, frequency):
    out = x.copy()
    for t, n in Counter(history).items():
        out[t] = x[t] - presence * n - frequency * n
    return out


def penalty_sign_flipped(x, history, presence, frequency):
    out = x.copy()
    for t, n in Counter(history).items():
        out[t] = x[t] + presence + frequency * n
    return out


def ngram_compares_n_tokens(x, history, n):  # matches the last n tokens instead of n - 1
    out = x.copy()
    prefix = history[len(history) - n :]
    for i in range(len(history) - n):
        if history[i : i + n] == prefix:
            out[history[i + n]] = -np.inf
    return out


def ngram_misses_the_latest(x, history, n):  # the most recent n-gram of the history is never looked at
    out = x.copy()
    prefix = history[len(history) - n + 1 :] if n > 1 else []
    for i in range(len(history) - n):
        if history[i : i + n - 1] == prefix:
            out[history[i + n - 1]] = -np.inf
    return out


BUGS = [
    ("temperature", lambda x, t: x * t, "keep"),  # temperature applied as a product
    ("temperature", lambda x, t: np.where(x > 0, x / t, x), "keep"),  # only positive logits scaled
    ("temperature", lambda x, t: np.log(probs(x) / t), "keep"),  # divides the probabilities: T has no effect
    ("temperature", lambda x, t: x / t**2, "keep"),
    ("top_k", lambda x, k: top_k_by_position(x, k + 1), "any"),  # keeps k + 1
    ("top_k", lambda x, k: masked(x, x > np.sort(x)[::-1][min(k, len(x)) - 1]), "keep"),  # > instead of >=
    ("top_k", top_k_by_position, "keep"),  # splits a tie under ties="keep"
    ("top_k", top_k_mutates, "keep"),
    ("top_p", top_p_drops_the_crossing_token, "any"),
    ("top_p", top_p_keeps_one_more, "any"),
    ("top_p", top_p_naive_softmax, "keep"),
    ("top_p", top_p_splits_ties_by_position, "keep"),
    ("min_p", min_p_absolute, "keep"),
    ("min_p", min_p_strict, "keep"),
    ("min_p", min_p_in_logit_space, "keep"),
    ("typical_p", typical_by_probability, "keep"),
    ("typical_p", typical_signed, "keep"),
    ("typical_p", typical_drops_the_crossing_token, "any"),
    ("repetition_penalty", repetition_divides_negatives, "keep"),
    ("repetition_penalty", repetition_per_occurrence, "keep"),
    ("repetition_penalty", repetition_skips_the_last_token, "keep"),
    ("presence_frequency_penalty", frequency_once, "keep"),
    ("presence_frequency_penalty", presence_per_occurrence, "keep"),
    ("presence_frequency_penalty", penalty_sign_flipped, "keep"),
    ("presence_penalty", lambda x, h, pr: presence_per_occurrence(x, h, pr, 0.0), "keep"),
    ("presence_penalty", lambda x, h, pr: penalty_sign_flipped(x, h, pr, 0.0), "keep"),
    ("frequency_penalty", lambda x, h, fr: frequency_once(x, h, 0.0, fr), "keep"),
    ("frequency_penalty", lambda x, h, fr: penalty_sign_flipped(x, h, 0.0, fr), "keep"),
    ("no_repeat_ngram", ngram_compares_n_tokens, "keep"),
    ("no_repeat_ngram", ngram_misses_the_latest, "keep"),
]


def name_of(case):
    kind, fn, ties = case
    return f"{kind}-{getattr(fn, '__name__', 'fn')}-{ties}"


# ---------------------------------------------------------------------------------------------------------------
# The kit on correct implementations and on bugs
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CORRECT, ids=[name_of(c) for c in CORRECT])
def test_correct_implementations_pass(case):
    """50 examples a search here to keep the suite short; scripts/bench/kit_false_alarms.py runs the default 100, 20 times."""
    kind, fn, ties = case
    check_filter(fn, kind, ties=ties, max_examples=50)


@pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")  # a planted bug's log(0)
@pytest.mark.parametrize("case", BUGS, ids=[f"{name_of(c)}-{i}" for i, c in enumerate(BUGS)])
def test_planted_bugs_are_caught(case):
    """Detection with the default number of examples; shrink=False because only detection is asserted here (the
    minimal example is tested once below)."""
    kind, fn, ties = case
    with pytest.raises(LawFailure) as failure:
        check_filter(fn, kind, ties=ties, shrink=False)
    assert failure.value.law.kind == kind
    assert f"{kind} law {failure.value.law.name!r} fails" in str(failure.value)


def test_every_kind_has_two_planted_bugs_and_a_correct_implementation():
    kinds = {kind for kind, _, _ in CORRECT}
    assert kinds == {law.kind for kind in kinds for law in laws_of(kind)}
    assert all(sum(k == kind for k, _, _ in BUGS) >= 2 for kind in kinds)


def test_the_failure_names_the_law_and_shows_the_minimal_example():
    with pytest.raises(LawFailure) as failure:
        check_filter(top_p_drops_the_crossing_token, "top_p", ties="any")
    message = str(failure.value)
    assert failure.value.law.name == "top_p.reaches_p"
    assert "the kept tokens hold probability mass >= p" in message
    assert "logits = np.array(" in message
    assert "Failing test case" in message or "Falsifying example" in message  # Hypothesis' own report


def test_ties_keep_catches_a_split_tie_that_ties_any_accepts():
    x = np.array([1.0, 2.0, 2.0, 0.0])
    check_case(top_k_by_position, "top_k", x, 2, ties="any")
    check_case(top_k_by_position, "top_k", x, 2, ties="keep")  # k = 2 takes both 2.0s: no split
    with pytest.raises(LawFailure, match="top_k.keeps_k"):
        check_case(top_k_by_position, "top_k", x, 1, ties="keep")


def test_check_case_runs_the_pointwise_laws_on_a_large_row():
    x = np.random.default_rng(0).standard_normal(20000).astype(np.float32) * 2
    check_case(top_p_ok, "top_p", x, 0.9)
    check_case(lambda v, h, pr: presence_frequency_ok(v, h, pr, 0.0), "presence_penalty", x, 0.5,
               history=[1, 5, 5])
    with pytest.raises(LawFailure, match="top_p"):
        check_case(top_p_drops_the_crossing_token, "top_p", x, 0.9)


def test_laws_run_under_random_and_derandomised_search():
    """The suite's profile is derandomised; check_filter must also search at random when asked (a user's suite)."""
    check_filter(top_p_ok, "top_p", derandomize=False, max_examples=30)
    check_filter(top_p_ok, "top_p", seed=12345, max_examples=30)
    with pytest.raises(LawFailure):
        check_filter(top_p_keeps_one_more, "top_p", derandomize=False, ties="any", shrink=False)


def test_check_filter_needs_no_test_suite_profile(tmp_path):
    """Called from a plain script (no conftest, Hypothesis' default profile) it behaves the same."""
    script = textwrap.dedent("""
        import numpy as np
        from npllm.testing import check_filter, LawFailure

        def top_k_keeps_k_plus_one(x, k):
            keep = np.zeros(len(x), bool)
            keep[np.argsort(-x, kind="stable")[: k + 1]] = True
            return np.where(keep & (x > -np.inf), x, -np.inf)

        try:
            check_filter(top_k_keeps_k_plus_one, "top_k", ties="any")
        except LawFailure as failure:
            print("caught", failure.law.name)
    """)
    path = tmp_path / "user_check.py"
    path.write_text(script)
    done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("caught top_k.")


def test_import_npllm_needs_no_hypothesis():
    code = textwrap.dedent("""
        import sys
        sys.modules["hypothesis"] = None  # as if it were not installed
        import npllm, npllm.sampling, npllm.testing
        from npllm.testing import check_sampler
        try:
            npllm.testing.check_filter
        except ImportError as err:
            print("needs hypothesis:", "pip install hypothesis" in str(err))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "needs hypothesis: True"


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="unknown kind"):
        check_filter(top_k_ok, "top_z")
    with pytest.raises(ValueError, match="ties"):
        check_filter(top_k_ok, "top_k", ties="some")
    with pytest.raises(ValueError, match="no such law"):
        check_filter(top_k_ok, "top_k", laws=["top_k.nonsense"])


# ---------------------------------------------------------------------------------------------------------------
# check_sampler
# ---------------------------------------------------------------------------------------------------------------


def sample_ok(x, rng):  # inverse CDF with one uniform
    cdf = np.cumsum(probs(x.astype(np.float64)))
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(x) - 1))


def sample_choice(x, rng):
    return int(rng.choice(len(x), p=probs(x.astype(np.float64))))


def test_correct_samplers_pass():
    check_sampler(sample_ok)
    check_sampler(sample_choice)


@pytest.mark.parametrize("factor", [2.0, 0.5])
def test_a_temperature_off_by_a_factor_two_is_caught(factor):
    with pytest.raises(AssertionError, match="do not follow") as failure:
        check_sampler(lambda x, rng: sample_ok(x / factor, rng))
    assert "frequencies" in str(failure.value) and "logits = " in str(failure.value)


def golden_ratio_sampler():
    """A sampler that ignores its generator's values: a low-discrepancy sequence, restarted for each generator it is
    handed. Its frequencies fit the softmax very well and one seed reproduces itself, but every seed gives the
    same tokens. (The generators are kept alive so that no id is reused.)"""
    seen = {}

    def sample(x, rng):
        entry = seen.setdefault(id(rng), [rng, 0])
        entry[1] += 1
        cdf = np.cumsum(probs(x.astype(np.float64)))
        u = (entry[1] * 0.6180339887498949) % 1.0
        return int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), len(x) - 1))

    return sample


def test_sampler_bugs_are_caught():
    with pytest.raises(AssertionError, match="do not follow"):  # greedy one time in ten
        check_sampler(lambda x, rng: int(np.argmax(x)) if rng.random() < 0.1 else sample_ok(x, rng))
    with pytest.raises(AssertionError, match="probability 0"):  # -inf read as 0
        check_sampler(lambda x, rng: sample_ok(np.where(np.isinf(x), 0.0, x), rng))
    with pytest.raises(AssertionError, match="same seed"):  # a fresh generator of its own at every call
        check_sampler(lambda x, rng: sample_ok(x, np.random.default_rng()))
    with pytest.raises(AssertionError, match="different seeds"):
        check_sampler(golden_ratio_sampler())
    with pytest.raises(AssertionError, match="token id"):
        check_sampler(lambda x, rng: float(sample_ok(x, rng)))
    with pytest.raises(AssertionError, match="in place"):
        check_sampler(lambda x, rng: sample_ok(np.exp(x, out=x) if x.dtype == np.float64 else x, rng))


def test_a_sampler_with_filters_is_checked_against_its_target():
    def target(x):
        return probs(top_p_ok(x.astype(np.float64), 0.8))

    check_sampler(lambda x, rng: sample_ok(top_p_ok(x.astype(np.float64), 0.8), rng), target=target)
    with pytest.raises(AssertionError):
        check_sampler(lambda x, rng: sample_ok(x, rng), target=target)


def test_chi_square_tail_against_tables():
    # upper quantiles from standard tables: chi2(df) at 0.05, 0.001 and 1e-4
    for alpha, df, table in [(0.05, 1, 3.841), (0.05, 10, 18.307), (0.001, 3, 16.266), (0.001, 30, 59.703),
                             (1e-4, 5, 25.745), (1e-4, 1, 15.137)]:
        assert chi_square_critical(alpha, df) == pytest.approx(table, abs=2e-3)
    assert chi_square_sf(0.5, 4) == pytest.approx(math.exp(-0.25) * 1.25, rel=1e-12)


def test_draws_are_enough_to_see_a_temperature_off_by_two():
    """The draw counts the check uses: modest for spread rows, the minimum for a flat row."""
    counts = [draws_needed(probs(x.astype(np.float64)), x, 1e-4 / len(DEFAULT_ROWS)) for x in DEFAULT_ROWS]
    assert all(2000 <= n <= 20000 for n in counts), counts
    assert draws_needed(np.full(4, 0.25), np.zeros(4), 1e-4) == 2000


def test_docs_list_every_law_with_its_statement():
    from pathlib import Path

    from npllm.testing import CONVENTIONS, KINDS

    text = (Path(__file__).resolve().parent.parent / "docs" / "testing.md").read_text(encoding="utf-8")
    for kind in KINDS:
        assert f"`{CONVENTIONS[kind]}`" in text
        for law in laws_of(kind):
            assert f"- `{law.name}`: {law.statement}." in text, law.name
