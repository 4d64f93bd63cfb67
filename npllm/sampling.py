"""Sampling: from a row of logits to the next token, as pure, vectorised NumPy.

Every function takes logits of shape [V] or [B, V] (float32 or float64; other real dtypes are read as float64),
never mutates its arguments, and returns a new array of the same shape and dtype. Filters return logits whose
removed entries are -inf and whose kept entries are unchanged. Work over the whole vocabulary stays in the
logits' dtype; cumulative sums and the final draw are computed in float64.

The pipeline is one table, PIPELINE, read by `sample_step`, `sample_with` and `explain_steps` alike
(docs/sampling.md states every definition and how other engines differ):

    constraint   the tokens a structured-output constraint forbids -> -inf (`constrain`; applied by the generation
                 loop to the logits it passes here, so every stage below acts on the allowed set only)
    penalties    repetition_penalty -> presence_frequency_penalty -> logit_bias -> no_repeat_ngram
    temperature  z = (x - max x) / T      (T = 0 is greedy: argmax of the penalised logits, ties to the lowest id)
    filters      top_k -> top_p -> min_p -> typical_p   (each sees the distribution the previous one left)
    draw         inverse CDF over ascending token ids, one uniform from the row's generator

Each stage's rule is defined once, below, and its public function (top_p, repetition_penalty, ...) applies exactly
that rule. `explain_steps` runs the public definitions stage by stage over the whole vocabulary. `sample_step` and
`sample_with` run the same rules in the same order, with the shortcuts of the private module npllm._sampling_fast
(filters on a compact array of candidates, top-p without a full sort, block-wise running sums), each equivalent to
the definition here and tested against it (tests/test_sampling_fast.py).

Special values. NaN anywhere raises GenerationError. A row holding +inf entries is the limit of those logits
growing together: its +inf tokens share the mass equally and every other token gets probability 0. A row whose
logits are all -inf has no distribution: every function that normalises raises on it. Every filter keeps the row's
most probable token (typical_p keeps the most typical one), so no filter can leave a row empty.

Dimension letters: V vocabulary, B batch rows, C candidate tokens kept after the first filter, N alternatives.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple

import numpy as np

from . import _sampling_fast as fast
from .errors import GenerationError

__all__ = [
    "softmax",
    "log_softmax",
    "top_k",
    "top_p",
    "min_p",
    "typical_p",
    "repetition_penalty",
    "presence_frequency_penalty",
    "no_repeat_ngram",
    "logit_bias",
    "greedy",
    "constrain",
    "SamplingParams",
    "Option",
    "options",
    "Sampled",
    "Stage",
    "PIPELINE",
    "sample",
    "sample_step",
    "sample_with",
    "explain_steps",
]


# ----------------------------------------------------------------------------------------------------------------
# Validation of logits, histories and parameters
# ----------------------------------------------------------------------------------------------------------------


def _as_logits(logits) -> np.ndarray:
    """Any array-like -> a float32/float64 array of shape [V] or [B, V] without NaN (no copy when possible)."""
    x = np.asarray(logits)
    if x.dtype != np.float32 and x.dtype != np.float64:
        if x.dtype.kind not in "iuf":
            raise GenerationError(f"logits must be real numbers, got dtype {x.dtype}")
        x = x.astype(np.float64)
    if x.ndim not in (1, 2) or x.shape[-1] == 0 or x.shape[0] == 0:
        raise GenerationError(f"logits must have shape [V] or [B, V] with V >= 1 and B >= 1, got shape {x.shape}")
    if np.isnan(x).any():
        where = tuple(int(i) for i in np.argwhere(np.isnan(x))[0])
        raise GenerationError(f"logits contain NaN (first at index {where}); the model output is broken")
    return x


def _rows(x: np.ndarray) -> np.ndarray:
    """[V] or [B, V] -> [B, V] view (B = 1 for a single row)."""
    return x.reshape(-1, x.shape[-1])


def _history(token_ids, x: np.ndarray) -> list[np.ndarray]:
    """The past tokens of each row as int64 arrays, checked against the vocabulary.

    For [V] logits token_ids is one sequence; for [B, V] logits it is B sequences (one per row). None means no
    history.
    """
    B, V = _rows(x).shape
    if token_ids is None:
        return [np.empty(0, np.int64) for _ in range(B)]
    if x.ndim == 2:
        if isinstance(token_ids, (str, bytes)) or len(token_ids) != B:
            raise GenerationError(f"token_ids must hold one sequence per logits row ({B} rows)")
        sequences = list(token_ids)
    else:
        sequences = [token_ids]
    history = []
    for b, seq in enumerate(sequences):
        ids = np.asarray(seq)
        if ids.size == 0:
            ids = np.empty(0, np.int64)
        elif ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise GenerationError(f"token_ids row {b} must be a flat sequence of integer token ids")
        history.append(ids.astype(np.int64, copy=False))
    every = np.concatenate(history)
    if every.size and (every.min() < 0 or every.max() >= V):  # one check for all rows; find the row on failure
        b = next(b for b, ids in enumerate(history) if ids.size and (ids.min() < 0 or ids.max() >= V))
        bad = int(history[b][(history[b] < 0) | (history[b] >= V)][0])
        raise GenerationError(f"token_ids row {b} holds id {bad}, outside the vocabulary [0, {V})")
    return history


def _real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
        raise GenerationError(f"{name} must be a real number, got {value!r}")
    return float(value)


def _integer(name: str, value, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise GenerationError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def _temperature_value(value) -> float:
    t = _real("temperature", value)
    if not (0.0 <= t < math.inf):
        raise GenerationError(f"temperature must be finite and >= 0 (0 means greedy), got {value!r}")
    if 0.0 < t < np.finfo(np.float32).tiny:  # it would round to 0 against float32 logits and divide by zero
        raise GenerationError(f"temperature {value!r} is below float32's smallest normal number: use 0 for greedy")
    return t


def _mass_value(name: str, value) -> float:
    """A probability mass for top_p / typical_p: 0 < p <= 1."""
    p = _real(name, value)
    if not (0.0 < p <= 1.0):
        raise GenerationError(f"{name} must be in (0, 1] (1 disables it), got {value!r}")
    return p


def _min_p_value(value) -> float:
    p = _real("min_p", value)
    if not (0.0 <= p <= 1.0):
        raise GenerationError(f"min_p must be in [0, 1] (0 disables it), got {value!r}")
    return p


def _penalty_value(value) -> float:
    penalty = _real("repetition_penalty", value)
    if not (0.0 < penalty < math.inf):
        raise GenerationError(f"repetition_penalty must be finite and > 0 (1 disables it), got {value!r}")
    return penalty


def _finite_value(name: str, value) -> float:
    v = _real(name, value)
    if not math.isfinite(v):
        raise GenerationError(f"{name} must be finite, got {value!r}")
    return v


def _bias_value(bias) -> Mapping[int, float] | None:
    """A token -> bias mapping, checked and frozen; None when empty."""
    if bias is None:
        return None
    if not isinstance(bias, Mapping):
        raise GenerationError(f"logit_bias must be a mapping from token id to bias, got {type(bias).__name__}")
    checked = {}
    for token, value in bias.items():
        token = _integer("logit_bias token id", token)
        v = _real(f"logit_bias[{token}]", value)
        if v == math.inf:
            raise GenerationError(f"logit_bias[{token}] is +inf; use a large finite bias to force a token")
        checked[token] = v
    return MappingProxyType(checked) if checked else None


def _stop_value(stop) -> tuple[str, ...]:
    if isinstance(stop, str):
        stop = (stop,)
    stop = tuple(stop)
    for s in stop:
        if not isinstance(s, str) or not s:
            raise GenerationError(f"stop must hold non-empty strings, got {s!r}")
    return stop


# ----------------------------------------------------------------------------------------------------------------
# Normalisation
# ----------------------------------------------------------------------------------------------------------------


def _normalisable(x2: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[B, V] logits -> ([B, V] logits as the distribution sees them, [B] row maxima), same dtype.

    A row with +inf entries becomes 0 there and -inf elsewhere: its +inf tokens share the mass equally. A row with
    nothing above -inf has no distribution and raises.
    """
    z = x2
    m = z.max(axis=1)  # [B]
    if (m == -np.inf).any():
        row = int(np.flatnonzero(m == -np.inf)[0])
        raise GenerationError(f"logits row {row}: every token is -inf (masked), so there is nothing to sample")
    inf_rows = m == np.inf
    if inf_rows.any():
        z = z.copy()
        z[inf_rows] = np.where(np.isposinf(z[inf_rows]), 0.0, -np.inf)
        m = np.where(inf_rows, 0, m).astype(z.dtype)
    return z, m


def _shifted(x2: np.ndarray, temperature: float) -> np.ndarray:
    """[B, V] -> [B, V] (x - max x) / T in x's dtype, +inf rows resolved: every row's maximum is 0.

    Subtracting the maximum first keeps every exponent <= 0 and a small T from overflowing; it changes no
    probability and no filter decision, since all of them are invariant to adding a constant to a row.
    """
    z, m = _normalisable(x2)
    s = z - m[:, None]
    if temperature != 1.0:
        s /= temperature
    return s


def _softmax_rows(x2: np.ndarray, temperature: float) -> np.ndarray:
    """[B, V] -> [B, V] probabilities in x's dtype; temperature 0 gives the limit (maxima share the mass)."""
    if temperature == 0.0:
        z, m = _normalisable(x2)
        top = z == m[:, None]
        return (top / top.sum(axis=1, keepdims=True)).astype(x2.dtype)
    e = np.exp(_shifted(x2, temperature))
    e /= e.sum(axis=1, keepdims=True)
    return e


def _log_softmax_rows(x2: np.ndarray, temperature: float) -> np.ndarray:
    """[B, V] -> [B, V] log-probabilities in x's dtype; temperature 0 gives the log of the limit."""
    if temperature == 0.0:
        z, m = _normalisable(x2)
        top = z == m[:, None]
        return np.where(top, -np.log(top.sum(axis=1, keepdims=True)), -np.inf).astype(x2.dtype)
    s = _shifted(x2, temperature)
    s -= np.log(np.exp(s).sum(axis=1, keepdims=True))
    return s


def softmax(logits, temperature: float = 1.0) -> np.ndarray:
    """π_i = exp((x_i - max x) / T) / Σ_j exp((x_j - max x) / T), per row: [V] or [B, V] -> same shape.

    Subtracting the row maximum changes nothing mathematically and keeps every exponent <= 0. T = 0 returns the
    T -> 0 limit: the row's maximal logits share the mass equally. Computed in the logits' dtype.

    >>> softmax([11.0, 12.0, 13.0]).round(4).tolist()
    [0.09, 0.2447, 0.6652]
    >>> softmax([0.01, 0.02, 0.03]).round(4).tolist()
    [0.33, 0.3333, 0.3367]
    >>> [softmax([2.0, 1.0, 0.5, 0.1], t).round(3).tolist() for t in (0.5, 1.0, 2.0)]
    [[0.828, 0.112, 0.041, 0.019], [0.575, 0.211, 0.128, 0.086], [0.406, 0.246, 0.192, 0.157]]
    """
    x = _as_logits(logits)
    t = _temperature_value(temperature)
    return _softmax_rows(_rows(x), t).reshape(x.shape)


def log_softmax(logits, temperature: float = 1.0) -> np.ndarray:
    """log π_i = (x_i - max x) / T - log Σ_j exp((x_j - max x) / T), per row: [V] or [B, V] -> same shape.

    -inf where π_i = 0. T = 0 gives the log of the T -> 0 limit (-log(number of maxima) on the maxima).
    """
    x = _as_logits(logits)
    t = _temperature_value(temperature)
    return _log_softmax_rows(_rows(x), t).reshape(x.shape)


def constrain(logits, allowed) -> np.ndarray:
    """The constraint stage: logits with every token outside `allowed` set to -inf, the rest unchanged.

    allowed: [V] or [B, V] booleans (a structured-output constraint's mask, npllm.constraint) matching logits.
    Applied before every other stage, it leaves each later stage the sub-vocabulary of allowed tokens: the draw's
    distribution is the unconstrained pipeline's on that sub-vocabulary (so, without filters, the unconstrained
    distribution renormalised over the allowed set), and greedy is the argmax over it. A row with nothing allowed
    raises: there would be nothing to sample.
    """
    x = _as_logits(logits)
    mask = np.asarray(allowed)
    if mask.dtype != np.bool_ or mask.shape != x.shape:
        raise GenerationError(f"allowed must be a boolean array of the logits' shape {x.shape}, got "
                              f"{mask.dtype} {mask.shape}")
    empty = ~_rows(mask).any(axis=1)
    if empty.any():
        raise GenerationError(f"logits row {int(np.flatnonzero(empty)[0])}: the constraint allows no token")
    return np.where(mask, x, -np.inf).astype(x.dtype, copy=False)


# ----------------------------------------------------------------------------------------------------------------
# Filters. Each _keep rule maps [B, C] logits and its parameter to a [B, C] boolean mask of the tokens kept, or
# None when the filter keeps everything. They depend only on the values of a row, not on positions, so a step can
# run them on a compact [B, C] array of the candidates that survived the first filter.
# ----------------------------------------------------------------------------------------------------------------


def _filtered(x: np.ndarray, keep: np.ndarray | None) -> np.ndarray:
    """Logits with the entries outside `keep` set to -inf, in x's dtype and shape."""
    x2 = _rows(x)
    out = x2.copy() if keep is None else np.where(keep, x2, -np.inf).astype(x.dtype, copy=False)
    return out.reshape(x.shape)


def _top_k_keep(x2: np.ndarray, k: int) -> np.ndarray | None:
    """Keep x_i >= the k-th largest logit of the row (ties with it are kept too). k = 0 or k >= V: everything."""
    V = x2.shape[1]
    if k == 0 or k >= V:
        return None
    kth = np.partition(x2, V - k, axis=1)[:, V - k]  # [B] k-th largest; partition, not a sort
    return x2 >= kth[:, None]


def top_k(logits, k: int) -> np.ndarray:
    """Keep every token whose logit is >= the k-th largest logit of its row; the rest become -inf.

    Ties at the boundary are all kept, so more than k tokens survive when the k-th largest value is shared
    (exactly k survive when it is not). The rule depends only on values, never on token ids. k = 0 disables the
    filter, and k >= V keeps everything.
    """
    x = _as_logits(logits)
    k = _integer("top_k", k)
    return _filtered(x, _top_k_keep(_rows(x), k))


def _top_p_keep(x2: np.ndarray, p: float) -> np.ndarray | None:
    """Keep π_i >= τ, τ the largest probability whose upper set {π >= τ} holds mass >= p.

    The most probable tokens first: the running sum of the descending probabilities (float64) reaches p · total
    at some entry, whose value is τ. When rounding keeps the sum below the target, τ is the smallest value.
    """
    if p >= 1.0:
        return None
    e = np.exp(_shifted(x2, 1.0))  # [B, V] unnormalised probabilities, row max 1
    target = p * e.sum(axis=1, dtype=np.float64)  # [B]
    descending = -np.sort(-e, axis=1)  # [B, V]
    reach = np.cumsum(descending, axis=1, dtype=np.float64)  # [B, V] mass of the i + 1 most probable tokens
    first = np.minimum((reach < target[:, None]).sum(axis=1), e.shape[1] - 1)  # [B] where it reaches p
    tau = descending[np.arange(len(e)), first]
    return e >= tau[:, None]


def top_p(logits, p: float) -> np.ndarray:
    """Nucleus filter: keep the smallest set of most probable tokens whose probability mass reaches p.

    With π = softmax(logits) and τ the largest probability such that Σ_{π_j >= τ} π_j >= p, keep exactly the
    tokens with π_i >= τ. So the kept mass is >= p, the tokens strictly more probable than the least probable kept
    one hold mass < p, the most probable token is always kept, and a tie at the boundary is kept whole. p = 1
    keeps everything; 0 < p <= 1.
    """
    x = _as_logits(logits)
    p = _mass_value("top_p", p)
    return _filtered(x, _top_p_keep(_rows(x), p))


def _min_p_keep(x2: np.ndarray, p: float) -> np.ndarray | None:
    """Keep x_i - max x >= ln p (that is π_i >= p · max π)."""
    if p == 0.0:
        return None
    return _shifted(x2, 1.0) >= math.log(p)


def min_p(logits, p: float) -> np.ndarray:
    """Keep tokens with probability >= p times the row's largest probability; 0 <= p <= 1, p = 0 keeps all.

    Decided in logit space as x_i - max x >= ln p, which is the same condition without computing any
    exponential. The argmax always survives (0 >= ln p); p = 1 keeps only the maxima.
    """
    x = _as_logits(logits)
    p = _min_p_value(p)
    return _filtered(x, _min_p_keep(_rows(x), p))


def _typical_keep(x2: np.ndarray, p: float) -> np.ndarray | None:
    """Keep the tokens whose surprise is closest to the entropy, until their mass reaches p."""
    if p >= 1.0:
        return None
    B, V = x2.shape
    logq = _log_softmax_rows(x2.astype(np.float64), 1.0)  # [B, V] log-probabilities, float64
    q = np.exp(logq)
    entropy = -np.sum(q * np.where(np.isfinite(logq), logq, 0.0), axis=1)  # [B]; 0 · log 0 = 0
    gap = np.abs(-logq - entropy[:, None])  # [B, V] |surprise - entropy|; +inf for impossible tokens
    order = np.argsort(gap, axis=1, kind="stable")
    cumulative = np.cumsum(np.take_along_axis(q, order, axis=1), axis=1)
    j = np.minimum((cumulative < p).sum(axis=1), V - 1)  # first position where the mass reaches p
    bound = np.take_along_axis(gap, order, axis=1)[np.arange(B), j]
    return gap <= bound[:, None]


def typical_p(logits, p: float) -> np.ndarray:
    """Locally typical filter (Meister et al. 2022): keep the tokens whose surprise is closest to the entropy.

    With π = softmax(logits), H = -Σ π_j log π_j and d_i = |-log π_i - H|, let δ be the smallest d value such that
    Σ_{d_j <= δ} π_j >= p; keep exactly the tokens with d_i <= δ. Ties in d are kept whole. At least one token
    survives (the most typical), but the argmax may not. p = 1 keeps everything; 0 < p <= 1.
    """
    x = _as_logits(logits)
    p = _mass_value("typical_p", p)
    return _filtered(x, _typical_keep(_rows(x), p))


# ----------------------------------------------------------------------------------------------------------------
# Penalties. Each _rule edits [B, V] logits in place given the rows' histories and its parameters; the public
# function applies it to a copy, and a step applies every active one to a single copy.
# ----------------------------------------------------------------------------------------------------------------


def _history_counts(history: list[np.ndarray], V: int) -> tuple[tuple[np.ndarray, np.ndarray], np.ndarray]:
    """Distinct (row, token) pairs of the histories and how often each occurs: ([n], [n]) positions, [n] counts."""
    flat = np.concatenate([b * V + ids for b, ids in enumerate(history)])
    pairs, counts = np.unique(flat, return_counts=True)
    return (pairs // V, pairs % V), counts


def _repetition_rule(out: np.ndarray, history: list[np.ndarray], penalty: float) -> None:
    """CTRL rule on every (row, token) seen: x / penalty where x > 0, x · penalty otherwise."""
    if penalty == 1.0 or not any(len(h) for h in history):
        return
    positions, _ = _history_counts(history, out.shape[1])
    v = out[positions]
    out[positions] = np.where(v > 0, v / penalty, v * penalty)


def _presence_frequency_rule(out: np.ndarray, history: list[np.ndarray], presence: float, frequency: float) -> None:
    """x_t -= presence + frequency · count_t on every (row, token) seen (all of them have count >= 1)."""
    if not (presence or frequency) or not any(len(h) for h in history):
        return
    positions, counts = _history_counts(history, out.shape[1])
    out[positions] -= presence + frequency * counts


def _bias_rule(out: np.ndarray, history: list[np.ndarray], bias: Mapping[int, float] | None) -> None:
    """x_t += bias_t in every row (the history plays no part); a -inf bias bans the token even where x_t is +inf."""
    if not bias:
        return
    V = out.shape[1]
    ids = np.fromiter(bias.keys(), np.int64, len(bias))
    values = np.fromiter(bias.values(), np.float64, len(bias))
    if ids.max() >= V:
        raise GenerationError(f"logit_bias names token {int(ids.max())}, outside the vocabulary [0, {V})")
    with np.errstate(invalid="ignore"):  # inf + -inf: NaN, replaced by the ban
        out[:, ids] = np.where(values == -np.inf, -np.inf, out[:, ids] + values)


def _ngram_banned(ids: np.ndarray, n: int) -> np.ndarray:
    """Tokens t such that ids + [t] would end with an n-gram already present in ids: [L] -> [n_banned]."""
    if len(ids) < n:
        return ids[:0]
    windows = np.lib.stride_tricks.sliding_window_view(ids, n)  # [L - n + 1, n] every n-gram of the history
    prefix = ids[len(ids) - n + 1 :]  # [n - 1] the most recent n - 1 tokens
    return windows[(windows[:, :-1] == prefix).all(axis=1), -1]


def _ngram_rule(out: np.ndarray, history: list[np.ndarray], n: int) -> None:
    """-inf on every token that would complete an n-gram already in the row's history (n = 0: nothing)."""
    if n:
        for b, ids in enumerate(history):
            out[b, _ngram_banned(ids, n)] = -np.inf


def _penalise(logits, token_ids, rule: Callable, *values) -> np.ndarray:
    """A public penalty: `rule` applied to a copy of the logits.                       # [V] or [B, V] -> same"""
    x = _as_logits(logits)
    history = _history(token_ids, x)
    out = _rows(x).copy()
    rule(out, history, *values)
    return out.reshape(x.shape)


def repetition_penalty(logits, token_ids, penalty: float) -> np.ndarray:
    """CTRL repetition penalty: for each distinct token t in token_ids, x_t / penalty if x_t > 0 else x_t · penalty.

    A token is penalised once however often it occurs. penalty > 1 discourages repeats, 0 < penalty < 1 favours
    them, 1 is the identity. Dividing positive and multiplying negative logits makes a penalty > 1 always lower
    the logit (x = 0 stays 0). token_ids: one sequence for [V] logits, B sequences for [B, V].
    """
    return _penalise(logits, token_ids, _repetition_rule, _penalty_value(penalty))


def presence_frequency_penalty(logits, token_ids, presence: float, frequency: float) -> np.ndarray:
    """OpenAI-style penalties: x_t - presence · [c_t > 0] - frequency · c_t, c_t = occurrences of t in token_ids.

    Tokens absent from token_ids are untouched; negative values reward repeats instead.
    """
    presence = _finite_value("presence_penalty", presence)
    frequency = _finite_value("frequency_penalty", frequency)
    return _penalise(logits, token_ids, _presence_frequency_rule, presence, frequency)


def no_repeat_ngram(logits, token_ids, n: int) -> np.ndarray:
    """Ban (-inf) every token that would complete an n-gram already present in token_ids.

    With history h of length L, token t is banned when some i <= L - n has h[i : i + n - 1] == h[L - n + 1 :] and
    h[i + n - 1] == t. n = 1 bans every token seen; n = 0 disables. This filter alone can mask a whole row (tiny
    vocabularies); `sample` then raises rather than sample from nothing.
    """
    return _penalise(logits, token_ids, _ngram_rule, _integer("no_repeat_ngram", n))


def logit_bias(logits, bias: Mapping[int, float] | None) -> np.ndarray:
    """x_t + bias[t] for every listed token, in every row. A -inf bias bans a token; +inf is refused."""
    return _penalise(logits, None, _bias_rule, _bias_value(bias))


def greedy(logits) -> int | np.ndarray:
    """argmax per row, ties to the lowest token id: [V] -> int, [B, V] -> [B] int64.

    A +inf logit wins over every finite one (the lowest-id +inf when several); a row of all -inf raises.
    """
    x = _as_logits(logits)
    ids = np.argmax(_normalisable(_rows(x))[0], axis=1)  # argmax returns the first maximum
    return int(ids[0]) if x.ndim == 1 else ids.astype(np.int64)


@dataclass(frozen=True)
class Option:
    """How a SamplingParams field is asked for from outside Python. The command line's flags (npllm.cli.parser) and the
    HTTP server's request fields (npllm.serve.protocol) are built from these, so a field declared with an Option is
    offered by both with nothing else to change.

        kind         "real": a float (SamplingParams checks its range); "integer": an int, in [least, most] on the
                     command line when least is given; "text": strings, the flag repeatable; "bias": a token -> bias
                     mapping (no flag; the server checks ids against the vocabulary)
        flag, help   the command-line flag ("--top-k"; its argparse dest is the field's name) and its help text;
                     flag None: not on the command line
        least, most  an integer flag's bounds, refused by the parser (most None: unbounded)
        cli_default  the flag's default where it differs from the field's (top_p: 0.9, llama2.c's choice);
                     None: the field's
        api          the OpenAI request field that sets it (None: not served); a number must lie in `api_range`
                     (low, high; None: unbounded), low excluded when `api_open`; `api_off`, where given, is
                     another API's word for the stage being off (vLLM's top_k -1), read as the field's default
    """

    kind: str
    flag: str | None = None
    help: str = ""
    least: int | None = None
    most: int | None = None
    cli_default: float | None = None
    metavar: str | None = None
    api: str | None = None
    api_range: tuple[float | None, float | None] = (None, None)
    api_open: bool = False
    api_off: int | None = None


def _option(default, kind: str, hash: bool = True, **how):
    """A SamplingParams field with its default and its Option (in the field's metadata, under "option")."""
    return field(default=default, hash=hash, metadata={"option": Option(kind, **how)})


MOST_LOGPROBS = 1 << 20  # far above any sensible use: a typo cannot ask for a vocabulary's worth of lines


@dataclass(frozen=True)
class SamplingParams:
    """Everything that decides how the next token is chosen, validated on construction.

    Defaults disable every stage except plain sampling at temperature 1. `stop` is used by the generation loop, not
    by `sample`; `seed` seeds `generator()`. A bad value raises GenerationError (a ValueError) naming the field.
    Each field's Option says how the command line and the server ask for it (`options()`).
    """

    temperature: float = _option(1.0, "real", flag="--temperature", help="0 = greedy (default 1.0)",
                                 api="temperature", api_range=(0.0, 2.0))  # >= 0; 0 is greedy
    top_k: int = _option(0, "integer", flag="--top-k", least=0, help="keep the k most probable tokens (0: off)",
                         api="top_k", api_range=(-1, None), api_off=-1)  # >= 0; 0 disables (vLLM's -1 too)
    top_p: float = _option(1.0, "real", flag="--top-p", cli_default=0.9, help="nucleus mass in (0, 1] (default 0.9)",
                           api="top_p", api_range=(0.0, 1.0), api_open=True)  # (0, 1]; 1 disables
    min_p: float = _option(0.0, "real", flag="--min-p", help="keep tokens with p >= min_p * p_max (0: off)",
                           api="min_p", api_range=(0.0, 1.0))  # [0, 1]; 0 disables
    typical_p: float = _option(1.0, "real", flag="--typical-p", help="locally typical sampling mass (1: off)",
                               api="typical_p", api_range=(0.0, 1.0), api_open=True)  # (0, 1]; 1 disables
    repetition_penalty: float = _option(1.0, "real", flag="--repetition-penalty",
                                        help="CTRL penalty on seen tokens (1: off)", api="repetition_penalty",
                                        api_range=(0.0, 10.0), api_open=True)  # > 0; 1 disables
    presence_penalty: float = _option(0.0, "real", flag="--presence-penalty",
                                      help="subtract this from seen tokens' logits",
                                      api="presence_penalty", api_range=(-2.0, 2.0))
    frequency_penalty: float = _option(0.0, "real", flag="--frequency-penalty",
                                       help="subtract this times each token's count",
                                       api="frequency_penalty", api_range=(-2.0, 2.0))
    no_repeat_ngram: int = _option(0, "integer", flag="--no-repeat-ngram", least=0,
                                   help="forbid repeating any n-gram of this size")  # n-gram size; 0 disables
    logit_bias: Mapping[int, float] | None = _option(None, "bias", hash=False, api="logit_bias",
                                                     api_range=(-100.0, 100.0))
    seed: int | None = _option(None, "integer", flag="--seed", help="seed for reproducible sampling",
                               api="seed", api_range=(0, None))
    logprobs: int = _option(0, "integer", flag="--logprobs", least=0, most=MOST_LOGPROBS, metavar="N",
                            help="print each token's log-probability and the top N alternatives to stderr")
    # how many top alternatives to report per step (the server reads its own logprobs fields: they differ by endpoint)
    stop: tuple[str, ...] = _option((), "text", flag="--stop", metavar="STR",
                                    help="end the completion before this text (repeatable; may span tokens)")
    # stop strings are text: the server reads its `stop` beside the request, which stops on token ids

    def __post_init__(self):
        put = object.__setattr__
        put(self, "temperature", _temperature_value(self.temperature))
        put(self, "top_k", _integer("top_k", self.top_k))
        put(self, "top_p", _mass_value("top_p", self.top_p))
        put(self, "min_p", _min_p_value(self.min_p))
        put(self, "typical_p", _mass_value("typical_p", self.typical_p))
        put(self, "repetition_penalty", _penalty_value(self.repetition_penalty))
        put(self, "presence_penalty", _finite_value("presence_penalty", self.presence_penalty))
        put(self, "frequency_penalty", _finite_value("frequency_penalty", self.frequency_penalty))
        put(self, "no_repeat_ngram", _integer("no_repeat_ngram", self.no_repeat_ngram))
        put(self, "logit_bias", _bias_value(self.logit_bias))
        if self.seed is not None:
            put(self, "seed", _integer("seed", self.seed))
        put(self, "logprobs", _integer("logprobs", self.logprobs))
        put(self, "stop", _stop_value(self.stop))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @functools.cached_property  # asked at every step of a generation; the dataclass is frozen, so it never changes
    def options_in_use(self) -> frozenset[str]:
        """The names of the fields set to something other than their default."""
        return frozenset(f.name for f in dataclasses.fields(self) if getattr(self, f.name) != f.default)

    def generator(self) -> np.random.Generator:
        """A fresh generator from `seed` (fresh OS entropy when seed is None). Create it once per generation."""
        return np.random.default_rng(self.seed)


def options(params_type: type = SamplingParams) -> list[tuple[dataclasses.Field, Option]]:
    """The fields of a SamplingParams class that carry an Option, in declaration order, each with its Option."""
    return [(f, f.metadata["option"]) for f in dataclasses.fields(params_type) if "option" in f.metadata]


def with_keywords(params: SamplingParams | None, keywords: Mapping, caller: str = "the call") -> SamplingParams:
    """The SamplingParams a call draws with: `params` (default: SamplingParams()) with the sampling keywords given
    beside it replacing its fields, checked as on construction. The one place a call's sampling keywords become a
    SamplingParams (the calls pass the result on, never the keywords): a keyword that names no field is a TypeError
    naming it, as Python's own for a function's unexpected keyword."""
    fields = [f.name for f in dataclasses.fields(SamplingParams)]
    unknown = [name for name in keywords if name not in fields]
    if unknown:
        raise TypeError(f"{caller} got unexpected keyword argument{'s' if len(unknown) > 1 else ''} "
                        f"{', '.join(map(repr, unknown))} (its sampling keywords are SamplingParams' fields: "
                        f"{', '.join(fields)})")
    if params is None:
        return SamplingParams(**keywords)
    if not isinstance(params, SamplingParams):
        raise GenerationError(f"params must be a SamplingParams, got {type(params).__name__}")
    return dataclasses.replace(params, **keywords) if keywords else params


class Sampled(NamedTuple):
    """What `sample` and `sample_step` return: for [V] logits a Python int and float and [N] arrays; for [B, V]
    logits [B], [B], [B, N], [B, N]. (A generation step that was asked for ids only carries NaN log-probabilities
    and no alternatives.)

    logprobs are the chosen tokens' log-probabilities under the distribution they were drawn from: the penalised,
    temperature-scaled, filtered one. Under greedy decoding (temperature 0) that distribution is a point mass, so
    the log-softmax of the penalised logits at temperature 1 is reported instead. top_ids / top_logprobs list the
    N most probable tokens of that same distribution, most probable first, ties to the lower id; slots beyond the
    tokens that survived the filters hold id -1 and -inf.
    """

    token_ids: int | np.ndarray
    logprobs: float | np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


# ----------------------------------------------------------------------------------------------------------------
# The pipeline: one ordered table of stages, read by sample_step, sample_with and explain_steps
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stage:
    """One stage of the pipeline: its name, the SamplingParams fields it reads, and its rule.

    kind "penalty": rule(out [B, V], histories, *values) edits raw logits in place.
    kind "temperature": z = (x - max x) / T, no rule (T = 0 ends the pipeline: greedy decoding).
    kind "filter": rule([B, C] logits, value) -> [B, C] mask of the tokens kept, or None when it keeps all.
    A stage whose fields all hold SamplingParams' defaults (its neutral values) is skipped.
    """

    name: str
    kind: str
    fields: tuple[str, ...]
    rule: Callable | None = None

    def active(self, params: SamplingParams) -> bool:
        return any(getattr(params, f) != _DEFAULTS[f] for f in self.fields)

    def values(self, params: SamplingParams) -> tuple:
        return tuple(getattr(params, f) for f in self.fields)


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SamplingParams)}

PIPELINE = (
    Stage("repetition_penalty", "penalty", ("repetition_penalty",), _repetition_rule),
    Stage("presence_frequency_penalty", "penalty", ("presence_penalty", "frequency_penalty"), _presence_frequency_rule),
    Stage("logit_bias", "penalty", ("logit_bias",), _bias_rule),
    Stage("no_repeat_ngram", "penalty", ("no_repeat_ngram",), _ngram_rule),
    Stage("temperature", "temperature", ("temperature",)),
    Stage("top_k", "filter", ("top_k",), _top_k_keep),
    Stage("top_p", "filter", ("top_p",), _top_p_keep),
    Stage("min_p", "filter", ("min_p",), _min_p_keep),
    Stage("typical_p", "filter", ("typical_p",), _typical_keep),
)


@functools.lru_cache(maxsize=256)
def _active(params: SamplingParams, kind: str) -> tuple[Stage, ...]:
    """The stages of one kind that params switches on, in pipeline order (remembered: a loop asks at every step)."""
    return tuple(stage for stage in PIPELINE if stage.kind == kind and stage.active(params))


def _check_rng(rng, B: int, batched: bool) -> None:
    if isinstance(rng, np.random.Generator):
        return
    if batched and isinstance(rng, Sequence) and len(rng) == B and all(isinstance(g, np.random.Generator) for g in rng):
        return
    raise GenerationError(
        "rng must be a numpy.random.Generator (for [B, V] logits also a list of B generators, one per row)"
    )


def _uniforms(rng, B: int) -> np.ndarray:
    """One uniform in [0, 1) per row: [B]. One generator serves the rows in order; a list gives one per row."""
    if isinstance(rng, np.random.Generator):
        return rng.random(B)
    return np.array([g.random() for g in rng])


def _prepared(params: SamplingParams, logits, rng, token_ids) -> tuple[np.ndarray, np.ndarray]:
    """Checked logits and generator(s), and the [B, V] logits after every active penalty stage, applied in order
    to one copy (the logits themselves when none is active; the histories are then not even read)."""
    x = _as_logits(logits)
    x2 = _rows(x)
    if rng is not None or not params.is_greedy:
        _check_rng(rng, x2.shape[0], x.ndim == 2)
    stages = _active(params, "penalty")
    if not stages:
        return x, x2
    history = _history(token_ids, x)
    z = x2.copy()
    for stage in stages:
        stage.rule(z, history, *stage.values(params))
    if np.isneginf(z.max(axis=1)).any():
        row = int(np.flatnonzero(np.isneginf(z.max(axis=1)))[0])
        raise GenerationError(
            f"logits row {row}: the penalties (logit_bias / no_repeat_ngram) masked every token, nothing to sample"
        )
    return x, z


def _candidates(z: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """Penalised [B, V] -> ([B, C] ids, [B, C] tempered logits) left by the filter stages (-inf where removed)."""
    filters = [(stage.name, stage.rule, *stage.values(params)) for stage in _active(params, "filter")]
    return fast.candidates(_shifted(z, params.temperature), filters)


def sample_with(params: SamplingParams, logits, rng, token_ids=None) -> int | np.ndarray:
    """Only the chosen token id(s) of `sample_step`: an int for [V] logits, [B] int64 for [B, V].

    The call a generation loop makes when nobody asked for log-probabilities: it computes none, and no
    alternatives. The same draws as sample_step (the same uniforms, the same candidates).
    """
    x, z = _prepared(params, logits, rng, token_ids)
    if params.is_greedy:
        ids = np.argmax(_normalisable(z)[0], axis=1)  # ties: the first maximum, i.e. the lowest id
    else:
        candidates, vals = _candidates(z, params)
        slot, _ = fast.draw(vals, _uniforms(rng, len(z)))
        ids = candidates[np.arange(len(z)), slot]
    return int(ids[0]) if x.ndim == 1 else ids.astype(np.int64)


def _greedy_draw(z: np.ndarray, params: SamplingParams) -> tuple:
    """argmax of the penalised [B, V] logits, its log-softmax at T = 1, and the top alternatives under it."""
    B, V = z.shape
    zr, m = _normalisable(z)
    chosen = np.argmax(zr, axis=1)  # ties: the first maximum, i.e. the lowest id
    shifted = zr - m[:, None]  # [B, V]
    log_total = np.log(np.exp(shifted).sum(axis=1, dtype=np.float64))  # [B]
    logq_of = lambda b: shifted[b].astype(np.float64) - log_total[b]  # noqa: E731  [V] row b's log-probabilities
    top_ids, top_lp = fast.top_n(np.broadcast_to(np.arange(V), (B, V)), logq_of, params.logprobs, B)
    return chosen, shifted[np.arange(B), chosen].astype(np.float64) - log_total, top_ids, top_lp


def _sampled_draw(z: np.ndarray, params: SamplingParams, rng) -> tuple:
    """The draw from the filtered, tempered distribution, its log-probability there, and the top alternatives."""
    B = len(z)
    ids, vals = _candidates(z, params)  # [B, C]
    slot, log_total = fast.draw(vals, _uniforms(rng, B))
    vmax = vals.max(axis=1).astype(np.float64)
    logq_of = lambda b: vals[b].astype(np.float64) - vmax[b] - log_total[b]  # noqa: E731  [C] of row b
    rows = np.arange(B)
    chosen_lp = vals[rows, slot].astype(np.float64) - vmax - log_total
    top_ids, top_lp = fast.top_n(ids, logq_of, params.logprobs, B)
    return ids[rows, slot], chosen_lp, top_ids, top_lp


def sample_step(params: SamplingParams, logits, rng, token_ids=None) -> Sampled:
    """Choose the next token of each row following `params`, with its log-probability and the top alternatives.

    logits [V] or [B, V]; token_ids the past tokens (one sequence, or B of them; None: no history) that the
    penalties look at; rng a numpy Generator, or for [B, V] a list of B generators so that a row's draws do not
    depend on its neighbours (rng may be None for greedy decoding). A sampled step consumes exactly one
    `rng.random()` per row, a greedy step none. token_ids are read (and checked) only when a penalty is active.
    Raises GenerationError when the penalties leave a row with no allowed token. `params.logprobs` sets how many
    alternatives are reported.
    """
    x, z = _prepared(params, logits, rng, token_ids)
    ids, lp, top_ids, top_lp = _greedy_draw(z, params) if params.is_greedy else _sampled_draw(z, params, rng)
    if x.ndim == 1:
        return Sampled(int(ids[0]), float(lp[0]), top_ids[0], top_lp[0])
    return Sampled(np.asarray(ids, np.int64), np.asarray(lp, np.float64), top_ids, top_lp)


def sample(logits, rng, token_ids=None, **params) -> Sampled:
    """Choose the next token of each row: penalties -> temperature -> top-k -> top-p -> min-p -> typical-p -> draw.

    Keyword arguments are the fields of SamplingParams (validated the same way; logprobs=N reports N alternatives);
    see `sample_step` and `Sampled`. Temperature 0 is greedy: the argmax of the penalised logits, ties to the
    lowest id, filters not applied.
    """
    return sample_step(SamplingParams(**params), logits, rng, token_ids)


def explain_steps(logits, params: SamplingParams, token_ids=None) -> list[tuple[str, np.ndarray]]:
    """The probability vector after each active pipeline stage, for `--explain`: [(stage name, [V] or [B, V])].

    Starts with ("logits", softmax of the raw logits) and ends with the distribution `sample_step` draws from (for
    greedy decoding, ("greedy", a point mass on the chosen token)). Each stage is its public definition applied to
    the whole vocabulary. Probabilities are float64.
    """
    x = _as_logits(logits)
    history = _history(token_ids, x)
    z = _rows(x)
    steps = [("logits", _softmax_rows(z.astype(np.float64), 1.0))]
    for stage in _active(params, "penalty"):
        z = z.copy()
        stage.rule(z, history, *stage.values(params))
        steps.append((stage.name, _softmax_rows(z.astype(np.float64), 1.0)))
    if params.is_greedy:
        point = np.zeros(z.shape)
        point[np.arange(len(z)), greedy(z)] = 1.0
        steps.append(("greedy", point))
    else:
        steps += _filter_steps(_shifted(z, params.temperature), params)
    return [(name, p.reshape(x.shape)) for name, p in steps]


def _filter_steps(s: np.ndarray, params: SamplingParams) -> list[tuple[str, np.ndarray]]:
    """explain_steps after the temperature stage: tempered [B, V] logits -> the distribution after each stage."""
    steps = [("temperature", _softmax_rows(s, 1.0))] if _active(params, "temperature") else []
    for stage in _active(params, "filter"):
        s = _filtered(s, stage.rule(s, *stage.values(params)))
        steps.append((stage.name, _softmax_rows(s, 1.0)))
    return steps
