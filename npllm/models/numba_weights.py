"""The Numba backend's weights records, as its one compiled forward pass (models/numba.py, _forward) reads them:
float32 panels (Packed, pack) or matrices kept in their file types over one byte pool (QPacked, pack_quantized).

Both records hold every family's options as data: a norm the family does not have is an [L, 0] array, a dense
model's experts are E = 0 arrays (a mixture of experts' dense matrices are empty), so one compiled loop runs them all.
"""

from __future__ import annotations

import dataclasses
from collections import namedtuple

import numpy as np

from ..config import ModelConfig
from ..kernels import cpu
from ..kernels import quant as qk
from ..quant import INTERLEAVE
from ..tensors import release, release_files
from .weights import Weights, fused_gate_up, fused_qkv

PANEL = cpu.PANEL


# The weights as _forward reads them, float32, stacked over L layers; matrices packed in panels of 16 rows. A vector
# a family does not have is [L, 0] (block_norms "post" has no attention_norm / ffn_norm, Llama no q_norm, ...); a
# dense model's expert arrays have E = 0, a mixture of experts' w13 and w2 no panels.
Packed = namedtuple("Packed", [
    "embeddings",  # [V, D]
    "attention_norm",  # [L, D]
    "wqkv",  # [L, ceil(W/16), D, 16]      W = (H + 2K) Dh
    "bqkv",  # [L, 16 ceil(W/16)]          zero-padded
    "wo",  # [L, ceil(D/16), H Dh, 16]
    "ffn_norm",  # [L, D]
    "w13",  # [L, 2 ceil(F/16), D, 16]     gate and up panels alternating
    "w2",  # [L, ceil(D/16), F, 16]
    "norm",  # [D]
    "qk_perm",  # [0] int64: empty, fused_qkv put q and k rows in the interleaved RoPE layout at load (see QPacked)
    "q_norm",  # [L, Dh or H Dh]            RMSNorm gains of q and k (ModelConfig.qk_norm), interleaved RoPE layout
    "k_norm",  # [L, Dh or K Dh]
    "post_attention_norm",  # [L, D]        RMSNorm gains of a block's output (block_norms "sandwich", "post")
    "post_ffn_norm",  # [L, D]
    "router",  # [L, ceil(E/16), D, 16]    mixture of experts: the router's panels
    "w13_exps",  # [L, E, 2 ceil(Fe/16), D, 16]   each expert's gate and up panels, alternating
    "w2_exps",  # [L, E, ceil(D/16), Fe, 16]
])


def _padded(n: int) -> int:
    return -(-n // PANEL) * PANEL


def lookup_table(embeddings) -> np.ndarray:
    """The embedding table as _forward reads it: float32, C order, read-only, whatever the source (one compiled
    signature). No copy of a float32 table: over a file's memory map, only the rows looked up become resident."""
    table = np.ascontiguousarray(embeddings, dtype=np.float32).view()
    table.flags.writeable = False
    return table


def pack_released(w) -> np.ndarray:
    """cpu.pack_panels(w), a block of rows at a time, each block's pages of a mapped file released once packed:
    the panels become the only resident copy, with no moment holding both whole.        # [N, D] -> [P, D, 16]"""
    N, D = w.shape
    panels = np.empty((-(-N // PANEL), D, PANEL), np.float32)
    rows = PANEL * max(1, (1 << 20) // (PANEL * D * 4))  # ~1 MiB of float32 rows a block, whole panels
    for r0 in range(0, N, rows):
        block = w[r0:r0 + rows]
        panels[r0 // PANEL:(r0 + len(block) + PANEL - 1) // PANEL] = cpu.pack_panels(block)
        release(block)
    return panels


def pack(c: ModelConfig, weights: Weights) -> Packed:
    """The layer weights fused, packed in panels and stacked along L, as _forward reads them."""
    L, D, F, H, K, Dh = c.n_layers, c.dim, c.hidden_dim, c.n_heads, c.n_kv_heads, c.head_dim
    n_qkv, dense = (H + 2 * K) * Dh, not c.n_experts
    wqkv = np.empty((L, _padded(n_qkv) // PANEL, D, PANEL), np.float32)
    bqkv = np.zeros((L, _padded(n_qkv)), np.float32)
    wo = np.empty((L, _padded(D) // PANEL, H * Dh, PANEL), np.float32)
    w13 = np.empty((L, 2 * _padded(F) // PANEL * dense, D, PANEL), np.float32)
    w2 = np.empty((L, _padded(D) // PANEL * dense, F, PANEL), np.float32)
    # The vectors first, then the file's pages let go (as in pack_quantized): reading a vector maps the cached pages
    # around it (up to 2 MiB each), resident beside the panels until the end of the load: 10 MiB of a 110M F32 peak
    vectors = layer_vectors(c, weights)
    release_files([layer.wq for layer in weights.layers])
    for l, layer in enumerate(weights.layers):
        qkv, bqkv[l, :n_qkv] = fused_qkv(c, layer, interleave_rope=True)
        wqkv[l] = cpu.pack_panels(qkv)
        wo[l] = cpu.pack_panels(layer.wo)
        if dense:
            w13[l] = cpu.pack_panels(fused_gate_up(layer, PANEL))
            w2[l] = cpu.pack_panels(layer.w2)
        release(*[w for w in (layer.wq, layer.wk, layer.wv, layer.wo, layer.w1, layer.w2, layer.w3) if w is not None])
    return Packed(lookup_table(weights.tok_embeddings), vectors["attention_norm"], wqkv, bqkv, wo,
                  vectors["ffn_norm"], w13, w2, np.array(weights.norm, np.float32), np.empty(0, np.int64),
                  vectors["q_norm"], vectors["k_norm"], vectors["post_attention_norm"], vectors["post_ffn_norm"],
                  *pack_experts(c, weights))


def pack_experts(c: ModelConfig, weights: Weights) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A mixture of experts' router panels, and each expert's gate-up and down panels (fused_gate_up, as a dense
    layer's), stacked along L; E = 0 for a dense model.          # -> [L, ceil(E/16), D, 16], [L, E, ...] x2"""
    L, D, E, Fe = c.n_layers, c.dim, c.n_experts, c.moe_hidden_dim
    router = np.empty((L, -(-E // PANEL), D, PANEL), np.float32)
    w13 = np.empty((L, E, 2 * _padded(Fe) // PANEL, D, PANEL), np.float32)
    w2 = np.empty((L, E, _padded(D) // PANEL, Fe, PANEL), np.float32)
    for l, layer in enumerate(weights.layers if E else ()):
        router[l] = cpu.pack_panels(np.asarray(layer.router, np.float32))
        for e in range(E):
            expert = dataclasses.replace(layer, w1=np.asarray(layer.w1_exps[e], np.float32),
                                         w3=np.asarray(layer.w3_exps[e], np.float32))
            w13[l, e] = cpu.pack_panels(fused_gate_up(expert, PANEL))
            w2[l, e] = cpu.pack_panels(np.asarray(layer.w2_exps[e], np.float32))
        release(layer.router, layer.w1_exps, layer.w2_exps, layer.w3_exps)
    return router, w13, w2


NORMS = ("attention_norm", "ffn_norm", "q_norm", "k_norm", "post_attention_norm", "post_ffn_norm")


def layer_vectors(c: ModelConfig, weights: Weights) -> dict[str, np.ndarray]:
    """The layers' RMSNorm gains by name (NORMS), float32 stacked along L, [L, 0] where the family has none; q_norm
    and k_norm permuted as fused_qkv permutes q and k rows (Hugging Face's rope_layout "half" into the interleaved
    one), each head's Dh gains alike ("head": one head's [Dh]; "projection": [H Dh], [K Dh]).   # -> {name: [L, n]}"""
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
# Weights kept in their file types (a GGUF checkpoint's quantized blocks, F16, ...): no float32 copy, no repacking.
#
# Every matrix is a run of byte rows inside ONE uint8 array, the `pool`: the checkpoint's memory map itself when all
# matrices lie in it (a GGUF file), else their bytes put together once. A table says where each one is:
#
#     mats [7 L + 2, 5] int64: byte offset, GGML type id, rows N, values per row K, bytes per row
#          rows 7 l + (WQ, WK, WV, WO, W1, W3, W2) for layer l, then the token embeddings and the LM head
#
# Nothing is fused at load (fusing would copy): q, k and v (and gate and up), which read the same input, are
# computed in ONE parallel region over their concatenated rows, each matrix by the row-range worker of its own type
# (kernels/quant), so a file that mixes types (Q4_K_M: Q4_K, Q6_K, Q5_0, ...) runs every matrix as stored.


WQ, WK, WV, WO, W1, W3, W2 = range(7)
PER_LAYER = 7
# Quantized forward: the float32 panels of a product over T tokens come from decoding 16 rows; rows of one token
# are read straight from the blocks (see kernels/quant).
QPacked = namedtuple("QPacked", [
    "pool",  # [bytes] uint8, read-only
    "mats",  # [7 L + 2, 5] int64 (see above)
    "attention_norm",  # [L, D]           and the other vectors as in Packed ([L, 0] where the family has none)
    "bqkv",  # [L, (H + 2K) Dh]      zeros where the model has no biases
    "ffn_norm",  # [L, D]
    "norm",  # [D]
    "qk_perm",  # [(H + K) Dh] int64: column i of q|k takes column qk_perm[i] (rope_layout "half"); empty otherwise
    "q_norm",  # [L, Dh or H Dh]
    "k_norm",  # [L, Dh or K Dh]
    "post_attention_norm",  # [L, D]
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
    pool = np.concatenate(parts)
    pool.flags.writeable = False
    return pool, offsets


def interleaved_pool(matrices: list, interleave: list[bool]) -> tuple[np.ndarray, list[int]]:
    """weight_pool's one uint8 array, built as a copy: the matrices marked in `interleave` as
    quant.interleave_rows(raw) (eight rows per group), the others as they are, each distinct matrix once. A mapped
    source's pages are released once copied (tensors.release), so the pool is the only resident copy, with no moment
    holding both whole."""
    from ..quant import interleave_rows

    keys = [(m.raw.__array_interface__["data"][0], m.raw.shape, inter) for m, inter in zip(matrices, interleave)]
    first = {}
    for i, key in enumerate(keys):
        first.setdefault(key, i)
    offsets_of, at = {}, 0
    for key, i in first.items():
        offsets_of[key] = at
        at += stored_row_bytes(matrices[i], interleave[i]) * stored_rows(matrices[i], interleave[i])
    pool = np.empty(at, np.uint8)
    for key, i in first.items():
        raw, at = matrices[i].raw, offsets_of[key]
        rows = INTERLEAVE * max(1, (1 << 20) // (INTERLEAVE * raw.shape[1]))  # ~1 MiB at a time: no whole temporaries
        for r0 in range(0, raw.shape[0], rows):
            part = raw[r0:r0 + rows]
            stored = interleave_rows(part, matrices[i].qtype) if interleave[i] else part
            pool[at:at + stored.nbytes] = np.ascontiguousarray(stored).reshape(-1)
            at += stored.nbytes
            release(part)
    pool.flags.writeable = False
    return pool, [offsets_of[key] for key in keys]


def stored_rows(m, interleaved: bool) -> int:
    """Rows matrix m takes in the pool: its own, or (interleaved) as many as whole groups of INTERLEAVE hold."""
    return -(-m.shape[0] // INTERLEAVE) * INTERLEAVE if interleaved else m.shape[0]


def stored_row_bytes(m, interleaved: bool) -> int:
    """Bytes a row of matrix m takes in the pool: its file's, or as interleaved rows (Q4_K's scales unpacked)."""
    from ..quant import INTERLEAVED_BLOCK_BYTES, TYPES

    if not interleaved:
        return m.raw.shape[1]
    return m.raw.shape[1] // TYPES[m.qtype].block_bytes * INTERLEAVED_BLOCK_BYTES[m.qtype] // INTERLEAVE


def pack_quantized(c: ModelConfig, weights: Weights) -> QPacked:
    """The matrices in their own types over one byte pool, the vectors as float32 arrays stacked along L."""
    from ..quant import INTERLEAVED_TYPES, TYPES
    from ..tensors import permute_qk_half_to_interleaved

    matrices = pool_matrices(c, weights)
    embed = PER_LAYER * c.n_layers  # the embedding table's index; the LM head's next
    # Every block type's products run on rows interleaved by eight (kernels/quant), which needs a copy
    # of the file's bytes in that order. The embedding table stays as stored (its rows are looked up one by one, and a
    # mapped table's unused rows never load), unless the LM head is tied to it: then the one copy is interleaved for
    # the head's product (the largest of a decode step), and a lookup gathers its row back (decode_any_row).
    tied = matrices[embed + 1].raw.__array_interface__["data"][0] == matrices[embed].raw.__array_interface__["data"][0]
    interleave = [m.qtype in INTERLEAVED_TYPES and (i != embed or tied) for i, m in enumerate(matrices)]
    # The vectors first, then every page of the file let go: reading a vector maps the cached pages around it (up to
    # 2 MiB each), 17-35 MB of a 110M Q4_0 file, resident beside the pool while it is built.
    H, K, Dh = c.n_heads, c.n_kv_heads, c.head_dim
    bqkv = np.zeros((c.n_layers, (H + 2 * K) * Dh), np.float32)
    if c.attention_bias:
        for l, layer in enumerate(weights.layers):
            bqkv[l] = np.concatenate([layer.bq, layer.bk, layer.bv])
    qk_perm = np.empty(0, np.int64)
    if c.rope_layout == "half":  # q and k rows in HF's layout: permute their outputs into the interleaved one
        r = c.rotary_dims
        qk_perm = np.concatenate([permute_qk_half_to_interleaved(np.arange(H * Dh), H, Dh, r),
                                  H * Dh + permute_qk_half_to_interleaved(np.arange(K * Dh), K, Dh, r)])
    v = layer_vectors(c, weights)
    norm = np.array(weights.norm, np.float32)
    release_files(matrices)
    if any(interleave):
        pool, offsets = interleaved_pool(matrices, interleave)
    else:
        pool, offsets = weight_pool([m.raw for m in matrices])
    rows = np.array([(at, TYPES[m.qtype].type_id + (qk.INTERLEAVED_CODE if inter else 0), m.shape[0], m.shape[1],
                      stored_row_bytes(m, inter)) for at, m, inter in zip(offsets, matrices, interleave)], np.int64)
    return QPacked(pool, rows[:embed + 2], v["attention_norm"], bqkv, v["ffn_norm"], norm, qk_perm.astype(np.int64),
                   v["q_norm"], v["k_norm"], v["post_attention_norm"], v["post_ffn_norm"],
                   rows[embed + 2:].reshape(-1, 5).copy())


def pool_matrices(c: ModelConfig, weights: Weights) -> list:
    """Every matrix the pool holds, as QuantizedMatrix: each layer's (WQ .. W2), the embeddings, the LM head, then a
    mixture of experts' routers and each expert's gate, up and down (QPacked.experts' order). A mixture of experts'
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
