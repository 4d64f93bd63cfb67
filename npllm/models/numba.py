"""NumbaTransformer: the reference Transformer run by the Numba kernels, one compiled call per forward pass.

What differs from models/reference.py is how the work is laid out:

- Weights are repacked once at load (kernels/cpu.py: pack_panels), stacked over layers: wqkv = fused_qkv (q, k and
  v in one pass over the weights, Hugging Face q/k rows permuted into the interleaved RoPE layout, so the kernels
  know a single RoPE) and w13 = fused_gate_up in blocks of 16 (gate and up in one pass).
- forward() checks its arguments in Python, then makes ONE call into compiled code that runs every layer
  (`_forward`): at batch 1 a small model is bound by per-call overhead, not arithmetic.
- The float32 result does not depend on how tokens are split into calls: a prefill of T tokens and T one-token
  decode steps produce the same bits (each matrix-product output and each attention row is summed in an order
  fixed by its own position; see kernels/cpu.py).

The Numba model computes in float32 whatever the checkpoint's dtype; its cache stores float32 or float16.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import threading
from collections import namedtuple
from pathlib import Path

import numba
import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from .. import ops
from ..cache import RingKVCache
from ..config import ModelConfig
from ..errors import ConfigError, GenerationError
from ..kernels import SPINNING, cpu
from ..kernels import quant as qk
from ..kernels.compiler import cached_here, release_compiler_pages, release_linking_modules
from ..quant import INTERLEAVE
from ..tensors import release, release_files
from .base import Model, sampler_rows
from .weights import Weights, fused_gate_up, fused_qkv

PANEL = cpu.PANEL
# A parallel region pays for starting the other threads: a few microseconds where they spin between regions, tens
# where they sleep (kernels/__init__.py decides which). Work shorter than this per region stays on one thread, as
# estimated from a core's rates on a 2-core laptop-class machine: ~10 GB/s of weights, ~50 GFLOP/s.
PARALLEL_MIN_SECONDS = 20e-6 if SPINNING else 100e-6
CORE_BYTES_PER_S = 10e9
CORE_FLOPS = 50e9
LAYER_REGIONS = 5  # parallel regions per layer in _forward: four matrix products and attention

# The weights as _forward reads them, float32, stacked over L layers; matrices packed in panels of 16 rows.
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
])
Sequences = cpu.Sequences  # a forward call's tokens grouped by cache slot (order, starts, slots)
# One ring cache's arrays (RingKVCache): k, v [L, B, C, K, Dh], positions [B, C], lengths [B].
Ring = namedtuple("Ring", ["k", "v", "positions", "lengths"])
# Shape and options of a call: heads H, kv heads K, head dim Dh, norm eps, attention window, threads.
Dims = namedtuple("Dims", ["H", "K", "Dh", "eps", "window", "threads"])


_threads_set = threading.local()  # numba.set_num_threads is per Python thread, and so is what it was last set to


def use_threads(n: int) -> None:
    """numba.set_num_threads(n) unless this Python thread set n last: the call costs ~2.5 us, and a decode step asks
    twice (the forward, the LM head), which is ~2% of a stories260K step."""
    if getattr(_threads_set, "n", None) != n:
        numba.set_num_threads(n)
        _threads_set.n = n


def _padded(n: int) -> int:
    return -(-n // PANEL) * PANEL


class NumbaTransformer(Model):
    backend = "numba"
    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray], threads: int | None = None):
        named = Weights.from_checkpoint(config, weights)
        if threads is not None and not 1 <= threads <= numba.config.NUMBA_NUM_THREADS:
            raise ConfigError(f"threads must be in 1 .. {numba.config.NUMBA_NUM_THREADS}, got {threads}")
        super().__init__(config)
        self.inv_freq = ops.rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)  # [Dh/2] f64
        self.packed = pack(config, named)
        self.output_panels = pack_released(named.output)  # [ceil(V/16), D, 16]
        release_files(weights.values())  # copied: what the per-weight releases left of a mapped file goes too
        self.threads = threads or numba.config.NUMBA_NUM_THREADS
        p = self.packed
        self.layer_bytes = (p.wqkv.nbytes + p.wo.nbytes + p.w13.nbytes + p.w2.nbytes) // config.n_layers

    # fused_qkv(interleave_rope=True) permutes Hugging Face q/k rows, so every cached key pairs (2i, 2i+1)
    key_layout = "interleaved"

    def threads_for(self, T: int, weight_bytes: int, regions: int) -> int:
        """Threads for a call over T tokens that reads weight_bytes in `regions` parallel regions: all of
        self.threads, or one when a region would take less than PARALLEL_MIN_SECONDS on one core, since waking
        the other threads would cost more than they save (decode of stories260K and stories15M, on this estimate)."""
        one_core = weight_bytes / CORE_BYTES_PER_S + 2 * T * (weight_bytes / 4) / CORE_FLOPS
        return self.threads if one_core / regions >= PARALLEL_MIN_SECONDS else 1

    @property
    def weight_bytes(self) -> int:
        """Bytes of packed weights one decode step streams (all layers and the LM head, padding included)."""
        layers = sum(a.nbytes for name, a in self.packed._asdict().items() if name != "embeddings")
        return layers + self.output_panels.nbytes + self.config.dim * 4

    def forward(self, tokens, positions, cache: RingKVCache, slots=None) -> np.ndarray:
        """Final-norm hidden states of the given tokens, updating the cache.     # [T], [T], [T] -> [T, D]

        slots[t] is the cache slot (sequence) of token t (all 0 when omitted). Within a slot, this call's tokens
        must have consecutive positions in increasing order, following what the slot's cache already holds.
        """
        tokens, positions, slots = self.call_arrays(tokens, positions, slots)
        self._check_cache(cache)
        sequences = self._sequences(tokens, positions, slots, cache)
        if len(tokens) == 0:
            return np.zeros((0, self.config.dim), np.float32)
        threads = self.threads_for(len(tokens), self._layer_cost(), LAYER_REGIONS)
        use_threads(threads)
        c = self.config
        dims = Dims(c.n_heads, c.n_kv_heads, c.head_dim, c.norm_eps, self.window(cache), threads)
        ring = Ring(*_kv_arrays(cache), cache.positions, cache.lengths)
        return _forward(tokens, positions, sequences, self.packed, self.inv_freq, dims, ring)

    def _layer_cost(self) -> int:
        """Weight bytes one layer's products read (what threads_for weighs)."""
        return self.layer_bytes

    def _check_cache(self, cache) -> None:
        c = self.config
        if cache.k.dtype not in KV_STORED or cache.k.shape[0] != c.n_layers or cache.k.shape[3:] != (c.n_kv_heads,
                                                                                                    c.head_dim):
            raise GenerationError(f"the cache holds {cache.k.dtype} [layers, slots, capacity, kv heads, head dim] = "
                                  f"{list(cache.k.shape)}: not one made by this model's new_cache()")

    def _sequences(self, tokens, positions, slots, cache) -> Sequences:
        """Check the call and group its tokens by slot. The checks are Model.check_call's, compiled (they run on
        every decode step), plus one: a slot's positions in one call are consecutive."""
        T = len(tokens)
        order, starts, seq_slots = np.empty(T, np.int64), np.empty(T + 1, np.int64), np.empty(T, np.int64)
        n_seq = _group_by_slot(tokens, positions, slots, self.config.vocab_size, cache.slots, order, starts,
                               seq_slots)
        if n_seq < 0:
            raise GenerationError(CALL_PROBLEMS[-n_seq].format(V=self.config.vocab_size, B=cache.slots))
        return Sequences(order, starts[:n_seq + 1], seq_slots[:n_seq])

    def sample(self, h, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, uniforms=0.0) -> np.ndarray:
        """Token ids drawn from final hidden states' logits (lm_head's: padding ids -inf, never drawn) by the
        compiled sampler (kernels.cpu.sample_rows): greedy at temperature 0, else sampling.sample_with's draw with
        the given uniform numbers in [0, 1). Each option is one value for every row or one per row.
                                                                                       # [B, D] -> [B] int64 ids"""
        logits = self.lm_head(h)
        ids = np.empty(len(logits), np.int64)
        table = sampler_rows(len(logits), temperature, top_k, top_p, min_p, uniforms, np.float64)
        bad = cpu.sample_rows(logits, table, ids)
        if bad >= 0:
            raise GenerationError(SAMPLER_PROBLEMS[int(ids[bad])].format(b=bad))
        return ids

    def head_logits(self, h: np.ndarray) -> np.ndarray:
        """Logits from final hidden states.  # [T, D] -> [T, V]"""
        threads = self.threads_for(len(h), self.output_panels.nbytes, 1)
        use_threads(threads)
        return cpu.lm_head(np.ascontiguousarray(h, dtype=np.float32), self.output_panels, self.config.vocab_size,
                           threads)


# A cache's keys and values as the kernels take them: float32, or float16 passed as its bits (Numba has no float16 on
# the CPU; kernels/simd.py's *_kv functions round and widen them).
KV_STORED = {np.dtype(np.float32): np.float32, np.dtype(np.float16): np.uint16}


def _kv_arrays(cache: RingKVCache) -> tuple[np.ndarray, np.ndarray]:
    return cache.k.view(KV_STORED[cache.k.dtype]), cache.v.view(KV_STORED[cache.v.dtype])


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
    n_qkv = (H + 2 * K) * Dh
    wqkv = np.empty((L, _padded(n_qkv) // PANEL, D, PANEL), np.float32)
    bqkv = np.zeros((L, _padded(n_qkv)), np.float32)
    wo = np.empty((L, _padded(D) // PANEL, H * Dh, PANEL), np.float32)
    w13 = np.empty((L, 2 * _padded(F) // PANEL, D, PANEL), np.float32)
    w2 = np.empty((L, _padded(D) // PANEL, F, PANEL), np.float32)
    # The vectors first, then the file's pages let go (as in pack_quantized): reading a vector maps the cached pages
    # around it (up to 2 MiB each), resident beside the panels until the end of the load: 10 MiB of a 110M F32 peak
    attention_norm, ffn_norm = weights.stacked("attention_norm"), weights.stacked("ffn_norm")
    release_files([layer.wq for layer in weights.layers])
    for l, layer in enumerate(weights.layers):
        qkv, bqkv[l, :n_qkv] = fused_qkv(c, layer, interleave_rope=True)
        wqkv[l] = cpu.pack_panels(qkv)
        wo[l] = cpu.pack_panels(layer.wo)
        w13[l] = cpu.pack_panels(fused_gate_up(layer, PANEL))
        w2[l] = cpu.pack_panels(layer.w2)
        release(layer.wq, layer.wk, layer.wv, layer.wo, layer.w1, layer.w2, layer.w3)  # the panels are the copy
    return Packed(lookup_table(weights.tok_embeddings), attention_norm, wqkv, bqkv, wo, ffn_norm, w13, w2,
                  np.array(weights.norm, np.float32), np.empty(0, np.int64))


SAMPLER_PROBLEMS = {-1: "logits row {b} contains NaN; the model output is broken",
                    -2: "logits row {b}: every token is -inf (masked), so there is nothing to sample"}

CALL_PROBLEMS = {1: "token ids must lie in [0, {V})", 2: "positions must be >= 0", 3: "slots must lie in [0, {B})",
                 4: "within a slot, a forward call's positions must be consecutive and increasing"}


@njit(cache=True)
def _group_by_slot(tokens, positions, slots, V, B, order, seq_starts, seq_slots):
    """Check token ids, positions and slots; fill order (token indices grouped by slot, first-seen order kept),
    seq_starts and seq_slots (sequence s = order[seq_starts[s] : seq_starts[s + 1]], in slot seq_slots[s]).
    Returns the number of sequences, or minus the CALL_PROBLEMS key of the first problem found."""
    T = tokens.shape[0]
    for t in range(T):
        if tokens[t] < 0 or tokens[t] >= V:
            return -1
        if positions[t] < 0:
            return -2
        if slots[t] < 0 or slots[t] >= B:
            return -3
    counts = np.zeros(B, np.int64)
    for t in range(T):
        counts[slots[t]] += 1
    n_seq, start = 0, 0
    first = np.full(B, -1)  # the sequence index of each slot present
    for t in range(T):
        if first[slots[t]] < 0:
            first[slots[t]] = n_seq
            seq_slots[n_seq] = slots[t]
            seq_starts[n_seq] = start
            start += counts[slots[t]]
            n_seq += 1
    seq_starts[n_seq] = T
    filled = seq_starts[:n_seq].copy()
    for t in range(T):
        s = first[slots[t]]
        i = filled[s]
        if i > seq_starts[s] and positions[t] != positions[order[i - 1]] + 1:
            return -4
        order[i] = t
        filled[s] += 1
    return n_seq


@njit(inline="always")
def _residual_add(x, o, T, D):
    """x[:T] += o[:T, :D] (o may be wider: padded to whole panels)."""
    for t in range(T):
        for d in range(D):
            x[t, d] += o[t, d]


@njit(inline="always")
def _commit_positions(positions, seqs, ring):
    """Record this call's positions in the ring's table once every layer holds its keys, as RingKVCache.write."""
    C = ring.positions.shape[1]
    for s in range(seqs.slots.shape[0]):
        b = seqs.slots[s]
        for i in range(seqs.starts[s], seqs.starts[s + 1]):
            ring.positions[b, positions[seqs.order[i]] % C] = positions[seqs.order[i]]
        ring.lengths[b] = max(ring.lengths[b], positions[seqs.order[seqs.starts[s + 1] - 1]] + 1)


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

# A product's input quantized to 8 bits per block of 32 (kernels/quant quantize_activations_q8_into), or in two
# 8-bit parts (two_part_activations_into: q [T, 2K] each token's first part then its second, d, s and s16 those of
# the 15-bit sum v = 128 q + q').
Int8Activations = namedtuple("Int8Activations", [
    "q",  # [T, K] int8       round(x / d)
    "d",  # [T, K/32]         block scales max|x| / 127
    "s",  # [T, K/32]         block sums of q (for offsets: Q4_0's -8, the K-quants' mins)
    "s16",  # [T, K/16] int32  the sums of each half block (where the interleaved kernels' dots start)
])
# The matrices of one products_into call: `count` consecutive rows of `mats` from `first`, over the byte pool.
Matrices = namedtuple("Matrices", ["pool", "mats", "first", "count"])
# The input of one products_into call as its kernels read it: x [>=T, K] float32, T tokens, x's sums of 16 [K/16]
# (one token), and x quantized to 8 bits (xq) and in two 8-bit parts (xv), each Int8Activations (empty if unused).
Operand = namedtuple("Operand", ["x", "T", "sums", "xq", "xv"])
WQ, WK, WV, WO, W1, W3, W2 = range(7)
PER_LAYER = 7
# Quantized forward: the float32 panels of a product over T tokens come from decoding 16 rows; rows of one token
# are read straight from the blocks (see kernels/quant).
QPacked = namedtuple("QPacked", [
    "pool",  # [bytes] uint8, read-only
    "mats",  # [7 L + 2, 5] int64 (see above)
    "attention_norm",  # [L, D]
    "bqkv",  # [L, (H + 2K) Dh]      zeros where the model has no biases
    "ffn_norm",  # [L, D]
    "norm",  # [D]
    "qk_perm",  # [(H + K) Dh] int64: column i of q|k takes column qk_perm[i] (rope_layout "half"); empty otherwise
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
    from ..quant import INTERLEAVED_TYPES, TYPES, as_matrix
    from ..tensors import permute_qk_half_to_interleaved

    names = ("wq", "wk", "wv", "wo", "w1", "w3", "w2")
    matrices = [as_matrix(getattr(layer, name)) for layer in weights.layers for name in names]
    matrices += [as_matrix(weights.tok_embeddings), as_matrix(weights.output)]
    # Every block type's products run on rows interleaved by eight (kernels/quant), which needs a copy
    # of the file's bytes in that order. The embedding table stays as stored (its rows are looked up one by one, and a
    # mapped table's unused rows never load), unless the LM head is tied to it: then the one copy is interleaved for
    # the head's product (the largest of a decode step), and a lookup gathers its row back (decode_any_row).
    tied = matrices[-1].raw.__array_interface__["data"][0] == matrices[-2].raw.__array_interface__["data"][0]
    interleave = [m.qtype in INTERLEAVED_TYPES and (i != len(matrices) - 2 or tied)
                  for i, m in enumerate(matrices)]
    # The vectors first, then every page of the file let go: reading a vector maps the cached pages around it (up to
    # 2 MiB each), 17-35 MB of a 110M Q4_0 file, resident beside the pool while it is built.
    H, K, Dh = c.n_heads, c.n_kv_heads, c.head_dim
    bqkv = np.zeros((c.n_layers, (H + 2 * K) * Dh), np.float32)
    if c.attention_bias:
        for l, layer in enumerate(weights.layers):
            bqkv[l] = np.concatenate([layer.bq, layer.bk, layer.bv])
    qk_perm = np.empty(0, np.int64)
    if c.rope_layout == "half":  # q and k rows in HF's layout: permute their outputs into the interleaved one
        qk_perm = np.concatenate([permute_qk_half_to_interleaved(np.arange(H * Dh), H, Dh),
                                  H * Dh + permute_qk_half_to_interleaved(np.arange(K * Dh), K, Dh)])
    attention_norm, ffn_norm = weights.stacked("attention_norm"), weights.stacked("ffn_norm")
    norm = np.array(weights.norm, np.float32)
    release_files(matrices)
    if any(interleave):
        pool, offsets = interleaved_pool(matrices, interleave)
    else:
        pool, offsets = weight_pool([m.raw for m in matrices])
    mats = np.array([(at, TYPES[m.qtype].type_id + (qk.INTERLEAVED_CODE if inter else 0), m.shape[0], m.shape[1],
                      stored_row_bytes(m, inter)) for at, m, inter in zip(offsets, matrices, interleave)], np.int64)
    return QPacked(pool, mats, attention_norm, bqkv, ffn_norm, norm, qk_perm.astype(np.int64))


class QuantizedNumbaTransformer(NumbaTransformer):
    """NumbaTransformer on weights kept in their checkpoint's types (models/numba.py, below the float32 path):
    matrices read from the file's bytes, never widened to float32 as a whole."""

    def __init__(self, config: ModelConfig, weights: dict, threads: int | None = None):
        named = Weights.from_checkpoint(config, weights)
        if threads is not None and not 1 <= threads <= numba.config.NUMBA_NUM_THREADS:
            raise ConfigError(f"threads must be in 1 .. {numba.config.NUMBA_NUM_THREADS}, got {threads}")
        Model.__init__(self, config)
        self.inv_freq = ops.rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        self.packed = pack_quantized(config, named)
        release_files(weights.values())  # copied into the pool: what the per-part releases left goes too
        self.threads = threads or numba.config.NUMBA_NUM_THREADS
        mats, L = self.packed.mats, config.n_layers
        self.type_bytes = _bytes_by_type(mats)
        self.layer_bytes = int(mats[:PER_LAYER * L, 2] @ mats[:PER_LAYER * L, 4]) // L
        # what the thread estimate sees: the kernels' cost follows the values (decoding), not the bytes
        self.layer_cost_bytes = 4 * int(mats[:PER_LAYER * L, 2] @ mats[:PER_LAYER * L, 3]) // L

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights one decode step reads, in their stored types (layers, LM head, norms, biases and the
        one embedding row looked up), as bench.decode_weight_bytes counts float32 ones."""
        p, L = self.packed, self.config.n_layers
        head, embedding_row = int(p.mats[-1, 2] * p.mats[-1, 4]), int(p.mats[-2, 4])
        vectors = 4 * (p.attention_norm.size + p.ffn_norm.size + self.config.dim)
        if self.config.attention_bias:
            vectors += p.bqkv.nbytes
        return self.layer_bytes * L + head + embedding_row + vectors

    @property
    def weight_types(self) -> dict[str, int]:
        """Bytes of the model's matrices by type, e.g. {"Q4_0": ..., "Q6_K": ...} (the embeddings included)."""
        return dict(self.type_bytes)

    def _layer_cost(self) -> int:
        return self.layer_cost_bytes

    def head_logits(self, h: np.ndarray) -> np.ndarray:
        """Logits from final hidden states, the LM head read in its own type.  # [T, D] -> [T, V]"""
        mats = self.packed.mats
        threads = self.threads_for(len(h), 4 * int(mats[-1, 2] * mats[-1, 3]), 1)
        use_threads(threads)
        h = np.ascontiguousarray(h, dtype=np.float32)
        out = np.empty((len(h), self.config.vocab_size), np.float32)
        if len(h):
            products_into(self.packed.pool, mats, len(mats) - 1, 1, h, len(h), out, threads)
        return out


def _bytes_by_type(mats: np.ndarray) -> dict[str, int]:
    from ..quant import TYPES_BY_ID

    totals: dict[str, int] = {}
    seen = set()
    for at, code, N, K, row_bytes in mats.tolist():
        if at in seen:  # tied embeddings: one matrix, listed twice
            continue
        seen.add(at)
        name = TYPES_BY_ID[code % qk.INTERLEAVED_CODE].name
        totals[name] = totals.get(name, 0) + N * row_bytes
    return totals


@njit(inline="always")
def _matrix(pool, mats, m):
    """Matrix m's byte rows, a view of the pool.  # -> [N, row bytes] uint8 (interleaved: [ceil(N / 8), 8 row bytes])"""
    at, N, row_bytes = mats[m, 0], mats[m, 2], mats[m, 4]
    if mats[m, 1] >= qk.INTERLEAVED_CODE:
        G = (N + 7) // 8
        return pool[at:at + G * 8 * row_bytes].reshape((G, 8 * row_bytes))
    return pool[at:at + N * row_bytes].reshape((N, row_bytes))


# Quantizing one token's activations takes ~2.5 us per 768 values on one core; from this many tokens a product's
# quantization is split over the threads (one more parallel region: tens of microseconds where threads sleep)
QUANTIZE_IN_PARALLEL_FROM = 16


@njit(cache=True)
def products_into(pool, mats, first, count, x, T, out, threads):
    """out[:T, col_i : col_i + N_i] = x[:T, :K] @ W_i.T for the `count` matrices first .. first + count - 1, which
    read the same input, side by side (col_i = N_0 + ... + N_{i-1}).   # [>=T, >=K] -> [>=T, >= sum N_i]

    The concatenated groups of 8 or 16 rows (one token: qk.ROWS_AT_ONCE) or panels of 16 rows (several tokens) are
    split into one contiguous range per thread, in ONE parallel region (none on one thread: a small model's step is
    mostly such calls); each matrix's part of a range goes to its type's row-range worker (kernels/quant).

    Every block type's weights (Q2_K .. Q8_0, as interleaved rows), in calls of any length, meet activations
    quantized to 8 bits per block of 32 (as llama.cpp does): integer dot products, with x quantized once here for
    every matrix and row range (on every thread from QUANTIZE_IN_PARALLEL_FROM tokens; docs/quant.md, "8-bit
    activations", for the rounding bound and the measured KL divergence). Q2_K and Q3_K meet x in two 8-bit parts
    (quant.oracle.quantize_activations_two_part: 15 bits, two dot instructions a word). Other types take x in float32.
    """
    unit = qk.ROWS_AT_ONCE if T == 1 else PANEL  # whole groups (or pairs) of interleaved rows
    total = np.int64(0)  # not a literal 0 (see _product_pool)
    for i in range(count):
        total += -(-mats[first + i, 2] // unit)
    K = mats[first, 3]
    sums = np.zeros(K // 16, np.float32)  # x's sums of 16 for the blocks' offsets (one token only)
    if T == 1:
        for g in range(K // 16):
            s = np.float32(0)
            for j in range(16):
                s += x[0, 16 * g + j]
            sums[g] = s
    any_int8, two_part = False, False
    for i in range(count):
        any_int8 = any_int8 or _int8_type(mats[first + i, 1], T)
        two_part = two_part or _two_part_type(mats[first + i, 1])
    xq = _int8_activations(T if any_int8 else 0, K, 1)
    xv = _int8_activations(T if two_part else 0, K, 2)  # the two parts, for TWO_PART_ACTIVATION_TYPES
    in_parallel = threads > 1 and T >= QUANTIZE_IN_PARALLEL_FROM
    if any_int8 and in_parallel:
        qk.quantize_activations_q8_parallel(x, T, xq.q, xq.d, xq.s, xq.s16, threads)
    elif any_int8:
        qk.quantize_activations_q8_into(x, T, xq.q, xq.d, xq.s, xq.s16)
    if two_part and in_parallel:
        qk.two_part_activations_parallel(x, T, xq.q, xq.d, xv.q, xv.d, xv.s, xv.s16, threads)
    elif two_part:
        qk.two_part_activations_into(x, T, xq.q, xq.d, xv.q, xv.d, xv.s, xv.s16)
    chunks = max(1, min(total, threads))
    group = Matrices(pool, mats, first, count)
    if chunks == 1:
        _product_units(group, Operand(x, T, sums, xq, xv), out, unit, np.int64(0), total)
    else:
        _products_parallel(group, x, T, sums, xq, xv, out, unit, total, chunks)


@njit(inline="always")
def _int8_activations(T, K, parts) -> Int8Activations:
    """Room for T tokens' activations of K values quantized to 8 bits, in one part or two (q [T, 2K] then)."""
    return Int8Activations(np.empty((T, parts * K), np.int8), np.empty((T, K // 32), np.float32),
                           np.empty((T, K // 32), np.float32), np.empty((T, K // 16), np.int32))


@njit(inline="always")
def _int8_type(code, T) -> bool:
    """Whether weights of GGML type `code` meet 8-bit activations (in a call of any T tokens): the interleaved ones,
    every block type's matrices (quant.INT8_ACTIVATION_TYPES states the same for the NumPy oracle)."""
    return code >= qk.INTERLEAVED_CODE


@njit(inline="always")
def _two_part_type(code) -> bool:
    """Whether weights of type `code` take their activations in two 8-bit parts (quant.TWO_PART_ACTIVATION_TYPES:
    Q2_K and Q3_K, interleaved)."""
    return qk.takes_two_parts(code)


@njit(parallel=True, cache=True)
def _products_parallel(group, x, T, sums, xq, xv, out, unit, total, chunks):
    """_product_units of `chunks` ranges of the `total` units, in one parallel region. The input comes as
    Operand's fields: a parallel region's records must be arguments, each a tuple of arrays and numbers."""
    for c in prange(chunks):
        _product_units(group, Operand(x, T, sums, xq, xv), out, unit, c * total // chunks, (c + 1) * total // chunks)


@njit(cache=True)
def _product_units(group, a, out, unit, u0, u1):
    """Units u0 .. u1-1 of the concatenated rows (unit 1) or panels (unit 16) of the group's matrices, from input a
    (Operand) into out."""
    mats, T = group.mats, a.T
    base, col = np.int64(0), np.int64(0)
    for i in range(group.count):
        m = group.first + i
        N = mats[m, 2]
        units = -(-N // unit)
        lo, hi = max(u0, base), min(u1, base + units)
        if lo < hi:
            w = _matrix(group.pool, mats, m)
            n0, n1 = (lo - base) * unit, min((hi - base) * unit, N)
            if _int8_type(mats[m, 1], T):
                q = a.xv if _two_part_type(mats[m, 1]) else a.xq  # one call site: each kernel compiled in once
                qk.matmul_rows_interleaved(mats[m, 1], w, q.q, q.d, q.s, q.s16, T, out, col, n0, n1)
            elif T == 1:
                qk.matvec_rows(mats[m, 1], w, a.x[0], a.sums, out[0], col, n0, n1)
            else:
                qk.matmul_rows(mats[m, 1], w, a.x, T, out, col, n0, n1)
        base += units
        col += N


@njit(inline="always")
def _embed_rows(w, tokens, x):
    """x[t] = the embedding row of tokens[t], decoded from its stored type (gathered back first from a table held
    interleaved for a tied LM head).                                                            # [T] -> [T, D]"""
    embed = w.mats.shape[0] - 2
    table = _matrix(w.pool, w.mats, embed)
    scratch = np.empty(qk.file_row_bytes(w.mats[embed, 1], x.shape[1]), np.uint8)
    for t in range(tokens.shape[0]):
        qk.decode_any_row(w.mats[embed, 1], table, tokens[t], x[t], scratch)


@njit(inline="always")
def _swiglu(gate_up, F, out, T, threads):
    """silu(gate) * up of T tokens, on the threads from QUANTIZE_IN_PARALLEL_FROM tokens.   # [>=T, 2F] -> [>=T, F]"""
    if threads > 1 and T >= QUANTIZE_IN_PARALLEL_FROM:
        _swiglu_halves_parallel(gate_up, F, out, T, threads)
    else:
        _swiglu_halves_into(gate_up, F, out, T)


@njit(parallel=True, cache=True)
def _swiglu_halves_parallel(gate_up, F, out, T, threads):
    """_swiglu_halves_into with the T tokens split into `threads` ranges run in parallel (the same bits: tokens are
    independent). A 128-token prefill at 110M spent ~6 ms in it on one thread."""
    for c in prange(threads):
        t0, t1 = c * T // threads, (c + 1) * T // threads
        _swiglu_halves_into(gate_up[t0:t1], F, out[t0:t1], t1 - t0)


@njit(cache=True)
def _swiglu_halves_into(gate_up, F, out, T):
    """out[t, i] = silu(gate) * up = gate / (1 + e^-gate) * up with gate = gate_up[t, i], up = gate_up[t, F + i].
                                                                                   # [>=T, 2F] -> [>=T, F]"""
    e = np.empty(F, np.float32)
    bits = np.empty(F, np.int32)
    for t in range(T):
        for i in range(F):
            e[i] = -gate_up[t, i]
        cpu._exp_into(e, F, bits)
        for i in range(F):
            out[t, i] = gate_up[t, i] / (np.float32(1.0) + e[i]) * gate_up[t, F + i]


# ================================================================================================================
# The forward pass, once for both weights records.
#
# The layer loop (_forward) is written once. What differs between float32 panels (Packed) and weights kept in their
# file types (QPacked) is how an embedding row is found, how a layer's matrix products run and how SwiGLU reads
# their output: each such stage is a stub below whose compiled body is chosen by the type of its first argument,
# the weights record, when _forward is compiled for it (numba.extending.overload). Numba compiles _forward once per
# record type; each copy calls only its record's stages, with the arithmetic of the code they replace.

QKV, OUT, GATE_UP, DOWN = range(4)  # a layer's products: [q; k; v], the attention output's, [gate; up], the FFN's


def by_record(implementations: dict):
    """Decorator: compiled calls of the decorated stub(w, ...) run implementations[w's record class], a Python
    function with the stub's parameters, chosen when the caller is compiled (w: a Packed or QPacked)."""

    def register(stub):
        def choose(w, *args):
            if isinstance(w, types.BaseNamedTuple):
                return implementations.get(w.instance_class)
            return None

        choose.__signature__ = inspect.signature(stub)  # Numba requires the implementations' signature
        overload(stub)(choose)
        return stub

    return register


def _embed_panels(w, tokens, x):
    for t in range(tokens.shape[0]):
        x[t] = w.embeddings[tokens[t]]


def _embed_pool(w, tokens, x):
    _embed_rows(w, tokens, x)


@by_record({Packed: _embed_panels, QPacked: _embed_pool})
def embed_tokens(w, tokens, x):
    """x[t] = row tokens[t] of the embedding table, in float32.                                  # [T] -> [T, D]"""
    raise NotImplementedError("compiled code only")


def _product_panels(w, l, which, x, T, out, threads):
    cpu.matmul_into(x, (w.wqkv, w.wo, w.w13, w.w2)[which][l], out, T, threads)


FIRST_MATRIX = (WQ, WO, W1, W2)  # the first of each product's matrices in a layer's rows of mats, and how many
MATRICES = (3, 1, 2, 1)


def _product_pool(w, l, which, x, T, out, threads):
    # the count as np.int64, not a literal: Numba compiles a called function once per literal argument value, and
    # each compilation re-optimises every kernel linked below it (minutes)
    products_into(w.pool, w.mats, PER_LAYER * l + FIRST_MATRIX[which], np.int64(MATRICES[which]), x, T, out, threads)


@by_record({Packed: _product_panels, QPacked: _product_pool})
def layer_product(w, l, which, x, T, out, threads):
    """out[:T] = x[:T] @ W.T for product `which` (QKV, OUT, GATE_UP, DOWN) of layer l.  # [>=T, K] -> [>=T, N]

    Packed: its fused matrix's panels (fused_qkv, fused_gate_up: gate and up panels alternate in out); QPacked:
    the matrices side by side in out (q | k | v, gate | up), each read in its own type (products_into)."""
    raise NotImplementedError("compiled code only")


def _swiglu_panels(w, gate_up, hidden, T, threads):
    cpu.swiglu_hidden_into(gate_up, hidden, T)


def _swiglu_pool(w, gate_up, hidden, T, threads):
    _swiglu(gate_up, hidden.shape[1], hidden, T, threads)


@by_record({Packed: _swiglu_panels, QPacked: _swiglu_pool})
def swiglu_product(w, gate_up, hidden, T, threads):
    """hidden = silu(gate) * up from the GATE_UP product's output, laid out as the record's product writes it.
                                                                                   # [>=T, 2F] -> [>=T, F]"""
    raise NotImplementedError("compiled code only")


def _widths_panels(w):
    return w.wo.shape[1] * PANEL, w.w13.shape[1] * PANEL


def _widths_pool(w):
    return w.attention_norm.shape[1], 2 * w.mats[W1, 2]


@by_record({Packed: _widths_panels, QPacked: _widths_pool})
def product_widths(w):
    """Columns of the OUT and GATE_UP products' outputs: D and 2F, or (Packed) rounded up to whole panels."""
    raise NotImplementedError("compiled code only")


# A forward call's buffers, float32 [T, ...]: x the residual stream [D], h a block's normed input [D], o a block's
# output before the residual add [>= D], qkv [(H + 2K) Dh, padded as bqkv], attn [H Dh], gate_up [>= 2F], hidden
# [>= F], cos and sin the RoPE angles [Dh/2].
Buffers = namedtuple("Buffers", ["x", "h", "o", "qkv", "attn", "gate_up", "hidden", "cos", "sin"])


@njit(inline="always")
def _buffers(w, T, dims) -> Buffers:
    """Room for a forward call of T tokens on weights record w (product_widths says how wide its outputs are)."""
    D = w.attention_norm.shape[1]
    o_cols, gate_up_cols = product_widths(w)
    half = dims.Dh // 2
    return Buffers(np.empty((T, D), np.float32), np.empty((T, D), np.float32), np.empty((T, o_cols), np.float32),
                   np.empty((T, w.bqkv.shape[1]), np.float32), np.empty((T, dims.H * dims.Dh), np.float32),
                   np.empty((T, gate_up_cols), np.float32), np.empty((T, gate_up_cols // 2), np.float32),
                   np.empty((T, half), np.float32), np.empty((T, half), np.float32))


@njit(inline="always")
def _add_bias(qkv, bias, perm, T):
    """qkv[t] += bias for t < T, then, where perm is not empty, the q|k columns in the interleaved RoPE layout:
    column i takes column perm[i] (rope_layout "half" read in its file's row order).     # [>=T, W], [W], [P]"""
    unpermuted = np.empty(perm.shape[0], np.float32)
    for t in range(T):
        for i in range(qkv.shape[1]):  # a loop, not qkv[t] += bias (an array addition per token: ~3 ms at 110M)
            qkv[t, i] += bias[i]
        if perm.shape[0]:
            unpermuted[:] = qkv[t, :perm.shape[0]]
            for i in range(perm.shape[0]):
                qkv[t, i] = unpermuted[perm[i]]


@njit(cache=True)
def _forward(tokens, positions, seqs, w, inv_freq, dims, ring):
    """Every layer of the reference Transformer.forward for T tokens, then the cache's position table.  # -> [T, D]

    x = embed(tokens); per layer: x += wo(attention(rope(qkv(rms_norm(x))))); x += w2(swiglu(w13(rms_norm(x))));
    then rms_norm(x). w: Packed or QPacked (compiled once for each; see by_record).
    """
    H, K, Dh, eps, window, threads = dims
    T = tokens.shape[0]
    L, D = w.attention_norm.shape
    b = _buffers(w, T, dims)
    cpu.rope_angles_into(positions, inv_freq, b.cos, b.sin, T)
    valid_from = np.empty(seqs.slots.shape[0], np.int64)
    cpu.valid_from_into(positions, seqs, ring.positions, window, valid_from)
    embed_tokens(w, tokens, b.x)
    for l in range(L):
        cpu.rms_norm_into(b.x, w.attention_norm[l], eps, b.h, T)
        layer_product(w, l, QKV, b.h, T, b.qkv, threads)
        _add_bias(b.qkv, w.bqkv[l], w.qk_perm, T)
        cpu.rope_interleaved_into(b.qkv, H + K, Dh, b.cos, b.sin, T)  # queries and keys: the first H + K heads
        cpu.attention_ring_into(b.qkv, H, K, positions, seqs, valid_from,
                                cpu.LayerRing(ring.k[l], ring.v[l], ring.positions), window, b.attn)
        layer_product(w, l, OUT, b.attn, T, b.o, threads)
        _residual_add(b.x, b.o, T, D)
        cpu.rms_norm_into(b.x, w.ffn_norm[l], eps, b.h, T)
        layer_product(w, l, GATE_UP, b.h, T, b.gate_up, threads)
        swiglu_product(w, b.gate_up, b.hidden, T, threads)
        layer_product(w, l, DOWN, b.hidden, T, b.o, threads)
        _residual_add(b.x, b.o, T, D)
    cpu.rms_norm_into(b.x, w.norm, eps, b.h, T)
    _commit_positions(positions, seqs, ring)
    return b.h

# ------------------------------------------------------------------------------------------- code before weights

# A model small enough to build in a millisecond, with every argument type a real model's compiled calls take.
TINY = ModelConfig(dim=32, hidden_dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=32, max_seq_len=8)
_LINKED: set = set()  # (model class, kv storage) whose compiled calls this process has already run
RECORD = {NumbaTransformer: Packed, QuantizedNumbaTransformer: QPacked}  # the weights record _forward gets
FORWARD = _forward  # the one compiled forward: each class's weights record is one of its signatures


def code_cached(model_class) -> bool:
    """Whether Numba's cache holds _forward compiled for model_class's weights record, for this CPU."""
    return cached_here(_forward, lambda signature: getattr(signature[3], "instance_class", None)
                       is RECORD[model_class])


def link_ahead(model_class, kv: np.dtype | None) -> None:
    """Load model_class's compiled code before a real model's weights arrive, then give the compiler's pages back.

    Runs the class's compiled calls (a forward pass, the LM head, the sampler) once on a TINY model whose arguments
    have the types a real model's calls will have, caches of storage `kv` (None: float32), so Numba loads their
    code now (from its cache; not there yet, a child process compiles it first), not at the first real call; then
    kernels/compiler.py drops the LLVM pages that loading left resident, and LLVM's modules for linking leave the
    heap. The process's peak then holds the compiler's pages or the weights, not both: a Q4_0 110M model's peak fell
    from 235 to 159 MiB (docs/quant.md, "The compiler's pages, then the weights").
    Each pair runs once a process; the releases every time (a model built since may have compiled something)."""
    release_compiler_pages()  # what importing Numba touched (it builds LLVM objects too): 36 MiB, not all needed now
    if (model_class, kv) not in _LINKED:
        _LINKED.add((model_class, kv))
        if not code_cached(model_class):
            compile_in_child(model_class, kv)
        run_tiny(model_class, kv, release_compiler_pages)
    release_linking_modules()
    release_compiler_pages()


def run_tiny(model_class, kv: np.dtype | None, between=lambda: None) -> None:
    """The class's compiled calls, once, on a TINY model with a cache of storage kv; between() after the forward."""
    tiny = model_class(TINY, _tiny_weights(quantized=model_class is QuantizedNumbaTransformer), threads=1)
    cache = tiny.new_cache(2, kv_dtype=None if kv is None else np.dtype(kv).name)
    h = tiny.forward([1, 2], [0, 1], cache)
    between()  # the compiler's pages released between the two loads: the peak holds what one touched, not both
    tiny.sample(h[-1:])


def compile_in_child(model_class, kv: np.dtype | None) -> None:
    """run_tiny(model_class, kv) in a child process, which compiles the class's code into Numba's cache: what LLVM
    keeps of a compile (kernels/compiler.py) then dies with the child, and this process loads the code from the
    cache (a first run of a quantized TinyLlama peaked at 1,141 MiB with the compile in the process). Raised as a
    "numba:compile" event, as a compile here would be (the CLI's notice listens). Where the child fails, this process
    compiles the code itself, as before."""
    from numba.core import event

    code, env = child_code(model_class, kv)
    with event.trigger_event("numba:compile", data={"dispatcher": FORWARD, "args": None,
                                                    "return_type": None}):
        subprocess.run([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def child_code(model_class, kv: np.dtype | None) -> tuple[str, dict]:
    """(Python code, environment) of a child process that runs run_tiny(model_class, kv): compile_in_child's, and
    the detached compile's that fills Numba's cache behind a run (models/__init__.py: compile_behind)."""
    kv_name = "None" if kv is None else repr(np.dtype(kv).name)
    code = f"from npllm.models.numba import {model_class.__name__} as c, run_tiny; run_tiny(c, {kv_name})"
    root = str(Path(__file__).resolve().parents[2])  # this npllm, not another one the child's path would find first
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    return code, env


def _tiny_weights(quantized: bool) -> dict:
    """TINY's weights, random (their values do not matter: only the types the compiled calls see), its matrices as
    Q8_0 blocks where the model keeps file types (any type will do: a matrix's type is data in its pool, not a type
    the compiler sees)."""
    from ..quant import QuantizedMatrix, quantize
    from ..tensors import expected_shapes

    rng = np.random.default_rng(0)
    weights = {name: rng.standard_normal(shape, dtype=np.float32) / 4 for name, shape in expected_shapes(TINY).items()}
    if quantized:
        for name, w in weights.items():
            if w.ndim == 2:
                weights[name] = QuantizedMatrix(quantize(w, "Q8_0").reshape(len(w), -1), "Q8_0", w.shape)
    return weights
