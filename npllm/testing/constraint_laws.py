"""The laws of a structured-output constraint, checkable against anyone's: `check_constraint(bound, ...)`.

A constraint here is anything with start() -> a state offering allowed(stops) -> [V] bool (the tokens allowed next;
the stop ids where the output may end), advance(token) and finished (nothing but the end is allowed), as
npllm.constraint's BoundConstraint does. Hypothesis walks the language, each step drawing one of the allowed tokens,
and checks at every step:

    never_empty        a state that is not finished allows at least one token
    end_exactly        the stop ids are allowed exactly where the text so far is in the language
    finished_in        a finished state's text is in the language, and it allows the stop ids and nothing else
                       (so the generation loop can end it without another forward)

`in_language(text) -> bool` is the oracle, independent of the constraint (jsonschema, re.fullmatch, a parser).

`check_masked_sampler(fn)` checks the stage itself on anyone's sampler fn(logits[V], allowed[V] bool, rng) -> id:

    never_masked       Hypothesis over logits and masks: the token drawn is always allowed
    renormalised       on fixed rows and masks, the draws follow softmax(logits) restricted to the allowed set and
                       renormalised (check_sampler's chi-square test)
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

__all__ = ["check_constraint", "check_masked_sampler"]


def _text(data: bytes) -> str | None:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _step(state, stops, data: bytes, in_language) -> np.ndarray:
    """The allowed mask at this point of a walk, checked against the laws (AssertionError naming the law)."""
    allowed = np.asarray(state.allowed(stops))
    text = _text(data)
    member = text is not None and bool(in_language(text))
    for stop in stops:
        if bool(allowed[stop]) != member:
            raise AssertionError(f"end_exactly: stop id {stop} is {'allowed' if allowed[stop] else 'masked'} after "
                                 f"{data!r}, which is {'in' if member else 'not in'} the language (the end may come "
                                 f"exactly where the text may end)")
    if state.finished:
        if not member:
            raise AssertionError(f"finished_in: the state finished on {data!r}, which is not in the language")
        others = np.flatnonzero(allowed & ~np.isin(np.arange(len(allowed)), list(stops)))
        if others.size:
            raise AssertionError(f"finished_in: finished after {data!r} yet allows token {int(others[0])}")
    elif not allowed.any():
        raise AssertionError(f"never_empty: nothing is allowed after {data!r}")
    return allowed


def check_constraint(bound, token_bytes, in_language, stops, *, max_examples: int = 100, steps: int = 64,
                     seed: int | None = None) -> None:
    """Walk `bound`'s language max_examples times (each walk up to `steps` tokens, Hypothesis choosing among the
    allowed tokens) and check the laws above at every step; AssertionError with the law and the text on a failure.
    token_bytes(id) -> the bytes the id adds to the text; stops: the ids that end an output."""
    stops = [int(s) for s in stops]

    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=seed is not None,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def walk(data):
        state, text = bound.start(), b""
        for _ in range(steps):
            allowed = _step(state, stops, text, in_language)
            if state.finished:
                return
            ids = np.flatnonzero(allowed)
            token = int(ids[data.draw(st.integers(0, len(ids) - 1), label="choice")])
            if token in stops:
                return
            state.advance(token)
            text += token_bytes(token)
        _step(state, stops, text, in_language)

    walk()


def _renormalised(x: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """softmax(x) restricted to `allowed` and renormalised, in float64."""
    z = np.where(allowed, np.asarray(x, np.float64), -np.inf)
    e = np.exp(z - z.max())
    return e / e.sum()


def check_masked_sampler(fn, *, max_examples: int = 100, alpha: float = 1e-4, seed: int = 0) -> None:
    """fn(logits[V], allowed[V] bool, rng) -> token id, a sampler with a constraint stage: the laws above
    (AssertionError naming the law, the logits and the mask)."""
    from . import strategies as nps
    from .sampler import check_sampler

    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=True)
    @given(nps.logits(size=(2, 24), neg_inf=False), st.data(), st.integers(0, 2**32 - 1))
    def never_masked(x, data, rng_seed):
        allowed = np.array(data.draw(st.lists(st.booleans(), min_size=len(x), max_size=len(x))))
        allowed[data.draw(st.integers(0, len(x) - 1))] = True
        token = int(fn(x.copy(), allowed.copy(), np.random.default_rng(rng_seed)))
        if not (0 <= token < len(x)) or not allowed[token]:
            raise AssertionError(f"never_masked: drew token {token}, which the mask forbids\n  logits = "
                                 f"{x.tolist()}\n  allowed = {allowed.astype(int).tolist()}")

    never_masked()
    rng = np.random.default_rng(seed)
    for V in (4, 9, 16):
        x = rng.normal(0, 2, V)
        allowed = rng.random(V) < 0.6
        allowed[int(np.argmax(x))] = False  # the most probable token masked: the renormalisation must show
        allowed[rng.integers(V)] = True
        try:
            # check_sampler also draws from a flat row of its own (seed checks): unmasked there
            check_sampler(lambda row, g: fn(row, allowed if len(row) == V else np.ones(len(row), bool), g),
                          logits=[x], target=lambda row: _renormalised(row, allowed), alpha=alpha, seed=seed)
        except AssertionError as err:
            raise AssertionError(f"renormalised: {err}\n  allowed = {allowed.astype(int).tolist()}") from None
