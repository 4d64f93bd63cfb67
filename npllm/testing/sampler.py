"""check_sampler: does fn(logits[V], rng) -> token id draw from softmax(logits)? A chi-square goodness-of-fit test.

The test is deterministic (fixed seeds), so a correct sampler passes or fails it for good; over all seeds a correct
sampler fails with probability at most `alpha` (1e-4 by default, split evenly over the logit rows). The number of
draws per row is chosen so that a sampler whose temperature is off by a factor of 2 (either way) fails with
probability >= 0.999. Needs only NumPy (no Hypothesis).
"""

from __future__ import annotations

import math
import numbers

import numpy as np

__all__ = ["check_sampler", "chi_square", "chi_square_sf", "chi_square_critical", "DEFAULT_ROWS"]

# Rows that a sampler meets: a spread of ten logits, masked tokens, a tie, a peaked row, two tokens, float32 of 50.
DEFAULT_ROWS = (
    np.array([2.0, 1.5, 1.4, 0.3, 0.2, -0.5, -1.0, -3.0, 0.9, 1.1]),
    np.array([0.5, -np.inf, 1.0, -np.inf, 0.0, 2.0]),
    np.array([1.0, 1.0, 1.0, 0.0, 0.0, -2.0]),
    np.array([6.0, 2.0, 1.0, 0.0, 0.0, -1.0, -4.0, -30.0]),
    np.array([0.0, 0.7]),
    (np.random.default_rng(1234).standard_normal(50) * 1.5).astype(np.float32),
)

POWER_Z = 3.090232  # standard normal quantile 0.999: the power against a temperature off by a factor 2


def _softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max())
    return e / math.fsum(e)


def chi_square_sf(stat: float, df: int) -> float:
    """P(chi2(df) > stat): the regularised upper incomplete gamma Q(df/2, stat/2).

    A power series for x < a + 1, a continued fraction (modified Lentz) above; both to double precision.
    """
    a, x = df / 2.0, stat / 2.0
    if x <= 0:
        return 1.0
    log_front = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1.0:  # P(a, x) = x^a e^-x / Gamma(a) * sum_n x^n / (a (a+1) ... (a+n))
        term = total = 1.0 / a
        ap = a
        for _ in range(10000):
            ap += 1.0
            term *= x / ap
            total += term
            if abs(term) < abs(total) * 1e-17:
                break
        return max(0.0, 1.0 - total * math.exp(log_front))
    tiny = 1e-300  # Q(a, x) = x^a e^-x / Gamma(a) * 1 / (x + 1 - a - 1 (1 - a) / (x + 3 - a - ...))
    b = x + 1.0 - a
    c = 1.0 / tiny
    d = 1.0 / b
    h = d
    for i in range(1, 10000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-16:
            break
    return math.exp(log_front) * h


def chi_square_critical(alpha: float, df: int) -> float:
    """The upper alpha quantile of chi2(df), by bisection on chi_square_sf."""
    low, high = 0.0, df + 10.0 * math.sqrt(2.0 * df) + 100.0
    while chi_square_sf(high, df) > alpha:
        high *= 2.0
    for _ in range(200):
        mid = 0.5 * (low + high)
        low, high = (mid, high) if chi_square_sf(mid, df) > alpha else (low, mid)
    return high


def chi_square(counts: np.ndarray, q: np.ndarray) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom of counts against probabilities q.

    Tokens with expected count below 5 are pooled, smallest first, into one bin until it reaches 5; tokens with
    q = 0 are left out (draws of them are reported separately).
    """
    n = counts.sum()
    expected = n * q
    live = np.flatnonzero(q > 0)
    order = live[np.argsort(q[live], kind="stable")]  # smallest expected counts first: they are pooled
    obs, exp, pool_o, pool_e = [], [], 0.0, 0.0
    for t in order:
        if pool_e < 5.0:
            pool_o, pool_e = pool_o + counts[t], pool_e + expected[t]
        else:
            obs.append(counts[t])
            exp.append(expected[t])
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    o, e = np.array(obs, np.float64), np.array(exp, np.float64)
    return float(((o - e) ** 2 / e).sum()), len(o) - 1


def _noncentrality_needed(df: int, alpha: float) -> float:
    """lambda such that a noncentral chi2(df, lambda) exceeds the alpha critical value with probability 0.999
    (normal approximation: mean df + lambda, variance 2 (df + 2 lambda))."""
    crit = chi_square_critical(alpha, df)
    lam = 1.0
    while df + lam - POWER_Z * math.sqrt(2.0 * (df + 2.0 * lam)) < crit:
        lam *= 1.1
    return lam


def draws_needed(q: np.ndarray, x: np.ndarray, alpha: float, low: int = 2000, high: int = 200_000) -> int:
    """Draws for a row: enough that sampling softmax(x / 2) or softmax(2 x) instead of q fails the test with
    probability >= 0.999, at least `low`, at most `high`."""
    live = q > 0
    df = max(1, int(live.sum()) - 1)
    divergence = math.inf
    for t in (2.0, 0.5):
        wrong = _softmax(np.asarray(x, np.float64) / t)
        divergence = min(divergence, float(np.sum((wrong[live] - q[live]) ** 2 / q[live])))
    if divergence <= 0 or not math.isfinite(divergence):
        return low
    return int(min(high, max(low, math.ceil(_noncentrality_needed(df, alpha) / divergence))))


def _token(fn, x: np.ndarray, rng, V: int) -> int:
    arg = x.copy()
    t = fn(arg, rng)
    if isinstance(t, (bool, np.bool_)) or not isinstance(t, (numbers.Integral, np.integer)) or not 0 <= t < V:
        raise AssertionError(f"[contract] fn returned {t!r}, expected a token id in [0, {V})\n  logits = {x.tolist()}")
    if not np.array_equal(arg, x):
        raise AssertionError(f"[contract] fn changed its logits argument in place\n  logits = {x.tolist()}")
    return int(t)


def _show(v) -> str:
    return np.array2string(np.asarray(v, np.float64), precision=4, separator=", ", max_line_width=10**6,
                           threshold=10**6)


def check_sampler(fn, *, logits=None, target=None, alpha: float = 1e-4, draws: int | None = None,
                  seed: int = 0) -> None:
    """Check that fn(logits[V], rng) -> token id draws from `target(logits)` (default: softmax(logits)).

    For each row of `logits` (default DEFAULT_ROWS), fn is called `draws` times (default: draws_needed, enough to
    catch a temperature off by a factor 2) with one numpy Generator seeded from (seed, row index), and the counts
    are compared with the target by a chi-square test at level alpha / rows. Also checked: no token of
    probability 0 is ever drawn; the same seed gives the same tokens; different seeds give different tokens (fn
    uses the generator it is given); fn returns an int id and leaves the logits alone.
    Raises AssertionError naming the logits, the expected probabilities and the observed frequencies.
    """
    rows = DEFAULT_ROWS if logits is None else [np.asarray(r) for r in logits]
    target = _softmax if target is None else target
    level = alpha / len(rows)
    for index, x in enumerate(rows):
        V = x.shape[-1]
        q = np.asarray(target(x), np.float64)
        n = draws or draws_needed(q, x, level)
        rng = np.random.default_rng([seed, index])
        counts = np.bincount([_token(fn, x, rng, V) for _ in range(n)], minlength=V)
        where = f"\n  logits = {x.tolist()}\n  expected    {_show(q)}\n  frequencies {_show(counts / n)} ({n} draws)"
        if counts[q == 0].any():
            t = int(np.flatnonzero((q == 0) & (counts > 0))[0])
            raise AssertionError(f"token {t} has probability 0 but was drawn {counts[t]} times{where}")
        if (q > 0).sum() > 1:
            stat, df = chi_square(counts, q)
            p_value = chi_square_sf(stat, df)
            if p_value < level:
                raise AssertionError(f"the draws do not follow the expected distribution: chi-square {stat:.2f} on "
                                     f"{df} degrees of freedom, p-value {p_value:.3g} < {level:.3g}{where}")
    x = rows[0]
    first = [_token(fn, x, rng, len(x)) for rng in [np.random.default_rng(seed + 1)] for _ in range(64)]
    again = [_token(fn, x, rng, len(x)) for rng in [np.random.default_rng(seed + 1)] for _ in range(64)]
    if first != again:
        raise AssertionError(f"the same seed gave different tokens: {first} then {again}\n  logits = {x.tolist()}")
    flat = np.zeros(16)
    a = [_token(fn, flat, rng, 16) for rng in [np.random.default_rng(seed + 2)] for _ in range(64)]
    b = [_token(fn, flat, rng, 16) for rng in [np.random.default_rng(seed + 3)] for _ in range(64)]
    if a == b:
        raise AssertionError(f"two different seeds gave the same 64 tokens on a flat row of 16: fn does not draw "
                             f"from the generator it is given\n  tokens = {a}")
