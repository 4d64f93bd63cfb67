"""The laws of the filters by kind (temperature, top_k, top_p, min_p, typical_p), after the laws they share; laws.py
collects them, law_base.py holds what they call."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import strategies as st

from . import strategies as nps
from .law_base import (LN_TINY, Law, call_under_test, dyadic_of, kept_of, law_case, log_probs_of, mass_of, probs_of,
                       row_then, rows_of, show_case, slack_of, top_of, with_param)


# ---------------------------------------------------------------------------------------------------------------
# Laws shared by the filters (top_k, top_p, min_p, typical_p)
# ---------------------------------------------------------------------------------------------------------------


def _form_law(kind, param_of):
    def check(fn, case, opts):
        x, param = case
        kept_of(x, call_under_test(fn, x, param), law_case(x, (param,)))

    return Law(kind, f"{kind}.output_form",
               "kept entries are returned unchanged, removed ones as -inf, -inf inputs stay -inf, and at least one "
               "token survives", lambda o: with_param(o, param_of), check, pointwise=True)


def _argmax_law(kind, param_of):
    def check(fn, case, opts):
        x, param = case
        keep = kept_of(x, call_under_test(fn, x, param), law_case(x, (param,)))
        if not keep[top_of(x, opts)].any():
            raise AssertionError(f"the most probable token {int(np.argmax(x))} was removed\n  {law_case(x, (param,))}")

    return Law(kind, f"{kind}.keeps_the_argmax", "the most probable token always survives",
               lambda o: with_param(o, param_of), check, pointwise=True)


def _monotone_law(kind, param_of, smaller_keeps_less: bool, needs_unique_under_any: bool = False):
    def cases(opts):
        ties = None if not needs_unique_under_any else (opts.ties == "keep")
        return row_then(rows_of(opts, ties), param_of, param_of)

    def check(fn, case, opts):
        x, a, b = case
        low, high = sorted((a, b))
        k_low = kept_of(x, call_under_test(fn, x, low), law_case(x, (low,)))
        k_high = kept_of(x, call_under_test(fn, x, high), law_case(x, (high,)))
        small, large, (ps, pl) = (k_low, k_high, (low, high)) if smaller_keeps_less else (k_high, k_low, (high, low))
        extra = small & ~large
        if extra.any():
            raise AssertionError(
                f"token {int(np.flatnonzero(extra)[0])} is kept at param {ps!r} but removed at {pl!r}, which should "
                f"keep a superset\n  {law_case(x, ())}"
            )

    direction = "a larger parameter keeps a superset" if smaller_keeps_less else "a larger parameter keeps a subset"
    return Law(kind, f"{kind}.monotone", f"monotone: {direction} of the tokens", cases, check)


def _shift_law(kind, param_of):
    """Adding a constant to every logit changes no decision (dyadic logits and integer constants: exact sums)."""

    def cases(opts):
        return row_then(rows_of(opts), lambda x: st.integers(-1000, 1000), param_of, transform=dyadic_of)

    def check(fn, case, opts):
        x, c, param = case
        y = (x + x.dtype.type(c)).astype(x.dtype)
        a = kept_of(x, call_under_test(fn, x, param), law_case(x, (param,)))
        b = kept_of(y, call_under_test(fn, y, param), law_case(y, (param,)))
        if not np.array_equal(a, b):
            raise AssertionError(
                f"kept {np.flatnonzero(a).tolist()} for the logits but {np.flatnonzero(b).tolist()} after adding "
                f"{c} to every logit\n  {law_case(x, (param,))}"
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
    slack = slack_of(opts, low - x64.max())
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
    once = call_under_test(fn, x, param)
    k1 = kept_of(x, once, law_case(x, (param,)))
    y = once.astype(x.dtype)
    return k1, kept_of(y, call_under_test(fn, y, param), law_case(y, (param,)))


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
            f"{(x64[i] - x64[a]) / T!r}\n  output = {show_case(out)}\n  {case}"
        )


def _temperature_divides(fn, case, opts):
    x, T = case
    _temperature_ratios(x, call_under_test(fn, x, T), T, opts, law_case(x, (T,)))


def _temperature_identity(fn, case, opts):
    (x,) = case
    _temperature_ratios(x, call_under_test(fn, x, 1.0), 1.0, opts, law_case(x, (1.0,)))


def _temperature_masked(fn, case, opts):
    x, T = case
    out = call_under_test(fn, x, T)
    bad = np.isneginf(x) & ~np.isneginf(out)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise AssertionError(f"token {i} was -inf and came out as {out[i]!r}\n  {law_case(x, (T,))}")


def _temperature_order(fn, case, opts):
    x, T = case
    out = call_under_test(fn, x, T)
    x64 = x.astype(np.float64)
    order = np.argsort(x64, kind="stable")
    xs, os = x64[order], out[order]
    bad = (xs[:-1] < xs[1:]) & (os[:-1] > os[1:])
    if bad.any():
        j = int(np.flatnonzero(bad)[0])
        i, k = int(order[j]), int(order[j + 1])
        raise AssertionError(f"x_{i} < x_{k} but out_{i} = {out[i]!r} > out_{k} = {out[k]!r}\n  {law_case(x, (T,))}")


def _temperature_sharpening(fn, case, opts):
    x, t1, t2 = case
    low, high = sorted((t1, t2))
    top_low = probs_of(call_under_test(fn, x, low)).max()
    top_high = probs_of(call_under_test(fn, x, high)).max()
    if top_low < top_high - opts.rtol:
        raise AssertionError(f"top probability {top_low!r} at T = {low!r} is below {top_high!r} at T = {high!r}"
                             f"\n  {law_case(x, ())}")


def temperature_laws():
    kind = "temperature"
    T = nps.temperatures()
    return [
        Law(kind, "temperature.divides_logits", "log-probability differences are divided by T: out_i - out_j = "
            "(x_i - x_j) / T", lambda o: st.tuples(rows_of(o), T), _temperature_divides, pointwise=True),
        Law(kind, "temperature.one_is_identity", "T = 1 leaves the distribution unchanged",
            lambda o: st.tuples(rows_of(o)), _temperature_identity),
        Law(kind, "temperature.keeps_masked_tokens_masked", "a -inf logit stays -inf",
            lambda o: st.tuples(rows_of(o), T), _temperature_masked, pointwise=True),
        Law(kind, "temperature.keeps_the_order", "x_i < x_j implies out_i <= out_j, so the argmax stays the argmax",
            lambda o: st.tuples(rows_of(o), T), _temperature_order, pointwise=True),
        Law(kind, "temperature.lower_sharpens", "a lower T never lowers the top probability",
            lambda o: st.tuples(rows_of(o), T, T), _temperature_sharpening),
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
    c = law_case(x, (k,))
    keep = kept_of(x, call_under_test(fn, x, k), c)
    x64 = x.astype(np.float64)
    dropped = (x64 > -np.inf) & ~keep
    if dropped.any() and x64[dropped].max() > x64[keep].min():
        j = int(np.flatnonzero(dropped & (x64 > x64[keep].min()))[0])
        raise AssertionError(f"token {j} (logit {x64[j]!r}) was removed while logit {x64[keep].min()!r} was kept"
                             f"\n  {c}")


def _top_k_count(fn, case, opts):
    x, k = case
    c = law_case(x, (k,))
    keep = kept_of(x, call_under_test(fn, x, k), c)
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
    once = call_under_test(fn, x, k)
    kept_of(x, once, law_case(x, (k,)))
    y = once.astype(x.dtype)
    twice = call_under_test(fn, y, k)
    if not np.array_equal(once, twice):
        raise AssertionError(f"a second pass changed the output: {show_case(once)} -> {show_case(twice)}\n  "
                             f"{law_case(x, (k,))}")


def _top_k_idempotent_cases(opts):
    return row_then(rows_of(opts, ties=opts.ties == "keep"), _top_k_of)


def top_k_laws():
    kind = "top_k"
    return [
        _form_law(kind, _top_k_of),
        Law(kind, "top_k.keeps_a_top_set", "no removed token has a larger logit than a kept one",
            lambda o: with_param(o, _top_k_of), _top_k_top_set, pointwise=True),
        Law(kind, "top_k.keeps_k", "ties='keep': exactly the tokens with logit >= the k-th largest survive (exactly k "
            "without ties, everything when k >= V); ties='any': between k and that many",
            lambda o: with_param(o, _top_k_of), _top_k_count, pointwise=True),
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
    c = law_case(x, (p,))
    keep = kept_of(x, call_under_test(fn, x, p), c)
    got = mass_of(probs_of(x), keep)
    if got < p - opts.rtol:
        raise AssertionError(f"kept mass {got!r} < p = {p!r} (kept {np.flatnonzero(keep).tolist()})\n  {c}")


def _top_p_minimal(fn, case, opts):
    x, p = case
    c = law_case(x, (p,))
    keep = kept_of(x, call_under_test(fn, x, p), c)
    prob, x64 = probs_of(x), x.astype(np.float64)
    low = x64[keep].min()
    above = x64 > low + slack_of(opts, low - x64.max())
    whole = not ((x64 == low) & ~keep).any()  # the least probable kept value's tie group is kept whole
    if whole and mass_of(prob, above) < p + opts.rtol:
        return
    if opts.ties == "any":
        least = np.flatnonzero(keep)[np.argmin(x64[keep])]
        if mass_of(prob, keep) - prob[least] < p + opts.rtol:
            return
    raise AssertionError(
        f"kept {np.flatnonzero(keep).tolist()} (mass {mass_of(prob, keep)!r}), but the tokens more probable than the "
        f"least probable kept one already hold mass {mass_of(prob, above)!r} >= p = {p!r}\n  {c}")


def _top_p_top_set(fn, case, opts):
    x, p = case
    c = law_case(x, (p,))
    _upper_set(x, kept_of(x, call_under_test(fn, x, p), c), opts, c)


def _top_p_second_pass(fn, case, opts):
    x, p = case
    k1, k2 = _two_passes(fn, x, p)
    if (k2 & ~k1).any() or not k2[top_of(x, opts)].any():
        raise AssertionError(f"a second pass kept {np.flatnonzero(k2).tolist()}, the first "
                             f"{np.flatnonzero(k1).tolist()}: it must keep a subset holding the argmax\n  "
                             f"{law_case(x, (p,))}")


def top_p_laws():
    kind = "top_p"
    return [
        _form_law(kind, _p_of),
        Law(kind, "top_p.reaches_p", "the kept tokens hold probability mass >= p", lambda o: with_param(o, _p_of),
            _reaches_p, pointwise=True),
        Law(kind, "top_p.minimal", "the tokens more probable than the least probable kept one hold mass < p (without "
            "ties: removing the last kept token falls below p)", lambda o: with_param(o, _p_of), _top_p_minimal,
            pointwise=True),
        Law(kind, "top_p.keeps_a_top_set", "no removed token is more probable than a kept one (ties='keep': a tie is "
            "kept whole)", lambda o: with_param(o, _p_of), _top_p_top_set, pointwise=True),
        _argmax_law(kind, _p_of),
        _monotone_law(kind, _p_of, smaller_keeps_less=True),
        Law(kind, "top_p.second_pass_keeps_a_subset", "applied twice it keeps a subset of one pass that still holds "
            "the argmax (not idempotent: the second pass renormalises)", lambda o: with_param(o, _p_of),
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
    d = slack_of(opts, np.where(finite, s, 0.0))
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


def min_p_laws():
    kind = "min_p"

    def p_of(x):
        return nps.min_p_values()

    def threshold(fn, case, opts):
        x, p = case
        c = law_case(x, (p,))
        why = _min_p_violation(x, kept_of(x, call_under_test(fn, x, p), c), p, opts)
        if why:
            raise AssertionError(f"{why}\n  {c}")

    def idempotent(fn, case, opts):
        x, p = case
        k1, k2 = _two_passes(fn, x, p)
        lost = k1 & ~k2
        x64 = x.astype(np.float64)
        s = np.where(x64 > -np.inf, x64 - x64.max(), 0.0)
        with np.errstate(invalid="ignore"):
            near = np.abs(s - (math.log(p) if p > 0 else -math.inf)) <= slack_of(opts, s)
        if (k2 & ~k1).any() or (lost & ~near).any():
            raise AssertionError(f"a second pass kept {np.flatnonzero(k2).tolist()}, the first "
                                 f"{np.flatnonzero(k1).tolist()}\n  {law_case(x, (p,))}")

    return [
        _form_law(kind, p_of),
        Law(kind, "min_p.threshold", "exactly the tokens with pi_i >= p * max pi survive",
            lambda o: with_param(o, p_of), threshold, pointwise=True),
        _argmax_law(kind, p_of),
        _monotone_law(kind, p_of, smaller_keeps_less=False),
        Law(kind, "min_p.idempotent", "applying it twice gives the same result as once (the maximum and the ratios "
            "survive)", lambda o: with_param(o, p_of), idempotent),
        _shift_law(kind, p_of),
    ]


# ---------------------------------------------------------------------------------------------------------------
# typical_p: fn(x, p)
# ---------------------------------------------------------------------------------------------------------------


def _typicality(x):
    """(pi, d, live, entropy): d_i = |-log pi_i - H| from log-probabilities; live = pi_i >= TINY."""
    logp = log_probs_of(x)
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
    logp = log_probs_of(x)
    return prob, d, live, j, opts.rtol * max(1.0, abs(logp[j]), entropy)


def _typical_call(fn, case, opts):
    """(x, p, the case line, the kept mask, _typical_bound of it) for fn applied to the case."""
    x, p = case
    c = law_case(x, (p,))
    keep = kept_of(x, call_under_test(fn, x, p), c)
    return x, p, c, keep, _typical_bound(x, keep, opts)


def _typical_minimal(fn, case, opts):
    x, p, c, keep, b = _typical_call(fn, case, opts)
    if b is None:
        return  # only dead tokens kept: typical_p.reaches_p reports it
    prob, d, live, j, slack = b
    x64 = x.astype(np.float64)
    closer = live & (d < d[j] - slack)
    whole = not ((x64 == x64[j]) & ~keep).any()
    if whole and mass_of(prob, closer) < p + opts.rtol:
        return
    if opts.ties == "any" and mass_of(prob, keep) - prob[j] < p + opts.rtol:
        return
    raise AssertionError(f"kept {np.flatnonzero(keep).tolist()}, but the tokens more typical than the least "
                         f"typical kept one ({int(j)}) already hold mass {mass_of(prob, closer)!r} >= p = {p!r}\n"
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


def typical_laws():
    kind = "typical_p"
    return [
        _form_law(kind, _p_of),
        Law(kind, "typical_p.reaches_p", "the kept tokens hold probability mass >= p",
            lambda o: with_param(o, _p_of), _reaches_p, pointwise=True),
        Law(kind, "typical_p.minimal", "the tokens more typical (|-log pi_i - H| smaller) than the least typical kept "
            "one hold mass < p", lambda o: with_param(o, _p_of), _typical_minimal, pointwise=True),
        Law(kind, "typical_p.keeps_the_most_typical", "no removed token is more typical than a kept one (ties='keep':"
            " equal logits share one decision)", lambda o: with_param(o, _p_of), _typical_closed, pointwise=True),
        _monotone_law(kind, _p_of, smaller_keeps_less=True),
        _shift_law(kind, _p_of),
    ]
