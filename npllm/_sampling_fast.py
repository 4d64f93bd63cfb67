"""Private: the speed helpers behind `sampling.sample_step` and `sampling.sample_with`. Not a public API.

`npllm.sampling` defines every stage of the pipeline readably, one public function each. Running those functions
one after the other on the whole vocabulary costs more than the model at small sizes, so a step takes these
shortcuts instead, each one equivalent to the readable definition (tests/test_sampling_fast.py holds them to it
with Hypothesis over random logits and parameters):

    candidates   the first filter that removes anything runs on the whole vocabulary; the later ones run on a
                 compact [B, C] array of its survivors (filters depend on values only, never on positions)
    top_k first  the survivors are gathered from above a floor read off block maxima, then top_k's own rule runs
                 on those few
    top_p        the nucleus is found among the largest _NUCLEUS_CANDIDATES probabilities (a partition, not a
                 sort of the row), with running sums taken block by block
    draw         the inverse CDF over the candidates with the same block-wise running sums
    top_n        the N most probable candidates, ordered only among those >= the N-th largest

Dimension letters: V vocabulary, B batch rows, C candidate tokens kept after the first filter, N alternatives.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

# Running sums over a whole row are taken block by block: float64 sums of _BLOCK entries, then a cumulative sum
# inside the one block that matters. A float64 cumulative sum of a float32 [32, 32000] array costs more than
# everything else in the pipeline together.
_BLOCK = 256


def running_search(values: np.ndarray, target: np.ndarray, side: str) -> np.ndarray:
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

    e holds unnormalised probabilities. Only the largest _NUCLEUS_CANDIDATES values are partitioned out and
    sorted; the rows whose target lies beyond them (flat distributions) are sorted in full. Both routes give
    identical bits, because the running sums of a descending prefix do not depend on what follows it. When
    rounding keeps the sum below the target, τ is the row's smallest value (everything is kept).
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
    j = running_search(ordered, target, "left")
    reached = j < values.shape[1]
    return np.where(reached, ordered[np.arange(len(values)), np.minimum(j, values.shape[1] - 1)], np.nan)


def top_p_keep(s: np.ndarray, p: float) -> np.ndarray | None:
    """sampling._top_p_keep for logits without +inf: keep π_i >= τ, found by _nucleus_floor.  # [B, C] -> [B, C]"""
    if p >= 1.0:
        return None
    e = np.exp(s - s.max(axis=1, keepdims=True))  # [B, C] unnormalised probabilities, row max 1
    tau = _nucleus_floor(e, p * e.sum(axis=1, dtype=np.float64))
    return e >= tau[:, None]


def masked(s: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """s where keep, -inf elsewhere, for s without +inf: s + (0 or -inf) by table lookup.

    About three times faster than np.where on the irregular masks filters produce.
    """
    return s + np.take(np.array([-np.inf, 0.0], s.dtype), keep.view(np.uint8))


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
        return np.broadcast_to(np.arange(V), (B, V)), masked(s, keep)
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


def _top_k_gather(s: np.ndarray, k: int, keep_of: Callable) -> tuple[np.ndarray, np.ndarray]:
    """top_k as the first filter: [B, V] -> ([B, C] ids, [B, C] logits), the survivors of keep_of(x, k).

    The entries above a floor (_top_k_floor) are gathered first and top_k's own rule runs on those few.
    """
    V = s.shape[1]
    candidates = s >= _top_k_floor(s, k)[:, None] if V >= 4 * k else keep_of(s, k)
    ids, vals = _gather(candidates, s)
    keep = keep_of(vals, k)
    return ids, vals if keep is None else masked(vals, keep)


def candidates(s: np.ndarray, filters: list[tuple[str, Callable, object]]) -> tuple[np.ndarray, np.ndarray]:
    """[B, V] tempered logits (no +inf) -> ([B, C] ids, [B, C] logits) after every filter; removed entries -inf.

    filters are the active filter stages in pipeline order, as (name, keep rule, value) with keep(x, value) the
    readable rule of sampling.py ([B, C] logits -> [B, C] mask, or None when it keeps everything). The first filter
    that removes anything runs on the whole vocabulary; the rest run on its survivors. top_k's survivors are
    gathered above a floor, and top_p's rule is replaced by top_p_keep. Candidates are listed in ascending id order.
    """
    ids = None
    for name, keep_of, value in filters:
        if name == "top_k" and ids is None:  # top_k is the pipeline's first filter
            if value < s.shape[1]:
                ids, s = _top_k_gather(s, value, keep_of)
            continue
        keep = top_p_keep(s, value) if name == "top_p" else keep_of(s, value)
        if keep is None:
            continue
        if ids is None:
            ids, s = _gather(keep, s)
        else:
            s = masked(s, keep)
    if ids is None:
        ids = np.broadcast_to(np.arange(s.shape[1]), s.shape)
    return ids, s


def draw(vals: np.ndarray, uniforms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Inverse CDF: per row, the first slot whose cumulative probability exceeds u.

    vals [B, C] logits (row max finite), uniforms [B] -> chosen slots [B], log Z [B] with Z = Σ exp(vals - max).
    With q = softmax(vals) in slot order, slot j is chosen when Σ_{i<j} q_i <= u < Σ_{i<=j} q_i, so slot j has
    probability q_j; a slot with q_j = 0 is never chosen. Exponentials in the logits' dtype, sums in float64.
    """
    e = np.exp(vals - vals.max(axis=1, keepdims=True))  # [B, C] unnormalised, row max 1
    total = e.sum(axis=1, dtype=np.float64)  # [B]
    slot = running_search(e, uniforms * total, "right")
    last_live = e.shape[1] - 1 - np.argmax(e[:, ::-1] > 0, axis=1)  # u · total may round past the running sum
    return np.minimum(slot, last_live), np.log(total)


def top_n(ids: np.ndarray, logq_of: Callable, n: int, B: int) -> tuple[np.ndarray, np.ndarray]:
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
