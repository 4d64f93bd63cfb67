"""Sampling: from a row of logits to the next token, as pure, vectorised NumPy.

Every function takes logits of shape [V] or [B, V] (float32 or float64; other real dtypes are read as float64),
never mutates its arguments, and returns a new array of the same shape and dtype. Filters return logits whose
removed entries are -inf and whose kept entries are unchanged. Work over the whole vocabulary stays in the
logits' dtype; cumulative sums and the final draw are computed in float64.

The pipeline of `sample` (docs/sampling.md states every definition and how other engines differ):

    penalties    repetition_penalty -> presence_frequency_penalty -> logit_bias -> no_repeat_ngram
    temperature  z = (x - max x) / T      (T = 0 is greedy: argmax of the penalised logits, ties to the lowest id)
    filters      top_k -> top_p -> min_p -> typical_p   (each sees the distribution the previous one left)
    draw         inverse CDF over ascending token ids, one uniform from the row's generator

Special values. NaN anywhere raises GenerationError. A row holding +inf entries is the limit of those logits
growing together: its +inf tokens share the mass equally and every other token gets probability 0. A row whose
logits are all -inf has no distribution: every function that normalises raises on it. Every filter keeps the row's
most probable token (typical_p keeps the most typical one), so no filter can leave a row empty.

Dimension letters: V vocabulary, B batch rows, C candidate tokens kept after the first filter, N alternatives.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple

import numpy as np

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
    "SamplingParams",
    "Sampled",
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
    if np.isneginf(m).any():
        row = int(np.flatnonzero(np.isneginf(m))[0])
        raise GenerationError(f"logits row {row}: every token is -inf (masked), so there is nothing to sample")
    inf_rows = np.isposinf(m)
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


# ----------------------------------------------------------------------------------------------------------------
# Filters. Each _keep function maps [B, C] logits to a [B, C] boolean mask of the tokens kept, or None when the
# filter keeps everything. They depend only on the values of a row, not on positions, so `sample` can run them
# on a compact [B, C] array of the candidates that survived the first filter.
# ----------------------------------------------------------------------------------------------------------------


def _masked(s: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """s where keep, -inf elsewhere, for s without +inf: s + (0 or -inf) by table lookup.

    About three times faster than np.where on the irregular masks filters produce.
    """
    return s + np.take(np.array([-np.inf, 0.0], s.dtype), keep.view(np.uint8))


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


# Running sums over a whole row are taken block by block: float64 sums of _BLOCK entries, then a cumulative sum
# inside the one block that matters. A float64 cumulative sum of a float32 [32, 32000] array costs more than
# everything else in the pipeline together.
_BLOCK = 256


def _running_search(values: np.ndarray, target: np.ndarray, side: str) -> np.ndarray:
    """np.searchsorted on each row's running sum: [R, n] values >= 0, [R] float64 targets -> [R] indices.

    The first index i whose running sum Σ_{j<=i} values_j is >= target (side "left") or > target (side "right");
    n when there is none. The index always lands on an entry with values_i > 0.
    """
    R, n = values.shape
    bs = min(n, _BLOCK)
    nb = -(-n // bs)
    if nb * bs != n:
        values = np.concatenate([values, np.zeros((R, nb * bs - n), values.dtype)], axis=1)
    blocks = values.reshape(R, nb, bs)
    ends = np.cumsum(blocks.sum(axis=2, dtype=np.float64), axis=1)  # [R, nb] running sum at each block's end
    t = target[:, None]
    b = np.sum(ends < t if side == "left" else ends <= t, axis=1)  # [R] first block that gets there
    found = b < nb
    b = np.minimum(b, nb - 1)
    rows = np.arange(R)
    block = blocks[rows, b].astype(np.float64)  # [R, bs]
    inner = np.where(b > 0, ends[rows, b - 1], 0.0)[:, None] + np.cumsum(block, axis=1)  # [R, bs]
    j = np.sum(inner < t if side == "left" else inner <= t, axis=1)
    last_live = bs - 1 - np.argmax(block[:, ::-1] > 0, axis=1)  # when block sum and cumsum round apart
    return np.where(found, b * bs + np.where(j < bs, j, last_live), n)


# Rows whose nucleus lies inside their largest _NUCLEUS_CANDIDATES probabilities are never sorted in full.
# A multiple of _BLOCK, so both routes add the same numbers in the same order.
_NUCLEUS_CANDIDATES = 4 * _BLOCK


def _nucleus_floor(e: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Per row, the largest value τ in e with Σ_{e_j >= τ} e_j >= target: [B, V], [B] -> [B].

    e holds unnormalised probabilities. The descending running sum (float64) first reaches the target at some
    entry; τ is that entry's value. Only the largest _NUCLEUS_CANDIDATES values are partitioned out and sorted; the
    rows whose target lies beyond them (flat distributions) are sorted in full. Both routes give identical bits,
    because the running sums of a descending prefix do not depend on what follows it. When rounding keeps the sum
    below the target, τ is the row's smallest value (everything is kept).
    """
    B, V = e.shape
    m = min(V, _NUCLEUS_CANDIDATES)
    head = e if m == V else np.partition(e, V - m, axis=1)[:, V - m :]  # [B, m] the m largest, unordered
    tau = _sorted_reach(head, target)
    short = np.flatnonzero(np.isnan(tau))
    if m < V and short.size:
        tau[short] = _sorted_reach(e[short], target[short])
    return np.where(np.isnan(tau), e.min(axis=1), tau).astype(e.dtype)


def _sorted_reach(values: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Sort each row descending; the value where the running sum first reaches target, else NaN: [R, n] -> [R]."""
    ordered = np.sort(values, axis=1)[:, ::-1]  # [R, n] descending (a view)
    j = _running_search(ordered, target, "left")
    reached = j < values.shape[1]
    return np.where(reached, ordered[np.arange(len(values)), np.minimum(j, values.shape[1] - 1)], np.nan)


def _top_p_keep(x2: np.ndarray, p: float) -> np.ndarray | None:
    """Keep π_i >= τ, τ the largest probability whose upper set {π >= τ} holds mass >= p."""
    if p >= 1.0:
        return None
    e = np.exp(_shifted(x2, 1.0))  # [B, V] unnormalised probabilities, row max 1
    tau = _nucleus_floor(e, p * e.sum(axis=1, dtype=np.float64))
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
# Penalties. Public functions copy once and call an in-place helper on the copy; `sample` chains the helpers on
# one copy.
# ----------------------------------------------------------------------------------------------------------------


def _history_counts(history: list[np.ndarray], V: int) -> tuple[tuple[np.ndarray, np.ndarray], np.ndarray]:
    """Distinct (row, token) pairs of the histories and how often each occurs: ([n], [n]) positions, [n] counts."""
    flat = np.concatenate([b * V + ids for b, ids in enumerate(history)])
    pairs, counts = np.unique(flat, return_counts=True)
    return (pairs // V, pairs % V), counts


def _repetition_inplace(out: np.ndarray, positions, penalty: float) -> None:
    """CTRL rule on the listed positions: x / penalty where x > 0, x · penalty otherwise."""
    v = out[positions]
    out[positions] = np.where(v > 0, v / penalty, v * penalty)


def _presence_frequency_inplace(out, positions, counts, presence: float, frequency: float) -> None:
    """x_t -= presence + frequency · count_t on the listed positions (all of them have count >= 1)."""
    out[positions] -= presence + frequency * counts


def _bias_inplace(out: np.ndarray, bias: Mapping[int, float]) -> None:
    """x_t += bias_t in every row; a -inf bias bans the token even where its logit is +inf."""
    V = out.shape[1]
    ids = np.fromiter(bias.keys(), np.int64, len(bias))
    values = np.fromiter(bias.values(), np.float64, len(bias))
    if ids.max() >= V:
        raise GenerationError(f"logit_bias names token {int(ids.max())}, outside the vocabulary [0, {V})")
    out[:, ids] = np.where(values == -np.inf, -np.inf, out[:, ids] + values)


def _ngram_banned(ids: np.ndarray, n: int) -> np.ndarray:
    """Tokens t such that ids + [t] would end with an n-gram already present in ids: [L] -> [n_banned]."""
    if len(ids) < n:
        return ids[:0]
    windows = np.lib.stride_tricks.sliding_window_view(ids, n)  # [L - n + 1, n] every n-gram of the history
    prefix = ids[len(ids) - n + 1 :]  # [n - 1] the most recent n - 1 tokens
    return windows[(windows[:, :-1] == prefix).all(axis=1), -1]


def _ngram_inplace(out: np.ndarray, history: list[np.ndarray], n: int) -> None:
    for b, ids in enumerate(history):
        out[b, _ngram_banned(ids, n)] = -np.inf


def repetition_penalty(logits, token_ids, penalty: float) -> np.ndarray:
    """CTRL repetition penalty: for each distinct token t in token_ids, x_t / penalty if x_t > 0 else x_t · penalty.

    A token is penalised once however often it occurs. penalty > 1 discourages repeats, 0 < penalty < 1 favours
    them, 1 is the identity. Dividing positive and multiplying negative logits makes a penalty > 1 always lower
    the logit (x = 0 stays 0). token_ids: one sequence for [V] logits, B sequences for [B, V].
    """
    x = _as_logits(logits)
    penalty = _penalty_value(penalty)
    history = _history(token_ids, x)
    out = _rows(x).copy()
    if penalty != 1.0 and any(len(h) for h in history):
        positions, _ = _history_counts(history, out.shape[1])
        _repetition_inplace(out, positions, penalty)
    return out.reshape(x.shape)


def presence_frequency_penalty(logits, token_ids, presence: float, frequency: float) -> np.ndarray:
    """OpenAI-style penalties: x_t - presence · [c_t > 0] - frequency · c_t, c_t = occurrences of t in token_ids.

    Tokens absent from token_ids are untouched; negative values reward repeats instead.
    """
    x = _as_logits(logits)
    presence = _finite_value("presence_penalty", presence)
    frequency = _finite_value("frequency_penalty", frequency)
    history = _history(token_ids, x)
    out = _rows(x).copy()
    if (presence or frequency) and any(len(h) for h in history):
        positions, counts = _history_counts(history, out.shape[1])
        _presence_frequency_inplace(out, positions, counts, presence, frequency)
    return out.reshape(x.shape)


def no_repeat_ngram(logits, token_ids, n: int) -> np.ndarray:
    """Ban (-inf) every token that would complete an n-gram already present in token_ids.

    With history h of length L, token t is banned when some i <= L - n has h[i : i + n - 1] == h[L - n + 1 :] and
    h[i + n - 1] == t. n = 1 bans every token seen; n = 0 disables. This filter alone can mask a whole row (tiny
    vocabularies); `sample` then raises rather than sample from nothing.
    """
    x = _as_logits(logits)
    n = _integer("no_repeat_ngram", n)
    history = _history(token_ids, x)
    out = _rows(x).copy()
    if n:
        _ngram_inplace(out, history, n)
    return out.reshape(x.shape)


def logit_bias(logits, bias: Mapping[int, float] | None) -> np.ndarray:
    """x_t + bias[t] for every listed token, in every row. A -inf bias bans a token; +inf is refused."""
    x = _as_logits(logits)
    bias = _bias_value(bias)
    out = _rows(x).copy()
    if bias:
        _bias_inplace(out, bias)
    return out.reshape(x.shape)


def greedy(logits) -> int | np.ndarray:
    """argmax per row, ties to the lowest token id: [V] -> int, [B, V] -> [B] int64.

    A +inf logit wins over every finite one (the lowest-id +inf when several); a row of all -inf raises.
    """
    x = _as_logits(logits)
    ids = np.argmax(_normalisable(_rows(x))[0], axis=1)  # argmax returns the first maximum
    return int(ids[0]) if x.ndim == 1 else ids.astype(np.int64)


# ----------------------------------------------------------------------------------------------------------------
# Parameters and the pipeline
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplingParams:
    """Everything that decides how the next token is chosen, validated on construction.

    Defaults disable every stage except plain sampling at temperature 1. `stop` is used by the generation loop, not
    by `sample`; `seed` seeds `generator()`. A bad value raises GenerationError (a ValueError) naming the field.
    """

    temperature: float = 1.0  # >= 0; 0 is greedy
    top_k: int = 0  # >= 0; 0 disables
    top_p: float = 1.0  # (0, 1]; 1 disables
    min_p: float = 0.0  # [0, 1]; 0 disables
    typical_p: float = 1.0  # (0, 1]; 1 disables
    repetition_penalty: float = 1.0  # > 0; 1 disables
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    no_repeat_ngram: int = 0  # n-gram size; 0 disables
    logit_bias: Mapping[int, float] | None = field(default=None, hash=False)
    seed: int | None = None
    logprobs: int = 0  # how many top alternatives to report per step
    stop: tuple[str, ...] = ()

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

    def generator(self) -> np.random.Generator:
        """A fresh generator from `seed` (fresh OS entropy when seed is None). Create it once per generation."""
        return np.random.default_rng(self.seed)


class Sampled(NamedTuple):
    """What `sample` and `sample_step` return. For [V] logits: a Python int and float, and [N] arrays; for [B, V]: [B], [B, N].

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


def _penalised(x2: np.ndarray, params: SamplingParams, history: list[np.ndarray]) -> np.ndarray:
    """[B, V] raw logits -> [B, V] logits after the penalty stages (x2 itself when none is active; never mutated)."""
    pairs_needed = params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty
    has_history = any(len(h) for h in history)
    if not (params.logit_bias or (has_history and (pairs_needed or params.no_repeat_ngram))):
        return x2
    out = x2.copy()
    if has_history and pairs_needed:
        positions, counts = _history_counts(history, out.shape[1])
        if params.repetition_penalty != 1.0:
            _repetition_inplace(out, positions, params.repetition_penalty)
        if params.presence_penalty or params.frequency_penalty:
            _presence_frequency_inplace(out, positions, counts, params.presence_penalty, params.frequency_penalty)
    if params.logit_bias:
        _bias_inplace(out, params.logit_bias)
    if has_history and params.no_repeat_ngram:
        _ngram_inplace(out, history, params.no_repeat_ngram)
    return out


def _filter_stages(params: SamplingParams) -> list[tuple[str, object]]:
    """The active filters in pipeline order, as (name, keep function of [B, C] logits)."""
    stages = []
    if params.top_k:
        stages.append(("top_k", lambda s: _top_k_keep(s, params.top_k)))
    if params.top_p < 1.0:
        stages.append(("top_p", lambda s: _top_p_keep(s, params.top_p)))
    if params.min_p > 0.0:
        stages.append(("min_p", lambda s: _min_p_keep(s, params.min_p)))
    if params.typical_p < 1.0:
        stages.append(("typical_p", lambda s: _typical_keep(s, params.typical_p)))
    return stages


# The first filter's survivors are gathered into a compact [B, C] array when C <= V / _COMPACT_RATIO; otherwise
# gathering would cost more than running the later stages on the whole (masked) vocabulary.
_COMPACT_RATIO = 8


def _gather(keep: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[B, V] mask and logits -> ([B, C] ids, [B, C] logits) of the kept tokens in ascending id order.

    Rows with fewer than C survivors are padded with id -1 and logit -inf. When many tokens survive, the whole
    vocabulary is kept with the removed entries set to -inf instead (C = V, ids 0..V-1).
    """
    B, V = s.shape
    counts = keep.sum(axis=1)
    C = int(counts.max())
    if C > V // _COMPACT_RATIO:
        return np.broadcast_to(np.arange(V), (B, V)), _masked(s, keep)
    ids = np.full((B, C), -1, np.int64)
    vals = np.full((B, C), -np.inf, s.dtype)
    for b in range(B):
        kept = np.flatnonzero(keep[b])
        ids[b, : kept.size] = kept
        vals[b, : kept.size] = s[b, kept]
    return ids, vals


def _top_k_floor(s: np.ndarray, k: int) -> np.ndarray:
    """A value <= the k-th largest logit of each row, read off block maxima: [B, V] -> [B] (needs V >= 4k).

    The row is cut into at least 4k blocks; any k block maxima are k distinct entries, so the k-th largest block
    maximum cannot exceed the k-th largest entry. One pass over the row and a partition of ~4k maxima replace a
    partition of the whole row; typically only a few more than k entries lie above the floor.
    """
    B, V = s.shape
    size = V // (4 * k)  # block length
    n = V // size  # number of whole blocks (>= 4k); the tail is left out, which only lowers the floor
    maxima = s[:, : n * size].reshape(B, n, size).max(axis=2)  # [B, n]
    return np.partition(maxima, n - k, axis=1)[:, n - k]


def _top_k_gather(s: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """top_k as the first filter: [B, V] -> ([B, C] ids, [B, C] logits), the survivors of _top_k_keep.

    The entries above a floor (_top_k_floor) are gathered first and the exact rule runs on those few.
    """
    V = s.shape[1]
    candidates = s >= _top_k_floor(s, k)[:, None] if V >= 4 * k else _top_k_keep(s, k)
    ids, vals = _gather(candidates, s)
    keep = _top_k_keep(vals, k)
    return ids, vals if keep is None else _masked(vals, keep)


def _candidates(s: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """[B, V] tempered logits (no +inf) -> ([B, C] ids, [B, C] logits) after every filter; removed entries -inf.

    The first filter that removes anything runs on the whole vocabulary; the rest run on its survivors only.
    Candidates are always listed in ascending token id order.
    """
    ids = None
    for name, keep_of in _filter_stages(params):
        if name == "top_k":  # always the first filter
            if params.top_k < s.shape[1]:
                ids, s = _top_k_gather(s, params.top_k)
            continue
        keep = keep_of(s)
        if keep is None:
            continue
        if ids is None:
            ids, s = _gather(keep, s)
        else:
            s = _masked(s, keep)
    if ids is None:
        ids = np.broadcast_to(np.arange(s.shape[1]), s.shape)
    return ids, s


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


def _draw(vals: np.ndarray, uniforms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Inverse CDF: per row, the first slot whose cumulative probability exceeds u.

    vals [B, C] logits (row max finite), uniforms [B] -> chosen slots [B], log Z [B] with Z = Σ exp(vals - max).
    With q = softmax(vals) in slot order, slot j is chosen when Σ_{i<j} q_i <= u < Σ_{i<=j} q_i, so slot j has
    probability q_j; a slot with q_j = 0 is never chosen. Exponentials in the logits' dtype, sums in float64.
    """
    e = np.exp(vals - vals.max(axis=1, keepdims=True))  # [B, C] unnormalised, row max 1
    total = e.sum(axis=1, dtype=np.float64)  # [B]
    slot = _running_search(e, uniforms * total, "right")
    last_live = e.shape[1] - 1 - np.argmax(e[:, ::-1] > 0, axis=1)  # u · total may round past the running sum
    return np.minimum(slot, last_live), np.log(total)


def _top_n(ids: np.ndarray, logq_of, n: int, B: int) -> tuple[np.ndarray, np.ndarray]:
    """The n most probable tokens per row, ties to the lower id -> [B, n] ids, [B, n] log-probs (-1 / -inf pads).

    ids [B, C]; logq_of(b) gives row b's [C] float64 log-probabilities (computed only when asked).
    """
    top_ids = np.full((B, n), -1, np.int64)
    top_lp = np.full((B, n), -np.inf)
    if n == 0:
        return top_ids, top_lp
    for b in range(B):
        logq = logq_of(b)
        live = np.flatnonzero(logq > -np.inf)
        if live.size > n:  # narrow to the values >= the n-th largest (ties included) before ordering
            nth = np.partition(logq[live], live.size - n)[live.size - n]
            live = live[logq[live] >= nth]
        order = live[np.lexsort((ids[b, live], -logq[live]))][:n]
        top_ids[b, : order.size] = ids[b, order]
        top_lp[b, : order.size] = logq[order]
    return top_ids, top_lp


def _shaped(x: np.ndarray, token_ids, logprobs, top_ids, top_lp) -> Sampled:
    if x.ndim == 1:
        return Sampled(int(token_ids[0]), float(logprobs[0]), top_ids[0], top_lp[0])
    return Sampled(np.asarray(token_ids, np.int64), np.asarray(logprobs, np.float64), top_ids, top_lp)


def sample_step(params: SamplingParams, logits, rng, token_ids=None) -> Sampled:
    """Choose the next token of each row following `params`, with its log-probability and the top alternatives.

    logits [V] or [B, V]; token_ids the past tokens (one sequence, or B of them; None: no history) that the
    penalties look at; rng a numpy Generator, or for [B, V] a list of B generators so that a row's draws do not
    depend on its neighbours (rng may be None for greedy decoding). A sampled step consumes exactly one
    `rng.random()` per row, a greedy step none. Raises GenerationError when the penalties leave a row with no
    allowed token. `params.logprobs` sets how many alternatives are reported.
    """
    x = _as_logits(logits)
    x2 = _rows(x)
    B, V = x2.shape
    if rng is not None or not params.is_greedy:
        _check_rng(rng, B, x.ndim == 2)
    z = _penalised(x2, params, _history(token_ids, x))  # [B, V]
    if z is not x2 and np.isneginf(z.max(axis=1)).any():
        row = int(np.flatnonzero(np.isneginf(z.max(axis=1)))[0])
        raise GenerationError(
            f"logits row {row}: the penalties (logit_bias / no_repeat_ngram) masked every token, nothing to sample"
        )
    rows = np.arange(B)
    if params.is_greedy:
        zr, m = _normalisable(z)
        chosen = np.argmax(zr, axis=1)  # ties: the first maximum, i.e. the lowest id
        shifted = zr - m[:, None]  # [B, V]
        log_total = np.log(np.exp(shifted).sum(axis=1, dtype=np.float64))  # [B]
        top_ids, top_lp = _top_n(
            np.broadcast_to(np.arange(V), (B, V)),
            lambda b: shifted[b].astype(np.float64) - log_total[b],
            params.logprobs,
            B,
        )
        return _shaped(x, chosen, shifted[rows, chosen].astype(np.float64) - log_total, top_ids, top_lp)

    ids, vals = _candidates(_shifted(z, params.temperature), params)  # [B, C]
    slot, log_total = _draw(vals, _uniforms(rng, B))
    vmax = vals.max(axis=1).astype(np.float64)

    def logq_of(b):  # [C] float64 log-probabilities of row b's candidates
        return vals[b].astype(np.float64) - vmax[b] - log_total[b]

    chosen_lp = vals[rows, slot].astype(np.float64) - vmax - log_total
    top_ids, top_lp = _top_n(ids, logq_of, params.logprobs, B)
    return _shaped(x, ids[rows, slot], chosen_lp, top_ids, top_lp)


def sample_with(params: SamplingParams, logits, rng, token_ids=None) -> int | np.ndarray:
    """Only the chosen token id(s) of `sample_step`: an int for [V] logits, [B] int64 for [B, V].

    The call the generation loop makes at every step when it needs no log-probabilities.
    """
    return sample_step(params, logits, rng, token_ids).token_ids


def sample(
    logits,
    rng,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    typical_p: float = 1.0,
    repetition_penalty: float = 1.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    no_repeat_ngram: int = 0,
    logit_bias: Mapping[int, float] | None = None,
    token_ids=None,
    logprobs: int = 0,
) -> Sampled:
    """Choose the next token of each row: penalties -> temperature -> top-k -> top-p -> min-p -> typical-p -> draw.

    Keyword arguments are those of SamplingParams (validated the same way); see `sample_step` and `Sampled`.
    Temperature 0 is greedy: the argmax of the penalised logits, ties to the lowest id, filters not applied.
    """
    params = SamplingParams(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        typical_p=typical_p,
        repetition_penalty=repetition_penalty,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        no_repeat_ngram=no_repeat_ngram,
        logit_bias=logit_bias,
        logprobs=logprobs,
    )
    return sample_step(params, logits, rng, token_ids)


def explain_steps(logits, params: SamplingParams, token_ids=None) -> list[tuple[str, np.ndarray]]:
    """The probability vector after each active pipeline stage, for `--explain`: [(stage name, [V] or [B, V])].

    Starts with ("logits", softmax of the raw logits) and ends with the distribution `sample_step` draws from (for
    greedy decoding, ("greedy", a point mass on the chosen token)). Probabilities are float64.
    """
    x = _as_logits(logits)
    history = _history(token_ids, x)
    seqs = history if x.ndim == 2 else history[0]
    steps = [("logits", softmax(x.astype(np.float64)))]
    z = x
    if params.repetition_penalty != 1.0:
        z = repetition_penalty(z, seqs, params.repetition_penalty)
        steps.append(("repetition_penalty", softmax(z.astype(np.float64))))
    if params.presence_penalty or params.frequency_penalty:
        z = presence_frequency_penalty(z, seqs, params.presence_penalty, params.frequency_penalty)
        steps.append(("presence_frequency_penalty", softmax(z.astype(np.float64))))
    if params.logit_bias:
        z = logit_bias(z, params.logit_bias)
        steps.append(("logit_bias", softmax(z.astype(np.float64))))
    if params.no_repeat_ngram:
        z = no_repeat_ngram(z, seqs, params.no_repeat_ngram)
        steps.append(("no_repeat_ngram", softmax(z.astype(np.float64))))
    if params.is_greedy:
        z2 = _rows(z)
        point = np.zeros(z2.shape)
        point[np.arange(z2.shape[0]), np.argmax(z2, axis=1)] = 1.0
        steps.append(("greedy", point.reshape(x.shape)))
        return steps
    s = _shifted(_rows(z), params.temperature).reshape(x.shape)
    if params.temperature != 1.0:
        steps.append(("temperature", softmax(s)))
    filters = {"top_k": top_k, "top_p": top_p, "min_p": min_p, "typical_p": typical_p}
    for name, _ in _filter_stages(params):
        s = filters[name](s, getattr(params, name))
        steps.append((name, softmax(s)))
    return steps
