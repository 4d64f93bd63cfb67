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

from collections import namedtuple

import numba
import numpy as np
from numba import njit

from .. import ops
from ..cache import RingKVCache
from ..config import ModelConfig
from ..errors import ConfigError, GenerationError
from ..kernels import cpu
from .base import Model
from .weights import Weights, fused_gate_up, fused_qkv

PANEL = cpu.PANEL
# A parallel region pays for waking the other threads: tens of microseconds where they sleep between regions
# (OMP_WAIT_POLICY=PASSIVE, see kernels/__init__.py). Work shorter than this per region stays on one thread, as
# estimated from a core's rates on a 2-core laptop-class machine: ~10 GB/s of weights, ~50 GFLOP/s.
PARALLEL_MIN_SECONDS = 100e-6
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
])
# A forward call's tokens grouped by cache slot: sequence s is order[starts[s] : starts[s + 1]], in slot slots[s].
Sequences = namedtuple("Sequences", ["order", "starts", "slots"])
# One ring cache's arrays (RingKVCache): k, v [L, B, C, K, Dh], positions [B, C], lengths [B].
Ring = namedtuple("Ring", ["k", "v", "positions", "lengths"])
# Shape and options of a call: heads H, kv heads K, head dim Dh, norm eps, attention window, threads.
Dims = namedtuple("Dims", ["H", "K", "Dh", "eps", "window", "threads"])


def _padded(n: int) -> int:
    return -(-n // PANEL) * PANEL


class NumbaTransformer(Model):
    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray], threads: int | None = None):
        named = Weights.from_checkpoint(config, weights)
        if threads is not None and not 1 <= threads <= numba.config.NUMBA_NUM_THREADS:
            raise ConfigError(f"threads must be in 1 .. {numba.config.NUMBA_NUM_THREADS}, got {threads}")
        super().__init__(config)
        self.inv_freq = ops.rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)  # [Dh/2] f64
        self.packed = pack(config, named)
        self.output_panels = cpu.pack_panels(named.output)  # [ceil(V/16), D, 16]
        self.threads = threads or numba.config.NUMBA_NUM_THREADS
        p = self.packed
        self.layer_bytes = (p.wqkv.nbytes + p.wo.nbytes + p.w13.nbytes + p.w2.nbytes) // config.n_layers

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
        threads = self.threads_for(len(tokens), self.layer_bytes, LAYER_REGIONS)
        numba.set_num_threads(threads)
        c = self.config
        dims = Dims(c.n_heads, c.n_kv_heads, c.head_dim, c.norm_eps, self.window(cache), threads)
        ring = Ring(*_kv_arrays(cache), cache.positions, cache.lengths)
        return _forward(tokens, positions, sequences, self.packed, self.inv_freq, dims, ring)

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

    def lm_head(self, h: np.ndarray) -> np.ndarray:
        """Logits from final hidden states.  # [T, D] -> [T, V]"""
        threads = self.threads_for(len(h), self.output_panels.nbytes, 1)
        numba.set_num_threads(threads)
        return cpu.lm_head(np.ascontiguousarray(h, dtype=np.float32), self.output_panels, self.config.vocab_size,
                           threads)


# A cache's keys and values as the kernels take them: float32, or float16 passed as its bits (Numba has no float16 on
# the CPU; kernels/simd.py's *_kv functions round and widen them).
KV_STORED = {np.dtype(np.float32): np.float32, np.dtype(np.float16): np.uint16}


def _kv_arrays(cache: RingKVCache) -> tuple[np.ndarray, np.ndarray]:
    return cache.k.view(KV_STORED[cache.k.dtype]), cache.v.view(KV_STORED[cache.v.dtype])


def pack(c: ModelConfig, weights: Weights) -> Packed:
    """The layer weights fused, packed in panels and stacked along L, as _forward reads them."""
    L, D, F, H, K, Dh = c.n_layers, c.dim, c.hidden_dim, c.n_heads, c.n_kv_heads, c.head_dim
    n_qkv = (H + 2 * K) * Dh
    wqkv = np.empty((L, _padded(n_qkv) // PANEL, D, PANEL), np.float32)
    bqkv = np.zeros((L, _padded(n_qkv)), np.float32)
    wo = np.empty((L, _padded(D) // PANEL, H * Dh, PANEL), np.float32)
    w13 = np.empty((L, 2 * _padded(F) // PANEL, D, PANEL), np.float32)
    w2 = np.empty((L, _padded(D) // PANEL, F, PANEL), np.float32)
    for l, layer in enumerate(weights.layers):
        qkv, bqkv[l, :n_qkv] = fused_qkv(c, layer, interleave_rope=True)
        wqkv[l] = cpu.pack_panels(qkv)
        wo[l] = cpu.pack_panels(layer.wo)
        w13[l] = cpu.pack_panels(fused_gate_up(layer, PANEL))
        w2[l] = cpu.pack_panels(layer.w2)
    embeddings = np.array(weights.tok_embeddings, np.float32)  # a writable copy: one compiled signature
    return Packed(embeddings, weights.stacked("attention_norm"), wqkv, bqkv, wo, weights.stacked("ffn_norm"), w13,
                  w2, np.array(weights.norm, np.float32))


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


@njit(cache=True)
def _forward(tokens, positions, seqs, w, inv_freq, dims, ring):
    """Every layer of the reference Transformer.forward for T tokens, then the cache's position table.  # -> [T, D]

    x = embed(tokens); per layer: x += wo(attention(rope(qkv(rms_norm(x))))); x += w2(swiglu(w13(rms_norm(x))));
    then rms_norm(x).
    """
    H, K, Dh, eps, window, threads = dims
    T = tokens.shape[0]
    L, D = w.attention_norm.shape
    x = np.empty((T, D), np.float32)  # the residual stream
    h = np.empty((T, D), np.float32)  # normed input of a block
    o = np.empty((T, w.wo.shape[1] * PANEL), np.float32)  # output of a block, before the residual add
    qkv = np.empty((T, w.bqkv.shape[1]), np.float32)
    attn = np.empty((T, H * Dh), np.float32)
    gate_up = np.empty((T, w.w13.shape[1] * PANEL), np.float32)
    hidden = np.empty((T, gate_up.shape[1] // 2), np.float32)
    cos = np.empty((T, Dh // 2), np.float32)
    sin = np.empty((T, Dh // 2), np.float32)
    cpu.rope_angles_into(positions, inv_freq, cos, sin, T)
    valid_from = np.empty(seqs.slots.shape[0], np.int64)
    cpu.valid_from_into(positions, seqs.order, seqs.starts, seqs.slots, ring.positions, window, valid_from)
    for t in range(T):
        x[t] = w.embeddings[tokens[t]]
    for l in range(L):
        cpu.rms_norm_into(x, w.attention_norm[l], eps, h, T)
        cpu.matmul_into(h, w.wqkv[l], qkv, T, threads)
        for t in range(T):
            qkv[t] += w.bqkv[l]
        cpu.rope_interleaved_into(qkv, H + K, Dh, cos, sin, T)  # queries and keys: the first H + K heads
        cpu.attention_ring_into(qkv, H, K, positions, seqs.order, seqs.starts, seqs.slots, valid_from, ring.k[l],
                                ring.v[l], ring.positions, window, attn)
        cpu.matmul_into(attn, w.wo[l], o, T, threads)
        _residual_add(x, o, T, D)
        cpu.rms_norm_into(x, w.ffn_norm[l], eps, h, T)
        cpu.matmul_into(h, w.w13[l], gate_up, T, threads)
        cpu.swiglu_hidden_into(gate_up, hidden, T)
        cpu.matmul_into(hidden, w.w2[l], o, T, threads)
        _residual_add(x, o, T, D)
    cpu.rms_norm_into(x, w.norm, eps, h, T)
    _commit_positions(positions, seqs, ring)
    return h
