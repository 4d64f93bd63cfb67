"""Hypothesis strategies for what sampling code meets: logit rows, probabilities, filter parameters, histories.

Every strategy here draws NumPy values a sampler can be handed: logits with repeated values, `-inf` entries (masked
tokens, never a whole row), huge and tiny spreads and large offsets, in float32 or float64. Shapes: `[V]`, or
`[B, V]` when `batch` is given.

    from hypothesis import given
    from npllm.testing import strategies as nps

    @given(nps.logits(size=(1, 50)), nps.p_values())
    def test_my_top_p(x, p): ...
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

__all__ = [
    "logits",
    "probabilities",
    "top_k_values",
    "p_values",
    "min_p_values",
    "temperatures",
    "penalties",
    "histories",
    "ngram_sizes",
]

# Spreads of a row (the width of its logits around the offset), most common first: Hypothesis shrinks toward the
# first. 1e4 makes every probability but the top one underflow; 1e-4 makes a row nearly flat (and, in float32 with a
# large offset, full of ties).
SPREADS = (5.0, 1.0, 30.0, 0.01, 1e-4, 1e4)
OFFSETS = (0.0, 3.0, -40.0, 1e3)


def _sizes(size) -> st.SearchStrategy[int]:
    """An int, a (low, high) pair, or a strategy -> a strategy of ints."""
    if isinstance(size, st.SearchStrategy):
        return size
    if isinstance(size, (tuple, list)):
        low, high = size
        return st.integers(int(low), int(high))
    return st.just(int(size))


def _dtypes(dtype) -> st.SearchStrategy:
    if isinstance(dtype, (tuple, list)):
        return st.sampled_from([np.dtype(d) for d in dtype])
    return st.just(np.dtype(dtype))


@st.composite
def logits(draw, size=(1, 32), batch=None, dtype=(np.float64, np.float32), ties=True, neg_inf=True, scale=None,
           offset=None):
    """Logits `[V]` (or `[B, V]` with `batch`), always with at least one finite entry per row.

    size, batch: an int, a (low, high) pair or a strategy of ints. dtype: one dtype or a sequence to choose from.
    ties: True lets values repeat (a row is drawn from a small pool of values, so ties are common); False makes the
    values of each row distinct in `dtype`. neg_inf: some entries may be -inf (masked tokens), never all of a row.
    scale: the spread of a row (default: drawn from 1e-4 to 1e4); offset: a constant added to the row (default:
    drawn from 0, 3, -40 and 1e3). The values are drawn in float64 and rounded to `dtype`.
    """
    V = draw(_sizes(size))
    B = None if batch is None else draw(_sizes(batch))
    dt = draw(_dtypes(dtype))
    rows = [_row(draw, V, dt, ties, neg_inf, scale, offset) for _ in range(1 if B is None else B)]
    return rows[0] if B is None else np.stack(rows)


def _row(draw, V, dt, ties, neg_inf, scale, offset) -> np.ndarray:
    spread = draw(st.sampled_from(SPREADS)) if scale is None else float(scale)
    shift = draw(st.sampled_from(OFFSETS)) if offset is None else float(offset)
    unit = st.floats(-1.0, 1.0, allow_nan=False)
    u = draw(hnp.arrays(np.float64, V, elements=unit, unique=not ties))
    if ties:
        # rounding to a coarse grid makes ties common (levels=None leaves the values alone); one choice, not V
        levels = draw(st.sampled_from([None, 1, 2, 3, 8]))
        if levels is not None:
            u = np.round(u * levels) / levels
    x = (shift + spread * u).astype(dt)
    if not ties and len(np.unique(x)) < V:
        x = _distinct(x)  # rounding to dtype merged values: step them apart
    if neg_inf and V > 1:
        bits = draw(st.integers(0, 2 ** (V - 1) - 1))  # which entries are -inf: one choice, shrinks to none
        masked = np.array([(bits >> i) & 1 for i in range(V - 1)], bool)
        keep = draw(st.integers(0, V - 1))  # the entry that always stays finite
        mask = np.insert(masked, keep, False)
        x = np.where(mask, -np.inf, x).astype(dt)
    return np.asarray(x, dt).reshape(V)


def _distinct(x: np.ndarray) -> np.ndarray:
    """Make equal values distinct by stepping repeats up to the next representable numbers (order kept)."""
    out = x.copy()
    order = np.argsort(out, kind="stable")
    for a, b in zip(order[:-1], order[1:]):
        if out[b] <= out[a]:
            out[b] = np.nextafter(out[a], np.inf)
    return out


@st.composite
def probabilities(draw, size=(1, 32), dtype=np.float64, zeros=True):
    """A probability vector `[V]` summing to 1 (within rounding): the softmax of `logits(...)`, zeros allowed."""
    x = draw(logits(size=size, dtype=np.float64, neg_inf=zeros))
    e = np.exp(x - x.max())
    return (e / math.fsum(e)).astype(dtype)


def top_k_values(vocab: int, allow_zero: bool = False) -> st.SearchStrategy[int]:
    """k for top-k on a vocabulary of `vocab` tokens: 1 .. vocab + 2 (k >= V must keep everything); 0 too when
    `allow_zero` (the "disabled" value of some APIs, npllm's included)."""
    return st.integers(0 if allow_zero else 1, vocab + 2)


def p_values(include_one: bool = True) -> st.SearchStrategy[float]:
    """A mass for top-p / typical-p: 0 < p <= 1, with 1 (keep everything) and round values drawn often."""
    special = [0.5, 0.9, 0.95] + ([1.0] if include_one else [])
    return st.sampled_from(special) | st.floats(0.0, 1.0, exclude_min=True, exclude_max=not include_one)


def min_p_values() -> st.SearchStrategy[float]:
    """A min-p ratio: 0 <= p <= 1 (0 keeps everything, 1 keeps only the maxima)."""
    return st.sampled_from([0.0, 0.05, 0.1, 1.0]) | st.floats(0.0, 1.0)


def temperatures(low: float = 0.05, high: float = 20.0) -> st.SearchStrategy[float]:
    """A positive temperature in [low, high], with 1 and round values drawn often."""
    special = [v for v in (1.0, 0.5, 2.0) if low <= v <= high]
    return st.sampled_from(special) | st.floats(low, high)


def penalties(low: float = 0.05, high: float = 20.0) -> st.SearchStrategy[float]:
    """A repetition penalty in [low, high] (below 1 favours repeats), with 1 and round values drawn often."""
    special = [v for v in (1.0, 1.3, 2.0, 0.5) if low <= v <= high]
    return st.sampled_from(special) | st.floats(low, high)


def histories(vocab: int, max_len: int = 16, repeats: bool = True) -> st.SearchStrategy[list[int]]:
    """A token history: a list of ids in [0, vocab). With `repeats` the ids come from a few distinct values, so
    repeated tokens and repeated n-grams are common."""
    if not repeats:
        return st.lists(st.integers(0, vocab - 1), max_size=min(max_len, vocab), unique=True)

    @st.composite
    def draw_history(draw):
        alphabet = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=min(4, vocab), unique=True))
        return draw(st.lists(st.sampled_from(alphabet), max_size=max_len))

    return draw_history()


def ngram_sizes(high: int = 4) -> st.SearchStrategy[int]:
    """n for no-repeat-n-gram: 1 .. high."""
    return st.integers(1, high)
