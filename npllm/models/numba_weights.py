"""The Numba backend's weights record (Packed), as its one compiled forward pass (models/numba.py, _forward) reads it:
every matrix over one byte pool, in its file's type (F16, BF16, a GGUF file's quantized blocks) or in a layout of the
kernels' own (float32 panels, interleaved block rows), with a type code each; the vectors as float32 arrays.

The record holds every family's options as data: a norm the family does not have is an [L, 0] array, a dense
model's experts are E = 0 rows (a mixture of experts' dense matrices are empty), so one compiled loop runs them all.
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np

from ..config import ModelConfig
from ..kernels import cpu
from ..kernels import quant as qk
from ..quant import INTERLEAVE
from ..tensors import release, release_files
from .weights import Weights

PANEL = cpu.PANEL


NORMS = ("attention_norm", "ffn_norm", "q_norm", "k_norm", "post_attention_norm", "post_ffn_norm")


def layer_vectors(c: ModelConfig, weights: Weights) -> dict[str, np.ndarray]:
    """The layers' RMSNorm gains by name (NORMS), float32 stacked along L, [L, 0] where the family has none; q_norm
    and k_norm permuted as Packed.qk_perm permutes q and k outputs (Hugging Face's rope_layout "half" into the
    interleaved one), each head's Dh gains alike ("head": one head's [Dh]; "projection": [H Dh], [K Dh]).   # -> {name: [L, n]}"""
    from ..tensors import permute_qk_half_to_interleaved

    vectors = {}
    for name in NORMS:
        present = getattr(weights.layers[0], name) is not None
        vectors[name] = weights.stacked(name) if present else np.zeros((c.n_layers, 0), np.float32)
    if c.rope_layout == "half" and c.qk_norm:
        for name, heads in (("q_norm", c.n_heads), ("k_norm", c.n_kv_heads)):
            n = vectors[name].shape[1]
            per_head = permute_qk_half_to_interleaved(np.arange(n), n // c.head_dim, c.head_dim, c.rotary_dims)
            vectors[name] = np.ascontiguousarray(vectors[name][:, per_head])
    return vectors


# ================================================================================================================
# Every matrix is a run of byte rows inside ONE uint8 array, the `pool`: the checkpoint's memory map itself when all
# matrices lie in it as stored (an F16 GGUF file), else their bytes put together once. A table says where each is:
#
#     mats [7 L + 2, 5] int64: byte offset, type code, rows N, values per row K, bytes per row
#          rows 7 l + (WQ, WK, WV, WO, W1, W3, W2) for layer l, then the token embeddings and the LM head
#
# The type code is the GGML type id, plus where the matrix is held in a layout of its own (kernels/quant/dispatch.py):
# a block type's rows interleaved by eight (+ INTERLEAVED_CODE), F32 rows as panels of 16 (+ PANELS_CODE, the
# layout of cpu.py's register tiles). Block types are not fused at load: q, k and v (and gate and up), which read the
# same input, are computed in ONE parallel region over their concatenated rows, each matrix by the row-range worker of
# its own type (models/numba_products.py), so a file that mixes types (Q4_K_M: Q4_K, Q6_K, Q5_0, ...) runs every
# matrix as stored. F32 ones, copied into panels anyway, are stored as one run of panels where all of a product's
# are F32 (_runs): the first matrix's row of the table then counts the run's rows, the others' none.


WQ, WK, WV, WO, W1, W3, W2 = range(7)
PER_LAYER = 7
Packed = namedtuple("Packed", [
    "pool",  # [bytes] uint8, read-only
    "mats",  # [7 L + 2, 5] int64 (see above)
    "table",  # [V, row bytes] uint8, read-only: the embedding table as stored, looked up row by row (a mapped file's
    #           other rows never load); [0, 0] where it is tied to the LM head: then its rows come from the head's
    "attention_norm",  # [L, D]         RMSNorm gains, float32 stacked along L ([L, 0] where the family has none)
    "bqkv",  # [L, (H + 2K) Dh]      zeros where the model has no biases
    "ffn_norm",  # [L, D]
    "norm",  # [D]
    "qk_perm",  # [(H + K) Dh] int64: column i of q|k takes column qk_perm[i] (rope_layout "half"); empty otherwise
    "q_norm",  # [L, Dh or H Dh]       q and k norms, in the interleaved RoPE layout (layer_vectors)
    "k_norm",  # [L, Dh or K Dh]
    "post_attention_norm",  # [L, D]   a block's output's norms (block_norms "sandwich", "post")
    "post_ffn_norm",  # [L, D]
    "experts",  # [L (1 + 3E), 5] int64 rows as mats': layer l's router at row l, its expert e's gate, up and down at
    #             rows L + 3 (l E + e) + (0, 1, 2); [0, 5] for a dense model (whose mats rows W1, W3, W2 are empty
    #             in a mixture of experts)
])


def _memory_root(a: np.ndarray):
    """The object whose memory an array views (a memory map, a bytes object), or the array itself if it owns it."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    root = a.base if a.base is not None else a
    return root.obj if isinstance(root, memoryview) else root


def weight_pool(raws: list[np.ndarray]) -> tuple[np.ndarray, list[int]]:
    """One read-only uint8 array holding every matrix's bytes, and each one's offset in it: the memory map they
    all view (no copy), or, when they do not share one, their bytes concatenated once (each distinct array once)."""
    roots = {id(_memory_root(r)): _memory_root(r) for r in raws}
    if len(roots) == 1 and not isinstance(next(iter(roots.values())), np.ndarray):
        pool = np.frombuffer(next(iter(roots.values())), np.uint8)
        start = pool.__array_interface__["data"][0]
        return pool, [r.__array_interface__["data"][0] - start for r in raws]
    offsets, parts, seen, at = [], [], {}, 0
    for r in raws:
        if id(r) not in seen:
            seen[id(r)] = at
            parts.append(np.ascontiguousarray(r).reshape(-1))
            at += r.nbytes
        offsets.append(seen[id(r)])
    pool = np.concatenate(parts) if parts else np.empty(0, np.uint8)
    pool.flags.writeable = False
    return pool, offsets


def layout_of(m, looked_up: bool) -> int:
    """The layout code (kernels/quant/dispatch.py) a matrix is held in: F32 as panels, a block type's rows
    interleaved, others (F16, BF16) as stored; an embedding table only looked up, as stored."""
    if looked_up:
        return 0
    if m.qtype in qk.PANEL_TYPES:
        return qk.PANELS_CODE
    return qk.INTERLEAVED_CODE if m.qtype in qk.INTERLEAVED_TYPES else 0


def _stored(part: np.ndarray, qtype: str, layout: int) -> np.ndarray:
    """Rows of a matrix as the pool holds them in `layout` (whole groups of 8 or 16 rows but the last)."""
    from ..quant import interleave_rows

    if layout == qk.PANELS_CODE:
        return cpu.pack_panels(np.ascontiguousarray(part).view("<f4"))
    return interleave_rows(part, qtype) if layout == qk.INTERLEAVED_CODE else part


def rearranged_pool(matrices: list, layouts: list[int], runs: list[list[int]]) -> tuple[np.ndarray, list[int]]:
    """weight_pool's one uint8 array, built as a copy: each run of matrices (_runs: one matrix, or F32 ones stored as
    one) in its layout (_stored), each distinct run once, each starting on 64 bytes; and each matrix's offset (its
    run's; -1: in no run). A mapped source's pages are released once copied (tensors.release), so the pool is the
    only resident copy, with no moment holding both whole."""
    distinct = {}
    for run in runs:
        distinct.setdefault(_run_key(matrices, layouts, run), run)
    offsets_of, at = {}, 0
    for key, run in distinct.items():
        offsets_of[key] = at
        rows = stored_rows(sum(matrices[i].shape[0] for i in run), layouts[run[0]])
        at += -(-stored_row_bytes(matrices[run[0]], layouts[run[0]]) * rows // 64) * 64
    pool = np.empty(at, np.uint8)
    for key, run in distinct.items():
        at, head, layout = offsets_of[key], matrices[run[0]], layouts[run[0]]
        per = PANEL if layout == qk.PANELS_CODE else INTERLEAVE
        rows = per * max(1, (1 << 20) // (per * head.raw.shape[1]))  # ~1 MiB at a time: no whole temporaries
        for part in _row_blocks([matrices[i].raw for i in run], rows):
            stored = _stored(part, head.qtype, layout)
            pool[at:at + stored.nbytes] = np.ascontiguousarray(stored).reshape(-1).view(np.uint8)
            at += stored.nbytes
    pool.flags.writeable = False
    offsets = [-1] * len(matrices)
    for run in runs:
        for i in run:
            offsets[i] = offsets_of[_run_key(matrices, layouts, run)]
    return pool, offsets


def _run_key(matrices: list, layouts: list[int], run: list[int]) -> tuple:
    """What makes two runs one (a tied embedding and LM head: the same bytes, held alike)."""
    return tuple((matrices[i].raw.__array_interface__["data"][0], matrices[i].raw.shape, layouts[i]) for i in run)


def _row_blocks(raws: list[np.ndarray], rows: int):
    """Consecutive blocks of `rows` rows of the raws' rows one after another (a copy where a block spans two), each
    source's part released (tensors.release) once its block has been used."""
    starts = np.cumsum([0] + [len(r) for r in raws])
    for r0 in range(0, int(starts[-1]), rows):
        r1 = min(int(starts[-1]), r0 + rows)
        parts = [raw[max(r0 - s, 0):r1 - s] for raw, s in zip(raws, starts) if s < r1 and s + len(raw) > r0]
        yield parts[0] if len(parts) == 1 else np.concatenate(parts)
        release(*parts)


def _runs(c: ModelConfig, matrices: list, layouts: list[int], skip: int) -> list[list[int]]:
    """The pool's runs of matrices: a layer's q, k and v, and its gate and up, stored as one run of panels where all are
    F32 (one fused matrix, whose outputs are the same side by side: its panels go to the register tiles four at a
    time, as the float32 kernels always took them, not as three small matrices' leftovers); every other matrix alone
    but matrix `skip` (an embedding table kept outside the pool; -1: none)."""
    runs, fused = [], set()
    for l in range(c.n_layers):
        for group in ((WQ, WK, WV), (W1, W3)):
            run = [PER_LAYER * l + g for g in group]
            if all(layouts[i] == qk.PANELS_CODE and matrices[i].shape[0] for i in run):
                runs.append(run)
                fused.update(run)
    return runs + [[i] for i in range(len(matrices)) if i not in fused and i != skip]


def stored_rows(n: int, layout: int) -> int:
    """Rows n rows take in the pool: n, or as many as whole groups of INTERLEAVE (panels of 16) hold."""
    per = {qk.INTERLEAVED_CODE: INTERLEAVE, qk.PANELS_CODE: PANEL}.get(layout, 1)
    return -(-n // per) * per


def stored_row_bytes(m, layout: int) -> int:
    """Bytes a row of matrix m takes in the pool: its file's (panels too), or as interleaved rows (Q4_K's scales
    unpacked)."""
    from ..quant import INTERLEAVED_BLOCK_BYTES, TYPES

    if layout != qk.INTERLEAVED_CODE:
        return m.raw.shape[1]
    return m.raw.shape[1] // TYPES[m.qtype].block_bytes * INTERLEAVED_BLOCK_BYTES[m.qtype] // INTERLEAVE


def pack(c: ModelConfig, weights: Weights) -> Packed:
    """The matrices over one byte pool (each in layout_of's layout), the vectors as float32 arrays stacked along L.

    F32 matrices are multiplied as panels (a layer's q, k and v as one, and its gate and up: _runs) and every block
    type's as rows interleaved by eight (kernels/quant), each a copy of the file's bytes in that order. The embedding table stays as stored, outside the pool (its rows are looked
    up one by one, and a mapped table's unused rows never load), unless the LM head is tied to it: then the one copy is
    held for the head's product (the largest of a decode step), and a lookup gathers its row back (decode_any_row)."""
    from ..quant import TYPES

    matrices = pool_matrices(c, weights)
    embed = PER_LAYER * c.n_layers  # the embedding table's index; the LM head's next
    tied = matrices[embed + 1].raw.__array_interface__["data"][0] == matrices[embed].raw.__array_interface__["data"][0]
    layouts = [layout_of(m, i == embed and not tied) for i, m in enumerate(matrices)]
    # The vectors first, then every page of the file let go: reading a vector maps the cached pages around it (up to
    # 2 MiB each), 17-35 MB of a 110M Q4_0 file, resident beside the pool while it is built.
    vectors = layer_vectors(c, weights)
    release_files(matrices)
    runs = _runs(c, matrices, layouts, -1 if tied else embed)
    if any(layouts):
        pool, offsets = rearranged_pool(matrices, layouts, runs)
    else:
        pool, at = weight_pool([matrices[run[0]].raw for run in runs])
        offsets = [-1] * len(matrices)  # -1: not in the pool (the table)
        for run, where in zip(runs, at):
            offsets[run[0]] = where
    rows_of = [m.shape[0] for m in matrices]
    for run in runs:  # a fused run (_runs): its first matrix's row of the table counts every row, the others none
        rows_of[run[0]], rest = sum(rows_of[i] for i in run), run[1:]
        for i in rest:
            rows_of[i] = 0
    table = np.ascontiguousarray(matrices[embed].raw if not tied else np.empty((0, 0), np.uint8)).view()
    table.flags.writeable = False
    rows = np.array([(at, TYPES[m.qtype].type_id + layout, n, m.shape[1], stored_row_bytes(m, layout))
                     for at, m, layout, n in zip(offsets, matrices, layouts, rows_of)], np.int64)
    return Packed(pool, rows[:embed + 2], table, vectors["attention_norm"], _biases(c, weights), vectors["ffn_norm"],
                  np.array(weights.norm, np.float32), _qk_permutation(c), vectors["q_norm"], vectors["k_norm"],
                  vectors["post_attention_norm"], vectors["post_ffn_norm"], rows[embed + 2:].reshape(-1, 5).copy())


def _biases(c: ModelConfig, weights: Weights) -> np.ndarray:
    """[bq; bk; bv] of each layer, zeros where the model has none.                        # -> [L, (H + 2K) Dh]"""
    H, K, Dh = c.n_heads, c.n_kv_heads, c.head_dim
    bqkv = np.zeros((c.n_layers, (H + 2 * K) * Dh), np.float32)
    if c.attention_bias:
        for l, layer in enumerate(weights.layers):
            bqkv[l] = np.concatenate([layer.bq, layer.bk, layer.bv])
    return bqkv


def _qk_permutation(c: ModelConfig) -> np.ndarray:
    """Where q and k rows are in Hugging Face's layout (rope_layout "half"): the permutation of their outputs into
    the interleaved one; else empty.                                                       # -> [(H + K) Dh] int64"""
    from ..tensors import permute_qk_half_to_interleaved

    H, K, Dh, r = c.n_heads, c.n_kv_heads, c.head_dim, c.rotary_dims
    if c.rope_layout != "half":
        return np.empty(0, np.int64)
    return np.concatenate([permute_qk_half_to_interleaved(np.arange(H * Dh), H, Dh, r),  # the first r of each head
                           H * Dh + permute_qk_half_to_interleaved(np.arange(K * Dh), K, Dh, r)]).astype(np.int64)


def pool_matrices(c: ModelConfig, weights: Weights) -> list:
    """Every matrix the pool holds, as QuantizedMatrix: each layer's (WQ .. W2), the embeddings, the LM head, then a
    mixture of experts' routers and each expert's gate, up and down (Packed.experts' order). A mixture of experts'
    layers have no W1, W3, W2: empty matrices (no rows) over WQ's bytes stand in for them. An expert tensor is
    anything whose [e] is a matrix (float arrays [E, N, K]: each expert's F32 bytes, no copy)."""
    from ..quant import QuantizedMatrix, as_matrix

    matrices = []
    for layer in weights.layers:
        wq = as_matrix(layer.wq)
        empty = QuantizedMatrix(wq.raw[:0], wq.qtype, (0, wq.shape[1]))
        matrices += [as_matrix(w) if w is not None else empty for w in (layer.wq, layer.wk, layer.wv, layer.wo,
                                                                         layer.w1, layer.w3, layer.w2)]
    matrices += [as_matrix(weights.tok_embeddings), as_matrix(weights.output)]
    if c.n_experts:
        matrices += [as_matrix(layer.router) for layer in weights.layers]
        matrices += [as_matrix(getattr(layer, name)[e]) for layer in weights.layers for e in range(c.n_experts)
                     for name in ("w1_exps", "w3_exps", "w2_exps")]
    return matrices


def bytes_by_type(mats: np.ndarray) -> dict[str, int]:
    from ..quant import TYPES_BY_ID

    totals: dict[str, int] = {}
    seen = set()
    for at, code, N, K, row_bytes in mats.tolist():
        if at in seen or N == 0:  # tied embeddings: one matrix, listed twice; empty stand-ins (pool_matrices)
            continue
        seen.add(at)
        name = TYPES_BY_ID[code % qk.INTERLEAVED_CODE].name
        totals[name] = totals.get(name, 0) + N * row_bytes
    return totals
