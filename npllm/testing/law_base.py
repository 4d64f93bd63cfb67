"""The machinery of the sampling laws (laws.py): Options, Law and LawFailure, calling the function under test, the
float64 references, and the strategies of cases the laws share.

References are computed here in float64 from the logits (softmax with the maximum subtracted, -inf entries with
probability 0), independently of the function under test. Decisions that involve arithmetic (masses, thresholds,
typicality) may go either way within a slack `rtol`: a probability mass within `rtol` of p, a logit within
`rtol · max(1, |logit - max|)` of a threshold, probabilities below 1e-30 (they underflow in float32). Decisions that
involve no arithmetic (which logits are larger, which tokens are listed in a history) are exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from hypothesis import strategies as st

from . import strategies as nps

TINY = 1e-30  # probabilities below this count as zero in either direction (float32 underflows near 1e-38)
LN_TINY = math.log(TINY)


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


def show_case(x) -> str:
    return np.array2string(np.asarray(x), precision=17, separator=", ", max_line_width=10**6, threshold=10**6)


def call_under_test(fn, x: np.ndarray, *args, history=None) -> np.ndarray:
    """fn(x, *args) or fn(x, history, *args) on copies; checks the contract and returns the output as float64.

    The contract: returns an array of x's shape with no NaN and no +inf, and leaves its arguments unchanged.
    """
    arg = x.copy()
    hist = None if history is None else list(history)
    try:
        out = fn(arg, *args) if history is None else fn(arg, hist, *args)
    except Exception as err:  # the function under test refused a valid input
        raise AssertionError(f"[contract] fn raised {type(err).__name__}: {err}\n  {law_case(x, args, history)}") \
            from err
    if not np.array_equal(arg, x):
        raise AssertionError(f"[contract] fn changed its logits argument in place\n  {law_case(x, args, history)}")
    if history is not None and hist != list(history):
        raise AssertionError(f"[contract] fn changed its history argument in place\n  {law_case(x, args, history)}")
    out = np.asarray(out)
    if out.shape != x.shape or out.dtype.kind not in "fiu":
        raise AssertionError(
            f"[contract] fn returned {out.dtype} of shape {out.shape}, expected a real array of shape {x.shape}\n"
            f"  {law_case(x, args, history)}"
        )
    out = out.astype(np.float64)
    if np.isnan(out).any() or np.isposinf(out).any():
        raise AssertionError(f"[contract] fn returned NaN or +inf: {show_case(out)}\n  {law_case(x, args, history)}")
    return out


class law_case:
    """The case as a line of Python (logits, history, parameters), formatted only when a message needs it: a
    law checks many cases and reports one."""

    def __init__(self, x, args, history=None):
        self.x, self.args, self.history = x, args, history

    def __str__(self) -> str:
        parts = [f"logits = np.array({show_case(self.x)}, dtype=np.{np.asarray(self.x).dtype})"]
        if self.history is not None:
            parts.append(f"history = {list(self.history)}")
        parts += [f"param = {a!r}" for a in self.args]
        return ", ".join(parts)


def probs_of(x: np.ndarray) -> np.ndarray:
    """[V] -> [V] float64 softmax, -inf entries 0."""
    x = x.astype(np.float64)
    e = np.exp(x - x.max())
    return e / math.fsum(e)


def log_probs_of(x: np.ndarray) -> np.ndarray:
    """[V] -> [V] float64 log-softmax from the logits (no underflow for finite logits), -inf for -inf."""
    s = x.astype(np.float64) - x.max()
    return s - math.log(math.fsum(np.exp(s)))


def mass_of(p: np.ndarray, keep: np.ndarray) -> float:
    return math.fsum(p[keep])


def slack_of(opts: Options, s) -> np.ndarray:
    """Logit slack around shifted logits s = x - max x: rtol · max(1, |s|)."""
    return opts.rtol * np.maximum(1.0, np.abs(s))


def kept_of(x: np.ndarray, out: np.ndarray, case: str) -> np.ndarray:
    """The filter's output form: each entry is its input value or -inf, and something survives. -> kept mask."""
    x64 = x.astype(np.float64)
    bad = ~((out == x64) | (out == -np.inf))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise AssertionError(
            f"token {i}: input {x64[i]!r}, output {out[i]!r}: a filter returns a kept logit unchanged, a removed one "
            f"as -inf\n  output = {show_case(out)}\n  {case}"
        )
    keep = out > -np.inf
    if not keep.any():
        raise AssertionError(f"every token was removed\n  {case}")
    return keep


def top_of(x: np.ndarray, opts: Options) -> np.ndarray:
    """The most probable tokens: logits within the slack (rtol) of the maximum. Logits 1e-278 apart have equal
    probabilities in floating point, so a filter may take either for the argmax."""
    x64 = x.astype(np.float64)
    return x64 >= x64.max() - opts.rtol


def dyadic_of(x: np.ndarray) -> np.ndarray:
    """Finite logits rounded to multiples of 1/64 (|x| < 2^17 stays exact in float32, so x + integer is exact)."""
    return np.where(np.isfinite(x), np.round(x.astype(np.float64) * 64) / 64, x).astype(x.dtype)


def rows_of(opts: Options, ties: bool | None = None, neg_inf: bool = True, size=None):
    return nps.logits(size=size or opts.size, dtype=tuple(opts.dtypes), ties=opts.ties == "keep" if ties is None
                      else ties, neg_inf=neg_inf)


@st.composite
def row_then(draw, rows, *param_ofs, transform=None):
    """(x, *params) with each param drawn from param_of(x); x optionally transformed first. A composite rather
    than flatmap: no strategy is built per example, which keeps a search of 100 examples near a second."""
    x = draw(rows)
    if transform is not None:
        x = transform(x)
    return (x, *(draw(param_of(x)) for param_of in param_ofs))


def with_param(opts, param_of, ties=None, size=None):
    """Strategy of (x, param) with param drawn from param_of(x)."""
    return row_then(rows_of(opts, ties, size=size), param_of)
