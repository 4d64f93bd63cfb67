"""The laws of sampling filters, checkable against anyone's implementation: `check_filter(fn, kind)` (check.py runs
them).

Each kind of filter has a calling convention (CONVENTIONS) and a list of laws (LAWS[kind]). A law is a Hypothesis
property: a strategy of cases and a check that raises AssertionError naming the token and the values when the law
fails. `check_filter` runs every law of a kind against a user's function and raises `LawFailure` (an
AssertionError) with the law's name, its one-line statement and Hypothesis' minimal falsifying example.

The laws live by kind in filter_laws.py (temperature and the filters) and penalty_laws.py (the penalties and the
n-gram ban); Options, Law, LawFailure, the calls of the function under test and the float64 references they check
against (with the slack `rtol` of their decisions) in law_base.py.
"""

from __future__ import annotations

from .filter_laws import min_p_laws, temperature_laws, top_k_laws, top_p_laws, typical_laws
from .law_base import Law, LawFailure, Options
from .penalty_laws import ngram_laws, presence_frequency_laws, repetition_laws

__all__ = ["laws_of", "KINDS", "CONVENTIONS", "Law", "LawFailure", "Options"]

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


LAWS: dict[str, list[Law]] = {
    "temperature": temperature_laws(),
    "top_k": top_k_laws(),
    "top_p": top_p_laws(),
    "min_p": min_p_laws(),
    "typical_p": typical_laws(),
    "repetition_penalty": repetition_laws(),
    "presence_penalty": presence_frequency_laws("presence_penalty"),
    "frequency_penalty": presence_frequency_laws("frequency_penalty"),
    "presence_frequency_penalty": presence_frequency_laws("presence_frequency_penalty"),
    "no_repeat_ngram": ngram_laws(),
}


def laws_of(kind: str) -> list[Law]:
    """The laws of one kind of filter, in the order check_filter runs them."""
    if kind not in LAWS:
        raise ValueError(f"unknown kind {kind!r}; one of {', '.join(KINDS)}")
    return list(LAWS[kind])
