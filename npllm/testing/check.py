"""Running the laws of laws.py against a function: one Hypothesis search per law (the pointwise laws of a kind share
one), a failure raised as LawFailure with the law's name, its statement and the minimal falsifying example."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed

from .laws import Law, LawFailure, Options, laws_of

__all__ = ["check_filter", "check_law", "check_case"]


def _options(ties, rtol, dtypes, size) -> Options:
    if ties not in ("keep", "any"):
        raise ValueError(f"ties must be 'keep' or 'any', got {ties!r}")
    return Options(ties=ties, rtol=float(rtol), dtypes=tuple(np.dtype(d) for d in dtypes), size=tuple(size))


class _Broken(AssertionError):
    """Raised from one place for whichever law of a group fails, so Hypothesis shrinks them as one failure."""

    def __init__(self, law: Law, failure: AssertionError):
        super().__init__(str(failure))
        self.law = law
        self.failure = failure


def _run(fn, group: list[Law], opts: Options, max_examples, seed, derandomize, shrink=True) -> None:
    """One Hypothesis search over the cases of group[0], checking every law of the group on each case.

    The settings are explicit (max_examples, no deadline, no health checks, no example database, one bug reported),
    so the check behaves the same in any test suite; `derandomize` is taken from the active profile unless given,
    and `seed` fixes the search.
    """

    def laws_hold(case):
        for law in group:
            try:
                law.check(fn, case, opts)
            except AssertionError as failure:
                raise _Broken(law, failure) from None

    laws_hold.__name__ = group[0].name.replace(".", "__") if len(group) == 1 else f"{group[0].kind}__laws"
    # No explain phase: its "lines run only by failing cases" point into the kit, not the user's code.
    phases = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target] + ([Phase.shrink] if shrink else [])
    config = dict(max_examples=max_examples, deadline=None, suppress_health_check=list(HealthCheck),
                  database=None, report_multiple_bugs=False, phases=phases)
    if derandomize is not None:
        config["derandomize"] = derandomize
    test = settings(**config)(given(group[0].cases(opts))(laws_hold))
    if seed is not None:
        test = hypothesis_seed(seed)(test)
    try:
        test()
    except _Broken as broken:
        broken.failure.__notes__ = getattr(broken, "__notes__", [])
        raise LawFailure(broken.law, broken.failure) from None
    except Exception as error:  # e.g. Hypothesis' FlakyFailure group: fn answered one input two ways
        inner = [e for e in getattr(error, "exceptions", ()) if isinstance(e, _Broken)]
        if not inner:
            raise
        inner[0].failure.__notes__ = [f"{type(error).__name__}: {error}"] + getattr(inner[0], "__notes__", [])
        raise LawFailure(inner[0].law, inner[0].failure) from error


def check_law(fn, law: Law, *, ties="keep", max_examples=100, rtol=1e-5, dtypes=(np.float64, np.float32),
              size=(1, 32), seed=None, derandomize=None, shrink=True) -> None:
    """Run one law against fn with Hypothesis; raise LawFailure with the minimal falsifying example if it fails."""
    _run(fn, [law], _options(ties, rtol, dtypes, size), max_examples, seed, derandomize, shrink)


def check_filter(fn, kind: str, *, ties="keep", max_examples=100, rtol=1e-5, dtypes=(np.float64, np.float32),
                 size=(1, 32), laws=None, seed=None, derandomize=None, shrink=True) -> None:
    """Check fn against every law of `kind`; raise LawFailure (an AssertionError) at the first law that fails.

    fn follows CONVENTIONS[kind] (logits are [V] NumPy arrays; -inf marks a removed token). ties: "keep" (a tie at
    a top-k / top-p / typical-p boundary is kept or removed whole, npllm's rule) or "any" (an implementation may
    split it by position). max_examples: Hypothesis examples per search (the pointwise laws share one search, each
    other law has its own). rtol: numerical slack for decisions within a few ulps of a threshold. dtypes: logit
    dtypes to draw. size: (low, high) vocabulary sizes (penalty kinds draw at most 20, no_repeat_ngram at most 6).
    laws: names of a subset of laws to run. seed: fixes Hypothesis' search; derandomize: overrides the profile's.
    shrink=False reports the first failing example found instead of the minimal one (faster when only detection
    matters).
    """
    selected = laws_of(kind)
    if laws is not None:
        unknown = set(laws) - {law.name for law in selected}
        if unknown:
            raise ValueError(f"no such law of {kind}: {sorted(unknown)}")
        selected = [law for law in selected if law.name in laws]
    opts = _options(ties, rtol, dtypes, size)
    pointwise = [law for law in selected if law.pointwise]
    groups = ([pointwise] if pointwise else []) + [[law] for law in selected if not law.pointwise]
    for group in groups:
        _run(fn, group, opts, max_examples, seed, derandomize, shrink)


def check_case(fn, kind: str, logits, *params, history=None, ties="keep", rtol=1e-5) -> None:
    """Check fn on one given case against every pointwise law of `kind` (no Hypothesis search): for inputs too
    large or too specific for the strategies, e.g. a 50 000-token row. Raises LawFailure."""
    x = np.asarray(logits)
    opts = _options(ties, rtol, (x.dtype,), (len(x), len(x)))
    if kind == "presence_penalty":
        params = (*params, 0.0)  # the laws take (presence, frequency)
    elif kind == "frequency_penalty":
        params = (0.0, *params)
    case = (x, *params) if history is None else (x, list(history), *params)
    for law in laws_of(kind):
        if law.pointwise:
            try:
                law.check(fn, case, opts)
            except AssertionError as failure:
                raise LawFailure(law, failure) from None
