"""The laws of the penalties (repetition, presence and frequency) and of the no-repeat-n-gram ban: fn(x, history,
...); laws.py collects them, law_base.py holds what they call."""

from __future__ import annotations

from collections import Counter
from functools import partial

import numpy as np
from hypothesis import strategies as st

from . import strategies as nps
from .law_base import TINY, Law, call_under_test, law_case, mass_of, probs_of, row_then, rows_of, show_case


# ---------------------------------------------------------------------------------------------------------------
# Penalties: fn(x, history, ...)
# ---------------------------------------------------------------------------------------------------------------


def _history_cases(opts, *params, size=(1, 20)):
    """Strategy of (x, history, *params)."""
    return row_then(rows_of(opts, size=size), lambda x: nps.histories(len(x)), *[lambda x, p=p: p for p in params])


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
    c = law_case(x, (pen,), h)
    out = call_under_test(fn, x, pen, history=h)
    expected = _repetition_ctrl(x, h, pen)
    ok = _close(out, expected, opts.rtol, np.abs(expected))
    if not ok.all():
        i = int(np.flatnonzero(~ok)[0])
        raise AssertionError(f"token {i}: {x[i]!r} became {out[i]!r}, expected {expected[i]!r}\n  {c}")


def _repetition_once(fn, case, opts):
    x, h, pen = case
    a = call_under_test(fn, x, pen, history=h)
    distinct = sorted(set(h))
    b = call_under_test(fn, x, pen, history=distinct)
    if not np.array_equal(a, b):
        raise AssertionError(f"history {h} gave {show_case(a)} but its distinct tokens {distinct} gave {show_case(b)}\n"
                             f"  {law_case(x, (pen,), h)}")


def _repetition_identity(fn, case, opts):
    x, h = case
    out = call_under_test(fn, x, 1.0, history=h)
    if not np.array_equal(out, x.astype(np.float64)):
        raise AssertionError(f"penalty 1 changed the logits to {show_case(out)}\n  {law_case(x, (1.0,), h)}")


def _repetition_untouched(fn, case, opts):
    x, h, pen = case
    out = call_under_test(fn, x, pen, history=h)
    other = np.ones(len(x), bool)
    other[list(set(h))] = False
    bad = other & (out != x.astype(np.float64))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise AssertionError(f"token {i} is not in the history but changed from {x[i]!r} to {out[i]!r}\n"
                             f"  {law_case(x, (pen,), h)}")


def _repetition_never_favours(fn, case, opts):
    x, h, pen = case
    c = law_case(x, (pen,), h)
    out = call_under_test(fn, x, pen, history=h)
    listed = np.zeros(len(x), bool)
    listed[list(set(h))] = True
    x64 = x.astype(np.float64)
    up = listed & (out > x64)
    if up.any():
        i = int(np.flatnonzero(up)[0])
        raise AssertionError(f"penalty {pen!r} >= 1 raised token {i}'s logit from {x64[i]!r} to {out[i]!r}\n  {c}")
    before, after = probs_of(x64), probs_of(out)
    rtol = max(opts.rtol, 1e-12)  # probabilities carry float64 rounding even when the logits are exact
    down = ~listed & (after < before * (1 - rtol) - TINY)
    if down.any():
        i = int(np.flatnonzero(down)[0])
        raise AssertionError(f"token {i} is not in the history but its probability fell from {before[i]!r} to "
                             f"{after[i]!r}\n  {c}")
    if mass_of(after, listed) > mass_of(before, listed) + rtol:
        raise AssertionError(f"the penalised tokens' mass rose from {mass_of(before, listed)!r} to "
                             f"{mass_of(after, listed)!r}\n  {c}")
    if listed.sum() == 1 and after[listed][0] > before[listed][0] * (1 + rtol) + TINY:
        raise AssertionError(f"the only penalised token's probability rose from {before[listed][0]!r} to "
                             f"{after[listed][0]!r}\n  {c}")


def repetition_laws():
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
        return call_under_test(fn, x, pr, history=h)
    if kind == "frequency_penalty":
        return call_under_test(fn, x, fr, history=h)
    return call_under_test(fn, x, pr, fr, history=h)


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
                             f"{expected[i]!r}\n  {law_case(x, _pf_params(kind, pr, fr), h)}")


def _pf_identity(kind, fn, case, opts):
    x, h = case
    out = _pf_call(kind, fn, x, h, 0.0, 0.0)
    if not np.array_equal(out, x.astype(np.float64)):
        raise AssertionError(f"zero penalties changed the logits to {show_case(out)}\n"
                             f"  {law_case(x, _pf_params(kind, 0.0, 0.0), h)}")


def _pf_never_raises(kind, fn, case, opts):
    x, h, pr, fr = case
    pr, fr = abs(pr), abs(fr)
    out = _pf_call(kind, fn, x, h, pr, fr)
    up = out > x.astype(np.float64)
    if up.any():
        i = int(np.flatnonzero(up)[0])
        raise AssertionError(f"non-negative penalties raised token {i} from {x[i]!r} to {out[i]!r}\n"
                             f"  {law_case(x, _pf_params(kind, pr, fr), h)}")


def presence_frequency_laws(kind):
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


def ngram_laws():
    kind = "no_repeat_ngram"

    def banned(h, n):
        seen = {tuple(h[i : i + n]) for i in range(len(h) - n + 1)}
        return {t for t in set(range(max(h, default=0) + 1)) if tuple((h + [t])[-n:]) in seen}

    def cases(opts):
        return _history_cases(opts, nps.ngram_sizes(), size=(1, 6))

    def bans(fn, case, opts):
        x, h, n = case
        out = call_under_test(fn, x, n, history=h)
        for t in sorted(banned(h, n)):
            if t < len(x) and out[t] != -np.inf:
                raise AssertionError(f"token {t} would repeat the {n}-gram {tuple((h + [t])[-n:])} but was not banned "
                                     f"(got {out[t]!r})\n  {law_case(x, (n,), h)}")

    def only(fn, case, opts):
        x, h, n = case
        out = call_under_test(fn, x, n, history=h)
        b = banned(h, n)
        for t in range(len(x)):
            if t not in b and out[t] != x[t]:
                raise AssertionError(f"token {t} repeats no {n}-gram but changed from {x[t]!r} to {out[t]!r}\n"
                                     f"  {law_case(x, (n,), h)}")

    return [
        Law(kind, "no_repeat_ngram.bans_repeats", "every token t such that history + [t] ends with an n-gram already "
            "in the history is -inf", cases, bans, pointwise=True),
        Law(kind, "no_repeat_ngram.bans_nothing_else", "every other token keeps its logit exactly", cases, only,
            pointwise=True),
    ]
