"""NumbaTransformer: the reference Transformer run by the Numba kernels, one compiled call per forward pass.

What differs from models/reference.py is how the work is laid out:

- Every matrix lies in one byte pool with a type code (models/numba_weights.py, Packed): F32 ones repacked once at
  load as panels of 16 rows (kernels/cpu.py: pack_panels), a block type's (Q8_0, Q4_K, ...) as rows interleaved by
  eight, F16 and BF16 as stored; each product runs every matrix in its type's kernel (models/numba_products.py:
  products_into), q, k and v (gate and up) side by side in one call. One record, one forward, whatever the types.
- Every family's options (config.py: GeGLU, multipliers, score scale and soft-cap, q/k norms, sandwich and post
  norms, per-layer windows and RoPE bases, longrope, mixtures of experts) are data of the one compiled loop: fields
  of Dims, per-layer arrays of the weights record ([L, 0] where absent), never a second forward.
- forward() checks its arguments in Python, then makes ONE call into compiled code that runs every layer
  (`_forward`): at batch 1 a small model is bound by per-call overhead, not arithmetic.
- The float32 result does not depend on how tokens are split into calls: a prefill of T tokens and T one-token
  decode steps produce the same bits (each matrix-product output and each attention row is summed in an order
  fixed by its own position; see kernels/cpu.py).

The Numba model computes in float32 whatever the checkpoint's dtype; its cache stores float32 or float16.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections import namedtuple
from pathlib import Path

import numba
import numpy as np
from numba import njit

from ..cache import RingKVCache
from ..config import FEATURE_FIELDS, SCALING_FEATURES, ModelConfig
from ..errors import ConfigError, GenerationError
from ..kernels import SPINNING, cpu
from ..kernels.compiler import cached_here, release_compiler_pages, release_linking_modules
from ..tensors import release_files
from .base import Model, sampler_rows
from .numba_products import embed_rows, products_into, swiglu_rows
from .numba_weights import PER_LAYER, W1, W2, W3, WO, WQ, bytes_by_type, pack  # noqa: F401
from .weights import Weights

PANEL = cpu.PANEL
# A parallel region pays for starting the other threads: a few microseconds where they spin between regions, tens
# where they sleep (kernels/__init__.py decides which). Work shorter than this per region stays on one thread, as
# estimated from a core's rates on a 2-core laptop-class machine: ~10 GB/s of weights, ~50 GFLOP/s.
PARALLEL_MIN_SECONDS = 20e-6 if SPINNING else 100e-6
CORE_BYTES_PER_S = 10e9
CORE_FLOPS = 50e9
LAYER_REGIONS = 5  # parallel regions per layer in _forward: four matrix products and attention

Sequences = cpu.Sequences  # a forward call's tokens grouped by cache slot (order, starts, slots)
# One ring cache's arrays (RingKVCache): k, v [L, B, C, K, Dh], positions [B, C], lengths [B].
Ring = namedtuple("Ring", ["k", "v", "positions", "lengths"])
# Shape and options of a call (ModelConfig's names where it has the option):
Dims = namedtuple("Dims", [
    "threads",  # cores the call's parallel regions use
    "windows",  # [L] int64: how many most recent positions a query of each layer sees (Model.windows)
    "H", "K", "Dh", "eps",  # query heads, kv heads, head dim, RMSNorm epsilon
    "rope_rows",  # [L] int64: each layer's row of the RoPE frequency table (Model.rope_rows)
    "act",  # the gate's activation: cpu.SILU or cpu.GELU_TANH (ffn_activation)
    "embedding_multiplier", "residual_multiplier",  # x = E[t] m;  x += m block(x)
    "scale", "softcap",  # attention scores: softcap(q.k scale) (score_scale, attn_logit_softcap; 0: none)
    "n_experts", "n_experts_used", "expert_weights_norm",  # mixture of experts (E = 0: a dense FFN)
])
ACTIVATIONS = {"silu": cpu.SILU, "gelu_tanh": cpu.GELU_TANH}


_threads_set = threading.local()  # numba.set_num_threads is per Python thread, and so is what it was last set to


def use_threads(n: int) -> None:
    """numba.set_num_threads(n) unless this Python thread set n last: the call costs ~2.5 us, and a decode step asks
    twice (the forward, the LM head), which is ~2% of a stories260K step."""
    if getattr(_threads_set, "n", None) != n:
        numba.set_num_threads(n)
        _threads_set.n = n


class NumbaTransformer(Model):
    """The Numba model over any checkpoint's matrices, each kept in its type (float32 ones as panels); see the
    module's docstring."""

    backend = "numba"
    FEATURES = frozenset(FEATURE_FIELDS + SCALING_FEATURES)  # every family the reference runs

    def __init__(self, config: ModelConfig, weights: dict, threads: int | None = None):
        named = self._start(config, weights, threads)
        self.packed = pack(config, named)
        release_files(weights.values())  # copied into the pool: what the per-part releases left goes too
        mats, L = self.packed.mats, config.n_layers
        rows = np.concatenate([mats[:PER_LAYER * L], self.packed.experts])  # a layer's, and its experts'
        self.type_bytes = bytes_by_type(np.concatenate([mats, self.packed.experts]))
        used = np.ones(len(rows))  # what a token reads of each: every matrix, k / E of each expert
        used[PER_LAYER * L + L:] = config.n_experts_used / max(1, config.n_experts)
        self.layer_bytes = int((rows[:, 2] * used) @ rows[:, 4]) // L
        # what the thread estimate sees: the kernels' cost follows the values (decoding), not the bytes
        self.layer_cost_bytes = 4 * int((rows[:, 2] * used) @ rows[:, 3]) // L

    def _start(self, config: ModelConfig, weights: dict, threads: int | None) -> Weights:
        """Check the weights and threads, and set the options' data (the static part of Dims, per-capacity windows
        and RoPE frequencies: per_capacity)."""
        named = Weights.from_checkpoint(config, weights)
        if threads is not None and not 1 <= threads <= numba.config.NUMBA_NUM_THREADS:
            raise ConfigError(f"threads must be in 1 .. {numba.config.NUMBA_NUM_THREADS}, got {threads}")
        Model.__init__(self, config)
        self.threads = threads or numba.config.NUMBA_NUM_THREADS
        c = config
        self.static_dims = (c.n_heads, c.n_kv_heads, c.head_dim, float(c.norm_eps), self.rope_rows(),
                            ACTIVATIONS[c.ffn_activation], float(c.embedding_multiplier), float(c.residual_multiplier),
                            float(c.score_scale), float(c.attn_logit_softcap), c.n_experts, c.n_experts_used,
                            bool(c.expert_weights_norm))  # one type each: one compiled signature
        self._capacities: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        return named

    def per_capacity(self, capacity: int) -> tuple[np.ndarray, np.ndarray]:
        """(windows [L] int64, RoPE frequencies and amplitudes [R, 2, Dh/2] float64) of a cache of this capacity
        (Model.windows, Model.padded_rope_tables: pairs past the rotary dims turn by angle 0), worked out once per
        capacity."""
        if capacity not in self._capacities:
            self._capacities[capacity] = (self.windows(capacity),
                                          np.ascontiguousarray(self.padded_rope_tables(), np.float64))
        return self._capacities[capacity]

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
        """Bytes of weights one decode step reads, in their stored types (layers, LM head, norms, biases and the
        one embedding row looked up; of a mixture of experts, the share of the experts a token uses)."""
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
        windows, freqs = self.per_capacity(cache.capacity)
        dims = Dims(threads, windows, *self.static_dims)
        ring = Ring(*_kv_arrays(cache), cache.positions, cache.lengths)
        return _forward(tokens, positions, sequences, self.packed, freqs, dims, ring)

    def _layer_cost(self) -> int:
        """What threads_for weighs for one layer's products: 4 bytes a value, whatever the type."""
        return self.layer_cost_bytes

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
        """Logits from final hidden states, the LM head read in its own type.  # [T, D] -> [T, V]"""
        mats = self.packed.mats
        threads = self.threads_for(len(h), 4 * int(mats[-1, 2] * mats[-1, 3]), 1)
        use_threads(threads)
        h = np.ascontiguousarray(h, dtype=np.float32)
        out = np.empty((len(h), self.config.vocab_size), np.float32)
        if len(h):
            products_into(self.packed.pool, mats, len(mats) - 1, 1, h, len(h), out, threads)
        return out


# A cache's keys and values as the kernels take them: float32, or float16 passed as its bits (Numba has no float16 on
# the CPU; kernels/simd.py's *_kv functions round and widen them).
KV_STORED = {np.dtype(np.float32): np.float32, np.dtype(np.float16): np.uint16}


def _kv_arrays(cache: RingKVCache) -> tuple[np.ndarray, np.ndarray]:
    return cache.k.view(KV_STORED[cache.k.dtype]), cache.v.view(KV_STORED[cache.v.dtype])


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
def _commit_positions(positions, seqs, ring):
    """Record this call's positions in the ring's table once every layer holds its keys, as RingKVCache.write."""
    C = ring.positions.shape[1]
    for s in range(seqs.slots.shape[0]):
        b = seqs.slots[s]
        for i in range(seqs.starts[s], seqs.starts[s + 1]):
            ring.positions[b, positions[seqs.order[i]] % C] = positions[seqs.order[i]]
        ring.lengths[b] = max(ring.lengths[b], positions[seqs.order[seqs.starts[s + 1] - 1]] + 1)


# ================================================================================================================
# The forward pass's stages that read the weights record: every product goes through products_into, each matrix in
# its type's kernel (models/numba_products.py).

QKV, OUT, GATE_UP, DOWN = range(4)  # a layer's products: [q; k; v], the attention output's, [gate; up], the FFN's
FIRST_MATRIX = (WQ, WO, W1, W2)  # the first of each product's matrices in a layer's rows of mats, and how many
MATRICES = (3, 1, 2, 1)


@njit(inline="always")
def layer_product(w, l, which, x, T, out, threads):
    """out[:T] = x[:T] @ W.T for product `which` (QKV, OUT, GATE_UP, DOWN) of layer l: its matrices side by side in
    out (q | k | v, gate | up), each read in its own type.                           # [>=T, K] -> [>=T, N]"""
    # the count as np.int64, not a literal: Numba compiles a called function once per literal argument value, and
    # each compilation re-optimises every kernel linked below it (minutes)
    products_into(w.pool, w.mats, PER_LAYER * l + FIRST_MATRIX[which], np.int64(MATRICES[which]), x, T, out, threads)


@njit(inline="always")
def router_product(w, l, x, T, out, threads):
    """out[:T, :E] = x[:T] @ router.T, layer l's router logits (a mixture of experts).      # [>=T, D] -> [>=T, >=E]"""
    products_into(w.pool, w.experts, l, np.int64(1), x, T, out, threads)


@njit(inline="always")
def expert_product(w, l, e, which, x, T, out, threads):
    """out[:T] = x[:T] @ W.T for expert e of layer l's product `which` (GATE_UP or DOWN), laid out as layer_product
    lays out a dense layer's.                                                       # [>=T, K] -> [>=T, N]"""
    L = w.attention_norm.shape[0]
    first = L + 3 * (l * ((w.experts.shape[0] - L) // (3 * L)) + e) + (which - GATE_UP) * 2  # gate (and up), down
    products_into(w.pool, w.experts, first, np.int64(2 - (which - GATE_UP)), x, T, out, threads)


@njit(inline="always")
def product_widths(w):
    """Columns of the OUT and GATE_UP products' outputs: D and 2F (2Fe: an expert's, where wider). Gate and up may be
    one run of rows (numba_weights._runs: W1's row of the table then counts both, W3's none)."""
    Fe = w.experts[w.attention_norm.shape[0], 2] if w.experts.shape[0] else 0  # the first expert's gate rows
    return w.norm.shape[0], max(w.mats[W1, 2] + w.mats[W3, 2], 2 * Fe)


# A forward call's buffers, float32 [T, ...]: x the residual stream [D], h a block's normed input [D], o a block's
# output before the residual add [>= D], qkv [(H + 2K) Dh, padded as bqkv], attn [H Dh], gate_up [>= 2F], hidden
# [>= F]; cos and sin the RoPE angles [R, T, Dh/2] (each row of the frequencies: Model.rope_rows); a mixture of experts'
# (0 rows in a dense model): logits [>= E], chosen [k] int64 and gates [k] (cpu.route_into), rows [] int64 and
# row_gates [] (the tokens routed to one expert), expert_x [D] and expert_o [>= D] (its input and output).
Buffers = namedtuple("Buffers", ["x", "h", "o", "qkv", "attn", "gate_up", "hidden", "cos", "sin", "logits", "chosen",
                                 "gates", "rows", "row_gates", "expert_x", "expert_o"])


@njit(inline="always")
def _buffers(w, T, dims) -> Buffers:
    """Room for a forward call of T tokens on weights record w (product_widths says how wide its outputs are)."""
    D = w.norm.shape[0]
    o_cols, gate_up_cols = product_widths(w)
    half, R = dims.Dh // 2, dims.rope_rows.max() + 1 if dims.rope_rows.shape[0] else 1
    Tm, E, k = T if dims.n_experts else 0, dims.n_experts, dims.n_experts_used
    return Buffers(np.empty((T, D), np.float32), np.empty((T, D), np.float32), np.empty((T, o_cols), np.float32),
                   np.empty((T, w.bqkv.shape[1]), np.float32), np.empty((T, dims.H * dims.Dh), np.float32),
                   np.empty((T, gate_up_cols), np.float32), np.empty((T, gate_up_cols // 2), np.float32),
                   np.empty((R, T, half), np.float32), np.empty((R, T, half), np.float32),
                   np.empty((Tm, -(-E // PANEL) * PANEL), np.float32), np.empty((Tm, k), np.int64),
                   np.empty((Tm, k), np.float32), np.empty(Tm, np.int64), np.empty(Tm, np.float32),
                   np.empty((Tm, D), np.float32), np.empty((Tm, o_cols), np.float32))


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


@njit(inline="always")
def _normed(x, weight, eps, out, T):
    """rms_norm(x[:T]) into out, or x itself where the family has no norm here (weight [0]).   # [>=T, D] -> [>=T, D]"""
    if weight.shape[0] == 0:
        return x
    cpu.rms_norm_into(x, weight, eps, out, T)
    return out


@njit(inline="always")
def _post_norm(o, weight, eps, T):
    """o[:T, :D] = rms_norm(o[:T, :D]) in place where the family norms a block's output (weight [D]; [0]: not)."""
    if weight.shape[0]:
        cpu.rms_norm_into(o, weight, eps, o, T)


@njit(inline="always")
def _rope_angles(positions, freqs, rope_rows, cos, sin, T):
    """cos, sin [r, :T] of the RoPE angles for each frequency row r the layers use (rope_rows): row 0 alone unless
    sliding layers turn at their own base or some layers have no RoPE.          # [T], [R, 2, Dh/2] -> [R, T, Dh/2]"""
    for r in range(rope_rows.max() + 1 if rope_rows.shape[0] else 1):
        cpu.rope_angles_into(positions, freqs[r, 0], freqs[r, 1], cos[r], sin[r], T)


@njit(inline="always")
def _attention_block(w, l, positions, seqs, valid_from, ring, b, dims):
    """b.o[:T, :D] = layer l's attention block of b.x: (rms_norm) -> q, k, v (+ bias) -> (q/k norms) -> RoPE ->
    attention over the ring (the layer's window, score scale, soft-cap) -> wo -> (post norm)."""
    T, H, K, Dh, eps = positions.shape[0], dims.H, dims.K, dims.Dh, dims.eps
    layer_product(w, l, QKV, _normed(b.x, w.attention_norm[l], eps, b.h, T), T, b.qkv, dims.threads)
    _add_bias(b.qkv, w.bqkv[l], w.qk_perm, T)
    if w.q_norm.shape[1]:
        cpu.rms_norm_heads_into(b.qkv, 0, H, Dh, w.q_norm[l], eps, T)
        cpu.rms_norm_heads_into(b.qkv, H * Dh, K, Dh, w.k_norm[l], eps, T)
    r = dims.rope_rows[l]
    cpu.rope_interleaved_into(b.qkv, H + K, Dh, b.cos[r], b.sin[r], T)  # queries and keys: the first H + K heads
    cpu.attention_ring_into(b.qkv, H, K, positions, seqs, valid_from,
                            cpu.LayerRing(ring.k[l], ring.v[l], ring.positions),
                            cpu.AttentionOptions(dims.windows[l], dims.scale, dims.softcap), b.attn)
    layer_product(w, l, OUT, b.attn, T, b.o, dims.threads)
    _post_norm(b.o, w.post_attention_norm[l], eps, T)


@njit(inline="always")
def _ffn_block(w, l, b, T, dims):
    """b.o[:T, :D] = layer l's feed-forward block of b.x: (rms_norm) -> SwiGLU / GeGLU, dense or routed to experts
    (_moe_ffn) -> (post norm)."""
    x = _normed(b.x, w.ffn_norm[l], dims.eps, b.h, T)
    if dims.n_experts:
        _moe_ffn(w, l, x, b, T, dims)
    else:
        layer_product(w, l, GATE_UP, x, T, b.gate_up, dims.threads)
        swiglu_rows(b.gate_up, b.hidden.shape[1], b.hidden, T, dims.threads, dims.act)
        layer_product(w, l, DOWN, b.hidden, T, b.o, dims.threads)
    _post_norm(b.o, w.post_ffn_norm[l], dims.eps, T)


@njit(inline="always")
def _moe_ffn(w, l, x, b, T, dims):
    """b.o[t, :D] = sum over the experts e token t's router chose (cpu.route_into) of gate_e * FFN_e(x[t]), as
    ops.moe_ffn: each expert runs once per call over the tokens that chose it (its weights read once), and every
    token adds its experts in increasing e, whatever the call's tokens (prefill and decode give the same bits)."""
    D, E, k = b.x.shape[1], dims.n_experts, dims.n_experts_used
    router_product(w, l, x, T, b.logits, dims.threads)
    cpu.route_into(b.logits, T, E, k, dims.expert_weights_norm, b.chosen, b.gates)
    b.o[:T, :D] = 0.0
    for e in range(E):
        n = 0
        for t in range(T):
            for j in range(k):
                if b.chosen[t, j] == e:
                    b.rows[n], b.row_gates[n] = t, b.gates[t, j]
                    n += 1
        if n == 0:
            continue
        for i in range(n):
            b.expert_x[i, :] = x[b.rows[i], :D]
        expert_product(w, l, e, GATE_UP, b.expert_x, n, b.gate_up, dims.threads)
        swiglu_rows(b.gate_up, b.hidden.shape[1], b.hidden, n, dims.threads, dims.act)
        expert_product(w, l, e, DOWN, b.hidden, n, b.expert_o, dims.threads)
        for i in range(n):
            for d in range(D):
                b.o[b.rows[i], d] += b.row_gates[i] * b.expert_o[i, d]


@njit(inline="always")
def _scaled_add(x, o, T, D, m):
    """x[:T] += m o[:T, :D] (o may be wider: padded to whole panels; m = 1 is exact: Llama's bits)."""
    for t in range(T):
        for d in range(D):
            x[t, d] += m * o[t, d]


@njit(cache=True)
def _forward(tokens, positions, seqs, w, freqs, dims, ring):
    """Every layer of the reference Transformer.forward for T tokens, then the cache's position table.  # -> [T, D]

    x = embed(tokens) m; per layer: x += r attention_block(x); x += r ffn_block(x); then rms_norm(x), with every
    family's options as data (Dims, and the per-layer arrays of the weights record w: Packed). freqs [R, 2, Dh/2]:
    RoPE frequencies and amplitudes of each kind of layer (padded_rope_tables).
    """
    T = tokens.shape[0]
    L, D = w.attention_norm.shape[0], w.norm.shape[0]
    b = _buffers(w, T, dims)
    _rope_angles(positions, freqs, dims.rope_rows, b.cos, b.sin, T)
    valid_from = np.empty(seqs.slots.shape[0], np.int64)
    cpu.valid_from_into(positions, seqs, ring.positions, dims.windows.max(), valid_from)
    embed_rows(w, tokens, b.x)
    if dims.embedding_multiplier != 1.0:
        b.x[:] *= np.float32(dims.embedding_multiplier)
    r = np.float32(dims.residual_multiplier)
    for l in range(L):
        _attention_block(w, l, positions, seqs, valid_from, ring, b, dims)
        _scaled_add(b.x, b.o, T, D, r)
        _ffn_block(w, l, b, T, dims)
        _scaled_add(b.x, b.o, T, D, r)
    cpu.rms_norm_into(b.x, w.norm, dims.eps, b.h, T)
    _commit_positions(positions, seqs, ring)
    return b.h

# ------------------------------------------------------------------------------------------- code before weights

# A model small enough to build in a millisecond, with every argument type a real model's compiled calls take.
TINY = ModelConfig(dim=32, hidden_dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=32, max_seq_len=8)
_LINKED: set = set()  # the kv storages whose compiled calls this process has already run
FORWARD = _forward  # the one compiled forward
COMPILE_LABEL = "NumbaTransformer"  # what a compile of its code writes in the cache's lock (kernels/compiler.py: compiling)


def code_cached() -> bool:
    """Whether Numba's cache holds _forward compiled for this CPU."""
    return cached_here(_forward, lambda signature: True)


def link_ahead(kv: np.dtype | None) -> None:
    """Load the model's compiled code before a real model's weights arrive, then give the compiler's pages back.

    Runs the model's compiled calls (a forward pass, the LM head, the sampler) once on a TINY model whose arguments
    have the types a real model's calls will have, caches of storage `kv` (None: float32), so Numba loads their
    code now (from its cache; not there yet, a child process compiles it first), not at the first real call; then
    kernels/compiler.py drops the LLVM pages that loading left resident, and LLVM's modules for linking leave the
    heap. The process's peak then holds the compiler's pages or the weights, not both: a Q4_0 110M model's peak fell
    from 235 to 159 MiB (docs/quant.md, "The compiler's pages, then the weights").
    Each storage runs once a process; the releases every time (a model built since may have compiled something)."""
    release_compiler_pages()  # what importing Numba touched (it builds LLVM objects too): 36 MiB, not all needed now
    if kv not in _LINKED:
        _LINKED.add(kv)
        if not code_cached():
            compile_in_child(kv)
        run_tiny(kv, release_compiler_pages)
    release_linking_modules()
    release_compiler_pages()


def run_tiny(kv: np.dtype | None, between=lambda: None) -> None:
    """The model's compiled calls, once, on a TINY model with a cache of storage kv; between() after the forward."""
    tiny = NumbaTransformer(TINY, _tiny_weights(), threads=1)
    cache = tiny.new_cache(2, kv_dtype=None if kv is None else np.dtype(kv).name)
    h = tiny.forward([1, 2], [0, 1], cache)
    between()  # the compiler's pages released between the two loads: the peak holds what one touched, not both
    tiny.sample(h[-1:])


def compile_in_child(kv: np.dtype | None) -> None:
    """run_tiny(kv) in a child process, which compiles the model's code into Numba's cache: what LLVM keeps of a
    compile (kernels/compiler.py) then dies with the child, and this process loads the code from the cache (a first
    run of a quantized TinyLlama peaked at 1,141 MiB with the compile in the process). Raised as a "numba:compile"
    event, as a compile here would be (the CLI's notice listens). The child holds the cache's compile lock, waiting
    for another compile into the same cache to end first. Where the child fails, this process compiles the code
    itself, as before."""
    from numba.core import event

    from ..kernels.compiler import cache_lock

    code, env = child_code(kv)
    lock = cache_lock(FORWARD)
    if lock is not None:  # one compile at a time into a cache (hold_lock_waiting): two first runs at once are safe
        code = (f"from npllm.kernels.compiler import hold_lock_waiting\n"
                f"hold_lock_waiting({str(lock)!r}, {COMPILE_LABEL!r})\n") + code
    with event.trigger_event("numba:compile", data={"dispatcher": FORWARD, "args": None,
                                                    "return_type": None}):
        subprocess.run([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def child_code(kv: np.dtype | None) -> tuple[str, dict]:
    """(Python code, environment) of a child process that runs run_tiny(kv): compile_in_child's, and the detached
    compile's that fills Numba's cache behind a run (models/__init__.py: compile_behind)."""
    kv_name = "None" if kv is None else repr(np.dtype(kv).name)
    code = f"from npllm.models.numba import run_tiny; run_tiny({kv_name})"
    root = str(Path(__file__).resolve().parents[2])  # this npllm, not another one the child's path would find first
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    return code, env


def _tiny_weights() -> dict:
    """TINY's weights, random (their values do not matter: only the types the compiled calls see), its matrices as
    Q8_0 blocks (any type will do: a matrix's type is data in its pool, not a type the compiler sees)."""
    from ..quant import QuantizedMatrix, quantize
    from ..tensors import expected_shapes

    rng = np.random.default_rng(0)
    weights = {name: rng.standard_normal(shape, dtype=np.float32) / 4 for name, shape in expected_shapes(TINY).items()}
    for name, w in weights.items():
        if w.ndim == 2:
            weights[name] = QuantizedMatrix(quantize(w, "Q8_0").reshape(len(w), -1), "Q8_0", w.shape)
    return weights
