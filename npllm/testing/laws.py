"""The laws of sampling filters, checkable against anyone's implementation: `check_filter(fn, kind)` (check.py runs
them).

Each kind of filter has a calling convention (CONVENTIONS) and a list of laws (LAWS[kind]). A law is a Hypothesis
property: a strategy of cases and a check that raises AssertionError naming the token and the values when the law
fails. `check_filter` runs every law of a kind against a user's function and raises `LawFailure` (an
AssertionError) with the law's name, its one-line statement and Hypothesis' minimal falsifying example.

References are computed here in float64 from the logits (softmax with the maximum subtracted, -inf entries with
probability 0), independently of the function under test. Decisions that involve arithmetic (masses, thresholds,
typicality) may go either way within a slack `rtol`: a probability mass within `rtol` of p, a logit within
`rtol · max(1, |logit - max|)` of a threshold, probabilities below 1e-30 (they underflow in float32). Decisions that
involve no arithmetic (which logits are larger, which tokens are listed in a history) are exact.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import numpy as np
from hypothesis import strategies as st

from . import strategies as nps

__all__ = ["laws_of", "KINDS", "CONVENTIONS", "Law", "LawFailure", "Options"]

TINY = 1e-30  # probabilities below this count as zero in either direction (float32 underflows near 1e-38)
LN_TINY = math.log(TINY)

CONVENTIONS = {
    "temperature": "fn(logits[V], T) -> logits[V] whose softmax is softmax(logits / T); T > 0",
    "top_k": "fn(logits[V], k) -> logits[V]: kept entries unchanged, removed ones -inf; k >= 1",
    "top_p": "fn(logits[V], p) -> logits[V]: kept entries unchanged, removed ones -inf; 0 < p <= 1",
    "min_p": "fn(logits[V], p) -> logits[V]: kept entries unchanged, removed ones -inf; 0 <= p <= 1",
    "typical_p": "fn(logits[V], p) -> logits[V]: kept entries unchanged, removed ones -inf; 0 < p <= 1",
    "repetition_penalty": "fn(logits[V], history, penalty) -> logits[V]; history a list of token ids; penalty > 0",
    "presence_penalty": "fn(logits[V], history, presence) -> logits[V]; history a list of token ids",
    "frequency_penalty": "fn(logits[V], history, frequency) -> logits[V]; history a list of token ids",
    "presence_frequency_penalty": "fn(logits[V], history, presence, frequency) -> logits[V]",
    "no_repeat_ngram": "fn(logits[V], history, n) -> logits[V] with banned tokens -inf; n >= 1",
}
KINDS = tuple(CONVENTIONS)


@dataclass(frozen=True)
class Options:
    """How strictly the laws are read. ties: "keep" (a tie at the boundary is kept or removed whole) or "any" (an
    implementation may split it by position, keeping exactly as many as it needs). rtol: the numerical slack (see
    the module docstring). dtypes: the logit dtypes drawn. size: the (low, high) vocabulary sizes drawn."""

    ties: str = "keep"
    rtol: float = 1e-5
    dtypes: tuple = (np.float64, np.float32)
    size: tuple = (1, 32)


@dataclass(frozen=True)
class Law:
    """One law of one kind of filter: a name, a one-line statement, a strategy of cases and a check.

    cases(opts) -> a strategy of tuples; check(fn, case, opts) raises AssertionError when fn breaks the law.
    pointwise laws take the cases (logits, param) or (logits, history, param...) that `check_case` is given.
    """

    kind: str
    name: str
    statement: str
    cases: Callable = field(repr=False)
    check: Callable = field(repr=False)
    pointwise: bool = False


class LawFailure(AssertionError):
    """A law of a sampling filter does not hold: names the kind, the law and the falsifying example."""

    def __init__(self, law: Law, cause: BaseException):
        notes = "\n".join(getattr(cause, "__notes__", []))
        self.law = law
        super().__init__(
            f"{law.kind} law {law.name!r} fails: {law.statement}\n{cause}" + (f"\n{notes}" if notes else "")
        )


# ---------------------------------------------------------------------------------------------------------------
# Calling the function under test, and the float64 references
# ---------------------------------------------------------------------------------------------------------------


def _show(x) -> str:
    return np.array2string(np.asarray(x), precision=17, separator=", ", max_line_width=10**6, threshold=10**6)


def _call(fn, x: np.ndarray, *args, history=None) -> np.ndarray:
    """fn(x, *args) or fn(x, history, *args) on copies; checks the contract and returns the output as float64.

    The contract: returns an array of x's shape with no NaN and no +inf, and leaves its arguments unchanged.
    """
    arg = x.copy()
    hist = None if history is None else list(history)
    try:
        out = fn(arg, *args) if history is None else fn(arg, hist, *args)
    except Exception as err:  # the function under test refused a valid input
        raise AssertionError(f"[contract] fn raised {type(err).__name__}: {err}\n  {_case(x, args, history)}") from err
    if not np.array_equal(arg, x):
        raise AssertionError(f"[contract] fn changed its logits argument in place\n  {_case(x, args, history)}")
    if history is not None and hist != list(history):
        raise AssertionError(f"[contract] fn changed its history argument in place\n  {_case(x, args, history)}")
    out = np.asarray(out)
    if out.shape != x.shape or out.dtype.kind not in "fiu":
        raise AssertionError(
            f"[contract] fn returned {out.dtype} of shape {out.shape}, expected a real array of shape {x.shape}\n"
            f"  {_case(x, args, history)}"
        )
    out = out.astype(np.float64)
    if np.isnan(out).any() or np.isposinf(out).any():
        raise AssertionError(f"[contract] fn returned NaN or +inf: {_show(out)}\n  {_case(x, args, history)}")
    return out


class _case:
    """The case as a line of Python (logits, history, parameters), formatted only when a message needs it: a
    law checks many cases and reports one."""

    def __init__(self, x, args, history=None):
        self.x, self.args, self.history = x, args, history

    def __str__(self) -> str:
        parts = [f"logits = np.array({_show(self.x)}, dtype=np.{np.asarray(self.x).dtype})"]
        if self.history is not None:
            parts.append(f"history = {list(self.history)}")
        parts += [f"param = {a!r}" for a in self.args]
        return ", ".join(parts)


def _probs(x: np.ndarray) -> np.ndarray:
    """[V] -> [V] float64 softmax, -inf entries 0."""
    x = x.astype(np.float64)
    e = np.exp(x - x.max())
    return e / math.fsum(e)


def _log_probs(x: np.ndarray) -> np.ndarray:
    """[V] -> [V] float64 log-softmax from the logits (no underflow for finite logits), -inf for -inf."""
    s = x.astype(np.float64) - x.max()
    return s - math.log(math.fsum(np.exp(s)))


def _mass(p: np.ndarray, keep: np.ndarray) -> float:
    return math.fsum(p[keep])


def _slack(opts: Options, s) -> np.ndarray:
    """Logit slack around shifted logits s = x - max x: rtol · max(1, |s|)."""
    return opts.rtol * np.maximum(1.0, np.abs(s))


def _kept(x: np.ndarray, out: np.ndarray, case: str) -> np.ndarray:
    """The filter's output form: each entry is its input value or -inf, and something survives. -> kept mask."""
    x64 = x.astype(np.float64)
    bad = ~((out == x64) | (out == -np.inf))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise AssertionError(
            f"token {i}: input {x64[i]!r}, output {out[i]!r}: a filter returns a kept logit unchanged, a removed one "
            f"as -inf\n  output = {_show(out)}\n  {case}"
        )
    keep = out > -np.inf
    if not keep.any():
        raise AssertionError(f"every token was removed\n  {case}")
    return keep


def _top(x: np.ndarray, opts: Options) -> np.ndarray:
    """The most probable tokens: logits within the slack (rtol) of the maximum. Logits 1e-278 apart have equal
    probabilities in floating point, so a filter may take either for the argmax."""
    x64 = x.astype(np.float64)
    return x64 >= x64.max() - opts.rtol


def _dyadic(x: np.ndarray) -> np.ndarray:
    """Finite logits rounded to multiples of 1/64 (|x| < 2^17 stays exact in float32, so x + integer is exact)."""
    return np.where(np.isfinite(x), np.round(x.astype(np.float64) * 64) / 64, x).astype(x.dtype)


def _rows(opts: Options, ties: bool | None = None, neg_inf: bool = True, size=None):
    return nps.logits(size=size or opts.size, dtype=tuple(opts.dtypes), ties=opts.ties == "keep" if ties is None
                      else ties, neg_inf=neg_inf)


@st.composite
def _row_then(draw, rows, *param_ofs, transform=None):
    """(x, *params) with each param drawn from param_of(x); x optionally transformed first. A composite rather
    than flatmap: no strategy is built per example, which keeps a search of 100 examples near a second."""
    x = draw(rows)
    if transform is not None:
        x = transform(x)
    return (x, *(draw(param_of(x)) for param_of in param_ofs))


def _with_param(opts, param_of, ties=None, size=None):
    """Strategy of (x, param) with param drawn from param_of(x)."""
    return _row_then(_rows(opts, ties, size=size), param_of)


# ---------------------------------------------------------------------------------------------------------------
# Laws shared by the filters (top_k, top_p, min_p, typical_p)
# ---------------------------------------------------------------------------------------------------------------


def _form_law(kind, param_of):
    def check(fn, case, opts):
        x, param = case
        _kept(x, _call(fn, x, param), _case(x, (param,)))

    return Law(kind, f"{kind}.output_form",
               "kept entries are returned unchanged, removed ones as -inf, -inf inputs stay -inf, and at least one "
               "token survives", lambda o: _with_param(o, param_of), check, pointwise=True)


def _argmax_law(kind, param_of):
    def check(fn, case, opts):
        x, param = case
        keep = _kept(x, _call(fn, x, param), _case(x, (param,)))
        if not keep[_top(x, opts)].any():
            raise AssertionError(f"the most probable token {int(np.argmax(x))} was removed\n  {_case(x, (param,))}")

    return Law(kind, f"{kind}.keeps_the_argmax", "the most probable token always survives",
               lambda o: _with_param(o, param_of), check, pointwise=True)


def _monotone_law(kind, param_of, smaller_keeps_less: bool, needs_unique_under_any: bool = False):
    def cases(opts):
        ties = None if not needs_unique_under_any else (opts.ties == "keep")
        return _row_then(_rows(opts, ties), param_of, param_of)

    def check(fn, case, opts):
        x, a, b = case
        low, high = sorted((a, b))
        k_low = _kept(x, _call(fn, x, low), _case(x, (low,)))
        k_high = _kept(x, _call(fn, x, high), _case(x, (high,)))
        small, large, (ps, pl) = (k_low, k_high, (low, high)) if smaller_keeps_less else (k_high, k_low, (high, low))
        extra = small & ~large
        if extra.any():
            raise AssertionError(
                f"token {int(np.flatnonzero(extra)[0])} is kept at param {ps!r} but removed at {pl!r}, which should "
                f"keep a superset\n  {_case(x, ())}"
            )

    direction = "a larger parameter keeps a superset" if smaller_keeps_less else "a larger parameter keeps a subset"
    return Law(kind, f"{kind}.monotone", f"monotone: {direction} of the tokens", cases, check)


def _shift_law(kind, param_of):
    """Adding a constant to every logit changes no decision (dyadic logits and integer constants: exact sums)."""

    def cases(opts):
        return _row_then(_rows(opts), lambda x: st.integers(-1000, 1000), param_of, transform=_dyadic)

    def check(fn, case, opts):
        x, c, param = case
        y = (x + x.dtype.type(c)).astype(x.dtype)
        a = _kept(x, _call(fn, x, param), _case(x, (param,)))
        b = _kept(y, _call(fn, y, param), _case(y, (param,)))
        if not np.array_equal(a, b):
            raise AssertionError(
                f"kept {np.flatnonzero(a).tolist()} for the logits but {np.flatnonzero(b).tolist()} after adding "
                f"{c} to every logit\n  {_case(x, (param,))}"
            )

    return Law(kind, f"{kind}.shift_invariant", "adding the same constant to every logit changes nothing", cases,
               check)


def _upper_set(x, keep, opts, case, what="logit"):
    """Kept tokens form a top set by logit: no removed token is larger (beyond the slack) than a kept one; with
    ties="keep" no removed token equals a kept one."""
    finite = x > -np.inf
    dropped = finite & ~keep
    if not dropped.any():
        return
    x64 = x.astype(np.float64)
    low = x64[keep].min()
    slack = _slack(opts, low - x64.max())
    over = dropped & (x64 > low + slack)
    if over.any():
        j = int(np.flatnonzero(over)[0])
        raise AssertionError(f"token {j} ({what} {x64[j]!r}) was removed while a token with {what} {low!r} was kept"
                             f"\n  {case}")
    if opts.ties == "keep":
        split = dropped & np.isin(x64, x64[keep])
        if split.any():
            j = int(np.flatnonzero(split)[0])
            raise AssertionError(f"a tie was split: token {j} (logit {x64[j]!r}) was removed while an equal logit was "
                                 f"kept (ties='keep' keeps or removes a tie whole)\n  {case}")


def _two_passes(fn, x, param):
    """The kept masks of fn applied to x and then to its own output (each checked for the filter's form)."""
    once = _call(fn, x, param)
    k1 = _kept(x, once, _case(x, (param,)))
    y = once.astype(x.dtype)
    return k1, _kept(y, _call(fn, y, param), _case(y, (param,)))


# ---------------------------------------------------------------------------------------------------------------
# temperature: fn(x, T) -> logits with softmax(out) = softmax(x / T)
# ---------------------------------------------------------------------------------------------------------------


def _temperature_ratios(x, out, T, opts, case):
    """out_i - out_a = (x_i - x_a) / T for the argmax a, within slack; -inf only where the tempered probability is
    below TINY."""
    x64 = x.astype(np.float64)
    a = int(np.argmax(x64))
    if not np.isfinite(out[a]):
        raise AssertionError(f"the argmax {a} came out as {out[a]!r}\n  {case}")
    finite = x64 > -np.inf
    expected = (x64[finite] - x64[a]) / T
    got = out[finite] - out[a]
    slack = opts.rtol * np.maximum(1.0, np.maximum(np.abs(x64[finite]), abs(x64[a])) / T)
    lost = np.isneginf(got) & (expected < LN_TINY)  # a log of an underflowed probability: harmless
    bad = ~lost & ~(np.abs(got - expected) <= slack)
    if bad.any():
        i = int(np.flatnonzero(finite)[np.flatnonzero(bad)[0]])
        raise AssertionError(
            f"token {i}: out_i - out_argmax = {out[i] - out[a]!r}, expected (x_i - x_argmax) / T = "
            f"{(x64[i] - x64[a]) / T!r}\n  output = {_show(out)}\n  {case}"
        )


def _temperature_divides(fn, case, opts):
    x, T = case
    _temperature_ratios(x, _call(fn, x, T), T, opts, _case(x, (T,)))


def _temperature_identity(fn, case, opts):
    (x,) = case
    _temperature_ratios(x, _call(fn, x, 1.0), 1.0, opts, _case(x, (1.0,)))


def _temperature_masked(fn, case, opts):
    x, T = case
    out = _call(fn, x, T)
    bad = np.isneginf(x) & ~np.isneginf(out)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise AssertionError(f"token {i} was -inf and came out as {out[i]!r}\n  {_case(x, (T,))}")


def _temperature_order(fn, case, opts):
    x, T = case
    out = _call(fn, x, T)
    x64 = x.astype(np.float64)
    order = np.argsort(x64, kind="stable")
    xs, os = x64[order], out[order]
    bad = (xs[:-1] < xs[1:]) & (os[:-1] > os[1:])
    if bad.any():
        j = int(np.flatnonzero(bad)[0])
        i, k = int(order[j]), int(order[j + 1])
        raise AssertionError(f"x_{i} < x_{k} but out_{i} = {out[i]!r} > out_{k} = {out[k]!r}\n  {_case(x, (T,))}")


def _temperature_sharpening(fn, case, opts):
    x, t1, t2 = case
    low, high = sorted((t1, t2))
    top_low = _probs(_call(fn, x, low)).max()
    top_high = _probs(_call(fn, x, high)).max()
    if top_low < top_high - opts.rtol:
        raise AssertionError(f"top probability {top_low!r} at T = {low!r} is below {top_high!r} at T = {high!r}"
                             f"\n  {_case(x, ())}")


def _temperature_laws():
    kind = "temperature"
    T = nps.temperatures()
    return [
        Law(kind, "temperature.divides_logits", "log-probability differences are divided by T: out_i - out_j = "
            "(x_i - x_j) / T", lambda o: st.tuples(_rows(o), T), _temperature_divides, pointwise=True),
        Law(kind, "temperature.one_is_identity", "T = 1 leaves the distribution unchanged",
            lambda o: st.tuples(_rows(o)), _temperature_identity),
        Law(kind, "temperature.keeps_masked_tokens_masked", "a -inf logit stays -inf",
            lambda o: st.tuples(_rows(o), T), _temperature_masked, pointwise=True),
        Law(kind, "temperature.keeps_the_order", "x_i < x_j implies out_i <= out_j, so the argmax stays the argmax",
            lambda o: st.tuples(_rows(o), T), _temperature_order, pointwise=True),
        Law(kind, "temperature.lower_sharpens", "a lower T never lowers the top probability",
            lambda o: st.tuples(_rows(o), T, T), _temperature_sharpening),
    ]


# ---------------------------------------------------------------------------------------------------------------
# top_k: fn(x, k)
# ---------------------------------------------------------------------------------------------------------------


def _kth(x64: np.ndarray, k: int) -> float:
    """The k-th largest finite logit (the smallest finite one when fewer than k are finite)."""
    f = np.sort(x64[x64 > -np.inf])[::-1]
    return f[min(k, len(f)) - 1]


def _top_k_of(x):
    return nps.top_k_values(len(x))


def _top_k_top_set(fn, case, opts):
    x, k = case
    c = _case(x, (k,))
    keep = _kept(x, _call(fn, x, k), c)
    x64 = x.astype(np.float64)
    dropped = (x64 > -np.inf) & ~keep
    if dropped.any() and x64[dropped].max() > x64[keep].min():
        j = int(np.flatnonzero(dropped & (x64 > x64[keep].min()))[0])
        raise AssertionError(f"token {j} (logit {x64[j]!r}) was removed while logit {x64[keep].min()!r} was kept"
                             f"\n  {c}")


def _top_k_count(fn, case, opts):
    x, k = case
    c = _case(x, (k,))
    keep = _kept(x, _call(fn, x, k), c)
    x64 = x.astype(np.float64)
    finite = x64 > -np.inf
    with_ties = int((finite & (x64 >= _kth(x64, k))).sum())
    n = int(keep.sum())
    if opts.ties == "keep" and n != with_ties:
        raise AssertionError(f"kept {n} tokens {np.flatnonzero(keep).tolist()}; the {with_ties} tokens with logit "
                             f">= the k-th largest ({_kth(x64, k)!r}) must survive, no others\n  {c}")
    if opts.ties == "any" and not (min(k, int(finite.sum())) <= n <= with_ties):
        raise AssertionError(f"kept {n} tokens {np.flatnonzero(keep).tolist()}; expected between "
                             f"min(k, finite tokens) = {min(k, int(finite.sum()))} and {with_ties} (k plus ties)"
                             f"\n  {c}")


def _top_k_idempotent(fn, case, opts):
    x, k = case
    once = _call(fn, x, k)
    _kept(x, once, _case(x, (k,)))
    y = once.astype(x.dtype)
    twice = _call(fn, y, k)
    if not np.array_equal(once, twice):
        raise AssertionError(f"a second pass changed the output: {_show(once)} -> {_show(twice)}\n  "
                             f"{_case(x, (k,))}")


def _top_k_idempotent_cases(opts):
    return _row_then(_rows(opts, ties=opts.ties == "keep"), _top_k_of)


def _top_k_laws():
    kind = "top_k"
    return [
        _form_law(kind, _top_k_of),
        Law(kind, "top_k.keeps_a_top_set", "no removed token has a larger logit than a kept one",
            lambda o: _with_param(o, _top_k_of), _top_k_top_set, pointwise=True),
        Law(kind, "top_k.keeps_k", "ties='keep': exactly the tokens with logit >= the k-th largest survive (exactly k "
            "without ties, everything when k >= V); ties='any': between k and that many",
            lambda o: _with_param(o, _top_k_of), _top_k_count, pointwise=True),
        _argmax_law(kind, _top_k_of),
        _monotone_law(kind, _top_k_of, smaller_keeps_less=True, needs_unique_under_any=True),
        Law(kind, "top_k.idempotent", "applying it twice gives the same result as once", _top_k_idempotent_cases,
            _top_k_idempotent),
        _shift_law(kind, _top_k_of),
    ]


# ---------------------------------------------------------------------------------------------------------------
# top_p: fn(x, p)
# ---------------------------------------------------------------------------------------------------------------


def _p_of(x):
    return nps.p_values()


def _reaches_p(fn, case, opts):
    x, p = case
    c = _case(x, (p,))
    keep = _kept(x, _call(fn, x, p), c)
    got = _mass(_probs(x), keep)
    if got < p - opts.rtol:
        raise AssertionError(f"kept mass {got!r} < p = {p!r} (kept {np.flatnonzero(keep).tolist()})\n  {c}")


def _top_p_minimal(fn, case, opts):
    x, p = case
    c = _case(x, (p,))
    keep = _kept(x, _call(fn, x, p), c)
    prob, x64 = _probs(x), x.astype(np.float64)
    low = x64[keep].min()
    above = x64 > low + _slack(opts, low - x64.max())
    whole = not ((x64 == low) & ~keep).any()  # the least probable kept value's tie group is kept whole
    if whole and _mass(prob, above) < p + opts.rtol:
        return
    if opts.ties == "any":
        least = np.flatnonzero(keep)[np.argmin(x64[keep])]
        if _mass(prob, keep) - prob[least] < p + opts.rtol:
            return
    raise AssertionError(
        f"kept {np.flatnonzero(keep).tolist()} (mass {_mass(prob, keep)!r}), but the tokens more probable than the "
        f"least probable kept one already hold mass {_mass(prob, above)!r} >= p = {p!r}\n  {c}")


def _top_p_top_set(fn, case, opts):
    x, p = case
    c = _case(x, (p,))
    _upper_set(x, _kept(x, _call(fn, x, p), c), opts, c)


def _top_p_second_pass(fn, case, opts):
    x, p = case
    k1, k2 = _two_passes(fn, x, p)
    if (k2 & ~k1).any() or not k2[_top(x, opts)].any():
        raise AssertionError(f"a second pass kept {np.flatnonzero(k2).tolist()}, the first "
                             f"{np.flatnonzero(k1).tolist()}: it must keep a subset holding the argmax\n  "
                             f"{_case(x, (p,))}")


def _top_p_laws():
    kind = "top_p"
    return [
        _form_law(kind, _p_of),
        Law(kind, "top_p.reaches_p", "the kept tokens hold probability mass >= p", lambda o: _with_param(o, _p_of),
            _reaches_p, pointwise=True),
        Law(kind, "top_p.minimal", "the tokens more probable than the least probable kept one hold mass < p (without "
            "ties: removing the last kept token falls below p)", lambda o: _with_param(o, _p_of), _top_p_minimal,
            pointwise=True),
        Law(kind, "top_p.keeps_a_top_set", "no removed token is more probable than a kept one (ties='keep': a tie is "
            "kept whole)", lambda o: _with_param(o, _p_of), _top_p_top_set, pointwise=True),
        _argmax_law(kind, _p_of),
        _monotone_law(kind, _p_of, smaller_keeps_less=True),
        Law(kind, "top_p.second_pass_keeps_a_subset", "applied twice it keeps a subset of one pass that still holds "
            "the argmax (not idempotent: the second pass renormalises)", lambda o: _with_param(o, _p_of),
            _top_p_second_pass),
        _shift_law(kind, _p_of),
    ]


# ---------------------------------------------------------------------------------------------------------------
# min_p: fn(x, p)
# ---------------------------------------------------------------------------------------------------------------


def _min_p_violation(x, keep, p, opts) -> str | None:
    """Where keep breaks 'keep exactly pi_i >= p * max pi' beyond the slack, a message; else None."""
    x64 = x.astype(np.float64)
    s = x64 - x64.max()
    lnp = math.log(p) if p > 0 else -math.inf
    finite = x64 > -np.inf
    s = np.where(finite, s, -1e308)  # masked tokens: no threshold arithmetic on -inf
    d = _slack(opts, np.where(finite, s, 0.0))
    either = (lnp < LN_TINY) & (s < LN_TINY)  # both below float32's range: either way
    must_keep = finite & (s >= lnp + d) & ~either
    must_drop = finite & (s < lnp - d) & ~either
    if (must_keep & ~keep).any():
        i = int(np.flatnonzero(must_keep & ~keep)[0])
        return f"token {i} has pi_i / max pi = exp({s[i]!r}) >= p = {p!r} but was removed"
    if (must_drop & keep).any():
        i = int(np.flatnonzero(must_drop & keep)[0])
        return f"token {i} has pi_i / max pi = exp({s[i]!r}) < p = {p!r} but was kept"
    return None


def _min_p_laws():
    kind = "min_p"

    def p_of(x):
        return nps.min_p_values()

    def threshold(fn, case, opts):
        x, p = case
        c = _case(x, (p,))
        why = _min_p_violation(x, _kept(x, _call(fn, x, p), c), p, opts)
        if why:
            raise AssertionError(f"{why}\n  {c}")

    def idempotent(fn, case, opts):
        x, p = case
        k1, k2 = _two_passes(fn, x, p)
        lost = k1 & ~k2
        x64 = x.astype(np.float64)
        s = np.where(x64 > -np.inf, x64 - x64.max(), 0.0)
        with np.errstate(invalid="ignore"):
            near = np.abs(s - (math.log(p) if p > 0 else -math.inf)) <= _slack(opts, s)
        if (k2 & ~k1).any() or (lost & ~near).any():
            raise AssertionError(f"a second pass kept {np.flatnonzero(k2).tolist()}, the first "
                                 f"{np.flatnonzero(k1).tolist()}\n  {_case(x, (p,))}")

    return [
        _form_law(kind, p_of),
        Law(kind, "min_p.threshold", "exactly the tokens with pi_i >= p * max pi survive",
            lambda o: _with_param(o, p_of), threshold, pointwise=True),
        _argmax_law(kind, p_of),
        _monotone_law(kind, p_of, smaller_keeps_less=False),
        Law(kind, "min_p.idempotent", "applying it twice gives the same result as once (the maximum and the ratios "
            "survive)", lambda o: _with_param(o, p_of), idempotent),
        _shift_law(kind, p_of),
    ]


# ---------------------------------------------------------------------------------------------------------------
# typical_p: fn(x, p)
# ---------------------------------------------------------------------------------------------------------------


def _typicality(x):
    """(pi, d, live, entropy): d_i = |-log pi_i - H| from log-probabilities; live = pi_i >= TINY."""
    logp = _log_probs(x)
    prob = np.exp(logp)
    live = logp >= LN_TINY
    entropy = -math.fsum(prob[prob > 0] * logp[prob > 0])
    return prob, np.abs(-logp - entropy), live, entropy


def _typical_bound(x, keep, opts):
    prob, d, live, entropy = _typicality(x)
    kl = keep & live
    if not kl.any():
        return None
    j = np.flatnonzero(kl)[np.argmax(d[kl])]
    logp = _log_probs(x)
    return prob, d, live, j, opts.rtol * max(1.0, abs(logp[j]), entropy)


def _typical_call(fn, case, opts):
    """(x, p, the case line, the kept mask, _typical_bound of it) for fn applied to the case."""
    x, p = case
    c = _case(x, (p,))
    keep = _kept(x, _call(fn, x, p), c)
    return x, p, c, keep, _typical_bound(x, keep, opts)


def _typical_minimal(fn, case, opts):
    x, p, c, keep, b = _typical_call(fn, case, opts)
    if b is None:
        return  # only dead tokens kept: typical_p.reaches_p reports it
    prob, d, live, j, slack = b
    x64 = x.astype(np.float64)
    closer = live & (d < d[j] - slack)
    whole = not ((x64 == x64[j]) & ~keep).any()
    if whole and _mass(prob, closer) < p + opts.rtol:
        return
    if opts.ties == "any" and _mass(prob, keep) - prob[j] < p + opts.rtol:
        return
    raise AssertionError(f"kept {np.flatnonzero(keep).tolist()}, but the tokens more typical than the least "
                         f"typical kept one ({int(j)}) already hold mass {_mass(prob, closer)!r} >= p = {p!r}\n"
                         f"  {c}")


def _typical_closed(fn, case, opts):
    x, p, c, keep, b = _typical_call(fn, case, opts)
    if b is None:
        return
    prob, d, live, j, slack = b
    over = live & ~keep & (d < d[j] - slack)
    if over.any():
        i = int(np.flatnonzero(over)[0])
        raise AssertionError(f"token {i} (|-log pi - H| = {d[i]!r}) was removed while the less typical token "
                             f"{int(j)} ({d[j]!r}) was kept\n  {c}")
    x64 = x.astype(np.float64)
    if opts.ties == "keep":
        split = (x64 > -np.inf) & ~keep & np.isin(x64, x64[keep])
        if split.any():
            i = int(np.flatnonzero(split)[0])
            raise AssertionError(f"a tie was split: token {i} (logit {x64[i]!r}) was removed while an equal logit "
                                 f"was kept (ties='keep')\n  {c}")


def _typical_laws():
    kind = "typical_p"
    return [
        _form_law(kind, _p_of),
        Law(kind, "typical_p.reaches_p", "the kept tokens hold probability mass >= p",
            lambda o: _with_param(o, _p_of), _reaches_p, pointwise=True),
        Law(kind, "typical_p.minimal", "the tokens more typical (|-log pi_i - H| smaller) than the least typical kept "
            "one hold mass < p", lambda o: _with_param(o, _p_of), _typical_minimal, pointwise=True),
        Law(kind, "typical_p.keeps_the_most_typical", "no removed token is more typical than a kept one (ties='keep':"
            " equal logits share one decision)", lambda o: _with_param(o, _p_of), _typical_closed, pointwise=True),
        _monotone_law(kind, _p_of, smaller_keeps_less=True),
        _shift_law(kind, _p_of),
    ]


# ---------------------------------------------------------------------------------------------------------------
# Penalties: fn(x, history, ...)
# ---------------------------------------------------------------------------------------------------------------


def _history_cases(opts, *params, size=(1, 20)):
    """Strategy of (x, history, *params)."""
    return _row_then(_rows(opts, size=size), lambda x: nps.histories(len(x)), *[lambda x, p=p: p for p in params])


def _close(got, expected, rtol, scale) -> np.ndarray:
    """got == expected, or within rtol * scale + TINY where expected is finite (float32 flushes below ~1e-38)."""
    with np.errstate(invalid="ignore"):
        slack = rtol * np.where(np.isfinite(scale), scale, 0.0) + TINY
        near = np.isfinite(expected) & (np.abs(got - expected) <= slack)
    return (got == expected) | near


def _repetition_ctrl(x, history, penalty):
    out = x.astype(np.float64)
    for t in set(history):
        out[t] = out[t] / penalty if out[t] > 0 else out[t] * penalty
    return out


def _repetition_rule(fn, case, opts):
    x, h, pen = case
    c = _case(x, (pen,), h)
    out = _call(fn, x, pen, history=h)
    expected = _repetition_ctrl(x, h, pen)
    ok = _close(out, expected, opts.rtol, np.abs(expected))
    if not ok.all():
        i = int(np.flatnonzero(~ok)[0])
        raise AssertionError(f"token {i}: {x[i]!r} became {out[i]!r}, expected {expected[i]!r}\n  {c}")


def _repetition_once(fn, case, opts):
    x, h, pen = case
    a = _call(fn, x, pen, history=h)
    distinct = sorted(set(h))
    b = _call(fn, x, pen, history=distinct)
    if not np.array_equal(a, b):
        raise AssertionError(f"history {h} gave {_show(a)} but its distinct tokens {distinct} gave {_show(b)}\n"
                             f"  {_case(x, (pen,), h)}")


def _repetition_identity(fn, case, opts):
    x, h = case
    out = _call(fn, x, 1.0, history=h)
    if not np.array_equal(out, x.astype(np.float64)):
        raise AssertionError(f"penalty 1 changed the logits to {_show(out)}\n  {_case(x, (1.0,), h)}")


def _repetition_untouched(fn, case, opts):
    x, h, pen = case
    out = _call(fn, x, pen, history=h)
    other = np.ones(len(x), bool)
    other[list(set(h))] = False
    bad = other & (out != x.astype(np.float64))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise AssertionError(f"token {i} is not in the history but changed from {x[i]!r} to {out[i]!r}\n"
                             f"  {_case(x, (pen,), h)}")


def _repetition_never_favours(fn, case, opts):
    x, h, pen = case
    c = _case(x, (pen,), h)
    out = _call(fn, x, pen, history=h)
    listed = np.zeros(len(x), bool)
    listed[list(set(h))] = True
    x64 = x.astype(np.float64)
    up = listed & (out > x64)
    if up.any():
        i = int(np.flatnonzero(up)[0])
        raise AssertionError(f"penalty {pen!r} >= 1 raised token {i}'s logit from {x64[i]!r} to {out[i]!r}\n  {c}")
    before, after = _probs(x64), _probs(out)
    rtol = max(opts.rtol, 1e-12)  # probabilities carry float64 rounding even when the logits are exact
    down = ~listed & (after < before * (1 - rtol) - TINY)
    if down.any():
        i = int(np.flatnonzero(down)[0])
        raise AssertionError(f"token {i} is not in the history but its probability fell from {before[i]!r} to "
                             f"{after[i]!r}\n  {c}")
    if _mass(after, listed) > _mass(before, listed) + rtol:
        raise AssertionError(f"the penalised tokens' mass rose from {_mass(before, listed)!r} to "
                             f"{_mass(after, listed)!r}\n  {c}")
    if listed.sum() == 1 and after[listed][0] > before[listed][0] * (1 + rtol) + TINY:
        raise AssertionError(f"the only penalised token's probability rose from {before[listed][0]!r} to "
                             f"{after[listed][0]!r}\n  {c}")


def _repetition_laws():
    kind = "repetition_penalty"
    pen = nps.penalties()
    return [
        Law(kind, "repetition_penalty.ctrl_rule", "each distinct token of the history: x / penalty if x > 0, else "
            "x * penalty", lambda o: _history_cases(o, pen), _repetition_rule, pointwise=True),
        Law(kind, "repetition_penalty.once_per_token", "a token is penalised once however often it occurs",
            lambda o: _history_cases(o, pen), _repetition_once, pointwise=True),
        Law(kind, "repetition_penalty.unlisted_untouched", "tokens absent from the history keep their logits exactly",
            lambda o: _history_cases(o, pen), _repetition_untouched, pointwise=True),
        Law(kind, "repetition_penalty.one_is_identity", "penalty 1 changes nothing",
            lambda o: _history_cases(o), _repetition_identity),
        Law(kind, "repetition_penalty.never_favours_repeats", "penalty >= 1: listed logits never rise, unlisted "
            "tokens' probabilities never fall, the listed tokens' total probability (and a lone listed token's) never "
            "rises",
            lambda o: _history_cases(o, nps.penalties(low=1.0)), _repetition_never_favours),
    ]


def _pf_call(kind, fn, x, h, pr, fr):
    if kind == "presence_penalty":
        return _call(fn, x, pr, history=h)
    if kind == "frequency_penalty":
        return _call(fn, x, fr, history=h)
    return _call(fn, x, pr, fr, history=h)


def _pf_params(kind, pr, fr):
    return {"presence_penalty": (pr,), "frequency_penalty": (fr,)}.get(kind, (pr, fr))


def _pf_formula(kind, fn, case, opts):
    x, h, pr, fr = case
    out = _pf_call(kind, fn, x, h, pr, fr)
    counts = Counter(h)
    x64 = x.astype(np.float64)
    expected = x64.copy()
    scale = np.abs(x64)
    for t, n in counts.items():
        expected[t] = x64[t] - (pr + fr * n)
        scale[t] = max(abs(x64[t]), abs(pr) + abs(fr) * n)
    ok = _close(out, expected, opts.rtol, scale)
    if not ok.all():
        i = int(np.flatnonzero(~ok)[0])
        raise AssertionError(f"token {i} (seen {counts.get(i, 0)} times): {x64[i]!r} became {out[i]!r}, expected "
                             f"{expected[i]!r}\n  {_case(x, _pf_params(kind, pr, fr), h)}")


def _pf_identity(kind, fn, case, opts):
    x, h = case
    out = _pf_call(kind, fn, x, h, 0.0, 0.0)
    if not np.array_equal(out, x.astype(np.float64)):
        raise AssertionError(f"zero penalties changed the logits to {_show(out)}\n"
                             f"  {_case(x, _pf_params(kind, 0.0, 0.0), h)}")


def _pf_never_raises(kind, fn, case, opts):
    x, h, pr, fr = case
    pr, fr = abs(pr), abs(fr)
    out = _pf_call(kind, fn, x, h, pr, fr)
    up = out > x.astype(np.float64)
    if up.any():
        i = int(np.flatnonzero(up)[0])
        raise AssertionError(f"non-negative penalties raised token {i} from {x[i]!r} to {out[i]!r}\n"
                             f"  {_case(x, _pf_params(kind, pr, fr), h)}")


def _presence_frequency_laws(kind):
    """kind: presence_frequency_penalty (fn(x, h, presence, frequency)), presence_penalty or frequency_penalty."""
    values = st.sampled_from([0.0, 0.5, 1.0, -0.5]) | st.floats(-3.0, 3.0)
    zero = st.just(0.0)
    presence = values if kind != "frequency_penalty" else zero
    frequency = values if kind != "presence_penalty" else zero

    what = {"presence_penalty": "x_t - presence for every token in the history",
            "frequency_penalty": "x_t - frequency * count_t for every token in the history"}.get(
        kind, "x_t - presence - frequency * count_t for every token in the history")
    return [
        Law(kind, f"{kind}.formula", f"{what}; other tokens unchanged",
            lambda o: _history_cases(o, presence, frequency), partial(_pf_formula, kind), pointwise=True),
        Law(kind, f"{kind}.zero_is_identity", "zero penalties change nothing", lambda o: _history_cases(o),
            partial(_pf_identity, kind)),
        Law(kind, f"{kind}.never_favours_repeats", "non-negative penalties never raise a logit",
            lambda o: _history_cases(o, presence, frequency), partial(_pf_never_raises, kind)),
    ]


def _ngram_laws():
    kind = "no_repeat_ngram"

    def banned(h, n):
        seen = {tuple(h[i : i + n]) for i in range(len(h) - n + 1)}
        return {t for t in set(range(max(h, default=0) + 1)) if tuple((h + [t])[-n:]) in seen}

    def cases(opts):
        return _history_cases(opts, nps.ngram_sizes(), size=(1, 6))

    def bans(fn, case, opts):
        x, h, n = case
        out = _call(fn, x, n, history=h)
        for t in sorted(banned(h, n)):
            if t < len(x) and out[t] != -np.inf:
                raise AssertionError(f"token {t} would repeat the {n}-gram {tuple((h + [t])[-n:])} but was not banned "
                                     f"(got {out[t]!r})\n  {_case(x, (n,), h)}")

    def only(fn, case, opts):
        x, h, n = case
        out = _call(fn, x, n, history=h)
        b = banned(h, n)
        for t in range(len(x)):
            if t not in b and out[t] != x[t]:
                raise AssertionError(f"token {t} repeats no {n}-gram but changed from {x[t]!r} to {out[t]!r}\n"
                                     f"  {_case(x, (n,), h)}")

    return [
        Law(kind, "no_repeat_ngram.bans_repeats", "every token t such that history + [t] ends with an n-gram already "
            "in the history is -inf", cases, bans, pointwise=True),
        Law(kind, "no_repeat_ngram.bans_nothing_else", "every other token keeps its logit exactly", cases, only,
            pointwise=True),
    ]


LAWS: dict[str, list[Law]] = {
    "temperature": _temperature_laws(),
    "top_k": _top_k_laws(),
    "top_p": _top_p_laws(),
    "min_p": _min_p_laws(),
    "typical_p": _typical_laws(),
    "repetition_penalty": _repetition_laws(),
    "presence_penalty": _presence_frequency_laws("presence_penalty"),
    "frequency_penalty": _presence_frequency_laws("frequency_penalty"),
    "presence_frequency_penalty": _presence_frequency_laws("presence_frequency_penalty"),
    "no_repeat_ngram": _ngram_laws(),
}


def laws_of(kind: str) -> list[Law]:
    """The laws of one kind of filter, in the order check_filter runs them."""
    if kind not in LAWS:
        raise ValueError(f"unknown kind {kind!r}; one of {', '.join(KINDS)}")
    return list(LAWS[kind])
