"""NumbaTransformer: the Transformer of model.py run by the Numba kernels, one compiled call per forward pass.

Same interface as model.Transformer (config, forward, lm_head, new_cache, logits), same RingKVCache, same math.
What differs is how the work is laid out:

- Weights are repacked once at load (kernels/cpu.py: pack_panels). Per layer, wq/wk/wv become one matrix (QKV in
  one pass over the weights) and w1/w3 another (gate and up in one pass). Hugging Face q/k rows are permuted into
  the interleaved RoPE layout here, so the kernels know a single RoPE.
- forward() checks its arguments in Python, then makes ONE call into compiled code that runs every layer
  (`_forward`): at batch 1 a small model is bound by per-call overhead, not arithmetic.
- The float32 result does not depend on how tokens are split into calls: a prefill of T tokens and T one-token
  decode steps produce the same bits (each matrix-product output and each attention row is summed in an order
  fixed by its own position; see kernels/cpu.py).

The Numba model computes in float32 whatever the checkpoint's dtype.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit

from . import ops
from .cache import RingKVCache
from .config import ModelConfig
from .errors import ConfigError, GenerationError
from .kernels import cpu
from .model import check_weights

PANEL = cpu.PANEL
# A parallel region pays for waking the other threads: tens of microseconds where they sleep between regions
# (OMP_WAIT_POLICY=PASSIVE, see kernels/__init__.py). Work shorter than this per region stays on one thread, as
# estimated from a core's rates on a 2-core laptop-class machine: ~10 GB/s of weights, ~50 GFLOP/s.
PARALLEL_MIN_SECONDS = 100e-6
CORE_BYTES_PER_S = 10e9
CORE_FLOPS = 50e9
LAYER_REGIONS = 5  # parallel regions per layer in _forward: four matrix products and attention


def _padded(n: int) -> int:
    return -(-n // PANEL) * PANEL


def half_to_interleaved_rows(w: np.ndarray, heads: int, head_dim: int) -> np.ndarray:
    """Reorder each head's rows from halves (i, i + Dh/2) to adjacent pairs (2i, 2i+1).  # [heads*Dh, ...] -> same

    A query or key computed with the reordered rows, rotated by rope_interleaved, is the original rotated by
    rope_half with its entries reordered the same way; dot products between queries and keys are unchanged.
    """
    half = head_dim // 2
    order = np.empty(head_dim, np.int64)
    order[0::2] = np.arange(half)
    order[1::2] = np.arange(half) + half
    index = (np.arange(heads)[:, None] * head_dim + order[None, :]).reshape(-1)
    return w[index]


class NumbaTransformer:
    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray], threads: int | None = None):
        check_weights(config, weights)
        if threads is not None and not 1 <= threads <= numba.config.NUMBA_NUM_THREADS:
            raise ConfigError(f"threads must be in 1 .. {numba.config.NUMBA_NUM_THREADS}, got {threads}")
        self.config = config
        self.dtype = np.dtype(np.float32)
        self.inv_freq = ops.rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)  # [Dh/2] f64
        self.weights = self._pack(config, weights)
        output = weights["tok_embeddings"] if config.tied_embeddings else weights["output"]
        self.output_panels = cpu.pack_panels(output)  # [ceil(V/16), D, 16]
        self.threads = threads or numba.config.NUMBA_NUM_THREADS
        _, _, wqkv, _, wo, _, w13, w2, _ = self.weights
        self.layer_bytes = (wqkv.nbytes + wo.nbytes + w13.nbytes + w2.nbytes) // config.n_layers

    def threads_for(self, T: int, weight_bytes: int, regions: int) -> int:
        """Threads for a call over T tokens that reads weight_bytes in `regions` parallel regions: all of
        self.threads, or one when a region would take less than PARALLEL_MIN_SECONDS on one core, since waking
        the other threads would cost more than they save (decode of stories260K and stories15M, on this estimate)."""
        one_core = weight_bytes / CORE_BYTES_PER_S + 2 * T * (weight_bytes / 4) / CORE_FLOPS
        return self.threads if one_core / regions >= PARALLEL_MIN_SECONDS else 1

    @staticmethod
    def _pack(c: ModelConfig, weights: dict[str, np.ndarray]) -> tuple:
        """The layer weights stacked along L and packed in panels, in the order _forward unpacks them."""
        L, D, F, H, K, Dh = c.n_layers, c.dim, c.hidden_dim, c.n_heads, c.n_kv_heads, c.head_dim
        n_qkv = (H + 2 * K) * Dh
        wqkv = np.empty((L, _padded(n_qkv) // PANEL, D, PANEL), np.float32)
        bqkv = np.zeros((L, _padded(n_qkv)), np.float32)
        wo = np.empty((L, _padded(D) // PANEL, H * Dh, PANEL), np.float32)
        w13 = np.empty((L, 2 * _padded(F) // PANEL, D, PANEL), np.float32)
        w2 = np.empty((L, _padded(D) // PANEL, F, PANEL), np.float32)
        for l in range(L):
            p = f"layers.{l}."
            wq, wk = weights[p + "wq"], weights[p + "wk"]
            bq, bk = weights.get(p + "bq"), weights.get(p + "bk")
            if c.rope_layout == "half":
                wq, wk = half_to_interleaved_rows(wq, H, Dh), half_to_interleaved_rows(wk, K, Dh)
                if c.attention_bias:
                    bq, bk = half_to_interleaved_rows(bq, H, Dh), half_to_interleaved_rows(bk, K, Dh)
            wqkv[l] = cpu.pack_panels(np.concatenate([wq, wk, weights[p + "wv"]]))
            if c.attention_bias:
                bqkv[l, :n_qkv] = np.concatenate([bq, bk, weights[p + "bv"]])
            wo[l] = cpu.pack_panels(weights[p + "wo"])
            w13[l] = cpu.pack_panels(cpu.interleave_panels(weights[p + "w1"], weights[p + "w3"]))
            w2[l] = cpu.pack_panels(weights[p + "w2"])

        def stack(name):
            return np.stack([np.asarray(weights[f"layers.{l}.{name}"], np.float32) for l in range(L)])

        embeddings = np.array(weights["tok_embeddings"], np.float32)  # a writable copy: one compiled signature
        return (embeddings, stack("attention_norm"), wqkv, bqkv, wo, stack("ffn_norm"), w13, w2,
                np.array(weights["norm"], np.float32))

    @property
    def weight_bytes(self) -> int:
        """Bytes of packed weights one decode step streams (all layers and the LM head, padding included)."""
        _, attn_norm, wqkv, bqkv, wo, ffn_norm, w13, w2, norm = self.weights
        layers = sum(a.nbytes for a in (attn_norm, wqkv, bqkv, wo, ffn_norm, w13, w2, norm))
        return layers + self.output_panels.nbytes + self.config.dim * 4

    def new_cache(self, capacity: int | None = None, slots: int = 1) -> RingKVCache:
        return RingKVCache(self.config, capacity, slots, np.float32)

    def window(self, cache: RingKVCache) -> int:
        """How many most recent positions a query sees: the model's sliding window, capped by the ring's size."""
        return min(self.config.sliding_window or cache.capacity, cache.capacity)

    def forward(self, tokens, positions, cache: RingKVCache, slots=None) -> np.ndarray:
        """Final-norm hidden states of the given tokens, updating the cache.     # [T], [T], [T] -> [T, D]

        slots[t] is the cache slot (sequence) of token t (all 0 when omitted). Within a slot, this call's tokens
        must have consecutive positions in increasing order, following what the slot's cache already holds.
        """
        tokens = np.asarray(tokens, dtype=np.int64)
        positions = np.asarray(positions, dtype=np.int64)
        slots = np.zeros_like(tokens) if slots is None else np.asarray(slots, dtype=np.int64)
        order, seq_starts, seq_slots = self._sequences(tokens, positions, cache, slots)
        if len(tokens) == 0:
            return np.zeros((0, self.config.dim), np.float32)
        threads = self.threads_for(len(tokens), self.layer_bytes, LAYER_REGIONS)
        numba.set_num_threads(threads)
        c = self.config
        return _forward(tokens, positions, order, seq_starts, seq_slots, self.weights, self.inv_freq,
                        c.n_heads, c.n_kv_heads, c.head_dim, c.norm_eps, self.window(cache), threads,
                        cache.k, cache.v, cache.positions, cache.lengths)

    def _sequences(self, tokens, positions, cache, slots):
        """Check the call and group its tokens by slot: (order, seq_starts, seq_slots) as _forward wants them.
        The checks are those of model.check_forward_inputs, compiled (they run on every decode step), plus one:
        a slot's positions in one call are consecutive."""
        if tokens.ndim != 1 or tokens.shape != positions.shape or tokens.shape != slots.shape:
            raise GenerationError(f"forward needs 1-D tokens, positions and slots of one length, got shapes "
                                  f"{tokens.shape}, {positions.shape}, {slots.shape}")
        c = self.config
        if cache.k.dtype != np.float32 or cache.k.shape[0] != c.n_layers or cache.k.shape[3:] != (c.n_kv_heads,
                                                                                                   c.head_dim):
            raise GenerationError(f"the cache holds {cache.k.dtype} [layers, slots, capacity, kv heads, head dim] = "
                                  f"{list(cache.k.shape)}: not one made by this model's new_cache()")
        T = len(tokens)
        order, seq_starts, seq_slots = np.empty(T, np.int64), np.empty(T + 1, np.int64), np.empty(T, np.int64)
        n_seq = _group_by_slot(tokens, positions, slots, self.config.vocab_size, cache.slots, order, seq_starts,
                               seq_slots)
        if n_seq < 0:
            raise GenerationError(CALL_PROBLEMS[-n_seq].format(V=self.config.vocab_size, B=cache.slots))
        return order, seq_starts[:n_seq + 1], seq_slots[:n_seq]

    def lm_head(self, h: np.ndarray) -> np.ndarray:
        """Logits from final hidden states.  # [T, D] -> [T, V]"""
        threads = self.threads_for(len(h), self.output_panels.nbytes, 1)
        numba.set_num_threads(threads)
        return cpu.lm_head(np.ascontiguousarray(h, dtype=np.float32), self.output_panels, self.config.vocab_size,
                           threads)

    def logits(self, tokens, positions=None, cache: RingKVCache | None = None) -> np.ndarray:
        """Logits of every token of one sequence on a fresh cache (or the given one).  # [T] -> [T, V]"""
        tokens = np.asarray(tokens, dtype=np.int64)
        if positions is None:
            positions = np.arange(len(tokens))
        cache = self.new_cache() if cache is None else cache
        return self.lm_head(self.forward(tokens, positions, cache))


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


@njit(cache=True)
def _forward(tokens, positions, order, seq_starts, seq_slots, weights, inv_freq, H, K, Dh, eps, window, threads,
             cache_k, cache_v, cache_positions, cache_lengths):
    """Every layer of model.Transformer.forward for T tokens, then the cache's position table.  # -> [T, D]

    x = embed(tokens); per layer: x += wo(attention(rope(qkv(rms_norm(x))))); x += w2(swiglu(w13(rms_norm(x))));
    then rms_norm(x).
    """
    embeddings, attn_norm, wqkv, bqkv, wo, ffn_norm, w13, w2, norm = weights
    T = tokens.shape[0]
    L, D = attn_norm.shape
    n_qkv = bqkv.shape[1]
    x = np.empty((T, D), np.float32)  # the residual stream
    h = np.empty((T, D), np.float32)  # normed input of a block
    o = np.empty((T, wo.shape[1] * PANEL), np.float32)  # output of a block, before the residual add
    qkv = np.empty((T, n_qkv), np.float32)
    attn = np.empty((T, H * Dh), np.float32)
    gate_up = np.empty((T, w13.shape[1] * PANEL), np.float32)
    hidden = np.empty((T, gate_up.shape[1] // 2), np.float32)
    cos = np.empty((T, Dh // 2), np.float32)
    sin = np.empty((T, Dh // 2), np.float32)
    cpu.rope_angles_into(positions, inv_freq, cos, sin, T)
    valid_from = np.empty(seq_slots.shape[0], np.int64)
    cpu.valid_from_into(positions, order, seq_starts, seq_slots, cache_positions, window, valid_from)
    for t in range(T):
        x[t] = embeddings[tokens[t]]
    for l in range(L):
        cpu.rms_norm_into(x, attn_norm[l], eps, h, T)
        cpu.matmul_into(h, wqkv[l], qkv, T, threads)
        for t in range(T):
            qkv[t] += bqkv[l]
        cpu.rope_interleaved_into(qkv, H + K, Dh, cos, sin, T)  # queries and keys: the first H + K heads
        cpu.attention_ring_into(qkv, H, K, positions, order, seq_starts, seq_slots, valid_from, cache_k[l],
                                cache_v[l], cache_positions, window, attn)
        cpu.matmul_into(attn, wo[l], o, T, threads)
        for t in range(T):
            for d in range(D):
                x[t, d] += o[t, d]
        cpu.rms_norm_into(x, ffn_norm[l], eps, h, T)
        cpu.matmul_into(h, w13[l], gate_up, T, threads)
        cpu.swiglu_hidden_into(gate_up, hidden, T)
        cpu.matmul_into(hidden, w2[l], o, T, threads)
        for t in range(T):
            for d in range(D):
                x[t, d] += o[t, d]
    cpu.rms_norm_into(x, norm, eps, h, T)
    C = cache_positions.shape[1]
    for s in range(seq_slots.shape[0]):  # commit the positions once every layer holds its keys, as RingKVCache.write
        b = seq_slots[s]
        for i in range(seq_starts[s], seq_starts[s + 1]):
            cache_positions[b, positions[order[i]] % C] = positions[order[i]]
        cache_lengths[b] = max(cache_lengths[b], positions[order[seq_starts[s + 1] - 1]] + 1)
    return h
